"""The update's forward + backward with each distinct prompt run once (`train.share_prompt`) vs the plain
transformers forward, at several prompt / response lengths.

    python benchmarks/shared_prompt.py                      # hidden 256 / 4 layers, 2 threads
    python benchmarks/shared_prompt.py --shapes 6x64 512x256 --groups 2
    python benchmarks/shared_prompt.py --record             # the table in docs/algorithms.md

A seeded Llama built from a config (random weights), float32. Each shape PxT is a batch of --groups
prompts of P tokens (some left-padded) x G = 8 completions of T tokens, the log-probs of the responses
summed and back-propagated, as in the trainer's update. The two forwards take turns --repeats times;
the printed speedup is the median of the per-turn ratios (plain / shared), so machine drift cancels.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from seeded_llama import add_model_args, seeded_llama  # noqa: E402

from lmrl.models.forward import model_forward_logprobs  # noqa: E402

GROUP = 8


def update(model, seqs: torch.Tensor, mask: torch.Tensor, t: int, share: bool) -> float:
    """Seconds for the forward and backward of the summed response log-probs."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    model_forward_logprobs(model, seqs, mask, t, share_prompt=share).sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--groups", type=int, default=4, help="distinct prompts per batch (x 8 completions)")
    parser.add_argument("--shapes", nargs="+", default=["6x64", "64x64", "128x128", "256x256"],
                        help="prompt x response tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--record", nargs="?", const="shared-prompt", metavar="NAME",
                        help="write the table to benchmarks/results/NAME.MACHINE.json")
    args = parser.parse_args()
    rows = []
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes]
    model, _ = seeded_llama(args, max_position_embeddings=max(p + t for p, t in shapes))
    model.train()
    print(f"torch {torch.__version__}, threads {args.threads}, hidden {args.hidden}, {args.layers} layers, float32; "
          f"{args.groups} prompts x {GROUP} completions, forward + backward")
    print(f"{'prompt x response':>18}{'plain s':>9}{'shared s':>10}{'speedup':>9}{'quartiles':>12}")
    rng = torch.Generator().manual_seed(0)
    for p, t in shapes:
        prompts = torch.randint(5, 90, (args.groups, p), generator=rng)
        prompt_mask = torch.ones_like(prompts)
        prompt_mask[1::2, : p // 4] = 0  # every other prompt is shorter, left-padded
        seqs = torch.cat([prompts.repeat_interleave(GROUP, 0), torch.randint(5, 90, (args.groups * GROUP, t), generator=rng)], 1)
        mask = torch.cat([prompt_mask.repeat_interleave(GROUP, 0), torch.ones(args.groups * GROUP, t, dtype=torch.long)], 1)
        update(model, seqs, mask, t, False), update(model, seqs, mask, t, True)  # warm-up
        pairs = [(update(model, seqs, mask, t, False), update(model, seqs, mask, t, True)) for _ in range(args.repeats)]
        ratios = sorted(a / b for a, b in pairs)
        row = {"shape": f"{p} x {t}", "plain": statistics.median(a for a, _ in pairs),
               "shared": statistics.median(b for _, b in pairs), "speedup": statistics.median(ratios),
               "low": ratios[len(ratios) // 4], "high": ratios[3 * len(ratios) // 4]}
        rows.append(row)
        print(f"{row['shape']:>18}{row['plain']:>9.3f}{row['shared']:>10.3f}{row['speedup']:>8.2f}x"
              f"{'{:.2f}-{:.2f}'.format(row['low'], row['high']):>12}", flush=True)
    if args.record:
        from recording import Column, record

        record(args.record, [Column("shape", "prompt x response tokens"), Column("plain", "transformers' forward", "{:.2f} s"),
                             Column("shared", "each prompt once", "{:.2f} s"),
                             Column("speedup", "speedup (quartiles)", "{:.2f}x ({low:.2f}-{high:.2f})")], rows,
               note=f"Forward + backward of {args.groups} prompts x {GROUP} completions on a hidden {args.hidden} / "
                    f"{args.layers} layers Llama, {args.threads} threads, median of {args.repeats} paired turns.")


if __name__ == "__main__":
    main()
