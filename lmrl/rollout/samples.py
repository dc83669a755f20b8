"""Episodes of several training samples: each model call's tokens trained in exactly the context they were sampled in.

An agent's episode is one row of a `Rollout` for everything that sees episodes (rewards, groups, dynamic sampling,
the asynchronous transport, `samples.jsonl`). Where a later request of the agent did not extend the tokens sampled
so far (a reasoning model's template cut the reasoning of earlier turns, a compacted context), the row's response
holds each sample's tokens one after another and `Rollout.contexts` the context each later sample was sampled
after (`lmrl.agents.gateway` records them). The trainer's forwards need each sample as a sequence of its own:

    rollout, episode = split_samples(rollout, pad_id)   # a row per sample; episode [R]: the row of each

A sample's row is its context (as the prompt), then its own response tokens: the trained ones and the observations
after them. Everything per row (the group, finished, a loss mask, the reward) is its episode's; the per-token
record (sampled log-probs, masks, versions) is cut out of the episode's row, so no token is trained twice.
"""

from __future__ import annotations

import torch

from lmrl.rollout.base import Rollout


def split_samples(rollout: Rollout, pad_id: int) -> tuple[Rollout, torch.Tensor | None]:
    """A row for each sample of each episode, and `[R]` the episode (input row) of each; (rollout, None) where every
    row is one sample."""
    if rollout.contexts is None or not any(rollout.contexts):
        return rollout, None
    if rollout.media is not None:
        raise ValueError("contexts: episodes of several samples are text-only; this rollout has images")
    attention = rollout.response_mask if rollout.response_attention is None else rollout.response_attention
    spans, episode = [], []  # spans: (row, context ids or None for the row's own prompt, first column, end)
    for i, later in enumerate(rollout.contexts):
        end = int(attention[i].sum())
        starts = [0, *(at for at, _ in later), end]
        contexts = [None, *(ids for _, ids in later)]
        for j, context in enumerate(contexts):
            spans.append((i, context, starts[j], starts[j + 1]))
            episode.append(i)
    device = rollout.response_ids.device
    R = len(spans)
    prompts = [rollout.prompt_ids[i][rollout.prompt_mask[i]].tolist() if c is None else c for i, c, _, _ in spans]
    P, T = max(len(p) for p in prompts), max(1, max(e - s for _, _, s, e in spans))
    prompt_ids = torch.full((R, P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros(R, P, dtype=torch.bool)
    for r, p in enumerate(prompts):
        prompt_ids[r, P - len(p):] = torch.tensor(p, dtype=torch.long)
        prompt_mask[r, P - len(p):] = True

    def cut(x: torch.Tensor | None, fill) -> torch.Tensor | None:
        """The [R, T] per-token record of each sample, cut out of its episode's row."""
        if x is None:
            return None
        out = torch.full((R, T), fill, dtype=x.dtype, device=device)
        for r, (i, _, s, e) in enumerate(spans):
            out[r, :e - s] = x[i, s:e]
        return out

    index = torch.tensor(episode, dtype=torch.long, device=device)
    split = Rollout(
        prompt_ids=prompt_ids.to(device),
        prompt_mask=prompt_mask.to(device),
        response_ids=cut(rollout.response_ids, pad_id),
        response_mask=cut(rollout.response_mask, False),
        logprobs=cut(rollout.logprobs, 0.0),
        texts=[rollout.texts[i] if s == 0 else "" for i, _, s, _ in spans],  # the episode's text on its first sample
        finished=rollout.finished[index],
        prompt_index=rollout.prompt_index[index],
        response_attention=cut(rollout.response_attention, False),
        versions=cut(rollout.versions, -1),
    )
    return split, index


def first_rows(episode_index: torch.Tensor | None) -> torch.Tensor | None:
    """The first row of each episode (rows of an episode are contiguous); None where each row is its own."""
    if episode_index is None:
        return None
    starts = torch.ones_like(episode_index, dtype=torch.bool)
    starts[1:] = episode_index[1:] != episode_index[:-1]
    return starts.nonzero().flatten()


def episode_sum(x: torch.Tensor, episode_index: torch.Tensor | None) -> torch.Tensor:
    """[B] each row's episode's total of `x` ([B]): `x` itself where each row is its own episode."""
    if episode_index is None:
        return x
    return torch.zeros(int(episode_index.max()) + 1, dtype=x.dtype, device=x.device).index_add(
        0, episode_index, x)[episode_index]


def sample_metrics(rollout: Rollout, prefix: str = "agent") -> dict[str, float]:
    """`PREFIX/samples_per_episode` and `PREFIX/closed_sample_tokens` (per episode, the tokens trained in its samples
    before its last): how often episodes did not extend what was sampled before."""
    rows = len(rollout.texts)
    later = rollout.contexts or [[] for _ in range(rows)]
    closed = sum(int(rollout.response_mask[i, :c[-1][0]].sum()) for i, c in enumerate(later) if c)
    return {f"{prefix}/samples_per_episode": sum(1 + len(c) for c in later) / max(rows, 1),
            f"{prefix}/closed_sample_tokens": closed / max(rows, 1)}
