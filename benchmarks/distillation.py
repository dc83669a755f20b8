"""On-policy distillation on the shipped task: a teacher from GRPO, then the shipped model distilled from it with no
reward function, and the control (the shipped model distilled from itself). docs/algorithms.md, "Distilling from a
teacher", gives the numbers.

    python benchmarks/distillation.py                          # teacher 600 steps; distillation 200 steps, seeds 0 1
    python benchmarks/distillation.py --teacher runs/teacher/final --seeds 0   # an existing teacher
    python benchmarks/distillation.py --teacher-steps 2 --steps 2 --seeds 0 --no-control   # a smoke run

Each run is `lmrl train ...` in its own subprocess, one after the other, with the shipped model's preset (one
thread, 32 prompts x 8 completions, 500 held-out prompts, evaluated every 50 steps and at the end). Printed: each
run's held-out greedy accuracy at step 0 and at the end, its gain in points, its seconds of training, and for the
distillation runs distill/reverse_kl over its first and last tenth of steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def train(out: Path, *overrides: str) -> dict:
    """`lmrl train OVERRIDES` into `out`: its evaluations and per-step metrics, or the last line it printed."""
    cmd = [sys.executable, "-m", "lmrl.cli", "train", f"train.output_dir={out}", "train.overwrite=true",
           "log.console=false", "log.samples_every=0", "train.max_minutes=null", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "time/step" in r]
    return {"evals": evals, "steps": steps, "seconds": steps[-1]["time/elapsed"] if steps else 0.0}


def line(label: str, run: dict) -> str:
    (_, start), (last, end) = run["evals"][0], run["evals"][-1]
    text = f"{label:<34} {start:6.1%} -> {end:6.1%} at step {last:<4} {100 * (end - start):+6.1f} points  {run['seconds']:6.0f} s"
    rkl = [r["distill/reverse_kl"] for r in run["steps"] if "distill/reverse_kl" in r]
    if rkl:
        tenth = max(1, len(rkl) // 10)
        text += f"  distill/reverse_kl {statistics.mean(rkl[:tenth]):.3f} -> {statistics.mean(rkl[-tenth:]):.3f}"
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", help="a teacher to distil from (default: train one with GRPO)")
    p.add_argument("--teacher-steps", type=int, default=600, help="GRPO steps of the teacher")
    p.add_argument("--steps", type=int, default=200, help="distillation steps")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--no-control", action="store_true", help="skip the shipped model distilled from itself")
    p.add_argument("--out", type=Path, help="where the runs go (default: a temporary directory)")
    args = p.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="lmrl-distillation-"))
    teacher = args.teacher
    if teacher is None:
        run = train(root / "teacher", f"train.steps={args.teacher_steps}")
        print(line(f"teacher: grpo, {args.teacher_steps} steps", run), flush=True)
        teacher = str(root / "teacher" / "final")
    for seed in args.seeds:
        run = train(root / f"distilled-{seed}", f"algorithm.teacher={teacher}", f"train.steps={args.steps}",
                    f"train.seed={seed}")
        print(line(f"distilled, no reward, seed {seed}", run), flush=True)
    if not args.no_control:
        run = train(root / "control", "algorithm.teacher=tiny-addition", f"train.steps={args.steps}")
        print(line("control: distilled from itself", run), flush=True)
    print(f"runs in {root}")


if __name__ == "__main__":
    main()
