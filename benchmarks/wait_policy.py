"""OpenMP's wait policy on a busy CPU: seconds per training step with OpenMP's default (threads spin while they
wait) and with `OMP_WAIT_POLICY=PASSIVE` (they sleep), on a quiet machine and with one core kept busy by another
process, as on a shared machine.

    python benchmarks/wait_policy.py            # the shipped task, 2 threads, 12 steps per run
    python benchmarks/wait_policy.py --record   # the table in docs/faq.md

Each run is `lmrl train train.threads=2 train.steps=N` (the shipped model and task, no evaluation) in its own
process; s/step is the mean `time/step` of steps 2..N. "busy": a process spinning in a Python loop for the whole
run (it takes one core from the two threads). The four runs take turns, --repeats times; the table shows each
configuration's median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SPIN = "while True: pass"


def step_seconds(steps: int, passive: bool, busy: bool, root: Path) -> float:
    out = root / f"run-{passive}-{busy}"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
    try:
        subprocess.run([sys.executable, "-m", "lmrl.cli", "train", "train.threads=2", f"train.steps={steps}",
                        f"train.output_dir={out}", "train.overwrite=true", "train.eval_every=0", "log.console=false",
                        "log.samples_every=0"], env=env, check=True, capture_output=True, timeout=900)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["time/step"] for r in rows if r.get("time/step") is not None and r["step"] >= 2]
    return statistics.fmean(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--record", nargs="?", const="wait-policy", metavar="NAME",
                        help="write the table to benchmarks/results/NAME.MACHINE.json")
    args = parser.parse_args()
    runs: dict[tuple[bool, bool], list[float]] = {(b, p): [] for b in (False, True) for p in (False, True)}
    with tempfile.TemporaryDirectory() as root:
        for turn in range(args.repeats):
            for busy, passive in runs:
                runs[busy, passive].append(step_seconds(args.steps, passive, busy, Path(root)))
                print(f"turn {turn}: {'busy' if busy else 'quiet'}, {'PASSIVE' if passive else 'default'}: "
                      f"{runs[busy, passive][-1]:.3f} s/step", flush=True)
    rows = []
    for busy in (False, True):
        spin, passive = statistics.median(runs[busy, False]), statistics.median(runs[busy, True])
        rows.append({"machine": "one core busy with another process" if busy else "quiet", "default": spin,
                     "passive": passive, "ratio": passive / spin})
        print(f"{rows[-1]['machine']:<36} default {spin:.3f} s/step  PASSIVE {passive:.3f}  ({passive / spin:.2f}x)")
    if args.record:
        from recording import Column, record

        record(args.record, [Column("machine", "the CPU"), Column("default", "default (spin)", "{:.3f} s"),
                             Column("passive", "`OMP_WAIT_POLICY=PASSIVE`", "{:.3f} s"),
                             Column("ratio", "PASSIVE / default", "{:.2f}x")], rows,
               note=f"The shipped task, `train.threads=2`, s/step of steps 2-{args.steps}, the median of "
                    f"{args.repeats} turns.")


if __name__ == "__main__":
    main()
