"""Does bfloat16 autocast speed up lmrl's training step on this CPU? (`train.autocast_bf16`)

    python benchmarks/autocast.py                        # matmuls, then hidden 256 / 4 layers and 512 / 8 layers
    python benchmarks/autocast.py --quick                # small matmuls, hidden 256 / 4 layers, 3 steps: ~1 min
    python benchmarks/autocast.py --sizes 512x8 --steps 8 --reward-steps 0

Three measurements, each float32 vs bfloat16 in the same process, one after the other:
    matmul     a [M, K] x [K, N] matmul: float32 tensors, bfloat16 tensors, and float32 tensors under
               torch.autocast(bfloat16) (which adds the casts of both inputs). Best of --repeats.
    step       lmrl's GRPO training step (generate + score + update) with train.autocast_bf16=false / true
               on the same start weights and prompts: mean of steps 2..N (step 1 is warm-up), and the
               generate / update split. 8 prompts x G=8 completions, 64 new tokens (EOS cannot be sampled,
               so both do the same work; see benchmarks/vs_trl.py).
    reward     does training still improve under autocast? --reward-steps steps at --reward-size from a
               supervised warm start, both settings: mean training reward of the first and last 5 steps.
The CPU may be shared with other processes: compare ratios within one run, and rerun when in doubt.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (vs_trl's helpers)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402
from vs_trl import SIZES, RewardRecorder, _load, build_start_model  # noqa: E402

MATMULS = [(4096, 256, 1024), (4096, 512, 2048), (64, 512, 2048), (1024, 1024, 1024)]  # M, K, N


def time_best(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_table(shapes: list[tuple[int, int, int]], repeats: int) -> None:
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


def train_run(model, tokenizer, steps: int, autocast: bool, threads: int, lr: float, out: str) -> dict[str, object]:
    """lmrl GRPO for `steps` steps on a copy of `model`; per-step times and rewards."""
    from lmrl.config import load_config
    from lmrl.data.tasks import get_task
    from lmrl.trainer import Trainer

    recorder = RewardRecorder()
    cfg = load_config(None, [
        "algorithm=grpo", f"train.steps={steps}", "rollout.prompts_per_step=8", "rollout.group_size=8",
        "rollout.max_new_tokens=64", f"optim.lr={lr}", f"train.autocast_bf16={str(autocast).lower()}",
        f"train.threads={threads}", f"train.output_dir={out}", "train.eval_every=0", "log.console=false",
        "log.samples_every=0", "log.jsonl=false", "model.name_or_path=benchmark",
    ])
    trainer = Trainer(cfg, model=copy.deepcopy(model), tokenizer=tokenizer, reward_funcs=[recorder],
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
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.steps, args.reward_steps, args.repeats = ["256x4"], 3, 0, 3
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {args.threads}, bf16 supported: "
          f"{torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()}")

    matmul_table(MATMULS[:2] if args.quick else MATMULS, args.repeats)

    print(f"\n{'model':<7}{'fp32 s/step':>12}{'bf16 s/step':>12}{'speedup':>9}{'gen fp32':>10}{'gen bf16':>10}"
          f"{'upd fp32':>10}{'upd bf16':>10}")
    for size in args.sizes:
        hidden, layers, heads = SIZES[size]
        with tempfile.TemporaryDirectory() as d:
            build_start_model(hidden, layers, heads, 0, 0, d)
            model, tokenizer = _load(d)
            runs = {ac: train_run(model, tokenizer, args.steps, ac, args.threads, args.lr, d) for ac in (False, True)}
        f, b = runs[False], runs[True]
        print(f"{size:<7}{f['step']:>12.2f}{b['step']:>12.2f}{f['step'] / b['step']:>8.2f}x{f['generate']:>10.2f}"
              f"{b['generate']:>10.2f}{f['update']:>10.2f}{b['update']:>10.2f}", flush=True)

    if args.reward_steps:
        size = args.reward_size
        hidden, layers, heads = SIZES[size]
        with tempfile.TemporaryDirectory() as d:
            start_acc = build_start_model(hidden, layers, heads, args.sft_steps, 0, d)
            model, tokenizer = _load(d)
            runs = {ac: train_run(model, tokenizer, args.reward_steps, ac, args.threads, args.lr, d)
                    for ac in (False, True)}
        print(f"\nreward check, {size}, {args.sft_steps} warm-start steps (held-out greedy accuracy {start_acc:.3f}), "
              f"{args.reward_steps} GRPO steps, lr {args.lr:g}")
        for ac, r in runs.items():
            k = min(5, len(r["rewards"]))
            print(f"  autocast_bf16={str(ac).lower():<5}  reward first {k} steps {statistics.fmean(r['rewards'][:k]):.3f}"
                  f"  last {k} steps {statistics.fmean(r['rewards'][-k:]):.3f}")


if __name__ == "__main__":
    main()
