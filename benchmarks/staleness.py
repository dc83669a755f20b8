"""Bounded staleness (train.max_staleness) against synchronous training and a fixed lag (train.async_steps) on a
task whose completion lengths have a long tail, on this machine's cores: the wall time to N steps and the held-out
accuracy at N steps, as verl measures its fully asynchronous mode.

    python benchmarks/staleness.py                       # 24 steps of each run
    python benchmarks/staleness.py --quick               # 6 steps: a smoke run
    python benchmarks/staleness.py --steps 24 --repeats 3 --record   # the table in docs/async.md
    python benchmarks/staleness.py --shipped 150 --repeats 3 --record  # the shipped task: the held-out gain
    python benchmarks/staleness.py --runs sync staleness=2 --repeats 3 --hidden 512 --record staleness-h512
    python benchmarks/staleness.py --runs sync keep_cache=2 keep_cache=2,2+1 --repeats 3 --record staleness-threads

The task: a Llama with random weights (hidden 256, 4 layers, 4 heads; `seeded_llama`) and the character tokenizer,
its final norm scaled by 0.01 so that it starts out sampling nearly uniformly over its 99 tokens. A completion ends
at the first of 2 stop strings (".", "!") or EOS: after a geometric number of tokens, mean about 33, a few running
to max_new_tokens=256. 4 prompts x 4 completions a step: the longest of 16 rows sets how long a synchronous step
samples. The reward, 1 when a completion starts with a digit, is learnable from
the start (10 of 99 tokens); the accuracy is that of greedy completions of 64 held-out prompts after the last step.
GRPO, one update per batch, AdamW lr 1e-4, float32, the same seed in every run.

Runs, each in its own process, one after the other:
    sync           train.threads=2 (both cores: the synchronous loop's best)
    async_steps=1  a generator process one step ahead, whole batches (automatic threads: trainer 2, generator 1)
    staleness=1    train.max_staleness=1: groups streamed through continuous batching, the first ready trained
                   (automatic threads: trainer 1, generator 1)
    staleness=2    train.max_staleness=2
    partial=2      train.max_staleness=2 rollout.partial=true: rows in flight take new weights at their next token,
                   their tokens so far prefilled again
    keep_cache=2   train.max_staleness=2 rollout.partial=keep_cache: the same, the keys and values cached kept
    keep_cache=2,2+1  the same with the trainer on both cores (train.threads=2), as a fixed lag's default; only
                   when named in --runs (the threads figure in docs/async.md)

With --repeats R every run is made R times, in turns, turn t with seed --seed + t: the wall time and its ratio to
sync's of the same turn are the medians over the turns, the accuracy their mean (one seed's accuracy swings by tens
of points on this task: the policy starts out nearly uniform, and greedy decoding picks its argmax). Printed per run: the wall time of its N steps (the sum of `time/step`: waits included, the evaluations and start-up
not), its ratio to sync's (goal >= 1.3x at staleness <= 2), the accuracy at N, the largest staleness trained on, the
groups dropped and the mean completion length.

The machine may be shared with other processes: compare the ratios of one run, and rerun when in doubt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

RUNS = {  # name: extra overrides
    "sync": ["train.threads=2"],
    "async_steps=1": ["train.async_steps=1"],
    "staleness=1": ["train.max_staleness=1"],
    "staleness=2": ["train.max_staleness=2"],
    "partial=2": ["train.max_staleness=2", "rollout.partial=true"],
    "keep_cache=2": ["train.max_staleness=2", "rollout.partial=keep_cache"],
    "keep_cache=2,2+1": ["train.max_staleness=2", "rollout.partial=keep_cache", "train.threads=2"],  # not by default
}
DEFAULT_RUNS = [name for name in RUNS if "+" not in name]
STOPS = [".", "!"]


def starts_with_digit(completions, **_):
    return [float(c[:1].isdigit()) for c in completions]


def child(name: str, steps: int, out: str, seed: int, hidden: int = 256) -> dict:
    """One run of the task, in this process; returns its figures."""
    import random

    if name != "sync":  # what `lmrl train` sets for an asynchronous run, before torch loads
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import torch
    from seeded_llama import seeded_llama

    from lmrl import Trainer
    from lmrl.config import load_config

    model, tokenizer = seeded_llama(argparse.Namespace(hidden=hidden, layers=4, heads=4, threads=2),
                                    max_position_embeddings=256)
    with torch.no_grad():
        model.model.norm.weight.mul_(0.01)  # nearly uniform: lengths geometric in the stop strings' share
    rng = random.Random(seed)
    rows = [{"prompt": "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 12))) + ":"} for _ in range(320)]
    cfg = load_config(None, [f"train.output_dir={out}", "log.console=false", "log.samples_every=0", f"train.steps={steps}",
                             "train.eval_every=0", "train.max_minutes=null", f"train.seed={seed}", "algorithm=grpo",
                             "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=256",
                             f"rollout.stop={json.dumps(STOPS)}", "optim.lr=1e-4", "data.num_eval_prompts=64",
                             *RUNS[name]])
    trainer = Trainer(cfg, model=model, tokenizer=tokenizer, reward_funcs=[starts_with_digit],
                      train_dataset=rows[64:], eval_dataset=rows[:64])
    history = trainer.train().history
    steps_ = [r for r in history if "time/step" in r]
    return {"run": name, "wall": sum(r["time/step"] for r in steps_), "accuracy": history[-1]["eval/accuracy"],
            "start_accuracy": trainer.result.evals[0]["eval/accuracy"],
            "staleness": max(r.get("async/staleness_max", r.get("async/version_lag", 0.0)) for r in steps_),
            "dropped": sum(r.get("async/dropped_groups", 0.0) for r in steps_),
            "length": sum(r["val/response_length"] for r in steps_) / len(steps_)}


def shipped(args) -> list[dict]:
    """The shipped task (`lmrl train`, its preset), sync and with max_staleness=2 (and partial rollouts that keep the
    cache), in turns: the held-out gain at a fixed number of steps (500 prompts, greedy, at step 0 and the last) and
    the wall time of the steps."""
    runs = {"sync": [], "staleness=2": ["train.max_staleness=2"],
            "keep_cache=2": ["train.max_staleness=2", "rollout.partial=keep_cache"]}
    out: dict[str, list[dict]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for turn in range(args.repeats):
            for name, extra in runs.items():
                run = f"{tmp}/{name}{turn}"
                subprocess.run([sys.executable, "-m", "lmrl", "train", f"train.output_dir={run}", f"train.steps={args.shipped}",
                                "train.eval_every=0", "train.max_minutes=null", "log.console=false", "log.samples_every=0",
                                f"train.seed={args.seed + turn}", *extra], check=True, capture_output=True)
                with open(f"{run}/metrics.jsonl") as f:
                    rows = [json.loads(line) for line in f]
                evals = [r for r in rows if "eval/accuracy" in r]
                r = {"run": name, "wall": sum(r["time/step"] for r in rows if "time/step" in r),
                     "start": evals[0]["eval/accuracy"], "end": evals[-1]["eval/accuracy"],
                     "staleness": max(r.get("async/staleness_max", 0.0) for r in rows)}
                out[name].append(r)
                print(f"turn {turn + 1}: {name:12} {args.shipped} steps in {r['wall']:5.1f} s, held-out accuracy "
                      f"{r['start']:.1%} -> {r['end']:.1%}", flush=True)
    results = []
    for name, rs in out.items():
        ratios = [a["wall"] / b["wall"] for a, b in zip(out["sync"], rs)]
        results.append({"run": name, "wall": statistics.median(r["wall"] for r in rs), "speedup": statistics.median(ratios),
                        "gain": statistics.mean(r["end"] - r["start"] for r in rs),
                        "accuracy": statistics.mean(r["end"] for r in rs), "staleness": max(r["staleness"] for r in rs)})
        print(f"{name:12} median {results[-1]['wall']:.1f} s ({results[-1]['speedup']:.2f}x sync's), held-out gain "
              f"{results[-1]['gain']:+.1%} (the mean of {args.repeats} seeds)")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--quick", action="store_true", help="6 steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each, in turns; the median wall time is kept")
    parser.add_argument("--runs", nargs="*", default=DEFAULT_RUNS, choices=list(RUNS))
    parser.add_argument("--record", nargs="?", const="staleness", metavar="NAME",
                        help="write the table to benchmarks/results/NAME.MACHINE.json")
    parser.add_argument("--shipped", type=int, metavar="STEPS",
                        help="instead: the shipped task, sync and max_staleness=2 (keep_cache too), this many steps")
    parser.add_argument("--hidden", type=int, default=256, help="the model's width (docs/async.md: 512 as well)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = 6 if args.quick else args.steps
    if args.shipped:
        results = shipped(args)
        if args.record:
            from recording import Column, record

            record(f"{args.record}-shipped", [Column("run"), Column("wall", f"wall time, {args.shipped} steps", "{:.1f} s"),
                                              Column("speedup", "x sync", "{:.2f}x"),
                                              Column("gain", "held-out gain", "{:+.1%}"),
                                              Column("accuracy", f"accuracy at step {args.shipped}", "{:.1%}"),
                                              Column("staleness", "largest staleness", "{:.0f}")],
                   results, note=f"`lmrl train` (the shipped model and task, its preset); seeds {args.seed}-"
                                 f"{args.seed + args.repeats - 1}; 500 held-out prompts, greedy, at step 0 and the last.")
        return
    if args.child:
        print("RESULT " + json.dumps(child(args.child, steps, args.out, args.seed, args.hidden)), flush=True)
        return
    runs: dict[str, list[dict]] = {name: [] for name in args.runs}
    with tempfile.TemporaryDirectory() as tmp:
        for turn in range(args.repeats):  # in turns, a seed each: drift of the machine reaches every run alike
            for name in args.runs:
                done = subprocess.run([sys.executable, __file__, "--child", name, "--out", f"{tmp}/{name}{turn}",
                                       "--steps", str(steps), "--seed", str(args.seed + turn),
                                       "--hidden", str(args.hidden)], capture_output=True,
                                      text=True)
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if done.returncode or not lines:
                    sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
                runs[name].append(r := json.loads(lines[0][7:]))
                print(f"turn {turn + 1}: {name:14} {steps} steps in {r['wall']:6.1f} s, accuracy {r['accuracy']:.1%} (from "
                      f"{r['start_accuracy']:.1%}), staleness <= {r['staleness']:.0f}, {r['dropped']:.0f} groups "
                      f"dropped, mean length {r['length']:.1f}", flush=True)
    results = []
    for rs in runs.values():  # medians of the walls and of the ratios to sync's of the same turn; means of accuracy
        ratios = [s["wall"] / r["wall"] for s, r in zip(runs.get("sync", []), rs)]
        results.append({"run": rs[0]["run"], "wall": statistics.median(r["wall"] for r in rs),
                        "speedup": statistics.median(ratios) if ratios else float("nan"),
                        "accuracy": statistics.mean(r["accuracy"] for r in rs),
                        "start_accuracy": statistics.mean(r["start_accuracy"] for r in rs),
                        "staleness": max(r["staleness"] for r in rs), "dropped": sum(r["dropped"] for r in rs),
                        "length": statistics.mean(r["length"] for r in rs)})
        r = results[-1]
        print(f"{r['run']:14} median {r['wall']:.1f} s, {r['speedup']:.2f}x sync's wall time (the median of the turns' "
              f"ratios); accuracy at step {steps} {r['accuracy']:.1%} (the mean of {args.repeats} seeds)")
    if args.record:
        from recording import Column, record

        record(args.record, [Column("run"), Column("wall", f"wall time, {steps} steps", "{:.1f} s"),
                             Column("speedup", "x sync", "{:.2f}x"), Column("accuracy", f"accuracy at step {steps}", "{:.1%}"),
                             Column("staleness", "largest staleness", "{:.0f}"), Column("dropped", "groups dropped", "{:.0f}"),
                             Column("length", "mean length", "{:.1f}")],
               results, note=f"4 prompts x 4 completions ending at a stop string after a geometric number of tokens "
                             f"(mean about 33, at most 256); hidden {args.hidden} / 4 layers Llama; seeds {args.seed}-"
                             f"{args.seed + args.repeats - 1}; accuracy from {results[0]['start_accuracy']:.1%} at step 0.")


if __name__ == "__main__":
    main()
