"""Operations on rollouts: joining rollouts of different widths, and keeping some of a rollout's rows.

With dynamic sampling (DAPO) the trainer collects a step's batch in rounds: it keeps each round's
informative groups (`select_rollout`) and joins the rounds into one batch (`concat_rollouts`). Prompts
stay left-padded and responses right-padded.
"""

from __future__ import annotations

import torch

from lmrl.rollout.base import Rollout


def concat_rollouts(rollouts: list[Rollout], pad_id: int) -> Rollout:
    """Join rollouts of different prompt / response widths: prompts left-padded, responses right-padded."""
    if len(rollouts) == 1:
        return rollouts[0]
    P = max(r.prompt_ids.shape[1] for r in rollouts)
    T = max(r.response_ids.shape[1] for r in rollouts)

    def pad(x: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
        extra = width - x.shape[1]
        if extra == 0:
            return x
        filler = torch.full((x.shape[0], extra), value, dtype=x.dtype, device=x.device)
        return torch.cat([filler, x] if left else [x, filler], dim=1)

    offset, index = 0, []
    for r in rollouts:
        index.append(r.prompt_index + offset)
        offset += int(r.prompt_index.max()) + 1 if len(r.prompt_index) else 0
    return Rollout(
        prompt_ids=torch.cat([pad(r.prompt_ids, P, pad_id, True) for r in rollouts]),
        prompt_mask=torch.cat([pad(r.prompt_mask, P, False, True) for r in rollouts]),
        response_ids=torch.cat([pad(r.response_ids, T, pad_id, False) for r in rollouts]),
        response_mask=torch.cat([pad(r.response_mask, T, False, False) for r in rollouts]),
        logprobs=torch.cat([pad(r.logprobs, T, 0.0, False) for r in rollouts]),
        texts=[t for r in rollouts for t in r.texts],
        finished=torch.cat([r.finished for r in rollouts]),
        prompt_index=torch.cat(index),
        response_attention=None if all(r.response_attention is None for r in rollouts) else torch.cat(
            [pad(r.response_mask if r.response_attention is None else r.response_attention, T, False, False)
             for r in rollouts]),
    )


def select_rollout(r: Rollout, index: torch.Tensor) -> Rollout:
    """Rows `index` of a rollout, its response width trimmed to the longest kept response."""
    mask = r.response_mask[index]
    attention = None if r.response_attention is None else r.response_attention[index]
    real = mask if attention is None else attention
    T = int(real.sum(1).max()) if len(index) else 0
    T = max(T, 1)
    return Rollout(
        prompt_ids=r.prompt_ids[index],
        prompt_mask=r.prompt_mask[index],
        response_ids=r.response_ids[index, :T],
        response_mask=mask[:, :T],
        logprobs=r.logprobs[index, :T],
        texts=[r.texts[i] for i in index.tolist()],
        finished=r.finished[index],
        prompt_index=r.prompt_index[index],
        response_attention=None if attention is None else attention[:, :T],
    )
