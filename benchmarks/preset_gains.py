"""Held-out accuracy gain of every algorithm preset on the shipped task (tiny-addition model, addition).

    python benchmarks/preset_gains.py                         # every preset, 75 s each, two at a time
    python benchmarks/preset_gains.py --names rloo ppo dapo   # some presets
    python benchmarks/preset_gains.py --steps 60              # step-matched: 60 steps each, no time limit
    python benchmarks/preset_gains.py --set algorithm.kl_coef=0 --names rloo   # extra overrides for every run
    python benchmarks/preset_gains.py --names ppo --seeds 0 1 2   # several seeds: a row each, then their mean
    python benchmarks/preset_gains.py --seeds 0 1 2 --record  # the table in docs/algorithms.md: its 75 s columns
    python benchmarks/preset_gains.py --steps 150 --record    # ... and its 150-step column

Each run is `lmrl train algorithm=NAME train.max_minutes=M` (or `train.steps=N train.max_minutes=null`) in its
own subprocess, with the shipped model's preset (one thread, 32 prompts x 8 completions, 500 held-out prompts).
The gain is the held-out greedy accuracy after the last step minus the one at step 0 (30.6% for the shipped
model). Wall-clock budgets measure steps per second as much as learning per step: on a shared CPU the 75 s
numbers move with the machine's load, the step-matched ones do not (same seed, same steps: the same run).

--record [NAME] (default preset-gains) writes benchmarks/results/NAME.MACHINE.json, one row per preset: a time-budget
run fills the columns "75 s: gain" per seed, their mean, the steps done and s/step; a --steps run the "N steps:
gain" column (the mean over its seeds). Each merges into the file already there (recording.record's merge_on): the
two runs fill one table, and the file lists both commands.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def table(results: list[dict], args) -> tuple[list, list[dict], str]:
    """The result file's (columns, rows, note) of this run: its own columns filled, the other kind's named (merging
    keeps the cells a run of the other kind wrote). The column keys stay those of the page's table whatever the
    budget or seeds; the headers say them."""
    from recording import Column

    seconds = f"{args.minutes * 60:g} s"
    columns = [Column("preset", "preset"),
               Column("75_s_gain_seeds_0_1_2_points", f"{seconds}: gain, seed{'s' * (len(args.seeds) > 1)} "
                      f"{' / '.join(map(str, args.seeds))} (points)"),
               Column("mean", "mean", "{:+.1f}"), Column("steps_in_75_s", f"steps in {seconds}"),
               Column("150_steps_gain", f"{args.steps} steps: gain" if args.steps else "steps: gain", "{:+.1f}"), Column("s_step", "s/step", "{:.2f}")]
    rows = []
    for name in args.names:
        done = [r for r in results if r["name"] == name and "error" not in r]
        if not done:
            continue
        gains = [100 * (r["end"] - r["start"]) for r in done]
        if args.steps:
            rows.append({"preset": f"`{name}`", "150_steps_gain": round(statistics.fmean(gains), 2)})
        else:
            rows.append({"preset": f"`{name}`", "75_s_gain_seeds_0_1_2_points": " / ".join(f"{g:+.1f}" for g in gains),
                         "mean": round(statistics.fmean(gains), 2), "steps_in_75_s": " / ".join(str(r["steps"]) for r in done),
                         "s_step": round(statistics.fmean(r["s_per_step"] for r in done), 4)})
    extra = "".join(f" {o}" for o in args.set)
    if args.steps:
        seeds = f"seed {args.seeds[0]}" if len(args.seeds) == 1 else f"the mean of seeds {' / '.join(map(str, args.seeds))}"
        note = f"The {args.steps}-step column: `train.steps={args.steps}{extra}`, no time limit, {seeds}; {args.parallel} at a time."
    else:
        note = (f"Each {seconds} run is `lmrl train algorithm=NAME train.max_minutes={args.minutes:g} train.seed=S{extra}` "
                f"in its own process, {args.parallel} at a time.")
    return columns, rows, note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--names", nargs="*", default=PRESETS)
    parser.add_argument("--minutes", type=float, default=1.25)
    parser.add_argument("--steps", type=int, help="step-matched: this many steps, no time limit")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for every run")
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--record", nargs="?", const="preset-gains", metavar="NAME",
                        help="merge the table into benchmarks/results/NAME.MACHINE.json (default NAME: preset-gains)")
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
    if args.record:
        import torch  # noqa: F401  (the runs' torch: its version goes into the file)
        from recording import record

        columns, rows, note = table(results, args)
        record(args.record, columns, rows, note=note, merge_on="preset")


if __name__ == "__main__":
    main()
