"""The fixed-shape decode step (CUDA graphs on a GPU): the path chosen and why, the same samples as the other
paths, and the fallback when capturing fails. No GPU here: the graph itself is replayed only on CUDA."""

from __future__ import annotations

import warnings

import pytest
import torch

import lmrl.rollout.hf as hf
from lmrl.models.tiny import char_tokenizer
from lmrl.rollout import HFGenerator, SamplingParams
from lmrl.rollout.static_decode import decode_path
from tests.rollout.test_hf_generator import encode, reference_logprobs, scrambled_model

CUDA = torch.device("cuda")  # a device object only: nothing runs on it here


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def test_the_path_and_why(tok):
    model = scrambled_model(tok)
    assert decode_path(model, CUDA, cuda_graph=True) == (
        "cuda_graph", "a fixed-shape decode step captured in a CUDA graph")
    assert decode_path(model, torch.device("cpu"), cuda_graph=True) == ("engine", "no CUDA graphs on cpu")
    assert decode_path(model, CUDA, cuda_graph=False) == ("engine", "rollout.cuda_graph=false")
    model.config._attn_implementation = "flash_attention_2"
    assert decode_path(model, CUDA, True) == (
        "engine", "no CUDA graph: attn_implementation='flash_attention_2' takes no 4D mask (sdpa or eager do)")
    model.config._attn_implementation = "sdpa"
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}
    assert decode_path(model, CUDA, True) == ("engine", "no CUDA graph: the model is spread over devices")
    sliding = scrambled_model(tok, "qwen2")
    sliding.config.layer_types = ["sliding_attention", "full_attention"]
    assert decode_path(sliding, CUDA, True) == ("engine", "no CUDA graph: the model has sliding-window layers")
    # the generator's line names the engine's step too
    assert HFGenerator(scrambled_model(tok), tok).decode_path() == (
        "engine", "module by module, each prompt's keys shared by its rows; no CUDA graphs on cpu")
    assert HFGenerator(sliding, tok).decode_path() == (
        "engine", "its own forward: the model has sliding-window layers; no CUDA graphs on cpu")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_fixed_shapes_sample_what_the_other_paths_sample(tok, arch, kernel, device):
    """On a CPU the fixed-shape step runs eagerly; on CUDA it is the captured graph, replayed."""
    model = scrambled_model(tok, arch, seed=2).to(device)
    model.config._attn_implementation = kernel
    # EOS and a stop string end rows early: they stay in the fixed-shape batch, their tokens ignored
    params = SamplingParams(max_new_tokens=16, temperature=1.0, stop=["e"], seed=5)
    usual = HFGenerator(model, tok, batch_size=6, cuda_graph=False).generate(encode(tok), 4, params)
    fixed = HFGenerator(model, tok, batch_size=6, fixed_shapes=True)
    assert fixed.decode_path()[0] == ("cuda_graph" if device.type == "cuda" else "fixed_shapes")
    out = fixed.generate(encode(tok), 4, params)
    assert torch.equal(out.response_ids, usual.response_ids) and torch.equal(out.response_mask, usual.response_mask)
    assert not out.response_mask.all() and out.response_mask.any(1).all()  # some rows did end early
    torch.testing.assert_close(out.logprobs, usual.logprobs, atol=2e-5, rtol=0)
    torch.testing.assert_close(out.logprobs, reference_logprobs(model, out, 1.0), atol=2e-5, rtol=0)


def test_a_failed_capture_says_why_once_and_decodes_the_same_eagerly(tok, monkeypatch):
    model = scrambled_model(tok, seed=3)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=1)
    usual = HFGenerator(model, tok).generate(encode(tok), 3, params)
    # as on a GPU whose capture fails (on any machine: the graph cannot even be made)
    monkeypatch.setattr(hf, "decode_path", lambda *a: ("cuda_graph", "test"))

    def no_graph():
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", no_graph)
    generator = HFGenerator(model, tok)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generator.generate(encode(tok), 3, params)
    notes = [str(w.message) for w in caught if "CUDA graph" in str(w.message)]
    assert len(notes) == 1 and notes[0].startswith("CUDA graph capture failed, decoding eagerly: ")
    assert torch.equal(out.response_ids, usual.response_ids)
    torch.testing.assert_close(out.logprobs, usual.logprobs, atol=2e-5, rtol=0)


def test_fixed_shapes_need_a_kernel_that_takes_a_mask(tok):
    model = scrambled_model(tok)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="fixed_shapes: needs a full-attention model with the sdpa or eager kernel"):
        HFGenerator(model, tok, fixed_shapes=True)


def test_layer_types_the_engine_does_not_decode_are_refused_in_one_line(tok):
    from lmrl.engine.model_step import ModelStep

    model = scrambled_model(tok, "qwen2")
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"^model: layer types \['linear_attention'\] are not decoded by lmrl's engine"):
        ModelStep(model)
