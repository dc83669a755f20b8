"""The generation contract: sampling parameters, the `Rollout` record and the `Generator` protocol.

A generator turns prompts (token-id lists) into `n` sampled completions per prompt. Everything the
trainer needs downstream is in the returned `Rollout`, aligned to response tokens:

- groups are contiguous: row `i` is completion `i % n` of prompt `i // n`;
- `response_mask` covers every real response token up to and including the first EOS (or the token
  that completed a stop string) and nothing after it. It is never derived from `pad_token_id`,
  because many tokenizers use their EOS token as the pad token;
- `logprobs` are the sampling log-probs log softmax(logits / temperature)[token] of the full
  distribution, before top-k / top-p truncation, so that they equal what the trainer's forward pass
  computes for the same tokens (the ratio at the first minibatch is then exactly 1).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Protocol, runtime_checkable

import torch


@dataclass
class SamplingParams:
    """How to sample completions.

    Attributes:
        max_new_tokens: Most response tokens per completion (>= 1); completions that reach it
            without EOS or a stop string are truncated (`Rollout.finished` is False).
        temperature: Softmax temperature (>= 0). 0 means greedy decoding (argmax); the returned
            log-probs are then those of softmax(logits), i.e. temperature 1.
        top_p: Nucleus sampling (Holtzman et al., 2020): sample from the smallest set of tokens whose
            probability mass reaches `top_p`. In (0, 1]; 1 disables it.
        top_k: Sample among the `top_k` most likely tokens only. 0 disables it.
        stop: Stop strings besides EOS. A completion ends with the token whose decoding completes one
            of them; the text keeps the stop string.
        seed: Seed for this call: the same seed gives identical rollouts. None continues the
            generator's own `torch.Generator` state (reproducible across a run, different per call).
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field that holds a value out of range."""
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens: must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature: must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1] (1 disables nucleus sampling), got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: must be an integer >= 0 (0 disables top-k), got {self.top_k!r}")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop: must be a list of non-empty strings, got {self.stop!r}")


@dataclass
class Rollout:
    """Sampled completions of a batch of prompts, `n` per prompt, in contiguous groups.

    Shapes: B = num_prompts * group_size rows, P prompt tokens (left-padded), T response tokens
    (right-padded; T is the longest response of this batch).

    Attributes:
        prompt_ids: `[B, P]` prompts, left-padded with the pad id; row i holds prompt `prompt_index[i]`.
        prompt_mask: `[B, P]` True on real prompt tokens.
        response_ids: `[B, T]` sampled tokens, right-padded with the pad id.
        response_mask: `[B, T]` True on real response tokens: up to and including the first EOS
            (or the token that completed a stop string), nothing after it.
        logprobs: `[B, T]` float32 log softmax(logits / temperature) of each sampled token under the
            full distribution (before top-k / top-p truncation); 0 where `response_mask` is False.
        texts: B decoded completions (special tokens skipped), cut right after the first stop
            string, which is kept.
        finished: `[B]` True if the completion ended with EOS or a stop string, False if it was
            truncated at `max_new_tokens`.
        prompt_index: `[B]` index of each row's prompt in the input list (`i // group_size`).
        response_attention: `[B, T]` True on every real response token, the model's and the
            environment's observations (multi-turn, `lmrl.rollout.multiturn`); None: `response_mask`,
            as in a single-turn rollout. Observation tokens are attended to but not trained on.
        media: a vision-language policy's bundle of each prompt (`lmrl.models.vision.Media`, None for a prompt
            without images), indexed by `prompt_index`; None for a text policy.
        media_index: `[B]` the bundle of `media` each row's sequence shows, where rows of one prompt show different
            images (multi-turn episodes whose environment showed images: one bundle per episode, the prompt's
            images then the observations'); None: its prompt's, `prompt_index`.
        versions: `[B, T]` the policy version (optimizer steps done) that sampled each response token, -1 past a
            row's end: a row may span versions where a sequence in flight took new weights (partial rollouts,
            `train.max_staleness`); None: one version sampled the whole rollout.
        contexts: an episode of several samples (an agent's, whose later request did not extend the tokens sampled
            so far: `lmrl.agents.gateway`): per row, for each sample after its first, (the response column where
            that sample's tokens begin, the token ids it was sampled after). The row's prompt and its response up to
            the first such column are its first sample. None (or a row's empty list): each row is one sequence.
            `lmrl.rollout.samples.split_samples` makes each sample a row for the trainer's forwards.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    texts: list[str]
    finished: torch.Tensor
    prompt_index: torch.Tensor
    response_attention: torch.Tensor | None = None
    media: list | None = None
    media_index: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    contexts: list[list[tuple[int, list[int]]]] | None = None

    @property
    def media_rows(self) -> torch.Tensor:
        """`[B]` the index in `media` of each row's images: `media_index`, else `prompt_index`."""
        return self.prompt_index if self.media_index is None else self.media_index

    @property
    def sequences(self) -> torch.Tensor:
        """`[B, P + T]` prompt followed by response: the input of the trainer's forward pass."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """`[B, P + T]` True on real prompt and response tokens (observations included)."""
        response = self.response_mask if self.response_attention is None else self.response_attention
        return torch.cat([self.prompt_mask, response], dim=1)

    @property
    def lengths(self) -> torch.Tensor:
        """`[B]` number of real response tokens of each completion."""
        return self.response_mask.sum(1)

    @property
    def num_prompts(self) -> int:
        """Number of distinct prompts (groups)."""
        return int(self.prompt_index.unique().numel())

    @property
    def group_size(self) -> int:
        """Completions per prompt (G); rows `g * G .. g * G + G - 1` form group `g`."""
        return self.prompt_index.numel() // max(self.num_prompts, 1)

    def to(self, device: torch.device | str) -> Rollout:
        """This rollout with its tensors on `device` (itself where they are there already): a generator that builds
        its rollouts from token lists (a server, an agent program's episodes) builds them on the CPU, and the
        trainer's arithmetic happens on the policy's device. The media bundles stay: the forward moves them."""
        device = torch.device(device)
        if self.response_ids.device == device:
            return self
        moved = {f.name: v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v
                 for f in fields(self)}
        return Rollout(**moved)


@runtime_checkable
class Generator(Protocol):
    """A generation backend: samples `n` completions for each prompt with the current weights."""

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> Rollout:
        """Sample `n` completions per prompt.

        Args:
            prompts: Token-id lists, one per prompt, each non-empty.
            n: Completions per prompt (>= 1); rows `i * n .. i * n + n - 1` belong to prompt `i`.
            params: Sampling parameters.

        Returns:
            A `Rollout` with `len(prompts) * n` rows.
        """
        ...


@runtime_checkable
class RemoteGenerator(Generator, Protocol):
    """A generator that holds its own copy of the policy's weights: an inference engine (vLLM), another process,
    another machine. It samples with the weights it last loaded; before it samples for a newer policy, the trainer
    gives it that policy's weights (`lmrl.collect.PushedWeights`). Multi-turn episodes, evaluation and every
    `Rollout` consumer cannot tell it from a generator that reads the live model.

    Attributes:
        version: the policy version of the weights it holds (optimizer steps done when they were taken); -1
            before the first `load_weights`, whatever it was started with.
    """

    version: int

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Take new weights and record their version; return when generation uses them.

        Args:
            weights: (name, tensor) pairs of the whole model under its Hugging Face checkpoint names, one tensor
                at a time (`lmrl.models.weights.export_weights`); read each before the next is asked for.
            version: the policy version they are.
        """
        ...
