"""lmrl's decode with one of its CPU speed-ups on and off, in paired rollouts of the same HFGenerator.

    python benchmarks/decode_ab.py                                  # the C kernels, hidden 256, 4 layers, 2 threads
    python benchmarks/decode_ab.py --toggle pack                    # oneDNN-packed weights vs plain F.linear
    python benchmarks/decode_ab.py --toggle pack --all-sizes        # pack every weight, not only 2**17+
    python benchmarks/decode_ab.py --hidden 64 --layers 2 --threads 1
    python benchmarks/decode_ab.py --dtype bfloat16                 # a bfloat16 sampler (rollout.dtype=bfloat16)
    python benchmarks/decode_ab.py --hidden 64 --layers 2 --record  # a row of the table in docs/generation.md

--record [NAME] writes this run's row to benchmarks/results/NAME.MACHINE.json (default NAME: decode-kernels, or
decode-pack with --toggle pack), merged with the rows of the other runs recorded there (one per model setting).

--toggle kernels: the C decode kernels (`lmrl.kernels`: rotary, KV write and shared-prompt attention in
one call per layer, RMSNorm) vs the PyTorch ops (`lmrl.engine.llama.USE_KERNELS`).
--toggle pack: decode matmuls with weights reordered for oneDNN and fused epilogues vs `F.linear`
(`lmrl.engine.layers.PACK_WEIGHTS`).

A seeded Llama built from a config (random weights, char tokenizer), 8 prompts x 8 completions of
exactly 64 tokens (no EOS), the vs_trl.py shape. The two settings take turns, one rollout each, for
--repeats pairs; the printed ratio is the median over pairs of (time off / time on), so a pair sees
one machine state even when the machine's speed drifts between pairs.
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

import lmrl.engine.layers as layers  # noqa: E402
import lmrl.engine.llama as llama  # noqa: E402
from lmrl.kernels import load as load_kernels  # noqa: E402
from lmrl.rollout import HFGenerator, SamplingParams  # noqa: E402

SWITCHES = {"kernels": "USE_KERNELS", "pack": "PACK_WEIGHTS"}
MODULES = {"kernels": llama, "pack": layers}  # where each switch lives
HEADERS = {"kernels": "with the kernels / without (quartiles)", "pack": "with packed weights / without (quartiles)"}
MODEL_FLAGS = ("hidden", "layers", "heads", "threads", "dtype", "all_sizes")  # what makes a row of the table


def table_row(args: argparse.Namespace, defaults: dict, ratios: list[float]) -> dict:
    """This run's row: the model ("hidden 64, 2 layers (`--hidden 64 --layers 2`)": the flags that differ from
    the defaults), the median of the paired ratios and their quartiles (`ratios` sorted)."""
    flags = []
    for name in MODEL_FLAGS:
        value = getattr(args, name)
        if value != defaults[name]:
            flags.append(f"--{name.replace('_', '-')}" + ("" if value is True else f" {value}"))
    label = f"hidden {args.hidden}, {args.layers} layers" + (", bfloat16 sampler" if args.dtype == "bfloat16" else "")
    return {"model": label + (f" (`{' '.join(flags)}`)" if flags else ""), "speedup": round(statistics.median(ratios), 4),
            "q1": round(ratios[len(ratios) // 4], 4), "q3": round(ratios[3 * len(ratios) // 4], 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--toggle", choices=sorted(SWITCHES), default="kernels", help="the speed-up to turn on and off")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--all-sizes", action="store_true", help="pack weights of any size (PACK_MIN_ELEMENTS=0)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the model's weights")
    parser.add_argument("--record", nargs="?", const="", metavar="NAME",
                        help="add this run's row to benchmarks/results/NAME.MACHINE.json (default NAME: decode-TOGGLE)")
    args = parser.parse_args()
    if args.all_sizes:
        layers.PACK_MIN_ELEMENTS = 0
    if args.toggle == "kernels" and load_kernels() is None:
        sys.exit("decode_ab.py: the C kernels are unavailable here (see the warning above), nothing to compare")

    model, tokenizer = seeded_llama(args)
    model.to(getattr(torch, args.dtype))
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 90, (6,), generator=rng).tolist() for _ in range(8)]
    params = SamplingParams(max_new_tokens=64, temperature=1.0, seed=0)
    generator = HFGenerator(model, tokenizer, eos_token_id=[])

    def rollout(on: bool) -> float:
        setattr(MODULES[args.toggle], SWITCHES[args.toggle], on)
        start = time.perf_counter()
        generator.generate(prompts, 8, params)
        return time.perf_counter() - start

    rollout(True), rollout(False)  # warm-up
    pairs = [(rollout(False), rollout(True)) for _ in range(args.repeats)]
    ratios = sorted(off / on for off, on in pairs)
    packs = layers.onednn_weight(model.model.layers[0].mlp.gate_proj.weight.detach(), 64) is not None
    print(f"torch {torch.__version__}, threads {args.threads}, hidden {args.hidden}, {args.layers} layers, "
          f"{args.dtype}, 64 rows x 64 tokens; MLP weights packed: {packs}; toggled: {args.toggle} ({SWITCHES[args.toggle]})")
    print(f"{args.toggle} off: median {statistics.median(off for off, _ in pairs):.3f} s per rollout")
    print(f"{args.toggle} on:  median {statistics.median(on for _, on in pairs):.3f} s per rollout")
    print(f"speedup (median of {len(ratios)} paired ratios): {statistics.median(ratios):.2f}x, "
          f"quartiles {ratios[len(ratios) // 4]:.2f}-{ratios[3 * len(ratios) // 4]:.2f}")
    if args.record is not None:
        from recording import Column, record

        defaults = {name: parser.get_default(name) for name in MODEL_FLAGS}
        record(args.record or f"decode-{args.toggle}", [Column("model", "model"), Column("speedup", HEADERS[args.toggle], "{:.2f}x ({q1:.2f}-{q3:.2f})")],
               [table_row(args, defaults, ratios)], merge_on="model",
               note=f"64 rows x 64 tokens, {defaults['threads']} threads unless the row says otherwise; the median of "
                    f"{args.repeats} paired rollouts' time without / time with, and the quartiles.")


if __name__ == "__main__":
    main()
