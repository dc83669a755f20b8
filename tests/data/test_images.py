"""Images in prompt rows (lmrl.data.images): TRL's format from JSONL, parquet, `datasets` and lists, every image
checked before a model loads, one line naming the file, line and field for each kind of bad row."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from lmrl.data import check_rows, load_prompts
from lmrl.data.images import ImageInputs, open_image, placeholders, row_images
from lmrl.data.prompts import PromptStream, open_stream
from lmrl.errors import DataError

LLAVA = ImageInputs(image_token="<image>", model="model.name_or_path=tiny-llava")
TEXT_ONLY = ImageInputs(image_token=None, model="model.name_or_path=tiny")
FIX = "; fix it, or set data.on_bad_row=skip to leave it out"


def drawn(value: int, size: int = 8) -> Image.Image:
    """A small RGB image with `value` in its red channel and a diagonal, drawn here (no files shipped)."""
    image = Image.new("RGB", (size, size), (value, 0, 0))
    for i in range(size):
        image.putpixel((i, i), (255, 255, 255))
    return image


def png(value: int) -> bytes:
    out = io.BytesIO()
    drawn(value).save(out, format="PNG")
    return out.getvalue()


def chat(images: int, text: str = "what is drawn?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}]


@pytest.fixture
def folder(tmp_path):
    """A data folder with images in a subfolder, referenced relative to the data file."""
    (tmp_path / "imgs").mkdir()
    for v in (10, 20, 30):
        (tmp_path / "imgs" / f"{v}.png").write_bytes(png(v))
    (tmp_path / "imgs" / "garbage.png").write_bytes(b"not a png at all")
    (tmp_path / "imgs" / "cut.png").write_bytes(png(40)[:60])  # truncated: the header opens, the data does not
    return tmp_path


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_one_image_several_and_none_in_one_file_with_paths_relative_to_the_file(folder, tmp_path_factory, monkeypatch):
    rows = [
        {"prompt": chat(1), "image": "imgs/10.png", "answer": "10"},
        {"prompt": chat(2), "images": ["imgs/20.png", "imgs/30.png"], "answer": "50"},
        {"prompt": [{"role": "user", "content": "no image here"}], "answer": "0"},
        {"prompt": "<image> then <image>", "images": ["imgs/30.png", "imgs/10.png"], "answer": "40"},
    ]
    path = write_jsonl(folder / "train.jsonl", rows)
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))  # paths are relative to the file, not the cwd
    ds = load_prompts(str(path), images=LLAVA)
    assert len(ds) == 4
    reds = [[open_image(v).getpixel((1, 0))[0] for v in row_images(row)] for row in ds]
    assert reds == [[10], [20, 30], [], [30, 10]]
    assert ds[0]["image"] == str(folder / "imgs" / "10.png")
    assert [placeholders(row["prompt"], "<image>") for row in ds] == [1, 2, 0, 2]


@pytest.mark.parametrize(
    "row, problem",
    [
        ({"prompt": chat(1), "image": "imgs/missing.png"}, "image: file not found: {folder}/imgs/missing.png"),
        ({"prompt": chat(2), "images": ["imgs/10.png", "imgs/none.png"]}, "images[1]: file not found: {folder}/imgs/none.png"),
        ({"prompt": chat(1), "image": "imgs/garbage.png"}, "image: not a readable image (cannot identify image file"),
        ({"prompt": chat(1), "image": "imgs/cut.png"}, "image: not a readable image ("),
        ({"prompt": chat(2), "image": "imgs/10.png"}, "prompt has 2 image placeholders ({'type': 'image'} parts) but the row has 1 image in 'image'"),
        ({"prompt": chat(0), "images": ["imgs/10.png"]}, "prompt has 0 image placeholders ({'type': 'image'} parts) but the row has 1 image in 'images'"),
        ({"prompt": chat(1)}, "prompt has 1 image placeholder ({'type': 'image'} parts) but the row has 0 images in 'image'"),
        ({"prompt": "<image> 1+1=", "images": []}, "prompt has 1 image placeholder ('<image>' tokens) but the row has 0 images in 'images'"),
        ({"prompt": chat(1), "image": "imgs/10.png", "images": ["imgs/10.png"]}, "row has both 'image' and 'images'; give one of them"),
        ({"prompt": chat(1), "images": "imgs/10.png"}, "images must be a list of images, got str"),
        ({"prompt": chat(1), "image": 7}, "image: must be a path, image bytes or a PIL image, got int"),
        ({"prompt": [{"role": "user", "content": [{"type": "video"}]}]},
         "prompt message 0 part 0: expected {'type': 'text', 'text': ...} or {'type': 'image'}, got {'type': 'video'}"),
        ({"prompt": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "prompt message 0 part 0: a text part needs a string 'text', got int"),
        ({"prompt": [{"role": "user", "content": []}]}, "prompt message 0 has an empty list of content parts"),
    ],
)
def test_a_bad_image_row_is_one_line_naming_file_line_and_field(folder, row, problem):
    good = {"prompt": chat(1), "image": "imgs/10.png"}
    path = write_jsonl(folder / "train.jsonl", [good, row, good])
    with pytest.raises(DataError) as info:
        load_prompts(str(path), images=LLAVA)
    message, problem = str(info.value), problem.replace("{folder}", str(folder))
    assert message.startswith(f"data.path: {path} line 2: {problem}"), message
    assert message.endswith(FIX) and "\n" not in message


def test_a_text_only_model_refuses_images_and_image_parts(folder):
    rows = [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": chat(1), "image": "imgs/10.png"},
        {"prompt": chat(1)},
        {"prompt": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"prompt": "two", "images": ["imgs/10.png", "imgs/20.png"]},
    ]
    out = check_rows(rows, images=TEXT_ONLY, on_bad_row="skip")
    assert out.rows == rows[:1]
    assert [b.problem for b in out.skipped] == [
        "image: 1 image for a text-only model (model.name_or_path=tiny); use a vision-language model or drop the column",
        "prompt message 0 has an image part, for a text-only model (model.name_or_path=tiny)",
        "prompt message 0: content parts are for a vision-language model; give model.name_or_path=tiny the text as a string",
        "images: 2 images for a text-only model (model.name_or_path=tiny); use a vision-language model or drop the column",
    ]
    assert [b.where for b in out.skipped] == ["dataset index 1", "dataset index 2", "dataset index 3", "dataset index 4"]


def test_skip_leaves_bad_image_rows_out_and_lists_them(folder):
    rows = [
        {"prompt": chat(1), "image": "imgs/10.png"},
        {"prompt": chat(1), "image": "imgs/missing.png"},
        {"prompt": chat(1), "image": "imgs/20.png"},
        {"prompt": chat(2), "images": ["imgs/garbage.png", "imgs/10.png"]},
    ]
    path = write_jsonl(folder / "train.jsonl", rows)
    ds = load_prompts(str(path), images=LLAVA, on_bad_row="skip")
    assert [row_images(r) for r in ds] == [[str(folder / "imgs/10.png")], [str(folder / "imgs/20.png")]]
    assert [b.where for b in ds.skipped] == [f"{path} line 2", f"{path} line 4"]
    assert ds.skipped[1].problem.startswith("images[0]: not a readable image (")


def test_images_unchecked_without_a_model_and_text_rows_unchanged():
    """`images=None` (the model is not known yet, e.g. `PromptDataset(rows)`): image columns pass as they are."""
    rows = [{"prompt": chat(1), "image": "nowhere.png"}, {"prompt": "1+1=", "image": None}]
    assert check_rows(rows).rows == rows
    assert check_rows([{"prompt": "1+1="}], images=TEXT_ONLY).rows == [{"prompt": "1+1="}]


def test_parquet_with_image_bytes_and_relative_paths(folder):
    rows = [
        {"prompt": "<image> what?", "images": [{"bytes": png(10), "path": None}]},
        {"prompt": "<image><image> what?", "images": [{"bytes": None, "path": "imgs/20.png"}, {"bytes": png(30), "path": None}]},
        {"prompt": "nothing", "images": []},
    ]
    path = folder / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    ds = load_prompts(path, images=LLAVA)
    assert [[open_image(v).getpixel((1, 0))[0] for v in row_images(r)] for r in ds] == [[10], [20, 30], []]
    pq.write_table(pa.Table.from_pylist([{"prompt": "<image>", "images": [{"bytes": b"\x89PNG broken", "path": None}]}]), path)
    with pytest.raises(DataError, match=r"^data.path: .*train.parquet row 0: images\[0\]: not a readable image \(.*\): 11 bytes;"):
        load_prompts(path, images=LLAVA)


def test_datasets_image_feature_in_memory_saved_and_streamed(folder):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"prompt": datasets.Value("string"), "image": datasets.Image()})
    ds = datasets.Dataset.from_dict({"prompt": ["<image> a", "<image> b"], "image": [drawn(10), drawn(20)]}, features=features)
    checked = check_rows(list(ds), images=LLAVA)
    assert [open_image(r["image"]).getpixel((1, 0))[0] for r in checked.rows] == [10, 20]
    ds.save_to_disk(str(folder / "saved"))
    saved = load_prompts(str(folder / "saved"), images=LLAVA)
    assert [open_image(r["image"]).getpixel((1, 0))[0] for r in saved] == [10, 20]
    # a stream of a JSONL file: paths relative to the file too, checked as they are read
    path = write_jsonl(folder / "s.jsonl", [{"prompt": chat(1), "image": "imgs/30.png"}, {"prompt": chat(1), "image": "imgs/x.png"}])
    stream = PromptStream(open_stream(str(path)), images=LLAVA, on_bad_row="skip", name=f"data.path: {path}")
    assert [open_image(r["image"]).getpixel((1, 0))[0] for r in stream.peek(2)] == [30]
    assert stream.first_skipped.problem == f"image: file not found: {folder}/imgs/x.png"


def test_pil_images_and_bytes_in_a_list_of_rows():
    rows = [{"prompt": chat(2), "images": [drawn(10), png(20)]}]
    out = check_rows(rows, images=LLAVA)
    assert [open_image(v).getpixel((1, 0))[0] for v in row_images(out.rows[0])] == [10, 20]
    assert placeholders([{"role": "user", "content": "see <image>"}], "<image>") == 1  # the token in a string message


def test_a_prompts_length_counts_its_images_tokens_as_the_processor_expands_them():
    """rollout.max_prompt_length holds the prompt the model will see: each image token expanded (16 tokens for a
    32x32 image in the tiny LLaVA), not the text alone; a text row as long as the image row's text passes."""
    from lmrl.config import load_config
    from lmrl.data.images import image_inputs
    from lmrl.models.tiny import tiny_llava

    _, processor = tiny_llava()
    inputs = image_inputs(load_config(None, []), processor)
    text = len(processor.tokenizer("<image> red?")["input_ids"])
    assert inputs.image_tokens([Image.new("RGB", (32, 32))]) == 15  # 16 image tokens in the placeholder's place
    rows = [{"prompt": "<image> red?", "image": Image.new("RGB", (32, 32), (200, 0, 0))}, {"prompt": "a long text prompt"}]

    def lengths(prompts):
        return [len(processor.tokenizer(p)["input_ids"]) for p in prompts]

    out = check_rows(rows, prompt_length=lengths, max_prompt_length=text + 14, images=inputs, on_bad_row="skip")
    assert out.rows == [rows[1]]
    assert lengths([rows[1]["prompt"]])[0] > text  # longer text than the image row's, and kept
    [bad] = out.skipped
    assert bad.problem == (f"prompt is {text + 15} tokens with its images, longer than "
                           f"rollout.max_prompt_length={text + 14}")
    assert check_rows(rows[:1], prompt_length=lengths, max_prompt_length=text + 15, images=inputs).rows == rows[:1]


def test_the_memory_estimate_counts_a_prompts_images_tokens(tmp_path):
    """The estimate made before the first step (`check_rollout_fits`) takes the longest prompt as the model will see
    it: a two-image prompt of a few characters is 30 tokens longer than its text."""
    from lmrl.build import load_data
    from lmrl.config import load_config
    from lmrl.memory_check import rollout_bytes
    from lmrl.models.tiny import tiny_llava

    model, processor = tiny_llava()
    rows = [{"prompt": "<image><image> which?", "images": [drawn(9, 32), drawn(99, 32)]}, {"prompt": "a text row."}]
    (tmp_path / "rw.py").write_text("def rw(completions, **kw):\n    return [0.0] * len(completions)\n")
    cfg = load_config(None, ["model.name_or_path=tiny-llava", f"reward.functions=[{tmp_path / 'rw.py'}:rw]"])
    data = load_data(cfg, processor.tokenizer, train_rows=rows, processor=processor)
    text = len(processor.tokenizer(rows[0]["prompt"])["input_ids"])
    assert data.longest_prompt == text + 30  # each placeholder is 16 image tokens
    assert rollout_bytes(cfg, model.config, data.longest_prompt) > rollout_bytes(cfg, model.config, text)
