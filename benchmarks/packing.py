"""Decode with oneDNN-packed weights vs plain `F.linear`: lmrl's HFGenerator with `PACK_WEIGHTS` on and off.

    python benchmarks/packing.py                                   # hidden 256, 4 layers, 2 threads
    python benchmarks/packing.py --hidden 64 --layers 2 --threads 1
    python benchmarks/packing.py --all-sizes                       # pack every weight, not only 2**17+

A seeded Llama built from a config (random weights, char tokenizer), 8 prompts x 8 completions of
exactly 64 tokens (no EOS), the vs_trl.py shape. The two settings take turns, one rollout each, for
--repeats pairs; the printed ratio is the median over pairs of (time unpacked / time packed), so a
pair sees one machine state even when the machine's speed drifts between pairs.
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

import lmrl.rollout.hf as hf  # noqa: E402
from lmrl.rollout import HFGenerator, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--all-sizes", action="store_true", help="pack weights of any size (PACK_MIN_ELEMENTS=0)")
    args = parser.parse_args()
    if args.all_sizes:
        hf.PACK_MIN_ELEMENTS = 0

    model, tokenizer = seeded_llama(args)
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 90, (6,), generator=rng).tolist() for _ in range(8)]
    params = SamplingParams(max_new_tokens=64, temperature=1.0, seed=0)
    generator = HFGenerator(model, tokenizer, eos_token_id=[])

    def rollout(pack: bool) -> float:
        hf.PACK_WEIGHTS = pack
        start = time.perf_counter()
        generator.generate(prompts, 8, params)
        return time.perf_counter() - start

    rollout(True), rollout(False)  # warm-up
    pairs = [(rollout(False), rollout(True)) for _ in range(args.repeats)]
    ratios = sorted(plain / packed for plain, packed in pairs)
    packs = hf._onednn_weight(model.model.layers[0].mlp.gate_proj.weight.detach(), 64) is not None
    print(f"torch {torch.__version__}, threads {args.threads}, hidden {args.hidden}, {args.layers} layers, "
          f"64 rows x 64 tokens; MLP weights packed: {packs}")
    print(f"plain F.linear: median {statistics.median(p for p, _ in pairs):.3f} s per rollout")
    print(f"oneDNN packed:  median {statistics.median(q for _, q in pairs):.3f} s per rollout")
    print(f"speedup (median of {len(ratios)} paired ratios): {statistics.median(ratios):.2f}x, "
          f"quartiles {ratios[len(ratios) // 4]:.2f}-{ratios[3 * len(ratios) // 4]:.2f}")


if __name__ == "__main__":
    main()
