"""Bring your own rollouts: an Experience from completions another system sampled and scored.

As TapeAgents trains on agent tapes, lmrl can train on traces from any generator. One JSON object per
line:

    {"prompt": "12+3=", "completion": "15", "reward": 1.0, "group_id": "q17",
     "old_logprobs": [-0.1, -0.3, -0.01], "finished": true}

- `prompt`: a string or a list of chat messages (rendered with the tokenizer's chat template).
- `completion`: the sampled text; it is tokenized without special tokens, and the EOS token is
  appended when `finished` (default true), so the model learns to stop.
- `reward`: the score; `group_id`: any value; completions sharing it are a group (of any size) for
  group-relative advantages.
- `old_logprobs` (optional): the sampler's log-prob of each completion token, EOS included when
  finished. When absent, the policy's own log-probs are computed (no grad) and serve as old log-probs.

Multi-turn traces (agent tapes, as TapeAgents trains on): `completion` is a list of segments in the order
the model saw them, each `{"text": ..., "trainable": true | false}` ("content" is read as "text"; a
segment without "trainable" is trainable when its "role" is "assistant" or absent):

    {"prompt": "12+3+4=", "group_id": "q17", "reward": 1.0, "completion": [
        {"text": "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 12, \"b\": 3}}</tool_call>", "trainable": true},
        {"text": "<tool_response>15</tool_response>", "trainable": false},
        {"text": "19", "trainable": true}]}

Each segment is tokenized on its own (no special tokens) and the pieces are joined; the model attends
to every token but only trainable ones are in the loss (`response_mask`). `old_logprobs`, when given,
has one value per trainable token (EOS included when finished).

Group estimators work by group id (`lmrl.algorithms.group_advantages`), so groups need not be equal
or contiguous in the file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lmrl import algorithms as A
from lmrl.config import AlgorithmConfig
from lmrl.experience import Experience, batched_forward
from lmrl.models.prompt_encoding import encode_prompts

REQUIRED = ("prompt", "completion", "reward", "group_id")

# advantage estimator name -> fn(scores [B], dense group ids [B]) -> [B], for groups of any size
BY_GROUP_ID: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "grpo": lambda r, g: A.group_advantages(r, g),
    "dr_grpo": lambda r, g: A.group_advantages(r, g, scale_by_std=False),
    "grpo_batch_std": lambda r, g: A.group_advantages(r, g, scale_by_std=False) / (_std(r) + 1e-8),
    "reinforce_baseline": lambda r, g: A.group_advantages(r, g, scale_by_std=False),
    "rloo": A.leave_one_out_advantages,
    "reinforce": lambda r, g: r,
}


def _std(r: torch.Tensor) -> torch.Tensor:
    """Unbiased std of a batch of rewards (0 for one reward)."""
    return r.double().std().nan_to_num(0.0).to(r.dtype) if len(r) > 1 else torch.zeros((), dtype=r.dtype)


def load_scored_rollouts(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file of scored completions, checked: one-line errors name the row and field."""
    from lmrl.data.prompts import load_prompts

    rows = list(load_prompts(str(path)))
    for i, row in enumerate(rows):
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise ValueError(f"{path}: row {i} lacks {', '.join(missing)} (need {', '.join(REQUIRED)})")
        try:
            _segments(row["completion"])
        except ValueError as e:
            raise ValueError(f"{path}: row {i}: {e}") from None
        if not isinstance(row["reward"], (int, float)) or isinstance(row["reward"], bool):
            raise ValueError(f"{path}: row {i}: reward must be a number, got {row['reward']!r}")
    return rows


def experience_from_records(
    records: Sequence[Mapping[str, Any]],
    tokenizer,
    cfg: AlgorithmConfig,
    *,
    max_prompt_length: int = 4096,
    policy_logprobs: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    micro_batch_size: int = 64,
    device: torch.device | str = "cpu",
) -> Experience:
    """Turn scored completions into an Experience (left-padded prompts, right-padded responses).

    Args:
        records: rows as described in the module docstring.
        tokenizer: the policy's tokenizer.
        cfg: the algorithm section; its `advantage` picks the estimator (by group id).
        policy_logprobs: `fn(sequences, attention_mask, T) -> (logprobs, entropy)`, needed when a
            record has no `old_logprobs`.
        device: where the Experience's tensors go (the policy's device).
    """
    if not records:
        raise ValueError("records: no scored completions")
    if cfg.advantage not in BY_GROUP_ID:
        raise ValueError(f"algorithm.advantage={cfg.advantage!r} is not supported for scored rollouts (gae needs a "
                         f"critic, remax greedy completions); they support {', '.join(BY_GROUP_ID)}")
    eos = tokenizer.eos_token_id
    prompts = encode_prompts(tokenizer, [r["prompt"] for r in records], max_prompt_length)
    responses, trainable = [], []
    for i, r in enumerate(records):
        try:
            segments = _segments(r["completion"])
        except ValueError as e:
            raise ValueError(f"records: row {i}: {e}") from None
        ids, train = [], []
        for text, is_trained in segments:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            ids += piece
            train += [is_trained] * len(piece)
        if r.get("finished", True):
            ids, train = ids + [eos], train + [True]
        if not any(train):
            raise ValueError(f"records: row {i} has no trainable completion token (an empty completion and "
                             "finished=false, or no trainable segment)")
        if r.get("old_logprobs") is not None and len(r["old_logprobs"]) != sum(train):
            raise ValueError(f"records: row {i} has {len(r['old_logprobs'])} old_logprobs for {sum(train)} "
                             "trainable completion tokens (EOS included when finished)")
        responses.append(ids)
        trainable.append(train)

    B, P, T = len(records), max(map(len, prompts)), max(map(len, responses))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    prompt_ids = torch.full((B, P), pad, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.bool)
    response_ids = torch.full((B, T), pad, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)  # trained on
    attention = torch.zeros(B, T, dtype=torch.bool)  # real tokens, observations included
    old = torch.zeros(B, T)
    for i, (p, c) in enumerate(zip(prompts, responses)):
        prompt_ids[i, P - len(p):], prompt_mask[i, P - len(p):] = torch.tensor(p), True
        response_ids[i, : len(c)], attention[i, : len(c)] = torch.tensor(c), True
        mask[i, : len(c)] = torch.tensor(trainable[i], dtype=torch.bool)
        if records[i].get("old_logprobs") is not None:
            old[i, mask[i]] = torch.tensor(records[i]["old_logprobs"], dtype=torch.float32)
    sequences = torch.cat([prompt_ids, response_ids], dim=1).to(device)
    attention_mask = torch.cat([prompt_mask, attention], dim=1).to(device)
    mask, old = mask.to(device), old.to(device)

    if any(r.get("old_logprobs") is None for r in records):
        if policy_logprobs is None:
            raise ValueError("records: some rows have no old_logprobs; pass policy_logprobs to compute them")
        computed = torch.cat([o[0] for o in batched_forward(policy_logprobs, sequences, attention_mask, T,
                                                            micro_batch_size)]).float()
        given = torch.tensor([r.get("old_logprobs") is not None for r in records], device=device)
        old = torch.where(given[:, None], old, computed)
    old = torch.where(mask, old, torch.zeros(()))

    # dense group ids in order of first appearance
    index: dict[Any, int] = {}
    groups = torch.tensor([index.setdefault(_hashable(r["group_id"]), len(index)) for r in records], device=device)
    scores = torch.tensor([float(r["reward"]) for r in records], device=device)
    seq_adv = BY_GROUP_ID[cfg.advantage](scores, groups) if cfg.use_advantages else scores  # TapeAgents' knob
    advantages = torch.where(mask, seq_adv[:, None].expand(B, T), torch.zeros(()))
    if cfg.whiten_advantages:
        advantages = A.masked_whiten(advantages, mask, unbiased=cfg.whiten_std == "unbiased")
    if cfg.relu_log_p_weights:  # TapeAgents: learn only from what beat its baseline
        advantages = advantages.clamp(min=0)
    return Experience(
        sequences=sequences, attention_mask=attention_mask, response_mask=mask, old_logprobs=old,
        advantages=advantages, scores=scores, group_index=groups,
        info={"length": mask.sum(1),
              "finished": torch.tensor([bool(r.get("finished", True)) for r in records], device=device)},
    )


def _segments(completion: Any) -> list[tuple[str, bool]]:
    """A completion as (text, trainable) segments: a string is one trainable segment."""
    if isinstance(completion, str):
        return [(completion, True)]
    if not isinstance(completion, list) or not completion:
        raise ValueError(f"completion must be a string or a non-empty list of segments, got {type(completion).__name__}")
    out = []
    for j, seg in enumerate(completion):
        if not isinstance(seg, Mapping):
            raise ValueError(f"completion[{j}] must be a {{'text', 'trainable'}} object, got {type(seg).__name__}")
        text = seg.get("text", seg.get("content"))
        if not isinstance(text, str):
            raise ValueError(f"completion[{j}] needs a string 'text' (or 'content')")
        trainable = seg.get("trainable", seg.get("role", "assistant") == "assistant")
        if not isinstance(trainable, bool):
            raise ValueError(f"completion[{j}].trainable must be true or false, got {trainable!r}")
        out.append((text, trainable))
    return out


def _hashable(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
