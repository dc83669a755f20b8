"""On-policy distillation on the shipped task: a teacher from GRPO, then the shipped model distilled from it with no
reward function, and the control (the shipped model distilled from itself). docs/algorithms.md, "Distilling from a
teacher", gives the numbers.

    python benchmarks/distillation.py                          # teacher 600 steps; distillation 200 steps, seeds 0 1
    python benchmarks/distillation.py --teacher runs/teacher/final --seeds 0   # an existing teacher
    python benchmarks/distillation.py --teacher-steps 2 --steps 2 --seeds 0 --no-control   # a smoke run
    python benchmarks/distillation.py --record                 # the table in docs/algorithms.md

Each run is `lmrl train ...` in its own subprocess, one after the other, with the shipped model's preset (one
thread, 32 prompts x 8 completions, 500 held-out prompts, evaluated every 50 steps and at the end). Printed: each
run's held-out greedy accuracy at step 0 and at the end, its gain in points, its seconds of training, and for the
distillation runs distill/reverse_kl over its first and last tenth of steps. --record [NAME] (default distillation)
writes benchmarks/results/NAME.MACHINE.json: that table, and the values the page's text quotes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path


def train(out: Path, *overrides: str) -> dict:
    """`lmrl train OVERRIDES` into `out`: its evaluations and per-step metrics, or the last line it printed."""
    from recording import lmrl_train_rows

    rows = lmrl_train_rows(out, "train.max_minutes=null", *overrides)
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "time/step" in r]
    return {"evals": evals, "steps": steps, "seconds": steps[-1]["time/elapsed"] if steps else 0.0}


def row(label: str, run: dict) -> dict:
    """A run's row of the table: held-out accuracy at step 0 and at the end, gain, seconds, distill/reverse_kl."""
    (_, start), (last, end) = run["evals"][0], run["evals"][-1]
    out = {"run": label, "start": 100 * start, "end": 100 * end, "last_step": last, "gain": 100 * (end - start),
           "seconds": run["seconds"]}
    rkl = [r["distill/reverse_kl"] for r in run["steps"] if "distill/reverse_kl" in r]
    if rkl:
        tenth = max(1, len(rkl) // 10)
        out |= {"rkl_first": statistics.mean(rkl[:tenth]), "rkl_last": statistics.mean(rkl[-tenth:])}
    return out


def line(r: dict) -> str:
    text = (f"{r['run']:<44} {r['start']:5.1f}% -> {r['end']:5.1f}% at step {r['last_step']:<4} {r['gain']:+6.1f} points"
            f"  {r['seconds']:6.0f} s")
    if "rkl_first" in r:
        text += f"  distill/reverse_kl {r['rkl_first']:.3f} -> {r['rkl_last']:.3f}"
    return text


def quoted(runs: dict[str, dict]) -> dict[str, str]:
    """The numbers the page's text quotes: accuracy at step 50, the task reward a distillation never trained on,
    the teacher at the distillation's last step, the control's signal at steps 1 and 2."""
    out = {}
    for name, run in runs.items():
        at = dict(run["evals"])
        if 50 in at:
            out[f"{name}_step_50"] = f"{at[50]:.1%}"
        if name.startswith("seed_") and run["steps"]:
            tenth = max(1, len(run["steps"]) // 10)
            for part, steps in (("first", run["steps"][:tenth]), ("last", run["steps"][-tenth:])):
                out[f"{name}_task_reward_{part}"] = f"{statistics.mean(r['reward/mean'] for r in steps):.2f}"
    distilled = next((r for n, r in runs.items() if n.startswith("seed_")), None)
    if "teacher" in runs and distilled is not None:
        last = distilled["evals"][-1][0]
        out["teacher_at_distillation_end"] = f"{dict(runs['teacher']['evals']).get(last, float('nan')):.1%}"
    if "control" in runs:
        rkl = [r["distill/reverse_kl"] for r in runs["control"]["steps"]]
        out["control_rkl_step_1"], out["control_rkl_step_2"] = f"{rkl[0]:.1e}", f"{rkl[1]:.3f}"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", help="a teacher to distil from (default: train one with GRPO)")
    p.add_argument("--teacher-steps", type=int, default=600, help="GRPO steps of the teacher")
    p.add_argument("--steps", type=int, default=200, help="distillation steps")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--no-control", action="store_true", help="skip the shipped model distilled from itself")
    p.add_argument("--out", type=Path, help="where the runs go (default: a temporary directory)")
    p.add_argument("--record", nargs="?", const="distillation", metavar="NAME",
                   help="write the table to benchmarks/results/NAME.MACHINE.json")
    args = p.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="lmrl-distillation-"))
    teacher, runs, rows = args.teacher, {}, []

    def done(name: str, label: str, run: dict) -> None:
        runs[name] = run
        rows.append(row(label, run))
        print(line(rows[-1]), flush=True)

    if teacher is None:
        done("teacher", f"teacher: `grpo`, {args.teacher_steps} steps", train(root / "teacher", f"train.steps={args.teacher_steps}"))
        teacher = str(root / "teacher" / "final")
    for seed in args.seeds:
        done(f"seed_{seed}", f"distilled, no reward, {args.steps} steps, seed {seed}",
             train(root / f"distilled-{seed}", f"algorithm.teacher={teacher}", f"train.steps={args.steps}",
                   f"train.seed={seed}"))
    if not args.no_control:
        done("control", f"control: distilled from itself, {args.steps} steps",
             train(root / "control", "algorithm.teacher=tiny-addition", f"train.steps={args.steps}"))
    print(f"runs in {root}")
    if args.record:
        from recording import Column, record

        columns = [Column("run", "run"), Column("start", "held-out accuracy, step 0", "{:.1f}%"),
                   Column("end", "at the end", "{:.1f}%"), Column("gain", "gain (points)", "{:+.1f}"),
                   Column("seconds", "training", "{:.0f} s"),
                   Column("rkl_first", "distill/reverse_kl, first tenth of the steps", "{:.3f}"),
                   Column("rkl_last", "last tenth", "{:.3f}")]
        record(args.record, columns, rows, values=quoted(runs),
               note="Each run is `lmrl train` with the shipped model's preset (one thread, 32 prompts x 8 completions, "
                    "500 held-out prompts); the distillations have no reward function.")


if __name__ == "__main__":
    main()
