"""Requests that join a running decode (continuous batching), for the generation server's batcher.

`HFGenerator.generate` decodes a fixed set of rows: a request that arrives while it runs waits for the whole call.
`JoiningDecode` hands a server's rows to a `lmrl.engine.DecodeEngine` of the generator's model, the loop `generate`
runs too, between any two of its steps, and hands each row back, as text, the step it ends. Used only by
`lmrl.rollout.batcher` for unseeded requests (an agent's, an OpenAI client's); a training batch, always seeded, goes
through `generate` as before. Each call to `add` draws one seed from the generator's own stream for its rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lmrl.engine import DecodeEngine, Request
from lmrl.engine.sampling import row_keys
from lmrl.rollout.base import SamplingParams
from lmrl.rollout.hf import HFGenerator, StopChecker
from lmrl.rollout.ops import cut_at_stop, decode_batch


def joinable(generator: Any) -> HFGenerator | None:
    """The lmrl decode behind `generator` (itself, or the `decoder` of `lmrl serve`'s `ModelGenerator`), whose
    engine rows can join. None: another backend, and the batcher runs whole calls."""
    decoder = generator if isinstance(generator, HFGenerator) else getattr(generator, "decoder", None)
    return decoder if isinstance(decoder, HFGenerator) else None


@dataclass
class Joining:
    """One row that joins: its prompt, its most new tokens, and whatever the caller tells its rows apart by."""

    prompt: list[int]
    max_new: int
    owner: Any


@dataclass
class Ended:
    """A row the step ended: its sampled tokens and their log-probs, and why it ended."""

    owner: Any
    tokens: list[int]
    logprobs: list[float]
    finished: bool  # EOS or a stop string; False: it reached its max_new
    text: str  # decoded, special tokens skipped, cut after the first stop string


class JoiningDecode:
    """A decode of `generator`'s model that rows join (`add`) and leave (`step`) between steps.

    Args:
        generator: the `HFGenerator` whose model, tokenizer, EOS, banned tokens and unseeded random stream it uses.
        params: temperature, top_p, top_k and stop strings of every row (each row has its own max_new).

    The caller runs it under `torch.inference_mode()` with the model in eval mode.
    """

    def __init__(self, generator: HFGenerator, params: SamplingParams):
        self.g, self.params = generator, params
        stops = StopChecker(generator.tokenizer, params.stop) if params.stop else None
        self.engine = DecodeEngine(generator.model, params, generator.eos_token_ids, banned=generator._banned,
                                   stops=stops, rows=generator.batch_size or 64, pad_token_id=generator.pad_token_id)

    def __len__(self) -> int:
        return len(self.engine)

    @property
    def forwards(self) -> int:
        """Forward passes run (prefills and steps): what a test counts."""
        return self.engine.forwards

    @property
    def rebuilds(self) -> int:
        return self.engine.rebuilds

    def add(self, joining: list[Joining]) -> None:
        """Prefill the distinct prompts of `joining` and put their rows in the batch; their first token is sampled
        by the next `step`."""
        keys = row_keys(self.g.draw_seed(), torch.arange(len(joining))).tolist()
        self.engine.add([Request(j.prompt, j.max_new, j.owner, k) for j, k in zip(joining, keys)])

    def step(self) -> list[Ended]:
        """Sample each row's next token; hand back the rows that ended, with their texts."""
        out = self.engine.step()
        texts = decode_batch(self.g.tokenizer, [e.tokens for e in out], skip_special_tokens=True) if out else []
        return [Ended(e.owner, e.tokens, e.logprobs, e.finished, cut_at_stop(text, self.params.stop))
                for e, text in zip(out, texts)]
