"""The experience forwards and the update with packing (`train.packing=true`) against padded micro-batches
(`train.packing=false`), on batches whose prompts and completions vary in length.

    python benchmarks/packing.py                      # 8 prompts x 8, hidden 256 / 4 layers, 2 threads
    python benchmarks/packing.py --repeats 9 --record # the table in docs/performance.md
    python benchmarks/packing.py --shipped 3 --record # the shipped task: `lmrl train`, packed and padded in turns

With --shipped N, `lmrl train` runs the shipped task (--steps steps) N times packed and N times padded, in
turns, and compares their summed time/experience + time/update.

The batch is made, not sampled, so that its lengths follow a stated law: 8 prompts of 4 to 90 random tokens, each
with 8 completions that end at a stop after a geometric number of tokens (mean 15, at most 64, where the
rest are cut off). A seeded Llama (random weights) runs lmrl's trainer on it: the experience (the reference's
forward, for a KL term) and one GRPO update (forward and backward), in float32. Two trainers built alike, one
packed and one padded, take turns on the same batches; the speedup printed is the median of the per-turn ratios
(padded / packed), so machine drift cancels. The first turn's policy loss of both is printed: it must agree to
float rounding, since packing changes the cost, not the update.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from seeded_llama import add_model_args, seeded_llama  # noqa: E402

from lmrl import Trainer  # noqa: E402
from lmrl.collect import Collected  # noqa: E402
from lmrl.config import load_config  # noqa: E402
from lmrl.logging.metrics import Phases  # noqa: E402
from lmrl.rollout import Rollout  # noqa: E402


def varied_batch(prompts: int, group: int, seed: int, prompt_range=(4, 90), mean=15, cap=64,
                 vocab=(5, 60)) -> tuple[Rollout, torch.Tensor]:
    """A scored rollout: `prompts` prompts of uniform length in `prompt_range`, `group` completions each of a
    geometric length with the given mean, cut at `cap`; random tokens, random scores."""
    rng = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt_range[0], prompt_range[1] + 1, (prompts,), generator=rng)
    width = int(lengths.max())
    prompt_ids = torch.zeros(prompts, width, dtype=torch.long)
    prompt_mask = torch.zeros(prompts, width, dtype=torch.bool)
    for i, n in enumerate(lengths.tolist()):  # left-padded
        prompt_ids[i, width - n:] = torch.randint(*vocab, (n,), generator=rng)
        prompt_mask[i, width - n:] = True
    rows = prompts * group
    u = torch.rand(rows, generator=rng).clamp(min=1e-12)
    response = (torch.log(u) / math.log(1 - 1 / mean)).ceil().long().clamp(1, cap)  # geometric, mean ~ `mean`
    columns = int(response.max())
    response_mask = torch.arange(columns) < response[:, None]
    response_ids = torch.randint(*vocab, (rows, columns), generator=rng) * response_mask
    index = torch.arange(prompts).repeat_interleave(group)
    rollout = Rollout(prompt_ids=prompt_ids[index], prompt_mask=prompt_mask[index], response_ids=response_ids,
                      response_mask=response_mask, logprobs=torch.zeros(rows, columns), texts=[""] * rows,
                      finished=response < cap, prompt_index=index)
    return rollout, torch.randn(rows, generator=rng)


def trainer_for(args: argparse.Namespace, packing: bool, out: str) -> Trainer:
    model, tokenizer = seeded_llama(args, max_position_embeddings=256)
    cfg = load_config(None, [f"train.packing={str(packing).lower()}", f"train.output_dir={out}", "log.console=false",
                             "train.eval_every=0", "algorithm=grpo", f"algorithm.kl_coef={args.kl_coef}",
                             f"rollout.group_size={args.group}", f"rollout.prompts_per_step={args.prompts}",
                             "rollout.max_new_tokens=64", f"train.threads={args.threads}", *args.set])
    rows = [{"prompt": "1+1=", "answer": "2"}] * args.prompts
    return Trainer(cfg, model=model, tokenizer=tokenizer, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                   train_dataset=rows)


def step(trainer: Trainer, rollout: Rollout, scores: torch.Tensor) -> tuple[float, tuple[float, float, float]]:
    """(seconds for the experience and the update, (the update's policy loss, its gradient norm, the process's
    memory peak in the update, MiB))."""
    collected = Collected(rollout=rollout, scores=scores, keep=None, rows=[], metrics={}, per_function={})
    start = time.perf_counter()
    exp = trainer.experience(collected)
    phases = Phases("cpu")
    metrics = trainer.update(exp)
    phases.end("update")
    return time.perf_counter() - start, (metrics["loss/policy_avg"], metrics["policy/grad_norm"],
                                         phases.peaks["memory/peak_update_mb"])


def shipped(args: argparse.Namespace) -> dict:
    """The shipped task's experience + update seconds a step, packed and padded, from `lmrl train` in turns."""
    import json
    import subprocess
    import tempfile

    per_step: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for turn in range(args.shipped):
            for packing in (False, True):
                out = f"{tmp}/{packing}"
                subprocess.run([sys.executable, "-m", "lmrl", "train", f"train.steps={args.steps}", f"train.output_dir={out}",
                                "train.overwrite=true", "log.console=false", f"train.threads={args.threads}",
                                f"train.packing={str(packing).lower()}", *args.set], check=True, capture_output=True)
                with open(f"{out}/metrics.jsonl") as f:
                    rows = [json.loads(line) for line in f]
                steps = [r["time/experience"] + r["time/update"] for r in rows if "time/update" in r]
                per_step[packing].append(sum(steps) / len(steps))
                print(f"turn {turn + 1}: packing={str(packing).lower():5} {1000 * per_step[packing][-1]:.1f} ms a step",
                      flush=True)
    ratios = sorted(a / b for a, b in zip(per_step[False], per_step[True]))
    return {"task": f"shipped, {args.steps} steps", "padded": statistics.median(per_step[False]),
            "packed": statistics.median(per_step[True]), "speedup": statistics.median(ratios), "low": ratios[0],
            "high": ratios[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--kl-coef", type=float, default=0.04, help="0: no reference forward")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--set", nargs="*", default=[], help="more config overrides for both trainers")
    parser.add_argument("--shipped", type=int, metavar="N", help="the shipped task instead: N runs of each, in turns")
    parser.add_argument("--steps", type=int, default=300, help="with --shipped: steps of each run")
    parser.add_argument("--record", nargs="?", const="packing", metavar="NAME",
                        help="write the table to benchmarks/results/NAME.MACHINE.json (NAME-shipped with --shipped)")
    args = parser.parse_args()
    if args.shipped:
        row = shipped(args)
        print(f"shipped task, experience + update a step: padded {1000 * row['padded']:.1f} ms, packed "
              f"{1000 * row['packed']:.1f} ms: {row['speedup']:.2f}x (range {row['low']:.2f}-{row['high']:.2f})")
        if args.record:
            from recording import Column, record

            record(f"{args.record}-shipped", [Column("task"), Column("padded", "padded, a step", "{:.4f} s"),
                                 Column("packed", "packed", "{:.4f} s"),
                                 Column("speedup", "speedup (range)", "{:.2f}x ({low:.2f}-{high:.2f})")], [row],
                   note=f"`lmrl train` of the shipped task, {args.steps} steps, {args.shipped} runs "
                                         "each in turns; time/experience + time/update a step, median over runs.")
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        packed, padded = trainer_for(args, True, f"{tmp}/packed"), trainer_for(args, False, f"{tmp}/padded")
        print(f"torch {torch.__version__}, threads {args.threads}, hidden {args.hidden}, {args.layers} layers, float32; "
              f"{args.prompts} prompts x {args.group}, kl_coef {args.kl_coef}: the experience + one update")
        turns, losses, peaks = [], None, []
        for turn in range(args.repeats + 1):  # turn 0 warms up (and gives the first-step losses)
            rollout, scores = varied_batch(args.prompts, args.group, seed=turn)
            a, loss_a = step(padded, rollout, scores)
            b, loss_b = step(packed, rollout, scores)
            if turn == 0:
                losses = (loss_a, loss_b)
                real = int(rollout.attention_mask.sum())
                print(f"batch: {tuple(rollout.sequences.shape)} columns, {real} real tokens "
                      f"({real / rollout.sequences.numel():.0%} of the padded batch)")
            else:
                turns.append((a, b))
                peaks.append((loss_a[2], loss_b[2]))
        ratios = sorted(a / b for a, b in turns)
        row = {"padded": statistics.median(a for a, _ in turns), "packed": statistics.median(b for _, b in turns),
               "speedup": statistics.median(ratios), "low": ratios[len(ratios) // 4], "high": ratios[3 * len(ratios) // 4],
               "loss_padded": losses[0][0], "loss_packed": losses[1][0], "norm_padded": losses[0][1],
               "norm_packed": losses[1][1], "peak_padded": statistics.median(a for a, _ in peaks),
               "peak_packed": statistics.median(b for _, b in peaks)}
    print(f"padded {row['padded']:.3f} s, packed {row['packed']:.3f} s: {row['speedup']:.2f}x "
          f"(quartiles {row['low']:.2f}-{row['high']:.2f})\nfirst step: policy loss padded {row['loss_padded']:.6e}, "
          f"packed {row['loss_packed']:.6e}; gradient norm padded {row['norm_padded']:.6e}, packed {row['norm_packed']:.6e}\n"
          f"the process's memory peak in the update (both trainers resident): padded {row['peak_padded']:,.0f} MiB, "
          f"packed {row['peak_packed']:,.0f} MiB")
    if args.record:
        from recording import Column, record

        record(args.record, [Column("padded", "padded s (experience + update)", "{:.3f} s"),
                             Column("packed", "packed s", "{:.3f} s"),
                             Column("speedup", "speedup (quartiles)", "{:.2f}x ({low:.2f}-{high:.2f})"),
                             Column("loss_padded", "first-step loss, padded / packed", "{:.6e} / {loss_packed:.6e}"),
                             Column("norm_padded", "gradient norm, padded / packed", "{:.6e} / {norm_packed:.6e}")],
               [row],
               note=f"{args.prompts} prompts of 4-90 tokens x {args.group} completions of geometric length (mean 15, "
                    f"at most 64), hidden {args.hidden} / {args.layers} layers Llama, {args.threads} threads, "
                    f"kl_coef {args.kl_coef}; median of {args.repeats} paired turns.")


if __name__ == "__main__":
    main()
