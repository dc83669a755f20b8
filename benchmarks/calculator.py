"""Does RL teach the shipped calculator model to use its tool? Held-out accuracy before and after `lmrl train`,
with the tool and without it, over several seeds.

    python benchmarks/calculator.py                      # seeds 0 1 2, 60 steps each, with and without the tool
    python benchmarks/calculator.py --tasks calculator-notool --seeds 0 --steps 600 --eval-every 200   # longer alone
    python benchmarks/calculator.py --record             # the table in docs/agents.md

Each run is `lmrl train model.name_or_path=tiny-calculator train.seed=S train.steps=N` (the preset: GRPO, 32
prompts x 8 episodes, evaluation on 500 held-out sums), once on `data.task=calculator` (the model may call
`<calc>...</calc>`) and once on `data.task=calculator-notool` (one turn: it must add by itself).
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


def run(task: str, seed: int, steps: int, eval_every: int, out: Path) -> dict[str, float]:
    args = [sys.executable, "-m", "lmrl.cli", "train", "model.name_or_path=tiny-calculator", f"data.task={task}",
            f"train.seed={seed}", f"train.steps={steps}", f"train.eval_every={eval_every}", f"train.output_dir={out}",
            "log.console=false"]
    subprocess.run(args, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    return {"start": evals[0]["eval/accuracy"], "end": evals[-1]["eval/accuracy"],
            "seconds": rows[-1]["time/elapsed"], "tool_calls": rows[-1].get("env/tool_calls", 0.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--tasks", nargs="+", default=["calculator", "calculator-notool"],
                        choices=["calculator", "calculator-notool"])
    parser.add_argument("--record", nargs="?", const="calculator", metavar="NAME",
                        help="write the table to benchmarks/results/NAME.MACHINE.json (docs/agents.md)")
    args = parser.parse_args()
    rows = []
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.steps} steps per run", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks:
            results = []
            for seed in args.seeds:
                r = run(task, seed, args.steps, args.eval_every, Path(tmp) / f"{task}-{seed}")
                results.append(r)
                print(f"{task:18s} seed {seed}: held-out accuracy {100 * r['start']:.1f}% -> {100 * r['end']:.1f}% "
                      f"in {r['seconds']:.0f} s (tool calls per episode at the end: {r['tool_calls']:.2f})", flush=True)
            start = statistics.mean(r["start"] for r in results)
            end = statistics.mean(r["end"] for r in results)
            seconds = statistics.mean(r["seconds"] for r in results)
            print(f"{task:18s} mean of {len(results)}: {100 * start:.1f}% -> {100 * end:.1f}% "
                  f"({100 * (end - start):+.1f} points) in {seconds:.0f} s", flush=True)
            rows.append(table_row(task, args.seeds, results))
    if args.record:
        from recording import Column, record

        record(args.record, [Column("task"), Column("seeds"), Column("accuracy", "held-out accuracy before -> after"),
                             Column("wall", "wall time of the run")], rows,
               note=f"GRPO with the preset, 32 prompts x 8 episodes, {args.steps} steps per run, greedy held-out "
                    f"accuracy on the 500 sums; load average {os.getloadavg()[0]:.1f} at the end.")


def table_row(task: str, seeds: list[int], results: list[dict]) -> dict:
    """One task's row as docs/agents.md shows it: the start accuracy, each seed's end, the mean gain, the times."""
    start = statistics.mean(r["start"] for r in results)
    gain = statistics.mean(r["end"] for r in results) - start
    ends = ", ".join(f"{100 * r['end']:.1f}%" for r in results)
    return {"task": f"`{task}`" + (" (with the tool)" if task == "calculator" else ""),
            "seeds": ", ".join(str(s) for s in seeds),
            "accuracy": f"{100 * start:.1f}% -> {ends} (mean {100 * gain:+.1f} points)",
            "wall": ", ".join(f"{r['seconds']:.0f}" for r in results) + " s"}


if __name__ == "__main__":
    main()
