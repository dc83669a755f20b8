"""float32 vs bfloat16 on this CPU: matmuls, and lmrl's training step in three precision settings.

    python benchmarks/precision.py                       # matmuls, then hidden 256 / 4 layers and 512 / 8 layers
    python benchmarks/precision.py --quick               # small matmuls, hidden 256 / 4 layers, 3 steps: ~1 min
    python benchmarks/precision.py --sizes 512x8 --steps 8 --reward-steps 0
    python benchmarks/precision.py --quick --record      # the table in docs/performance.md (benchmarks/results/precision.MACHINE.json)

Three measurements, each setting after the other in the same process:
    matmul     a [M, K] x [K, N] matmul: float32 tensors, bfloat16 tensors, and float32 tensors under
               torch.autocast(bfloat16) (which adds the casts of both inputs). Best of --repeats.
    step       lmrl's GRPO training step (generate + score + update) on the same start weights and prompts,
               mean of steps 2..N (step 1 is warm-up), and the generate / update split, in three settings:
                 fp32      float32 everywhere
                 autocast  train.autocast_bf16=true (bfloat16 autocast in generation and training)
                 bf16      autocast in training, sampling with a bfloat16 copy of the weights
                           (rollout.dtype=bfloat16, TIS-corrected), eager attention
               8 prompts x G=8 completions, 64 new tokens (EOS cannot be sampled, so all do the same work;
               see benchmarks/vs_trl.py). The reward is random, so that every row is trained on (lmrl skips
               rows whose advantage is 0, which would hide the update's cost).
    reward     does training still improve in bfloat16? --reward-steps steps at --reward-size from a
               supervised warm start, each setting: mean training reward of the first and last 5 steps.
The CPU may be shared with other processes: compare ratios within one run, and rerun when in doubt.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (vs_trl's helpers)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402
from vs_trl import SIZES, RewardRecorder, _load, build_start_model  # noqa: E402

SETTINGS = {
    "fp32": [],
    "autocast": ["train.autocast_bf16=true"],
    "bf16": ["train.autocast_bf16=true", "rollout.dtype=bfloat16", "model.attn_implementation=eager"],
}
MATMULS = [(4096, 256, 1024), (4096, 512, 2048), (64, 512, 2048), (1024, 1024, 1024)]  # M, K, N


def time_best(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_table(shapes: list[tuple[int, int, int]], repeats: int) -> list[dict]:
    """Prints the matmul times; returns the result file's rows (float32 against bfloat16 tensors)."""
    rows = []
    print(f"\n{'M x K x N':<18}{'fp32 ms':>9}{'bf16 ms':>9}{'autocast ms':>12}{'fp32/bf16':>10}{'fp32/autocast':>14}")
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        a16, b16 = a.bfloat16(), b.bfloat16()

        def autocast_mm(a=a, b=b):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return a @ b

        fp32 = time_best(lambda a=a, b=b: a @ b, repeats)
        bf16 = time_best(lambda a16=a16, b16=b16: a16 @ b16, repeats)
        auto = time_best(autocast_mm, repeats)
        print(f"{f'{m} x {k} x {n}':<18}{fp32 * 1e3:>9.2f}{bf16 * 1e3:>9.2f}{auto * 1e3:>12.2f}"
              f"{fp32 / bf16:>9.2f}x{fp32 / auto:>13.2f}x")
        rows.append({"label": f"matmul {m} x {k} x {n}", "float32": round(fp32 * 1e3, 4),
                     "bfloat16": round(bf16 * 1e3, 4), "ratio": round(fp32 / bf16, 4), "unit": "ms"})
    return rows


def step_rows(size: str, runs: dict[str, dict]) -> list[dict]:
    """The result file's rows of one model size: float32 against autocast, then against the bfloat16 sampler."""
    hidden, layers, _ = SIZES[size]
    base = runs["fp32"]["step"]
    labels = {"autocast": f"GRPO step, hidden {hidden} / {layers} layers, `train.autocast_bf16=true`",
              "bf16": "same, plus `rollout.dtype=bfloat16` and eager attention"}
    return [{"label": label, "float32": round(base, 4), "bfloat16": round(runs[n]["step"], 4),
             "ratio": round(base / runs[n]["step"], 4), "unit": "s"} for n, label in labels.items()]


def random_reward(prompts, completions, **kwargs) -> list[float]:
    """A seeded random score per completion: every group has a nonzero advantage, so no row is skipped."""
    return [random_reward.rng.random() for _ in completions]


def train_run(model, tokenizer, steps: int, setting: str, threads: int, lr: float, out: str,
              random_scores: bool) -> dict[str, object]:
    """lmrl GRPO for `steps` steps on a copy of `model` in one precision setting; per-step times and rewards."""
    from lmrl.config import load_config
    from lmrl.data.tasks import get_task
    from lmrl.trainer import Trainer

    recorder = RewardRecorder()
    random_reward.rng = random.Random(0)
    cfg = load_config(None, [
        "algorithm=grpo", f"train.steps={steps}", "rollout.prompts_per_step=8", "rollout.group_size=8",
        "rollout.max_new_tokens=64", f"optim.lr={lr}", f"train.threads={threads}", f"train.output_dir={out}",
        "train.eval_every=0", "log.console=false", "log.samples_every=0", "log.jsonl=false",
        "model.name_or_path=benchmark", *SETTINGS[setting],
    ])
    trainer = Trainer(cfg, model=copy.deepcopy(model), tokenizer=tokenizer,
                      reward_funcs=[random_reward if random_scores else recorder],
                      train_dataset=get_task("addition").train_prompts(), console=False)
    history = trainer.train().history
    steady = history[1:] or history
    return {
        "step": statistics.fmean(m["time/step"] for m in steady),
        "generate": statistics.fmean(m["time/generate"] for m in steady),
        "update": statistics.fmean(m["time/update"] for m in steady),
        "rewards": recorder.rewards,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=["256x4", "512x8"])
    parser.add_argument("--steps", type=int, default=4, help="training steps per setting (the first is warm-up)")
    parser.add_argument("--reward-steps", type=int, default=30, help="steps of the reward check (0 = skip)")
    parser.add_argument("--reward-size", choices=list(SIZES), default="64x2")
    parser.add_argument("--sft-steps", type=int, default=300, help="warm start of the reward check's model")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--record", nargs="?", const="precision", metavar="NAME",
                        help="write the matmul and step table to benchmarks/results/NAME.MACHINE.json (default NAME: precision)")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.steps, args.reward_steps, args.repeats = ["256x4"], 3, 0, 3
    torch.set_num_threads(args.threads)
    from lmrl.build import cpu_has_fast_bf16

    print(f"torch {torch.__version__}, threads {args.threads}, native bf16: {cpu_has_fast_bf16()}")

    table = matmul_table(MATMULS[:2] if args.quick else MATMULS, args.repeats)

    names = list(SETTINGS)
    print(f"\n{'model':<7}" + "".join(f"{n + ' s/step':>16}" for n in names) + "".join(f"{'x ' + n:>12}" for n in names[1:])
          + "   generate / update s")
    for size in args.sizes:
        hidden, layers, heads = SIZES[size]
        with tempfile.TemporaryDirectory() as d:
            build_start_model(hidden, layers, heads, 0, 0, d)
            model, tokenizer = _load(d)
            runs = {n: train_run(model, tokenizer, args.steps, n, args.threads, args.lr, f"{d}/run-{n}", True) for n in names}
        base = runs["fp32"]["step"]
        print(f"{size:<7}" + "".join(f"{runs[n]['step']:>16.2f}" for n in names)
              + "".join(f"{base / runs[n]['step']:>11.2f}x" for n in names[1:]) + "   "
              + ", ".join(f"{n} {runs[n]['generate']:.2f} / {runs[n]['update']:.2f}" for n in names), flush=True)
        table += step_rows(size, runs)
    if args.record:
        from recording import Column, record

        record(args.record, [Column("label", ""), Column("float32", "float32", "{:.2f} {unit}"),
                             Column("bfloat16", "bfloat16", "{:.2f} {unit}"), Column("ratio", "ratio", "{:.2f}x")], table,
               note=f"Matmuls: best of {args.repeats}. GRPO steps on random rewards, so every row is trained on; mean "
                    f"of steps 2-{args.steps} (step 1 is warm-up); {args.threads} threads.")

    if args.reward_steps:
        size = args.reward_size
        hidden, layers, heads = SIZES[size]
        with tempfile.TemporaryDirectory() as d:
            start_acc = build_start_model(hidden, layers, heads, args.sft_steps, 0, d)
            model, tokenizer = _load(d)
            runs = {n: train_run(model, tokenizer, args.reward_steps, n, args.threads, args.lr, f"{d}/run-{n}", False) for n in names}
        print(f"\nreward check, {size}, {args.sft_steps} warm-start steps (held-out greedy accuracy {start_acc:.3f}), "
              f"{args.reward_steps} GRPO steps, lr {args.lr:g}")
        for n, r in runs.items():
            k = min(5, len(r["rewards"]))
            print(f"  {n:<9} reward first {k} steps {statistics.fmean(r['rewards'][:k]):.3f}"
                  f"  last {k} steps {statistics.fmean(r['rewards'][-k:]):.3f}")


if __name__ == "__main__":
    main()
