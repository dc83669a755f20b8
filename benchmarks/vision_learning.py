"""The shipped vision model learning its task on this CPU, against the blank-image control. docs/vision.md,
"Learning on a CPU", gives the numbers.

    python benchmarks/vision_learning.py                   # both runs, tiny-vision's preset (5 minutes each)
    python benchmarks/vision_learning.py --minutes 0.2     # a smoke run
    python benchmarks/vision_learning.py --record          # the table in docs/vision.md

Each run is `lmrl train model.name_or_path=tiny-vision` in its own subprocess, one after the other, with the model's
preset (one thread, 16 prompts x 8 completions, 200 held-out drawings evaluated every 20 steps and at the end):
first on `data.task=digits`, then on `data.task=digits-blank`, the same rows with every image blank (held-out ones
too), where the digit cannot be seen and exact answers stay near a guess's 10%. Printed: each run's held-out greedy
accuracy at step 0 and at the end, its gain in points, its steps and its seconds of training (wall time: on a
shared CPU it is longer than alone). --record [NAME] (default vision-learning) writes
benchmarks/results/NAME.MACHINE.json.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

RUNS = {"digits": "digits: the digit drawn", "digits-blank": "control: digits-blank, every image blank"}


def train(out: Path, *overrides: str) -> dict:
    """`lmrl train model.name_or_path=tiny-vision OVERRIDES` into `out`: its evaluations and last step's metrics."""
    from recording import lmrl_train_rows

    rows = lmrl_train_rows(out, "model.name_or_path=tiny-vision", *overrides)
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "time/step" in r]
    return {"evals": evals, "steps": len(steps), "seconds": steps[-1]["time/elapsed"] if steps else 0.0}


def row(task: str, run: dict) -> dict:
    """A run's row of the table: held-out accuracy at step 0 and at the end, gain, steps, seconds."""
    (_, start), (_, end) = run["evals"][0], run["evals"][-1]
    return {"run": RUNS[task], "start": 100 * start, "end": 100 * end, "gain": 100 * (end - start),
            "steps": run["steps"], "seconds": run["seconds"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, help="train.max_minutes of each run (default: the preset's 5)")
    p.add_argument("--out", type=Path, help="where the runs go (default: a temporary directory)")
    p.add_argument("--record", nargs="?", const="vision-learning", metavar="NAME",
                   help="write the table to benchmarks/results/NAME.MACHINE.json")
    args = p.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="lmrl-vision-"))
    extra = [f"train.max_minutes={args.minutes}"] if args.minutes is not None else []
    rows = []
    for task in RUNS:
        rows.append(row(task, train(root / task, f"data.task={task}", *extra)))
        r = rows[-1]
        print(f"{r['run']:<42} {r['start']:5.1f}% -> {r['end']:5.1f}%  {r['gain']:+6.1f} points  {r['steps']:5d} steps"
              f"  {r['seconds']:5.0f} s", flush=True)
    print(f"runs in {root}")
    if args.record:
        from recording import Column, record

        columns = [Column("run", "run"), Column("start", "held-out accuracy, step 0", "{:.1f}%"),
                   Column("end", "at the end", "{:.1f}%"), Column("gain", "gain (points)", "{:+.1f}"),
                   Column("steps", "steps"), Column("seconds", "training (wall, shared CPU)", "{:.0f} s")]
        values = {"gain": f"{rows[0]['gain']:+.1f}", "control_gain": f"{rows[1]['gain']:+.1f}"}
        record(args.record, columns, rows, values=values,
               note="Each run is `lmrl train model.name_or_path=tiny-vision data.task=TASK` with the model's preset "
                    "(one thread, 16 prompts x 8 completions, 200 held-out drawings), measured on a CPU shared with "
                    "other jobs.")


if __name__ == "__main__":
    main()
