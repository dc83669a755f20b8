"""`lmrl train` with a vision-language policy, end to end: a tiny LLaVA built here, a JSONL + PNG dataset drawn
here (one image, two images and none in one batch), trained through the CLI in a subprocess."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests import forked

ROOT = Path(__file__).resolve().parents[2]
REWARD = "def reward(completions, **kwargs):\n    return [float(len(c) % 3) for c in completions]\n"
# an environment that shows an image (the same at every step) after the model's first turn, then ends the episode
SHOW_ENV = """from PIL import Image
from lmrl.envs import Step


class Show:
    def __init__(self, row):
        self.turn = 0

    def step(self, text, token_ids):
        self.turn += 1
        if self.turn > 1:
            return Step(reward=float(len(text) % 2), done=True)
        return Step(observation=" and <image>?", images=[Image.new("RGB", (32, 32), (0, 9, 99))])
"""
# turns of a random model end early (EOS alone almost never comes), so that episodes reach their observation
MULTI_TURN = ("env.name=show.py:Show", "env.max_turns=2", "env.max_tokens=40", "rollout.max_new_tokens=3",
              "rollout.stop=[a,e,i,o,u,' ',s,t,n,r,l,d,h,c,m,p,g,w,y]")


def _dataset(tmp: Path, build=None, image: str = "<image>") -> Path:
    """A saved tiny LLaVA (or what `build` returns) and its processor, and a JSONL whose rows hold one image, two,
    or none (each written as `image`)."""
    from PIL import Image

    from lmrl.models.tiny import tiny_llava

    model, processor = (build or tiny_llava)()
    model.save_pretrained(tmp / "model")
    processor.save_pretrained(tmp / "model")
    (tmp / "imgs").mkdir()
    rows = []
    for i in range(6):
        Image.new("RGB", (32, 32), (40 * i, 200 - 30 * i, 90)).save(tmp / "imgs" / f"{i}.png")
        if i % 3 == 0:
            rows.append({"prompt": f"{image} what {i}?", "image": f"imgs/{i}.png"})
        elif i % 3 == 1:
            rows.append({"prompt": f"no image: {i}+"})
        else:
            rows.append({"prompt": f"{image}{image} which {i}?", "images": [f"imgs/{i}.png", f"imgs/{i - 1}.png"]})
    (tmp / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "rw.py").write_text(REWARD)
    (tmp / "show.py").write_text(SHOW_ENV)
    return tmp


def _train(tmp: Path, out: str, *extra: str, imports: tuple[str, ...] = forked.LMRL) -> subprocess.CompletedProcess:
    args = [f"model.name_or_path={tmp / 'model'}", f"data.path={tmp / 'data.jsonl'}",
            f"reward.functions=[{tmp / 'rw.py'}:reward]", "rollout.prompts_per_step=3", "rollout.group_size=4",
            "rollout.max_new_tokens=6", "model.device=cpu", "algorithm.tis_cap=2.0", "optim.lr=1e-3",
            "data.num_eval_prompts=0", f"train.output_dir={tmp / out}", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return forked.lmrl("train", *args, env=env, cwd=tmp, timeout=300, imports=imports)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return _dataset(tmp_path_factory.mktemp("vision-train"))


def test_llava_trains_through_the_cli(data):
    run = _train(data, "run", "train.steps=3", "log.samples_every=1", "log.num_samples=12")
    assert run.returncode == 0, run.stderr[-2000:]
    history = [json.loads(line) for line in (data / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [h for h in history if "loss" in h]
    assert len(steps) == 3 and all(math.isfinite(h["loss"]) for h in steps)
    kl = [h["val/sampler_kl"] for h in steps if "val/sampler_kl" in h]
    assert kl and all(abs(v) < 1e-4 for v in kl), kl  # the sampler and the trainer score with the same images
    before, after = _weights(data / "model"), _weights(data / "run" / "final")
    vision = [k for k in before if "vision_tower" in k]
    language = [k for k in before if "language_model" in k]
    assert vision and language
    assert all(torch.equal(before[k], after[k]) for k in vision)  # model.freeze_vision (default true)
    assert any(not torch.equal(before[k], after[k]) for k in language)
    # samples.jsonl names the images each sample's prompt showed: its row's, in order
    shown = {r["prompt"]: [str(data / p) for p in r.get("images", [r["image"]] if "image" in r else [])]
             for r in map(json.loads, (data / "data.jsonl").read_text().splitlines())}
    samples = [json.loads(line) for line in (data / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 36 and {len(s["images"]) for s in samples} == {0, 1, 2}
    assert all(s["images"] == shown[s["prompt"]] for s in samples)
    # the saved run is a model transformers loads with its processor
    assert (data / "run" / "final" / "processor_config.json").exists()


@pytest.mark.parametrize("override, words", [
    ("algorithm.advantage=gae", "a critic"),
    ("rollout.dtype=bfloat16", "rollout.dtype"),
])
def test_what_images_cannot_do_is_refused_in_one_line(data, override, words):
    run = _train(data, "refused", "train.steps=1", override)
    assert run.returncode == 2, run.stderr[-2000:]
    line = run.stderr.strip().splitlines()[-1]
    assert words in line and "vision-language policy" in line and "Loading weights" not in run.stderr, run.stderr


def test_a_resumed_image_run_equals_an_uninterrupted_one(data):
    """Stopped after step 2 (its checkpoint) and resumed to step 4: the same losses and the same final weights as
    four steps in one go, so the images a resumed step scores are the ones the uninterrupted step scored."""
    straight = _train(data, "straight", "train.steps=4")
    assert straight.returncode == 0, straight.stderr[-2000:]
    first = _train(data, "resumed", "train.steps=2", "train.save_every=2")
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = _train(data, "resumed", "train.steps=4", "train.save_every=2", "train.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resum" in (resumed.stdout + resumed.stderr).lower()

    def losses(out: str) -> dict[int, float]:
        rows = [json.loads(line) for line in (data / out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    a, b = losses("straight"), losses("resumed")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert all(a[k] == pytest.approx(b[k], abs=1e-6) for k in a), (a, b)
    end, again = _weights(data / "straight" / "final"), _weights(data / "resumed" / "final")
    assert all(torch.allclose(end[k], again[k], atol=1e-6) for k in end)


def test_padding_side_cannot_change_a_score():
    """A row's log-probs are the same scored alone or left-padded beside a longer prompt, and whatever padding side
    the processor's tokenizer was saved with (TRL #5785: right padding silently moved the image context)."""
    from PIL import Image

    from lmrl.collect import prompt_media
    from lmrl.data.images import ImageInputs, open_image, row_images
    from lmrl.data.row_checks import check_rows
    from lmrl.models.forward import model_forward_logprobs
    from lmrl.models.tiny import tiny_llava
    from lmrl.models.vision import row_media
    from lmrl.rollout import HFGenerator, SamplingParams

    model, processor = tiny_llava()
    rows = check_rows([{"prompt": "<image> red?", "image": Image.new("RGB", (32, 32), (200, 30, 30))},
                       {"prompt": "<image><image> a much longer prompt, which pads the first one on the left",
                        "images": [Image.new("RGB", (32, 32), (0, 90, 0)), Image.new("RGB", (32, 32), (9, 9, 90))]}],
                      images=ImageInputs(image_token="<image>")).rows
    assert all(open_image(v) for r in rows for v in row_images(r))

    processor.tokenizer.padding_side = "right"
    right = prompt_media(processor, [r["prompt"] for r in rows], rows)[:2]
    processor.tokenizer.padding_side = "left"
    ids, media, _ = prompt_media(processor, [r["prompt"] for r in rows], rows)
    assert ids == right[0] and all(torch.equal(a["pixel_values"], b["pixel_values"]) for a, b in zip(media, right[1]))
    assert len(ids[1]) > len(ids[0]) + 20  # the first prompt is left-padded by 20+ tokens in their batch

    out = HFGenerator(model, processor.tokenizer).generate(
        ids, 2, SamplingParams(max_new_tokens=5, temperature=1.0, seed=3), media=media)
    seqs = torch.cat([out.prompt_ids, out.response_ids], 1)
    mask = torch.cat([out.prompt_mask, out.response_mask], 1).long()
    T = out.response_ids.shape[1]
    with torch.no_grad():
        batched = model_forward_logprobs(model, seqs, mask, T, media=row_media(media, out.prompt_index))
        assert (out.logprobs - batched)[out.response_mask].abs().max() < 1e-5  # the sampler's scores: the trainer's
        for row in (0, 1):  # the first prompt's rows, scored again without any padding
            real = mask[row].bool()
            alone = model_forward_logprobs(model, seqs[row][real][None], torch.ones(1, int(real.sum()), dtype=torch.long),
                                           int(out.response_mask[row].sum()), media=row_media(media, [0]))
            n = alone.shape[1]
            assert n > 0 and torch.allclose(batched[row, :n], alone[0], atol=1e-5), row


def test_lora_adapts_the_language_model_alone(data):
    """model.lora on a vision-language policy: `all-linear` adapters on the language model only; the merged saved
    model changes there and nowhere else; the reference (the base, adapters off) scores with the images too."""
    run = _train(data, "lora", "train.steps=2", "model.lora={r: 4}", "algorithm.kl_coef=0.1", "optim.lr=1e-2")
    assert run.returncode == 0, run.stderr[-2000:]
    from safetensors.torch import load_file

    adapter = load_file(str(data / "lora" / "final" / "adapter" / "adapter_model.safetensors"))
    assert adapter and all(".language_model." in k for k in adapter)
    before, after = _weights(data / "model"), _weights(data / "lora" / "final")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("language_model" in k for k in changed)
    rows = [json.loads(line) for line in (data / "lora" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["objective/kl"]) for r in rows if "objective/kl" in r)


@pytest.mark.skipif(torch.cuda.is_available() and importlib.util.find_spec("vllm") is None,
                    reason="vLLM's CUDA build is not installed on this GPU machine (given lmrl's wheels only)")
def test_an_idefics3_policy_samples_through_the_vllm_engine(tmp_path):
    """rollout.backend=vllm with images: the engine gets each prompt's unexpanded ids and its images
    (`multi_modal_data`), expands them with its own processor to the policy processor's ids (checked), and samples
    with the weights of every step: its log-probs are the trainer's (the sync check's `val/sampler_logprob_diff`,
    float32 on the CPU). vLLM's CPU build loads Idefics3 (SmolVLM's architecture) here, not LLaVA. Multi-turn: an
    environment shows a second image, the same at both steps (vLLM's encoder cache must not keep its features across
    a weight sync), and the second turns get each episode's ids and images."""
    from lmrl.models.tiny import tiny_idefics3

    data = _dataset(tmp_path, tiny_idefics3)
    run = _train(data, "run", "train.steps=2", "rollout.backend=vllm", *MULTI_TURN, imports=forked.VLLM)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = [h for h in map(json.loads, (data / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in h]
    assert len(steps) == 2 and all(math.isfinite(h["loss"]) for h in steps)
    assert all(h["env/observation_tokens"] > 0 for h in steps)  # episodes were shown the environment's image
    assert all(h["val/sampler_logprob_diff"] < 1e-4 for h in steps), [h["val/sampler_logprob_diff"] for h in steps]
    before, after = _weights(data / "model"), _weights(data / "run" / "final")
    assert all(torch.equal(before[k], after[k]) for k in before if "vision_model" in k)  # frozen
    assert any(not torch.equal(before[k], after[k]) for k in before if "text_model" in k)  # step 2 sampled with these


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
def test_a_vision_model_and_its_processor_passed_from_python(tmp_path, kind):
    """`Trainer(model=vlm, tokenizer=processor)` (TRL's `processing_class` may be a processor): image rows in
    memory (one image, two of different sizes) go through generate -> experience -> update with the model's
    images, the vision tower frozen, the sampler and trainer agreeing; for Qwen2-VL with its 3-D (M-RoPE)
    positions, which a 2-D `position_ids` would silently get wrong for the image tokens."""
    from PIL import Image

    from lmrl import Trainer
    from lmrl.config import load_config
    from lmrl.models.tiny import tiny_llava, tiny_qwen2_vl

    model, processor = (tiny_llava if kind == "llava" else tiny_qwen2_vl)(seed=1)
    # an image as each chat template writes it (Qwen's between <|vision_start|> and <|vision_end|>)
    token, tower_name = (("<image>", "vision_tower") if kind == "llava"
                         else ("<|vision_start|><|image_pad|><|vision_end|>", "visual"))
    tower = {k: v.clone() for k, v in model.state_dict().items() if tower_name in k}
    assert tower
    rows = [{"prompt": f"{token} what {i}?", "image": Image.new("RGB", (32, 32), (30 * i, 90, 9))} for i in range(3)]
    rows.append({"prompt": f"{token}{token} two?", "images": [Image.new("RGB", (32, 32), (9, 9, 99)),
                                                            Image.new("RGB", (32, 32) if kind == "llava" else (64, 32))]})
    cfg = load_config(None, ["train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=4",
                             "rollout.max_new_tokens=4", "data.num_eval_prompts=0", "optim.lr=1e-3", "algorithm.tis_cap=2.0",
                             f"train.output_dir={tmp_path}", "log.console=false"])
    reward = lambda completions, **kw: [sum(map(ord, c)) % 7 / 7 for c in completions]  # noqa: E731
    trainer = Trainer(cfg, model=model, tokenizer=processor, reward_funcs=[reward], train_dataset=rows)
    history = trainer.train().history
    assert len(history) == 2 and all(abs(h["val/sampler_kl"]) < 1e-4 for h in history)
    assert all(h["update/rows_skipped"] < 1 for h in history)  # each step trained
    assert trainer.models.processor is processor
    assert all(torch.equal(v, model.state_dict()[k].cpu()) for k, v in tower.items())


def test_an_asynchronous_run_samples_images_in_its_generator_process(data):
    """train.async_steps=1: the generator process makes each prompt's bundle with the policy's processor, samples with
    lmrl's decode over its own copy of the model and sends the bundles back with the batch (multi-turn episodes whose
    environment shows an image: one bundle per episode). Step 1 is sampled by the weights the trainer starts from:
    its log-probs are the trainer's with the same images; step 2's are a step old."""
    # train.seed=1: a first batch whose rewards differ (an update at step 1; seed 0's scored 0 everywhere)
    run = _train(data, "async", "train.steps=2", "train.async_steps=1", "train.seed=1", *MULTI_TURN)
    assert run.returncode == 0, run.stderr[-2000:]
    steps = [h for h in map(json.loads, (data / "async" / "metrics.jsonl").read_text().splitlines()) if "loss" in h]
    assert [h["async/version_lag"] for h in steps] == [0.0, 1.0] and all(math.isfinite(h["loss"]) for h in steps)
    assert all(h["env/observation_tokens"] > 0 for h in steps)
    assert steps[0]["val/sampler_logprob_diff"] < 1e-4, steps[0]["val/sampler_logprob_diff"]
    before, after = _weights(data / "model"), _weights(data / "async" / "final")
    assert all(torch.equal(before[k], after[k]) for k in before if "vision_tower" in k)
    assert any(not torch.equal(before[k], after[k]) for k in before if "language_model" in k)


def test_a_qwen2_vl_directory_trains_through_the_cli_where_its_own_processor_cannot_load(tmp_path):
    """A saved Qwen2-VL (M-RoPE) through `lmrl train`: transformers' processor for it needs torchvision (absent here),
    so its processor loads as lmrl's stand-in for images (`lmrl.models.qwen_vl`), which expands each image as
    transformers' own does; two steps, the sampler within 1e-4 of the trainer, the saved run loads back the same."""
    from lmrl.models.qwen_vl import QwenVLImageProcessor
    from lmrl.models.tiny import tiny_qwen2_vl
    from lmrl.models.vision import load_vision_processor

    data = _dataset(tmp_path, lambda: tiny_qwen2_vl(seed=1), image="<|vision_start|><|image_pad|><|vision_end|>")
    run = _train(data, "qwen", "train.steps=2")
    assert run.returncode == 0, run.stderr[-2000:]
    steps = [h for h in map(json.loads, (data / "qwen" / "metrics.jsonl").read_text().splitlines()) if "loss" in h]
    assert len(steps) == 2 and all(abs(h["val/sampler_kl"]) < 1e-4 for h in steps), steps
    saved = load_vision_processor(str(data / "qwen" / "final"))
    own = importlib.util.find_spec("torchvision") is not None  # transformers' own loads where torchvision is (a GPU image)
    assert isinstance(saved, QwenVLImageProcessor) != own, type(saved)
    text, image = ["<|vision_start|><|image_pad|><|vision_end|>?"], [Image.new("RGB", (64, 32))]
    assert saved(text, images=image)["input_ids"].tolist() == tiny_qwen2_vl()[1](text, images=image)["input_ids"].tolist()
