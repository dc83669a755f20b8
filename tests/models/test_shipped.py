"""Tests for the shipped tiny model and the script that builds it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from lmrl.data.tasks import AdditionTask, evaluate, generate_completions
from lmrl.models.shipped import SHIPPED_MODEL, load_shipped
from lmrl.models.tiny import char_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shipped():
    return load_shipped()


def test_asset_files_exist_and_are_small():
    names = {p.name for p in SHIPPED_MODEL.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert sum(p.stat().st_size for p in SHIPPED_MODEL.iterdir()) < 8e6


def test_loads_with_the_char_tokenizer(shipped):
    model, tokenizer = shipped
    assert tokenizer.get_vocab() == char_tokenizer().get_vocab()
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.padding_side == "left"
    assert tokenizer("12+34=", add_special_tokens=False)["input_ids"] == [4, 5, 75, 6, 7, 83]
    assert model.generation_config.eos_token_id == 2 and model.generation_config.pad_token_id == 0
    assert model.config.vocab_size == len(tokenizer)
    assert not model.training
    assert sum(p.numel() for p in model.parameters()) < 2_000_000


def test_answers_some_held_out_sums_greedily(shipped):
    model, tokenizer = shipped
    items = AdditionTask().eval_prompts()[:50]
    texts = generate_completions(model, tokenizer, [it["prompt"] for it in items], max_new_tokens=4)
    right = [t for t, it in zip(texts, items) if t == it["answer"]]
    assert len(right) >= 5
    # every completion is a number (the model learned the format, and stops with EOS)
    assert all(t.isdigit() for t in texts)


def test_held_out_accuracy_is_in_the_shipped_band(shipped):
    # The shipped model is stopped early on purpose: modest greedy accuracy, leaving room for RL.
    # A broken or retrained-to-convergence asset lands outside this band.
    model, tokenizer = shipped
    torch.manual_seed(0)
    result = evaluate(model, tokenizer, AdditionTask(), n_prompts=100, k=8)
    assert 0.2 <= result["accuracy"] <= 0.4  # 0.30 when built by scripts/make_tiny_model.py
    # sampling finds many answers greedy decoding misses: that gap is what GRPO turns into accuracy
    assert result["pass_at_k"] >= result["accuracy"] + 0.15


def _script():
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_tiny_model"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_sft_is_deterministic_and_seeded():
    script = _script()
    task = AdditionTask(num_train=200, num_eval=10)
    config = script.SFTConfig(hidden_size=32, num_layers=1, steps=20, batch_size=16, lr=3e-3, warmup=2)
    first, _ = script.sft(task, config)
    second, _ = script.sft(task, config)
    other, _ = script.sft(task, script.SFTConfig(**{**vars(config), "seed": 1}))
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)
    assert first.generation_config.eos_token_id == 2


def test_collate_puts_loss_on_answer_and_eos_only():
    script = _script()
    tok = char_tokenizer()
    encoded = script.encode_items(tok, [{"prompt": "1+2=", "answer": "3"}, {"prompt": "10+5=", "answer": "15"}])
    ids, attention, labels = script.collate(encoded, tok.pad_token_id)
    three, eos = tok.convert_tokens_to_ids("3"), tok.eos_token_id
    assert ids.shape == (2, 8)
    assert labels[0].tolist() == [-100] * 4 + [three, eos] + [-100] * 2
    assert attention[0].tolist() == [1] * 6 + [0] * 2
    assert labels[1].tolist()[5:] == [tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("5"), eos]
