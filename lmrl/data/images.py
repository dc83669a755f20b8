"""Images in prompt rows, in TRL's format, and their checks.

A row carries images in `image` (one) or `images` (a list). Each is a path (relative to the data file:
made absolute when the file is read, `resolve_image_paths`), a PIL image, encoded bytes, or what a
`datasets` Image feature holds undecoded (`{"bytes", "path"}`). The prompt says where each goes: chat
messages whose content is a list of parts, `{"type": "image"}` among `{"type": "text", "text": ...}`,
or a string holding the processor's image token (`"<image>"` for LLaVA).

Rows are checked before a model loads (`image_problem`, called by `lmrl.data.row_checks`): every image
opens, the images match the placeholders in number, and the model takes images at all. Images stay as
the row gives them until a processor turns a prompt and its images into token ids and one opaque bundle
of tensors (`lmrl.models`): nothing in `lmrl.data` knows a pixel layout, so video and audio can come
the same way. Pillow is imported only when a row has images.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmrl.models.image_files import open_image  # noqa: F401  (here since rows were first to open images)

IMAGE_COLUMNS = ("image", "images")


@dataclass(frozen=True)
class ImageInputs:
    """What the policy takes besides text, as the row checks need it.

    Attributes:
        image_token: the processor's image placeholder in string prompts (e.g. "<image>"); None: the model
            is text-only, and a row with an image (or an image part in its messages) is a bad row.
        model: how a message names the model (e.g. "model.name_or_path=tiny").
        image_tokens: the tokens a row's images add to its prompt beyond their placeholders, as the processor
            expands them (counted into the prompt's length); None: not counted.
        measured: told the length of each prompt with images that fits rollout.max_prompt_length, its images'
            tokens counted (the memory estimate's longest prompt, `lmrl.memory_check.check_rollout_fits`).
    """

    image_token: str | None
    model: str = "the model"
    image_tokens: Callable[[list[Any]], int] | None = None
    measured: Callable[[int], None] | None = None

    @property
    def takes_images(self) -> bool:
        return self.image_token is not None


def row_images(row: Mapping[str, Any]) -> list[Any]:
    """The images of a checked row as it gives them, in order; [] for a text row."""
    if row.get("images") is not None:
        return list(row["images"])
    return [] if row.get("image") is None else [row["image"]]


def resolve_image_paths(row: Any, base: Path) -> Any:
    """`row` with its relative image paths (strings, or the `path` of a `{"bytes", "path"}` without bytes)
    joined to `base`, the data file's directory; anything else is left as it is."""
    if not isinstance(row, dict) or not any(row.get(c) is not None for c in IMAGE_COLUMNS):
        return row

    def resolved(value: Any) -> Any:
        if isinstance(value, str) and value and not os.path.isabs(value):
            return str(base / value)
        if isinstance(value, dict) and value.get("bytes") is None and isinstance(value.get("path"), str):
            return {**value, "path": resolved(value["path"])}
        return value

    out = dict(row)
    if isinstance(out.get("images"), list):
        out["images"] = [resolved(v) for v in out["images"]]
    elif out.get("image") is not None:
        out["image"] = resolved(out["image"])
    return out


def placeholders(prompt: Any, image_token: str | None) -> int:
    """How many images `prompt` asks for: its `{"type": "image"}` parts, plus `image_token` in its text."""
    if isinstance(prompt, str):
        return prompt.count(image_token) if image_token else 0
    count = 0
    for message in prompt:
        content = message["content"]
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        for part in parts:
            if part["type"] == "image":
                count += 1
            elif image_token:
                count += part["text"].count(image_token)
    return count


def image_problem(row: Mapping[str, Any], prompt_column: str, inputs: ImageInputs) -> str | None:
    """The first thing wrong with a row's images, or None. The row's prompt has passed its own checks."""
    if row.get("image") is not None and row.get("images") is not None:
        return "row has both 'image' and 'images'; give one of them"
    column = "images" if row.get("images") is not None else "image"
    if column == "images" and not isinstance(row["images"], (list, tuple)):
        return f"images must be a list of images, got {type(row['images']).__name__}"
    images = row_images(row)
    prompt = row[prompt_column]
    if not inputs.takes_images:
        if images:
            return (f"{column}: {_count(len(images), 'image')} for a text-only model ({inputs.model}); "
                    "use a vision-language model or drop the column")
        return _text_only_problem(prompt, inputs.model)
    wanted = placeholders(prompt, inputs.image_token)
    if wanted != len(images):
        where = "{'type': 'image'} parts" if not isinstance(prompt, str) else f"{inputs.image_token!r} tokens"
        return (f"prompt has {_count(wanted, 'image placeholder')} ({where}) but the row has "
                f"{_count(len(images), 'image')} in {column!r}")
    for i, value in enumerate(images):
        problem = unreadable(value, f"images[{i}]" if column == "images" else "image")
        if problem is not None:
            return problem
    return None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def unreadable(value: Any, label: str = "image") -> str | None:
    """Why an image value cannot be opened (`label` names it: "images[1]"), or None: a missing file, not an
    image, a value of another type."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return None
    shown = value
    if isinstance(value, Mapping) and ("bytes" in value or "path" in value):
        shown = value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
    if isinstance(value, (str, os.PathLike)):
        if not os.path.isfile(value):
            return f"{label}: file not found: {os.fspath(value)}"
        source: Any = os.fspath(value)
        shown = source
    elif isinstance(value, (bytes, bytearray)):
        source, shown = io.BytesIO(value), f"{len(value)} bytes"
    else:
        return f"{label}: must be a path, image bytes or a PIL image, got {type(value).__name__}"
    try:
        with Image.open(source) as image:
            image.verify()  # reads the whole file: a truncated one fails here, not mid-run
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"{label}: not a readable image ({reason}): {shown}"
    return None


def _text_only_problem(prompt: Any, model: str) -> str | None:
    """For a text-only model: no image parts and no content parts at all (its chat template renders strings)."""
    if isinstance(prompt, str):
        return None
    for k, message in enumerate(prompt):
        content = message["content"]
        if isinstance(content, list):
            if any(part["type"] == "image" for part in content):
                return f"prompt message {k} has an image part, for a text-only model ({model})"
            return (f"prompt message {k}: content parts are for a vision-language model; "
                    f"give {model} the text as a string")
    return None


def image_refs(row: Mapping[str, Any], keep: str | os.PathLike | None = None, later: Sequence[Any] = ()) -> list[str]:
    """How `samples.jsonl` names the images a row's prompt showed (and then `later`, those its episode's environment
    showed): a path as the row gives it (made absolute when the file was read), else `sha256:` and the first 16 hex
    digits of the image's bytes (of its RGB pixels for a PIL image), so a person can tell which image a sample saw.
    `keep`: a directory where each in-memory image is also saved, once, as `HEX.png` (the run's `images/`, where
    `lmrl report` finds it for its thumbnail)."""
    import hashlib

    from PIL import Image

    out = []
    for value in [*row_images(row), *later]:
        if isinstance(value, Mapping):
            value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
        if isinstance(value, (str, os.PathLike)):
            out.append(os.fspath(value))
            continue
        data = value.convert("RGB").tobytes() if isinstance(value, Image.Image) else bytes(value)
        digest = hashlib.sha256(data).hexdigest()[:16]
        out.append("sha256:" + digest)
        if keep is not None and not (path := Path(keep) / f"{digest}.png").exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            (value if isinstance(value, Image.Image) else open_image(value)).save(path)
    return out


def image_inputs(cfg: Any, processor: Any) -> ImageInputs:
    """What the policy takes besides text, for the row checks: a vision-language
    policy's image token (what it cannot do with images refused here, before it loads); a text model (no
    processor) takes none, so a row with an image is refused naming the model."""
    from lmrl.models.vision import image_token, refuse_unsupported

    name = f"model.name_or_path={cfg.model.name_or_path}"
    if processor is None:
        return ImageInputs(image_token=None, model=name)
    refuse_unsupported(cfg)
    token = image_token(processor)
    known: dict[tuple[tuple[int, int], ...], int] = {}  # image sizes -> tokens added

    def added(images: list[Any]) -> int:
        """Processed as the collector will, once per distinct list of image sizes: how many tokens an image
        becomes depends on its size alone in the processors of LLaVA, Qwen2-VL and Idefics3."""
        opened = [open_image(v) for v in images]
        sizes = tuple(image.size for image in opened)
        if sizes not in known:
            text = token * len(opened)
            out = processor(text=[text], images=[image.convert("RGB") for image in opened], return_tensors="pt")
            known[sizes] = len(out["input_ids"][0]) - len(processor.tokenizer(text)["input_ids"])
        return known[sizes]

    return ImageInputs(image_token=token, model=name, image_tokens=added)
