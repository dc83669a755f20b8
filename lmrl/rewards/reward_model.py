"""A reward function backed by a sequence-classification reward model (one scalar per text).

The model is an `AutoModelForSequenceClassification` with `num_labels=1`, e.g. a Llama or Qwen2
reward model. Each (prompt, completion) is rendered to text, tokenized, right-padded and scored
in batches without gradients; the model's config must set `pad_token_id` so that it can find the
last real token of each padded row.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lmrl.rewards.core import completion_text


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and all(isinstance(m, Mapping) for m in prompt)


def render_scored(tokenizer: Any, prompt: Any, completion: str) -> tuple[str, bool]:
    """The text a reward model scores for (prompt, completion), and whether the tokenizer adds its special tokens.

    A chat-message prompt becomes `tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content":
    completion}])` (the template's own special tokens, none added); a string prompt is `prompt + completion`,
    tokenized with the tokenizer's special tokens (e.g. BOS). The scorer and the reward trainer both render
    through here, so that a model is trained on exactly the texts it is later asked to score.
    """
    if _is_chat(prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("prompts: chat-message prompts need a tokenizer with a chat_template")
        messages = [*prompt, {"role": "assistant", "content": completion}]
        return tokenizer.apply_chat_template(messages, tokenize=False), False
    if not isinstance(prompt, str):
        raise TypeError(f"prompts: expected a string or a list of chat messages, got {type(prompt).__name__}")
    return prompt + completion, True


def encode_scored(tokenizer: Any, prompt: Any, completion: str, max_length: int | None = None) -> list[int]:
    """The token ids a reward model scores for (prompt, completion): `render_scored`, tokenized, and with
    `max_length` only the last `max_length` ids, so that the completion (which the score is about) survives."""
    text, special = render_scored(tokenizer, prompt, completion)
    ids = list(tokenizer(text, add_special_tokens=special)["input_ids"])
    return ids[-max_length:] if max_length is not None else ids


def pad_right(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[n, width]` input ids and attention mask of `seqs`, right-padded with `pad_id`.

    Right padding keeps position ids 0..len-1 for every row, so a text scores the same alone or in a batch,
    and a sequence-classification model pools the last non-pad token.
    """
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, seq in enumerate(seqs):
        input_ids[i, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        attention_mask[i, : len(seq)] = 1
    return input_ids, attention_mask


def _recorded_stats(path: str) -> tuple[float, float]:
    """The reward mean and std `lmrl train-rm` wrote beside the model (reward_stats.json)."""
    stats_file = Path(path) / "reward_stats.json"
    if not stats_file.is_file():
        raise ValueError(f"normalize: {stats_file} not found; it is written by lmrl train-rm (or set normalize: false)")
    stats = json.loads(stats_file.read_text())
    mean, std = stats.get("mean"), stats.get("std")
    if not (isinstance(mean, (int, float)) and isinstance(std, (int, float)) and math.isfinite(mean) and std > 0):
        raise ValueError(f"normalize: {stats_file}: expected a finite mean and a std > 0, got mean={mean!r} std={std!r}")
    return float(mean), float(std)


class RewardModelScorer:
    """Sync reward function: scores prompt + completion with a reward model.

    Text rendering: a chat-message prompt (a list of {"role", "content"} dicts) becomes
    `tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": completion}])`; a
    string prompt is concatenated with the completion as is (`prompt + completion`) and tokenized
    with the tokenizer's special tokens (e.g. BOS).

    Args:
        model: a sequence-classification model with one output (num_labels=1).
        tokenizer: its tokenizer.
        batch_size: texts per forward pass.
        max_length: keep at most this many tokens per text, dropping from the left so that the
            completion (which the score is about) survives; None keeps everything.
        name: metric name.
        shift, scale: a score is `(r - shift) / scale` (`from_pretrained(normalize=True)` sets the recorded
            mean and std).
    """

    learned = True  # `lmrl.rewards.core.is_learned`: evaluation verifies beside it

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        batch_size: int = 8,
        max_length: int | None = None,
        name: str = "reward_model",
        shift: float = 0.0,
        scale: float = 1.0,
    ) -> None:
        num_labels = getattr(model.config, "num_labels", 1)
        if num_labels != 1:
            raise ValueError(f"model: a reward model needs num_labels=1, got {num_labels}")
        pad_id = model.config.pad_token_id
        if pad_id is None:
            raise ValueError("model: config.pad_token_id is None; set it (e.g. to tokenizer.pad_token_id) to score batches")
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length: must be >= 1 or None, got {max_length}")
        if not (scale > 0 and math.isfinite(scale) and math.isfinite(shift)):
            raise ValueError(f"scale, shift: expected a finite shift and a scale > 0, got {shift!r} and {scale!r}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.pad_id = int(pad_id)
        self.batch_size = batch_size
        self.max_length = max_length
        self.name = name
        self.shift, self.scale = float(shift), float(scale)  # a score is (r - shift) / scale

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: str | None = None, device: str = "cpu", normalize: bool = False,
                        **kwargs: Any) -> RewardModelScorer:
        """Load a reward model and tokenizer saved in a local directory (or a hub id, where reachable).
        `normalize=True` scores `(r - mean) / std` with the mean and std `lmrl train-rm` recorded in the
        directory's reward_stats.json (its training pairs' rewards)."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if normalize:
            kwargs["shift"], kwargs["scale"] = _recorded_stats(path)

        tokenizer = AutoTokenizer.from_pretrained(path)
        extra = {"dtype": getattr(torch, dtype)} if dtype else {}
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **extra).to(device)
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return cls(model, tokenizer, **kwargs)

    def render(self, prompt: Any, completion: str) -> tuple[str, bool]:
        """The text to score and whether the tokenizer should add its special tokens (`render_scored`)."""
        return render_scored(self.tokenizer, prompt, completion)

    @torch.no_grad()
    def __call__(self, prompts: list[Any], completions: list[str], **kwargs: Any) -> list[float]:
        device = next(self.model.parameters()).device
        ids = [encode_scored(self.tokenizer, p, completion_text(c), self.max_length)
               for p, c in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        for start in range(0, len(ids), self.batch_size):
            chunk = ids[start : start + self.batch_size]
            for i, seq in enumerate(chunk):
                if len(seq) == 0:
                    raise ValueError(f"completions: sample {start + i} renders to no tokens")
            input_ids, attention_mask = pad_right(chunk, self.pad_id)
            logits = self.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
            scores.extend(logits.view(-1).float().cpu().tolist())  # [b, 1] -> b floats
        if self.shift or self.scale != 1.0:
            scores = [(s - self.shift) / self.scale for s in scores]
        return scores
