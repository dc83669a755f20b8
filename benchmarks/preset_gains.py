"""Held-out accuracy gain of every algorithm preset on the shipped task (tiny-addition model, addition).

    python benchmarks/preset_gains.py                         # every preset, 75 s each, two at a time
    python benchmarks/preset_gains.py --names rloo ppo dapo   # some presets
    python benchmarks/preset_gains.py --steps 60              # step-matched: 60 steps each, no time limit
    python benchmarks/preset_gains.py --set algorithm.kl_coef=0 --names rloo   # extra overrides for every run
    python benchmarks/preset_gains.py --names ppo --seeds 0 1 2   # several seeds: a row each, then their mean

Each run is `lmrl train algorithm=NAME train.max_minutes=M` (or `train.steps=N train.max_minutes=null`) in its
own subprocess, with the shipped model's preset (one thread, 32 prompts x 8 completions, 500 held-out prompts).
The gain is the held-out greedy accuracy after the last step minus the one at step 0 (30.6% for the shipped
model). Wall-clock budgets measure steps per second as much as learning per step: on a shared CPU the 75 s
numbers move with the machine's load, the step-matched ones do not (same seed, same steps: the same run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lmrl.config import ALGORITHM_PRESETS

PRESETS = list(ALGORITHM_PRESETS)


def run(name: str, seed: int, args, root: Path) -> dict:
    out = root / f"{name}-{seed}"
    budget = [f"train.steps={args.steps}", "train.max_minutes=null"] if args.steps else [f"train.max_minutes={args.minutes}"]
    cmd = [sys.executable, "-m", "lmrl.cli", "train", f"algorithm={name}", *budget, f"train.seed={seed}",
           f"train.output_dir={out}", "train.overwrite=true", "log.console=false", "train.eval_every=0",
           "log.samples_every=0", *args.set]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"name": name, "seed": seed, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    steps = max(r["step"] for r in rows)
    train_time = max((r.get("time/elapsed") or 0.0) for r in rows)
    return {"name": name, "seed": seed, "start": evals[0]["eval/accuracy"], "end": evals[-1]["eval/accuracy"], "steps": steps,
            "s_per_step": train_time / max(steps, 1), "wall": time.time() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--names", nargs="*", default=PRESETS)
    parser.add_argument("--minutes", type=float, default=1.25)
    parser.add_argument("--steps", type=int, help="step-matched: this many steps, no time limit")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for every run")
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        runs = [(name, seed) for name in args.names for seed in args.seeds]
        with ThreadPoolExecutor(args.parallel) as pool:
            results = list(pool.map(lambda r: run(*r, args, root), runs))
    budget = f"{args.steps} steps" if args.steps else f"{args.minutes:g} min"
    print(f"| preset ({budget}) | seed | held-out accuracy start -> end | gain (points) | steps | s/step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.names:
        rows = [r for r in results if r["name"] == name]
        for r in rows:
            if "error" in r:
                print(f"| {name} | {r['seed']} | failed: {r['error']} | | | |")
                continue
            print(f"| {name} | {r['seed']} | {100 * r['start']:.1f}% -> {100 * r['end']:.1f}% | "
                  f"{100 * (r['end'] - r['start']):+.1f} | {r['steps']} | {r['s_per_step']:.2f} |", flush=True)
        done = [r for r in rows if "error" not in r]
        if len(done) > 1:
            gains = [100 * (r["end"] - r["start"]) for r in done]
            print(f"| {name} | mean of {len(done)} | | {sum(gains) / len(gains):+.1f} (min {min(gains):+.1f}) | "
                  f"{sum(r['steps'] for r in done) / len(done):.0f} | |")


if __name__ == "__main__":
    main()
