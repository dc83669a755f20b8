"""Build `tiny-vision`, the vision-language model that ships with lmrl: a tiny LLaVA supervised a little on the
digits task (`lmrl.data.tasks.DigitsTask`: `<image>digit+K=` -> digit + K).

    .venv/bin/python scripts/make_tiny_vision.py            # writes lmrl/assets/tiny-vision/

A CLIP tower on 32x32 images in 8-pixel patches (16 image tokens) and a two-layer character-level Llama, as
`lmrl.models.tiny.tiny_llava` builds them, with Pillow's CLIP image processor (no torchvision): the directory
loads with `AutoModelForImageTextToText` and `AutoProcessor`. Seeded and deterministic on one thread (same seed,
same torch build -> same weights). Stopped early on purpose, as the text models are: the shipped model answers
a minority of held-out drawings greedily but samples the right answer for many within 8 tries, so GRPO has room
to show progress in a few CPU minutes. The drawings RL evaluates on are held out from this supervision.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
from make_tiny_model import ASSETS, SFTConfig, supervise  # scripts/ is on the path when run as a script

from lmrl.data.digits import IMAGE_TOKEN
from lmrl.data.tasks import DigitsTask, exact_match_reward
from lmrl.models.tiny import tiny_llava

DEFAULT_OUT = ASSETS / "tiny-vision"
# what ships (each a flag): small enough to stop before the model reads every digit
DEFAULTS = SFTConfig(hidden_size=128, num_layers=2, steps=350, batch_size=64, lr=1e-3, warmup=50)
VISION_HIDDEN, VISION_LAYERS = 64, 2
READ_STEPS = 1000
SFT_ROWS = 2000  # the first training rows of the task: RL meets the rest, drawings this stage never showed


def encode_rows(processor, rows: list[dict]) -> tuple[list[list[int]], torch.Tensor, list[list[int]]]:
    """Each row's prompt ids (its image token expanded to the image's 16), its pixels (`[N, 3, 32, 32]`) and its
    answer ids + EOS, tokenized as the trainer does (no BOS)."""
    tokenizer = processor.tokenizer
    out = processor(text=[r["prompt"] for r in rows], images=[r["image"] for r in rows], return_tensors="pt",
                    padding=True)
    mask = out["attention_mask"].bool()
    prompts = [ids[m].tolist() for ids, m in zip(out["input_ids"], mask)]
    answers = [tokenizer(r["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for r in rows]
    return prompts, out["pixel_values"], answers


def batches(processor, rows: list[dict]):
    """`batch(indices)` -> right-padded (input_ids, attention_mask, labels, {"pixel_values"}) of those rows; labels
    are the answer and EOS tokens (-100 on the prompt and padding)."""
    prompts, pixels, answers = encode_rows(processor, rows)
    pad = processor.tokenizer.pad_token_id

    def batch(index: list[int]):
        width = max(len(prompts[i]) + len(answers[i]) for i in index)
        ids, attention, labels = [], [], []
        for i in index:
            p, a = prompts[i], answers[i]
            fill = width - len(p) - len(a)
            ids.append(p + a + [pad] * fill)
            attention.append([1] * (len(p) + len(a)) + [0] * fill)
            labels.append([-100] * len(p) + a + [-100] * fill)
        return torch.tensor(ids), torch.tensor(attention), torch.tensor(labels), {"pixel_values": pixels[index]}

    return batch


@torch.no_grad()
def evaluate_vision(model, processor, rows: list[dict], k: int = 1, seed: int = 0) -> dict[str, float]:
    """Held-out exact match through lmrl's own sampler, images in the prefill: greedy `accuracy`, and `pass_at_k`
    (at least one of `k` samples at temperature 1 right) when `k > 1`."""
    from lmrl.models.vision import encode_with_media
    from lmrl.rollout import HFGenerator, SamplingParams

    was_training = model.training
    model.eval()
    ids, bundles = encode_with_media(processor, [r["prompt"] for r in rows], [[r["image"]] for r in rows])
    generator = HFGenerator(model, processor.tokenizer, seed=seed)
    answers = [r["answer"] for r in rows]
    greedy = generator.generate(ids, 1, SamplingParams(max_new_tokens=3, temperature=0.0), media=bundles)
    out = {"accuracy": sum(exact_match_reward(None, greedy.texts, answers)) / len(rows)}
    if k > 1:
        sampled = generator.generate(ids, k, SamplingParams(max_new_tokens=3, temperature=1.0, seed=seed), media=bundles)
        right = exact_match_reward(None, sampled.texts, [a for a in answers for _ in range(k)])
        out["pass_at_k"] = sum(max(right[i * k:(i + 1) * k]) for i in range(len(rows))) / len(rows)
    model.train(was_training)
    return out


def sft_vision(task: DigitsTask, config: SFTConfig, read_steps: int = 0, log_every: int = 0):
    """Build the model and processor from `config.seed` and supervise every part on `task.train_prompts()`.

    Returns (model, processor); the model is in eval mode."""
    model, processor = tiny_llava(hidden_size=config.hidden_size, num_layers=config.num_layers, seed=config.seed,
                                  vision_hidden_size=VISION_HIDDEN, vision_layers=VISION_LAYERS)
    train, held_out = task.train_prompts()[:SFT_ROWS], task.eval_prompts()[:200]

    def progress(model) -> str:
        m = evaluate_vision(model, processor, held_out, k=8)
        return f"greedy {m['accuracy']:.3f}  pass@8 {m['pass_at_k']:.3f}"

    if read_steps:  # 1. reading: the digit alone, as a vision tower is pretrained before it meets a task
        reading = [reading_row(r) for r in train]
        print(f"reading ({read_steps} steps): <image>digit= -> the digit", flush=True)
        supervise(model, processor.tokenizer, len(reading), batches(processor, reading),
                  dataclasses.replace(config, steps=read_steps), log_every, progress)
    print(f"the task ({config.steps} steps): <image>digit+K= -> digit + K", flush=True)  # 2. briefly, the task
    supervise(model, processor.tokenizer, len(train), batches(processor, train), config, log_every, progress)
    return model, processor


def reading_row(row: dict) -> dict:
    """A task row as a reading exercise: `<image>digit=` -> the digit shown."""
    k = int(row["prompt"].rsplit("+", 1)[1].rstrip("="))
    return {"prompt": f"{IMAGE_TOKEN}digit=", "image": row["image"], "answer": str(int(row["answer"]) - k)}


def save(model, processor, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    # transformers 5 names the class TokenizersBackend, which 4.x cannot load; both load this name
    tok_config = out / "tokenizer_config.json"
    tok_config.write_text(tok_config.read_text().replace('"TokenizersBackend"', '"PreTrainedTokenizerFast"'))
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; installed package data must be readable by all
    print(f"saved to {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.2f} MB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="'-' to save nothing")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--read-steps", type=int, default=READ_STEPS, help="steps reading the digit alone, first")
    for field, value in vars(DEFAULTS).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args()
    # one thread: the same float reduction order on every machine (and faster for a model this small)
    torch.set_num_threads(1)
    config = SFTConfig(**{k: getattr(args, k) for k in vars(DEFAULTS)})
    task = DigitsTask()
    model, processor = sft_vision(task, config, args.read_steps, log_every=args.log_every)
    m = evaluate_vision(model, processor, task.eval_prompts(), k=8)
    blank = evaluate_vision(model, processor, DigitsTask(blank=True).eval_prompts())
    print(f"held-out ({task.num_eval} drawings): greedy {m['accuracy']:.3f}  pass@8 (T=1) {m['pass_at_k']:.3f}  "
          f"blank images: greedy {blank['accuracy']:.3f}")
    if str(args.out) != "-":
        save(model, processor, args.out)


if __name__ == "__main__":
    main()
