"""Held-out accuracy gain of every algorithm preset on the shipped task (tiny-addition model, addition).

    python benchmarks/preset_gains.py                         # every preset, 75 s each, two at a time
    python benchmarks/preset_gains.py --names rloo ppo dapo   # some presets
    python benchmarks/preset_gains.py --steps 60              # step-matched: 60 steps each, no time limit
    python benchmarks/preset_gains.py --set algorithm.kl_coef=0 --names rloo   # extra overrides for every run

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

PRESETS = ["grpo", "dr_grpo", "dapo", "rloo", "reinforce", "reinforce_pp", "reinforce_pp_baseline", "ppo", "gspo",
           "cispo"]


def run(name: str, args, root: Path) -> dict:
    out = root / f"{name}-{args.seed}"
    budget = [f"train.steps={args.steps}", "train.max_minutes=null"] if args.steps else [f"train.max_minutes={args.minutes}"]
    cmd = [sys.executable, "-m", "lmrl.cli", "train", f"algorithm={name}", *budget, f"train.seed={args.seed}",
           f"train.output_dir={out}", "train.overwrite=true", "log.console=false", "train.eval_every=0",
           "log.samples_every=0", *args.set]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"name": name, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    steps = max(r["step"] for r in rows)
    train_time = max((r.get("time/elapsed") or 0.0) for r in rows)
    return {"name": name, "start": evals[0]["eval/accuracy"], "end": evals[-1]["eval/accuracy"], "steps": steps,
            "s_per_step": train_time / max(steps, 1), "wall": time.time() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--names", nargs="*", default=PRESETS)
    parser.add_argument("--minutes", type=float, default=1.25)
    parser.add_argument("--steps", type=int, help="step-matched: this many steps, no time limit")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for every run")
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        with ThreadPoolExecutor(args.parallel) as pool:
            results = list(pool.map(lambda n: run(n, args, root), args.names))
    budget = f"{args.steps} steps" if args.steps else f"{args.minutes:g} min"
    print(f"| preset ({budget}, seed {args.seed}) | held-out accuracy start -> end | gain (points) | steps | s/step |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        if "error" in r:
            print(f"| {r['name']} | failed: {r['error']} | | | |")
            continue
        gain = 100 * (r["end"] - r["start"])
        print(f"| {r['name']} | {100 * r['start']:.1f}% -> {100 * r['end']:.1f}% | {gain:+.1f} | {r['steps']} | "
              f"{r['s_per_step']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
