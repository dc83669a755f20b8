"""How close a training step runs to what its matrix multiplies alone cost on this CPU.

    python benchmarks/floor.py                          # the vs_trl.py hidden 256 / 4 layers model, 2 threads
    python benchmarks/floor.py --hidden 64 --layers 2 --threads 1

A seeded Llama built from a config (random weights, char tokenizer), in float32, with the vs_trl.py shapes:
8 prompts x 8 completions of exactly 64 new tokens (no EOS).

    update   forward + backward of the policy's response log-probs (`model_forward_logprobs`) on --rows rows,
             as GFLOP/s of its linear layers (6 x weights x tokens: attention's score matmuls not counted),
             against torch.mm on the MLP's up-projection shape at the same number of tokens.
    decode   lmrl's rollout against the same rollout whose decode steps run only their matrix multiplies
             (the fused q/k/v, o, MLP and LM-head projections, with their fused adds): no norms, rotary,
             KV-cache writes or attention. Sampling, prefill and bookkeeping are in both.

The measured and the reference take turns, --repeats times, and each printed ratio is the median of the
per-turn ratios, so a ratio sees one machine state even when the machine's speed drifts.
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

import lmrl.engine.llama as llama  # noqa: E402
from lmrl.models.forward import model_forward_logprobs  # noqa: E402
from lmrl.rollout import HFGenerator, SamplingParams  # noqa: E402

PROMPTS, GROUP, NEW_TOKENS, PROMPT_LEN = 8, 8, 64, 6


def matmuls_only(self, token: torch.Tensor, position: torch.Tensor, cache, positions: int) -> torch.Tensor:
    """A decode step of the engine (`lmrl.engine.llama.LlamaStep`) reduced to its projections (same shapes, same fusions)."""
    hidden = self.inner.embed_tokens(token)
    width = self.heads * self.head_dim
    for i in range(len(self.layers)):
        attended = self.qkv[i](hidden)[:, :width]  # stands in for attention's output
        hidden = self.o_proj[i](attended, add=hidden)
        hidden = self.mlp[i](hidden, residual=hidden)
    return self.lm_head(hidden)


def paired(measured, reference, repeats: int) -> tuple[float, float, float]:
    """Median measured time, median reference time, median of per-turn ratios measured / reference."""
    measured(), reference()  # warm-up
    pairs = [(measured(), reference()) for _ in range(repeats)]
    return (statistics.median(m for m, _ in pairs), statistics.median(r for _, r in pairs),
            statistics.median(m / r for m, r in pairs))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--rows", type=int, default=32, help="rows in the update (vs_trl.py trains 25-42 of 64)")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    model, tokenizer = seeded_llama(args)
    cfg = model.config
    rng = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, threads {args.threads}, hidden {args.hidden}, {args.layers} layers, "
          f"intermediate {cfg.intermediate_size}, float32")

    # update: forward + backward against torch.mm at the same token count
    seqs = torch.randint(5, 90, (args.rows, PROMPT_LEN + NEW_TOKENS), generator=rng)
    mask = torch.ones_like(seqs)
    tokens = seqs.numel()
    linear = sum(m.weight.numel() for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and name != "lm_head")
    flops = 6 * linear * tokens + 6 * model.lm_head.weight.numel() * args.rows * NEW_TOKENS

    def update() -> float:
        model.zero_grad(set_to_none=True)
        return timed(lambda: model_forward_logprobs(model, seqs, mask, NEW_TOKENS).sum().backward())

    a, b = torch.randn(tokens, args.hidden), torch.randn(args.hidden, cfg.intermediate_size)
    mm_flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    model.train()
    upd, mm, ratio = paired(update, lambda: timed(lambda: torch.mm(a, b)), args.repeats)
    print(f"update  {args.rows} rows x {PROMPT_LEN + NEW_TOKENS} tokens: {upd:.3f} s, {flops / upd / 1e9:.0f} GFLOP/s; "
          f"torch.mm {tuple(a.shape)} @ {tuple(b.shape)}: {mm_flops / mm / 1e9:.0f} GFLOP/s; "
          f"the update runs at {flops / mm_flops / ratio:.0%} of the mm rate (median of turns)")

    # decode: the rollout against its matmuls alone
    model.eval()
    prompts = [torch.randint(5, 90, (PROMPT_LEN,), generator=rng).tolist() for _ in range(PROMPTS)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=0)
    generator = HFGenerator(model, tokenizer, eos_token_id=[])
    if not llama.supports(model):
        raise SystemExit("floor.py: the model does not take lmrl's decode engine, so there is nothing to reduce")
    full_step = llama.LlamaStep.__call__

    def rollout(step) -> float:
        llama.LlamaStep.__call__ = step
        try:
            return timed(lambda: generator.generate(prompts, GROUP, params))
        finally:
            llama.LlamaStep.__call__ = full_step

    full, floor, ratio = paired(lambda: rollout(full_step), lambda: rollout(matmuls_only), args.repeats)
    print(f"decode  {PROMPTS * GROUP} rows x {NEW_TOKENS} tokens: {full:.3f} s; matmuls only: {floor:.3f} s; "
          f"the matmuls are {1 / ratio:.0%} of decode time (median of turns)")


if __name__ == "__main__":
    main()
