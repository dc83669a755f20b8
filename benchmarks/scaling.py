"""Data-parallel scaling on one machine: training throughput at 1 and 2 ranks against 1 rank with 2 threads.

    python benchmarks/scaling.py               # 30 steps of 32 prompts x 8 completions, three ways: about 40 s on 2 cores
    python benchmarks/scaling.py --steps 10    # quicker, noisier

Three runs of `lmrl train` on the shipped tiny model and the addition task, the same config and seed, no evaluation:
    1 rank  x 1 thread    python -m lmrl.cli train train.threads=1
    1 rank  x 2 threads   python -m lmrl.cli train train.threads=2
    2 ranks x 1 thread    torchrun --standalone --nproc_per_node 2 -m lmrl.cli train train.threads=1 (gloo)
Throughput is completions per second over the training steps (the last metrics row's `episode` over its
`time/elapsed`: process start-up, model loading and the first evaluation excluded), printed with its ratio to
1 rank x 1 thread, measured in the same run of this script (timings on a shared machine drift; ratios less so).
Peak memory per rank with FSDP2 against DDP is not measured: FSDP2 is not built yet (docs/scaling.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(launcher: list[str], out: Path, steps: int, threads: int, seed: int) -> float:
    """Completions per second of one `lmrl train` run over its training steps."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    args = [f"train.steps={steps}", "rollout.prompts_per_step=32", "rollout.group_size=8", "data.num_eval_prompts=0",
            f"train.threads={threads}", f"train.seed={seed}", f"train.output_dir={out}", "log.console=false",
            "train.max_minutes=null"]
    proc = subprocess.run([*launcher, "-m", "lmrl.cli", "train", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"scaling: {' '.join(launcher)} failed:\n{proc.stderr[-2000:]}")
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    return last["episode"] / last["time/elapsed"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    ways = [("1 rank  x 1 thread ", [sys.executable], 1), ("1 rank  x 2 threads", [sys.executable], 2),
            ("2 ranks x 1 thread ", torchrun, 1)]
    print(f"scaling: the shipped model, {args.steps} steps x 256 completions, seed {args.seed}, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="lmrl-scaling-") as tmp:
        results = [(name, run(launcher, Path(tmp) / str(i), args.steps, threads, args.seed))
                   for i, (name, launcher, threads) in enumerate(ways)]
    base = results[0][1]
    for name, eps in results:
        print(f"  {name}  {eps:8.1f} completions/s  {eps / base:5.2f}x")


if __name__ == "__main__":
    main()
