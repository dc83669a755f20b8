"""What the decode / update micro-benchmarks share: a seeded Llama built from a config (random weights,
char tokenizer), sized and threaded from the command line."""

from __future__ import annotations

import argparse

import torch

from lmrl.models.tiny import char_tokenizer, tiny_causal_lm


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--hidden, --layers, --heads (the vs_trl.py 256x4 model by default) and --threads."""
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)


def seeded_llama(args: argparse.Namespace, **config):
    """(model, tokenizer) for the parsed model arguments, with torch set to --threads threads; `config`
    goes to `tiny_causal_lm` (e.g. max_position_embeddings)."""
    torch.set_num_threads(args.threads)
    tokenizer = char_tokenizer()
    model = tiny_causal_lm(tokenizer, arch="llama", hidden_size=args.hidden, num_layers=args.layers,
                           num_heads=args.heads, seed=0, **config)
    return model, tokenizer
