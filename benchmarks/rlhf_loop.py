"""The table of the RLHF loop's rounds (docs/rewards.md, "The whole loop on a laptop"), read from what
examples/rlhf/loop.sh wrote: each round's pairs, its reward model's held-out pair accuracy, and its GRPO run's
held-out accuracy (greedy exact match on the task's 500 held-out sums) at step 0, step 10 and the last step, its best
evaluation after step 0 (what train.keep_best keeps in best/ where it beats step 0), and where the reward-hacking
warning fired.

    bash examples/rlhf/loop.sh runs/rlhf 5                  # the rounds (minutes each)
    python benchmarks/rlhf_loop.py runs/rlhf                # their table
    python benchmarks/rlhf_loop.py runs/rlhf --record --further 2000   # merged into benchmarks/results/rlhf-loop.MACHINE.json

--further N also evaluates each round's policy (and the shipped model) on N sums of the task's stream that are in
neither split (nearly all two-digit + two-digit, as most training prompts are): a check on the 500 held-out sums,
which chose the policies and are the numbers the loop acted on.

--record merges the rounds into the file by the `run` column ("round 1", ...): the naive runs typed in there stay.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recording import Column, record  # noqa: E402

COLUMNS = [Column("run"), Column("reward_model", "reward model (held-out pair accuracy)"), Column("grpo", "GRPO"),
           Column("accuracy", "held-out accuracy, step 0 -> 10 -> last"), Column("best", "best after step 0 (step)"),
           Column("warning"), Column("further", "further sums, last step")]


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rounds(out: Path) -> list[dict]:
    """One row for each round loop.sh finished in `out`."""
    rows, earlier, names = [], 0, {}
    for r in range(1, 1000):
        grpo = out / f"grpo-{r}"
        if not (grpo / "final").is_dir():
            break
        names[str((grpo / "final").resolve())] = f"round {r}'s policy"
        pairs = sum(1 for line in (out / f"pairs-{r}.jsonl").read_text().splitlines() if line.strip())
        pair_accuracy = [m["eval/accuracy"] for m in metrics(out / f"rm-{r}" / "metrics.jsonl") if "eval/accuracy" in m][-1]
        sampler = "the shipped model" if r == 1 else f"round {r - 1}'s policy"
        rm = (f"{pairs:,} pairs: every distinct wrong sample of {sampler}" if r == 1 else
              f"+ {pairs - earlier:,} pairs from {sampler}") + f" ({pair_accuracy:.1%})"
        earlier = pairs
        rows.append({"run": f"round {r}", "reward_model": rm, **grpo_cells(grpo, names)})
    return rows


def grpo_cells(grpo: Path, names: dict[str, str]) -> dict[str, str]:
    """A GRPO run's cells: its settings, held-out accuracy at step 0, 10 and last, best, hacking warning."""
    config = yaml.safe_load((grpo / "lmrl_config.yaml").read_text())
    policy = config["model"]["name_or_path"]
    start = "the shipped model" if policy == "tiny-addition" else names.get(str(Path(policy).resolve()), policy)
    evals = [m for m in metrics(grpo / "metrics.jsonl") if "eval/accuracy" in m]
    shown = [evals[0], *[m for m in evals if m["step"] == 10], evals[-1]]
    best = max(evals[1:], key=lambda m: m["eval/accuracy"])  # the first of a tie; best/ only if above step 0's
    hacked = [m["step"] for m in evals if m.get("guard/reward_hacking") == 1.0]
    return {"grpo": f"{config['train']['steps']} steps, KL {config['algorithm']['kl_coef']:g}, from {start}",
            "accuracy": " -> ".join(f"{m['eval/accuracy']:.1%}" for m in shown),
            "best": f"{best['eval/accuracy']:.1%} ({best['step']})",
            "warning": f"step {hacked[0]}" if hacked else "none"}


def variant(out: Path, label: str, grpo: Path, rounds_done: int) -> dict:
    """A row for another GRPO run against one of the loop's reward models (`--variant LABEL=DIR`): not a round, so
    not in the loop's figures."""
    names = {str((out / f"grpo-{r}" / "final").resolve()): f"round {r}'s policy" for r in range(1, rounds_done + 1)}
    config = yaml.safe_load((grpo / "lmrl_config.yaml").read_text())
    rm = Path(config["reward"]["functions"][0]["path"]).parent  # the reward model's run directory
    pair_accuracy = [m["eval/accuracy"] for m in metrics(rm / "metrics.jsonl") if "eval/accuracy" in m][-1]
    return {"run": label, "reward_model": f"{rm.name} ({pair_accuracy:.1%})", **grpo_cells(grpo, names)}


def values(out: Path, rows: list[dict]) -> dict[str, str]:
    """The figures the page's prose quotes: held-out accuracy of the shipped model and of the policy the loop kept
    (loop.sh's rule: a round's last evaluation, where it beat the policy it started from), the gain, the minutes
    from the first round's pairs file to the last round's model, the last round's pairs, and each round's
    evaluations between step 10 and its last (`between_R`, lowest-highest)."""
    start = kept = None
    kept_round = 0  # the shipped model
    for r in range(1, len(rows) + 1):
        evals = [m["eval/accuracy"] for m in metrics(out / f"grpo-{r}" / "metrics.jsonl") if "eval/accuracy" in m]
        if start is None:
            start = kept = evals[0]
        if evals[-1] > kept:  # its step 0 is the kept policy's accuracy: kept only if it beat it
            kept, kept_round = evals[-1], r
    last = out / f"grpo-{len(rows)}" / "final"
    between = {}  # each round's evaluations after step 10 and before its last: how far the last one stands out
    for r in range(1, len(rows) + 1):
        evals = [m["eval/accuracy"] for m in metrics(out / f"grpo-{r}" / "metrics.jsonl") if "eval/accuracy" in m]
        middle = evals[2:-1] or evals
        between[f"between_{r}"] = f"{min(middle):.1%}".removesuffix("%") + f"-{max(middle):.1%}"
    minutes = (last.stat().st_mtime - (out / "pairs-1.jsonl").stat().st_mtime) / 60
    return {"start": f"{start:.1%}", "end": f"{kept:.1%}", "gain": f"+{100 * (kept - start):.1f}",
            "rounds": str(len(rows)), "minutes": f"{minutes:.0f}", "kept_round": str(kept_round),
            "pairs_last": f"{sum(1 for line in (out / f'pairs-{len(rows)}.jsonl').open() if line.strip()):,}", **between}


def further_sums(n: int, path: Path) -> Path:
    """`n` sums of the task's stream after its 4,000 training prompts: in neither split. Drawn later from a stream
    without replacement, they are nearly all two-digit + two-digit (the held-out split has all four kinds)."""
    from lmrl.data.tasks import get_task

    rows = get_task("addition", num_train=4000 + n).train_prompts()[4000:]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def accuracy_on(model: str, data: Path, n: int) -> float:
    """Greedy exact match of `model` on the sums in `data`: `lmrl eval`, run in this process (no interpreter and
    imports of its own for each model)."""
    from lmrl.cli import main as lmrl

    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        code = lmrl(["eval", "--model", model, "--data", str(data), "--reward", "exact_match", "--max-new-tokens", "4",
                     "--num-prompts", str(n)])
    if code:
        raise SystemExit(f"lmrl eval --model {model} exited with {code}")
    return float(re.search(r"accuracy \(greedy\) ([\d.]+)%", said.getvalue()).group(1)) / 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the directory examples/rlhf/loop.sh wrote")
    parser.add_argument("--record", action="store_true", help="merge the rows into the result file")
    parser.add_argument("--further", type=int, default=0, metavar="N",
                        help="also evaluate the shipped model and each round's policy on N sums in neither split")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=DIR",
                        help="also a row for another GRPO run against one of the loop's reward models")
    args = parser.parse_args()
    rows = rounds(args.out)
    if not rows:
        raise SystemExit(f"{args.out}: no finished round (grpo-1/final) of examples/rlhf/loop.sh")
    figures = values(args.out, rows)
    rows += [variant(args.out, label, Path(d), len(rows)) for label, d in (v.split("=", 1) for v in args.variant)]
    if args.further:
        with tempfile.TemporaryDirectory() as tmp:
            data = further_sums(args.further, Path(tmp) / "further.jsonl")
            shipped = accuracy_on("tiny-addition", data, args.further)
            for row, grpo in zip(rows, [args.out / f"grpo-{r}" for r in range(1, int(figures["rounds"]) + 1)]
                                 + [Path(v.split("=", 1)[1]) for v in args.variant]):
                row["further"] = f"{accuracy_on(str(grpo / 'final'), data, args.further):.1%}"
        kept = int(figures["kept_round"])
        figures |= {"further_n": f"{args.further:,}", "further_start": f"{shipped:.1%}",
                    "further_end": rows[kept - 1]["further"] if kept else f"{shipped:.1%}"}
    for row in rows:
        print(" | ".join(str(row[c.key]) for c in COLUMNS if c.key in row))
    print(f"{figures['rounds']} round{'s' * (len(rows) > 1)}: held-out accuracy {figures['start']} -> {figures['end']} "
          f"({figures['gain']} points, round {figures['kept_round']}'s policy) in {figures['minutes']} minutes"
          + (f"; on {figures['further_n']} further sums {figures['further_start']} -> {figures['further_end']}"
             if args.further else ""))
    if args.record:
        record("rlhf-loop", COLUMNS, rows, values=figures, merge_on="run")


if __name__ == "__main__":
    main()
