"""Tests for lmrl.models.loading: loading round trips, options and errors, the reference model, dropout."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from lmrl.errors import ModelError
from lmrl.models.loading import (
    check_causal,
    disable_dropout,
    dropout_as_loaded,
    load_causal_lm,
    load_tokenizer,
    reference_model,
)
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


def test_a_model_that_attends_both_ways_is_refused_and_a_causal_one_passes(saved):
    """BERT loads through AutoModelForCausalLM as BertLMHeadModel and, unless its config says is_decoder, attends
    both ways: every log-prob would be conditioned on the tokens after it. The same weights as a decoder pass, as
    does every causal LM (the architecture matrix runs the check on 18)."""
    from transformers import BertConfig, BertLMHeadModel

    _, _, model, _ = saved
    check_causal(model)
    for is_decoder in (False, True):
        torch.manual_seed(0)
        bert = BertLMHeadModel(BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=64, is_decoder=is_decoder)).train()
        if is_decoder:
            check_causal(bert)
        else:
            with pytest.raises(ModelError, match=r"^model.name_or_path: the bert model \(BertLMHeadModel\) is not a "
                                                 r"causal LM: its logits at a position change with the tokens after it"):
                check_causal(bert)
        assert bert.training  # the check leaves the mode as it found it


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


# --- dropout --------------------------------------------------------------------------------------

# tiny configs with every dropout rate their model reads at 0.1: GPT-2 and OPT ship such rates (modules and rates
# copied from the config), Llama's attention_dropout is a float on each attention module, Falcon reads its config's
# rates at forward time
DROPOUT_CONFIGS = {
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1),
    "opt": dict(hidden_size=32, ffn_dim=64, word_embed_proj_dim=32, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, dropout=0.1, attention_dropout=0.1),
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64, attention_dropout=0.1),
    "falcon": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, hidden_dropout=0.1, attention_dropout=0.1),
}


def tiny_dropout_lm(tok, arch: str, seed: int = 0):
    """A random tiny causal LM of `arch` (a DROPOUT_CONFIGS key) whose config's dropout rates are 0.1, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(arch, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **DROPOUT_CONFIGS[arch])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model.eval()


def _logits(model, ids, train: bool) -> torch.Tensor:
    model.train(train)
    torch.manual_seed(1)
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("arch", list(DROPOUT_CONFIGS))
def test_disable_dropout_makes_the_train_forward_the_eval_forward(arch):
    tok = char_tokenizer()
    model = tiny_dropout_lm(tok, arch)
    ids = torch.tensor([tok("12+34=46 and 7+8=15")["input_ids"]])
    assert not torch.equal(_logits(model, ids, True), _logits(model, ids, False))  # the model's dropout is on
    disable_dropout(model)
    assert torch.equal(_logits(model, ids, True), _logits(model, ids, False))


def test_a_saved_model_keeps_the_dropout_of_its_config(tmp_path):
    tok = char_tokenizer()
    model = tiny_dropout_lm(tok, "opt")
    disable_dropout(model)
    backbone = copy.deepcopy(model.model)  # as a critic copies the policy's
    assert model.config.dropout == model.config.attention_dropout == 0
    with dropout_as_loaded(model, backbone):
        model.save_pretrained(tmp_path / "policy")
        backbone.save_pretrained(tmp_path / "critic")
    for saved in ("policy", "critic"):
        config = json.loads((tmp_path / saved / "config.json").read_text())
        assert config["dropout"] == config["attention_dropout"] == 0.1, saved
    assert model.config.dropout == backbone.config.attention_dropout == 0  # off again for training


def test_disable_dropout_leaves_loras_dropout():
    pytest.importorskip("peft")
    from lmrl.config.sections import LoraConfig
    from lmrl.models.lora import apply_lora

    model = apply_lora(tiny_dropout_lm(char_tokenizer(), "llama"), LoraConfig(dropout=0.2))
    disable_dropout(model)
    lora = [m for name, m in model.named_modules() if name.split(".")[-2:-1] == ["lora_dropout"]]
    assert lora and all(m.p == 0.2 for m in lora)
    assert model.base_model.model.config.attention_dropout == 0
