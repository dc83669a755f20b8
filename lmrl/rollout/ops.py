"""Operations on rollouts: joining rollouts of different widths, keeping some of a rollout's rows, and building one
from the token lists a backend sampled.

With dynamic sampling (DAPO) the trainer collects a step's batch in rounds: it keeps each round's
informative groups (`select_rollout`) and joins the rounds into one batch (`concat_rollouts`). Prompts
stay left-padded and responses right-padded.
"""

from __future__ import annotations

from typing import Any

import torch

from lmrl.rollout.base import Rollout, SamplingParams


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
        **_joined_media(rollouts),
        versions=None if any(r.versions is None for r in rollouts) else torch.cat(
            [pad(r.versions, T, -1, False) for r in rollouts]),
        contexts=None if all(r.contexts is None for r in rollouts) else [
            c for r in rollouts for c in (r.contexts or [[] for _ in r.texts])],
    )


def _joined_media(rollouts: list[Rollout]) -> dict:
    """The `media` (and `media_index`) of joined rollouts: per prompt, following the prompt_index offsets of
    `concat_rollouts`; per row (`media_index`) where any rollout's rows have bundles of their own."""
    if all(r.media is None for r in rollouts):
        return {"media": None}
    if all(r.media_index is None for r in rollouts):
        return {"media": [m for r in rollouts for m in _media(r)]}
    media, index = [], []
    for r in rollouts:
        bundles = _media(r) if r.media_index is None else list(r.media)
        index.append(r.media_rows + len(media))
        media += bundles
    return {"media": media, "media_index": torch.cat(index)}


def _media(r: Rollout) -> list:
    """A rollout's bundles, one per prompt index up to its largest (None for a text rollout's prompts)."""
    count = int(r.prompt_index.max()) + 1 if len(r.prompt_index) else 0
    return list(r.media[:count]) if r.media is not None else [None] * count


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
        media=r.media,  # indexed by prompt_index (or media_index), which keeps its values
        media_index=None if r.media_index is None else r.media_index[index],
        versions=None if r.versions is None else r.versions[index, :T],
        contexts=None if r.contexts is None else [r.contexts[i] for i in index.tolist()],
    )


def call_seed(params: SamplingParams, rng: torch.Generator, prompts: int) -> int:
    """The seed of a generate call whose prompt i samples with seed + i: `params.seed`, else one drawn from the
    backend's own generator (saved in checkpoints), so unseeded calls repeat across a resumed run too."""
    if params.seed is not None:
        return params.seed
    return int(torch.randint(0, 2**31 - prompts, (), generator=rng))


def cut_at_stop(text: str, stop: list[str]) -> str:
    """Cut `text` right after the earliest-ending stop string (kept); unchanged if none occurs."""
    ends = [text.find(s) + len(s) for s in stop if s in text]
    return text[: min(ends)] if ends else text


def stop_found(text: str, stop: list[str]) -> str | None:
    """The stop string that ends `text` (cut by `cut_at_stop`; the longest where several end it), else None."""
    ends = [s for s in stop if s and text.endswith(s)]
    return max(ends, key=len) if ends else None


def decode_batch(tokenizer: Any, sequences: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
    """`tokenizer.batch_decode(sequences)`, through its Rust tokenizer where that gives the same text (a fast
    tokenizer that cleans up no spaces): transformers' wrapper costs several microseconds per sequence, which a decode
    step that checks every row for stop strings pays on each row at each step."""
    backend = getattr(tokenizer, "_tokenizer", None)  # a `tokenizers.Tokenizer` behind a fast tokenizer
    if hasattr(backend, "decode_batch") and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend.decode_batch(sequences, skip_special_tokens=skip_special_tokens)
    return tokenizer.batch_decode(sequences, skip_special_tokens=skip_special_tokens)


def rollout_from_tokens(prompts: list[list[int]], n: int, tokens: list[list[int]], logprobs: list[list[float]],
                        finished: list[bool], tokenizer, stop: list[str], pad_id: int,
                        device: torch.device | str = "cpu") -> Rollout:
    """A `Rollout` from per-row completions (row `i` is completion `i % n` of prompt `i // n`): each row's sampled
    tokens (up to and including its EOS or the token that completed a stop string), their log-probs and whether
    it ended that way (False: cut at max_new_tokens). Texts are decoded here (special tokens skipped) and cut
    after the first stop string, as every backend's are."""
    rows = len(prompts) * n
    if not len(tokens) == len(logprobs) == len(finished) == rows:
        raise ValueError(f"rollout_from_tokens: expected {rows} rows of tokens, log-probs and finished flags, got "
                         f"{len(tokens)}, {len(logprobs)}, {len(finished)}")
    width, P = max(1, max(len(t) for t in tokens)), max(len(p) for p in prompts)
    response_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    response_lp = torch.zeros(rows, width, dtype=torch.float32)
    prompt_ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros(len(prompts), P, dtype=torch.bool)
    for i, p in enumerate(prompts):
        prompt_ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        prompt_mask[i, P - len(p):] = True
    for i, (t, lp) in enumerate(zip(tokens, logprobs)):
        response_ids[i, :len(t)] = torch.tensor(t, dtype=torch.long)
        response_lp[i, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
    lengths = torch.tensor([len(t) for t in tokens])
    index = torch.arange(len(prompts)).repeat_interleave(n)
    texts = [cut_at_stop(text, stop) for text in decode_batch(tokenizer, tokens, skip_special_tokens=True)]
    return Rollout(
        prompt_ids=prompt_ids[index].to(device),
        prompt_mask=prompt_mask[index].to(device),
        response_ids=response_ids.to(device),
        response_mask=(torch.arange(width) < lengths[:, None]).to(device),
        logprobs=response_lp.to(device),
        texts=texts,
        finished=torch.tensor(finished, dtype=torch.bool, device=device),
        prompt_index=index.to(device),
    )
