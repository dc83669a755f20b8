"""Tests for lmrl.models.loading: loading round trips, options and errors, the reference model."""

from __future__ import annotations

import pytest
import torch

from lmrl.models.loading import load_causal_lm, load_tokenizer, reference_model
from lmrl.models.tiny import char_tokenizer

# --- loading ------------------------------------------------------------------------------------


def test_round_trip_same_logits_and_tokens(saved):
    arch, path, model, tok = saved
    loaded = load_causal_lm(path, dtype="float32")
    loaded_tok = load_tokenizer(path)
    assert type(loaded).__name__ == type(model).__name__
    assert loaded_tok.padding_side == "left"
    assert loaded_tok.pad_token_id == tok.pad_token_id
    text = "12+34=46"
    assert loaded_tok(text)["input_ids"] == tok(text)["input_ids"]
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-6, rtol=0)
    assert not loaded.training


@pytest.mark.parametrize(("dtype", "expected"), [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_dtype_option(saved, dtype, expected):
    _, path, _, _ = saved
    model = load_causal_lm(path, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {expected}


def test_auto_dtype_keeps_checkpoint_dtype(saved):
    _, path, _, _ = saved
    model = load_causal_lm(path)  # saved in float32
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_bad_dtype_and_device():
    with pytest.raises(ValueError, match=r"model.dtype: must be one of \['auto', 'float32'"):
        load_causal_lm("unused", dtype="fp8")
    with pytest.raises(ValueError, match="device: must be one of"):
        load_causal_lm("unused", device="tpu")


def test_missing_path_is_one_clear_line(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(ValueError) as info:
        load_causal_lm(missing)
    msg = str(info.value)
    assert msg == f"model.name_or_path: cannot load {str(missing)!r}: no such file or directory"
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        load_tokenizer(missing)


def test_unloadable_directory_is_one_line(tmp_path):
    with pytest.raises(ValueError) as info:
        load_causal_lm(tmp_path)  # exists, but holds no model
    msg = str(info.value)
    assert msg.startswith(f"model.name_or_path: cannot load {str(tmp_path)!r}: ")
    assert "\n" not in msg


def test_gradient_checkpointing_option(saved):
    _, path, _, _ = saved
    model = load_causal_lm(path, gradient_checkpointing=True)
    layers = model.get_decoder().layers
    assert all(getattr(layer, "gradient_checkpointing", False) for layer in layers)
    assert model.config.use_cache is False


def test_tokenizer_without_pad_uses_eos(tmp_path):
    tok = char_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path, padding_side="right")
    assert loaded.pad_token == loaded.eos_token == "</s>"
    assert loaded.padding_side == "right"


# --- reference model ------------------------------------------------------------------------------


def test_reference_model_is_frozen_equal_copy(saved):
    _, path, _, tok = saved
    policy = load_causal_lm(path, dtype="float32")
    policy.train()
    ref = reference_model(policy)
    assert not ref.training
    assert all(not p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in policy.parameters())
    ids = torch.tensor([tok("7+8=15")["input_ids"]])
    policy.eval()
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, policy(ids).logits, atol=0, rtol=0)
        # separate weights: changing the policy leaves the reference alone
        next(policy.parameters()).add_(1.0)
        assert not torch.equal(next(ref.parameters()), next(policy.parameters()))
