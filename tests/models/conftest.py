"""Fixtures shared by the tests of lmrl.models."""

from __future__ import annotations

import pytest

from lmrl.models.tiny import char_tokenizer, tiny_causal_lm

ARCHS = ["llama", "qwen2"]


@pytest.fixture(scope="module", params=ARCHS)
def saved(request, tmp_path_factory):
    """(arch, directory, in-memory model, tokenizer) for a tiny model written with save_pretrained."""
    tok = char_tokenizer()
    model = tiny_causal_lm(tok, arch=request.param, hidden_size=32, num_layers=2)
    path = tmp_path_factory.mktemp(f"tiny_{request.param}")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return request.param, path, model, tok
