"""The teacher of on-policy distillation (`algorithm.teacher`): a frozen causal LM placed like the reference model.

The teacher scores the tokens the student sampled, so both must read token ids alike: the same vocabulary size
and the same token for every id. That is checked before the teacher's weights load, one line naming both
models; a teacher with another tokenizer would score other text than the student wrote and nothing would fail.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lmrl.errors import ModelError
from lmrl.models.loading import (
    DTYPES,
    _check_exists,
    _first_line,
    check_causal,
    disable_dropout,
    load_causal_lm,
    load_tokenizer,
)

KEY = "algorithm.teacher"


def load_teacher(path: str, policy: nn.Module, tokenizer: Any, policy_name: str, *, device: Any,
                 trust_remote_code: bool = False, attn_implementation: str | None = None) -> nn.Module:
    """The teacher at `path` (a directory or hub id, shipped names already resolved), checked against the policy
    and its tokenizer, on `device` in the policy's dtype (as the reference, a copy of the policy, is), in eval mode
    with dropout off and every parameter frozen.

    Args:
        path: where the teacher loads from.
        policy: the student, for its vocabulary size.
        tokenizer: the student's tokenizer.
        policy_name: what names the student in errors (`model.name_or_path`).
        device, trust_remote_code, attn_implementation: the policy's (`model.*`), as the reference has them.

    Raises:
        ModelError: the path is missing or holds no model, or the teacher's vocabulary size or tokenizer differs
            from the student's.
    """
    check_vocab_size(path, policy, policy_name, trust_remote_code)
    check_same_tokenizer(load_tokenizer(path, trust_remote_code=trust_remote_code, config_key=KEY), tokenizer,
                         path, policy_name)
    policy_dtype = next(policy.parameters()).dtype
    dtype = next((name for name, d in DTYPES.items() if d == policy_dtype), "auto")
    teacher = load_causal_lm(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                             attn_implementation=attn_implementation, config_key=KEY)
    check_causal(teacher, config_key=KEY)
    disable_dropout(teacher)  # its eval-mode distribution, whatever mode a wrapper leaves it in
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher


def check_vocab_size(path: str, policy: nn.Module, policy_name: str, trust_remote_code: bool = False) -> None:
    """ModelError when the teacher's config has another vocabulary size than the policy's."""
    from transformers import AutoConfig

    where = _check_exists(path, KEY, "the teacher ")  # a missing directory, or one with no model, in one line
    try:
        config = AutoConfig.from_pretrained(where, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:  # transformers raises both, often over several lines
        raise ModelError(f"{KEY}: cannot load the teacher {path!r}: {_first_line(err)}") from err
    theirs = _vocab_size(config)
    ours = _vocab_size(policy.config)
    if theirs != ours:
        raise ModelError(f"{KEY}: the teacher {path!r} has a vocabulary of {theirs} tokens, the policy {policy_name!r} "
                         f"{ours}: distillation compares their log-probs of the same token ids; use a teacher with the "
                         "policy's tokenizer")


def check_same_tokenizer(teacher_tokenizer: Any, tokenizer: Any, path: str, policy_name: str) -> None:
    """ModelError when the two tokenizers map any token to another id (or one has tokens the other lacks)."""
    theirs, ours = teacher_tokenizer.get_vocab(), tokenizer.get_vocab()
    if theirs == ours:
        return
    differ = {t for t in theirs.keys() | ours.keys() if theirs.get(t) != ours.get(t)}
    none = float("inf")  # the first by the policy's id, a token only the teacher has after every other
    token = min(differ, key=lambda t: (ours.get(t, none), theirs.get(t, none), t))
    ids = len(differ)
    raise ModelError(f"{KEY}: the teacher's tokenizer ({path}) differs from the policy's ({policy_name}): {ids} of "
                     f"{max(len(theirs), len(ours))} tokens have other ids (first: {token!r} is {theirs.get(token)} for "
                     f"the teacher, {ours.get(token)} for the policy); distillation needs the student's tokenizer")


def _vocab_size(config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "vocab_size", None)
