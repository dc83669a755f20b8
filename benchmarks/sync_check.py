"""What the sync check costs (`guard.max_sampler_diff`, docs/generation.md "The sync check").

    python benchmarks/sync_check.py                 # the shipped model and the ~41M Llama
    python benchmarks/sync_check.py --record        # the table in docs/generation.md

A synchronous run's check computes nothing new: it reads the step's own experience (the sampler's log-probs and the
trainer's forward on the same tokens, which truncated importance sampling computes anyway) and takes one masked
mean, timed here on a batch's [B, T] tensors. An asynchronous run's probe (every guard.sync_probe_every steps)
scores one sequence (a prompt and 64 sampled tokens) with the trainer's forward as the weights are published, and
once more in the generator process. The peer each is measured against, in the same run: the trainer's no-grad
forward over the step's whole batch (B = prompts_per_step x group_size rows of the same lengths), one of the
three or more passes a step makes over its batch besides generating it (the update's forward and backward).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from generation import LABELS, build  # noqa: E402
from weight_sync import best  # noqa: E402

from lmrl import algorithms as A  # noqa: E402
from lmrl.models.forward import model_forward_logprobs, sequence_logprobs  # noqa: E402


def measure(preset: str, args: argparse.Namespace) -> dict:
    """One model's row: the batch's forward, the synchronous check and the probe, in ms, and their shares."""
    setup = build(preset)
    model, vocab = setup.model.eval(), setup.vocab
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, vocab, (args.rows, args.prompt + args.response), generator=g)
    mask = torch.ones_like(batch)
    probe = batch[0, : args.prompt].tolist(), batch[0, args.prompt:].tolist()
    with torch.no_grad():
        forward = best(lambda: model_forward_logprobs(model, batch, mask, args.response, chunk_size=128), args.repeats)
        trainer = model_forward_logprobs(model, batch, mask, args.response, chunk_size=128)
        sampler = trainer + 1e-7 * torch.randn(trainer.shape, generator=g)
        response_mask = torch.rand(trainer.shape, generator=g) < 0.9
        check = best(lambda: A.masked_mean((sampler - trainer).abs(), response_mask).item(), args.repeats)
        scored = best(lambda: sequence_logprobs(model, *probe), args.repeats)
    print(f"{LABELS[preset]}: the batch's forward ({args.rows} rows) {forward * 1e3:.1f} ms; synchronous check "
          f"{check * 1e3:.3f} ms ({check / forward:.2%} of it); probe {scored * 1e3:.2f} ms per side "
          f"({scored / forward:.2%} of it), every guard.sync_probe_every steps", flush=True)
    return {"model": LABELS[preset], "forward_ms": forward * 1e3, "check_ms": check * 1e3,
            "check_share": check / forward, "probe_ms": scored * 1e3, "probe_share": scored / forward}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", nargs="+", choices=["shipped", "30m", "100m"], default=["shipped", "30m"])
    parser.add_argument("--rows", type=int, default=128, help="the step's batch: prompts_per_step x group_size")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    parser.add_argument("--response", type=int, default=64, help="response tokens per row (the probe's too)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--record", nargs="?", const="sync-check", metavar="NAME",
                        help="write the table to benchmarks/results/NAME.MACHINE.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(preset, args) for preset in args.preset]
    if args.record:
        from recording import Column, record

        columns = [Column("model"), Column("forward_ms", f"the batch's no-grad forward ({args.rows} rows), ms", "{:.1f}"),
                   Column("check_ms", "synchronous check, ms", "{:.3f}"), Column("check_share", "of the forward", "{:.2%}"),
                   Column("probe_ms", "asynchronous probe, ms per side", "{:.2f}"),
                   Column("probe_share", "of the forward", "{:.2%}")]
        record(args.record, columns, rows, note=f"{args.rows} rows of {args.prompt} prompt + {args.response} response "
                                                f"tokens, {args.threads} threads, best of {args.repeats}.")


if __name__ == "__main__":
    main()
