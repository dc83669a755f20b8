"""lmrl vs TRL's GRPOTrainer with a vision-language policy, on equal settings (CPU): samples per second.

    python benchmarks/vision_vs_trl.py                        # the tiny LLaVA, 8 steps, seeds 0-1
    python benchmarks/vision_vs_trl.py --quick                # 3 steps, one seed: about a minute
    python benchmarks/vision_vs_trl.py --seeds 3 --record     # the table in docs/vision.md (results/vision-vs-trl.MACHINE.json)

Needs TRL (`pip install 'lmrl[bench]'`). Nothing is downloaded (HF_HUB_OFFLINE=1 in every process).

What is equal in both trainers:
    model      the same weights: a tiny LLaVA (`lmrl.models.tiny.tiny_llava`: a CLIP tower on 32x32 images in
               8-pixel patches, 16 image tokens each, on a tiny Llama of --hidden / --layers) built from a seed and
               saved with its processor, which both trainers load. Its EOS is a token outside the model's output
               vocabulary, so neither trainer can sample it: every completion runs to max_new_tokens (equal work).
    prompts    the vision task's rows (`lmrl.data.digits`: a digit drawn in the image, "digit+k=" in the text) as
               chat messages with an image part, rendered by the processor's chat template in both; the same
               prompts at every step (TRL reads them unshuffled, in the order lmrl's sampler draws them).
    reward     exact match of the answer (d + k).
    sampling   8 prompts x 8 completions per step, temperature 1, no top-k / top-p, 16 new tokens each.
    loss       GRPO: group-normalised advantages, PPO clip 0.2, no KL term and no reference model, one optimizer
               step per batch, per-sequence token mean (TRL loss_type="grpo").
    optimizer  AdamW, the same constant learning rate, no warm-up, weight decay 0, grad-norm clip 1.0, float32.
    vision     the tower trains in neither (lmrl: model.freeze_vision, its default; TRL: its parameters'
               requires_grad set False before the trainer is built).
    threads    torch.set_num_threads(--threads) in both processes.

How it measures: each trainer in a fresh subprocess, one after the other, the first alternating from seed to
seed. s/step is the mean wall time of steps 2..N (generation with the images, reward, forward, backward and
the optimizer step; lmrl: its `time/step` metric, TRL: a callback from on_step_begin to on_step_end);
samples/s = completions per step / s/step. The machine may be shared: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

END_TOKEN = "<end>"  # the benchmark's EOS: an id outside the model's output vocabulary


@dataclass
class Settings:
    init_dir: str
    steps: int
    seed: int
    threads: int
    prompts_per_step: int = 8
    group_size: int = 8
    max_new_tokens: int = 16
    lr: float = 1e-4
    rows: int = 256


def build_start_model(hidden: int, layers: int, seed: int, out_dir: str) -> None:
    """The tiny LLaVA both trainers load, with an EOS it cannot sample, saved with its processor."""
    from lmrl.models.tiny import tiny_llava

    model, processor = tiny_llava(hidden_size=hidden, num_layers=layers, seed=seed)
    processor.tokenizer.add_special_tokens({"eos_token": END_TOKEN})  # id = the model's vocab size: never sampled
    end = processor.tokenizer.convert_tokens_to_ids(END_TOKEN)
    assert end >= model.config.text_config.vocab_size
    model.config.text_config.eos_token_id = model.generation_config.eos_token_id = end
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)


def rows(s: Settings) -> list[dict]:
    """The vision task's rows as chat messages with an image part (TRL takes multimodal prompts as chat only)."""
    from lmrl.data.digits import IMAGE_TOKEN, digit_rows

    out = []
    for row in digit_rows(s.rows, seed=s.seed):
        text = row["prompt"].replace(IMAGE_TOKEN, "")
        out.append({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
                    "image": row["image"], "answer": row["answer"]})
    return out


LENGTHS: list[int] = []  # the characters of every completion scored (one token each with the char tokenizer)


def exact(completions, answer, **kwargs) -> list[float]:
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    LENGTHS.extend(map(len, texts))
    return [float(t.strip().startswith(a)) for t, a in zip(texts, answer)]


def run_lmrl(s: Settings, out_dir: str) -> list[float]:
    from lmrl.config import load_config
    from lmrl.trainer import Trainer

    cfg = load_config(None, [
        f"model.name_or_path={s.init_dir}", "algorithm=grpo", f"train.steps={s.steps}",
        f"rollout.prompts_per_step={s.prompts_per_step}", f"rollout.group_size={s.group_size}",
        f"rollout.max_new_tokens={s.max_new_tokens}", f"optim.lr={s.lr}", "optim.max_grad_norm=1.0",
        "optim.weight_decay=0.0", f"optim.micro_batch_size={s.prompts_per_step * s.group_size}",
        "rollout.temperature=1.0", "algorithm.kl_coef=0.0", "algorithm.aggregation=seq-mean-token-mean",
        "algorithm.clip_low=0.2", "algorithm.clip_high=0.2", f"train.seed={s.seed}", f"train.threads={s.threads}",
        f"train.output_dir={out_dir}", "train.eval_every=0", "log.console=false", "log.samples_every=0",
        "data.num_eval_prompts=0"])
    trainer = Trainer(cfg, reward_funcs=[exact], train_dataset=rows(s), console=False)
    return [m["time/step"] for m in trainer.train().history]


def run_trl(s: Settings, out_dir: str) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lmrl.data.prompts import PromptSampler
    from lmrl.models.vision import freeze_vision

    model = AutoModelForImageTextToText.from_pretrained(s.init_dir)
    freeze_vision(model)
    processor = AutoProcessor.from_pretrained(s.init_dir)
    data = rows(s)
    sampler = PromptSampler(len(data), seed=s.seed)  # lmrl's prompts of steps 1..N, in order
    order = [i for step in range(1, s.steps + 1) for i in sampler.indices(step, s.prompts_per_step)]

    class StepTimer(TrainerCallback):
        times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)

    timer = StepTimer()
    args = GRPOConfig(output_dir=out_dir, max_steps=s.steps, per_device_train_batch_size=s.prompts_per_step * s.group_size,
                      gradient_accumulation_steps=1, num_generations=s.group_size, max_completion_length=s.max_new_tokens,
                      num_iterations=1, beta=0.0, epsilon=0.2, loss_type="grpo", scale_rewards="group",
                      temperature=1.0, top_p=1.0, top_k=0, learning_rate=s.lr, lr_scheduler_type="constant",
                      warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, shuffle_dataset=False, seed=s.seed,
                      use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, report_to="none",
                      logging_steps=1, save_strategy="no", log_completions=False, disable_tqdm=True,
                      dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=[exact], args=args, train_dataset=Dataset.from_list(
        [data[i] for i in order]), processing_class=processor, callbacks=[timer])
    torch.set_num_threads(s.threads)
    trainer.train()
    return timer.times


def child(trainer: str, settings: str, result: str) -> None:
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    s = Settings(**json.loads(settings))
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    with tempfile.TemporaryDirectory() as out:
        times = (run_lmrl if trainer == "lmrl" else run_trl)(s, out)
    Path(result).write_text(json.dumps({"times": times, "length": statistics.fmean(LENGTHS)}))


def run_child(trainer: str, s: Settings) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", trainer, "--settings",
                               json.dumps(asdict(s)), "--result", path], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{trainer} subprocess failed:\n{proc.stderr[-4000:]}")
        return json.loads(Path(path).read_text())
    finally:
        os.unlink(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="3 steps, one seed")
    parser.add_argument("--record", nargs="?", const="vision-vs-trl", metavar="NAME",
                        help="write benchmarks/results/NAME.MACHINE.json (default name: vision-vs-trl)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.settings, args.result)
    steps, seeds = (3, 1) if args.quick else (args.steps, args.seeds)
    ratios, lmrl_rates, trl_rates = [], [], []
    for seed in range(seeds):
        with tempfile.TemporaryDirectory() as init:
            build_start_model(args.hidden, args.layers, seed, init)
            s = Settings(init_dir=init, steps=steps, seed=seed, threads=args.threads)
            order = ["lmrl", "trl"] if seed % 2 == 0 else ["trl", "lmrl"]
            runs = {name: run_child(name, s) for name in order}
        rate = {name: s.prompts_per_step * s.group_size / statistics.fmean(r["times"][1:] or r["times"])
                for name, r in runs.items()}
        length = {name: r["length"] for name, r in runs.items()}
        lmrl_rates.append(rate["lmrl"])
        trl_rates.append(rate["trl"])
        ratios.append(rate["lmrl"] / rate["trl"])
        print(f"seed {seed}: lmrl {rate['lmrl']:.1f} samples/s, TRL {rate['trl']:.1f} samples/s: "
              f"{ratios[-1]:.2f}x; mean completion length {length['lmrl']:.1f} / {length['trl']:.1f} characters",
              flush=True)
    row = {"model": f"tiny LLaVA {args.hidden}x{args.layers}", "batch": f"{s.prompts_per_step} x {s.group_size}",
           "lmrl": statistics.fmean(lmrl_rates), "trl": statistics.fmean(trl_rates),
           "ratio": statistics.fmean(ratios), "per_seed": ", ".join(f"{r:.2f}" for r in ratios)}
    print(f"lmrl / TRL: {row['ratio']:.2f}x ({row['per_seed']})")
    if args.record:
        import trl  # noqa: F401 - its version goes into the record

        from benchmarks.recording import Column, record

        columns = [Column("model"), Column("batch", "prompts x completions"),
                   Column("lmrl", "lmrl samples/s", "{:.1f}"), Column("trl", "TRL samples/s", "{:.1f}"),
                   Column("ratio", "lmrl / TRL (per seed)", "**{:.2f}x** ({per_seed})")]
        print(record(args.record, columns, [row], note=(
            f"float32; {steps} steps of {s.prompts_per_step} prompts x {s.group_size} completions, "
            f"{s.max_new_tokens} new tokens each, one 32x32 image per prompt; {args.threads} thread(s); "
            f"seeds 0-{seeds - 1}; samples/s from the mean time of steps 2..N; the vision tower frozen in both.")))


if __name__ == "__main__":
    main()
