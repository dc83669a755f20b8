"""The engine's fixed-shape steps (CUDA graphs on a GPU): the path chosen and why, the same samples as the other
steps, and the fallback when capturing fails. No GPU here: a graph is captured and replayed only on CUDA."""

from __future__ import annotations

import warnings

import pytest
import torch

import lmrl.engine.engine as engine_module
import lmrl.rollout.hf as hf
from lmrl.models.tiny import char_tokenizer
from lmrl.rollout import HFGenerator, SamplingParams
from lmrl.rollout.hf import graph_path
from tests.rollout.test_hf_generator import (
    encode,
    gqa_model,
    reference_logprobs,
    scrambled_model,
    sliding_model,
)

CUDA = torch.device("cuda")  # a device object only: nothing runs on it here


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def test_the_path_and_why(tok):
    model = scrambled_model(tok)
    assert graph_path(model, CUDA, True, lean=True) == ("cuda_graph", "fixed-shape steps captured in CUDA graphs")
    assert graph_path(model, torch.device("cpu"), True, lean=True) == ("engine", "no CUDA graphs on cpu")
    assert graph_path(model, CUDA, False, lean=True) == ("engine", "rollout.cuda_graph=false")
    model.config._attn_implementation = "flash_attention_2"  # the module-by-module step takes no mask from the model
    assert graph_path(model, CUDA, True, lean=True)[0] == "cuda_graph"
    assert graph_path(model, CUDA, True, lean=False) == (
        "engine", "no CUDA graph: attn_implementation='flash_attention_2' takes no 4D mask (sdpa or eager do)")
    model.config._attn_implementation = "sdpa"
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}
    assert graph_path(model, CUDA, True, lean=True) == ("engine", "no CUDA graph: the model is spread over devices")
    sliding = scrambled_model(tok, "qwen2")
    sliding.config.layer_types = ["sliding_attention", "full_attention"]
    # the generator's line names the engine's step too
    assert HFGenerator(scrambled_model(tok), tok).decode_path() == (
        "engine", "module by module, each prompt's keys shared by its rows; no CUDA graphs on cpu")
    assert HFGenerator(sliding, tok).decode_path() == (
        "engine", "its own forward: the model has sliding-window layers; no CUDA graphs on cpu")
    assert HFGenerator(sliding, tok, fixed_shapes=True).decode_path() == (
        "fixed_shapes", "its own forward: the model has sliding-window layers; fixed_shapes=True")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_fixed_shapes_sample_what_the_other_paths_sample(tok, arch, kernel, device):
    """On a CPU the fixed-shape steps run eagerly; on CUDA they are the captured graphs, replayed. Llama, Qwen2 and
    Qwen3 step module by module, Mistral (a window of 4 tokens) through its own forward. 16 rows, at most 6 in a
    step: rows join the slots of rows that ended, and the slots past the rows in flight step on padding."""
    model = (gqa_model(tok, arch) if arch != "mistral" else sliding_model(tok, kernel)).to(device)
    model.config._attn_implementation = kernel
    # EOS and a stop string end rows early
    params = SamplingParams(max_new_tokens=16, temperature=1.0, stop=["e"], seed=5)
    usual = HFGenerator(model, tok, batch_size=6, cuda_graph=False).generate(encode(tok), 4, params)
    fixed = HFGenerator(model, tok, batch_size=6, fixed_shapes=True)
    assert fixed.decode_path()[0] == ("cuda_graph" if device.type == "cuda" else "fixed_shapes")
    out = fixed.generate(encode(tok), 4, params)
    assert torch.equal(out.response_ids, usual.response_ids) and torch.equal(out.response_mask, usual.response_mask)
    assert not out.response_mask.all() and out.response_mask.any(1).all()  # some rows did end early
    torch.testing.assert_close(out.logprobs, usual.logprobs, atol=2e-5, rtol=0)
    torch.testing.assert_close(out.logprobs, reference_logprobs(model, out, 1.0), atol=1e-4, rtol=0)


@pytest.mark.parametrize("step", ["module by module", "the model's forward"])
def test_a_failed_capture_says_why_once_and_decodes_the_same_eagerly(tok, monkeypatch, step):
    monkeypatch.setattr(engine_module, "llama_supports", lambda model: step == "module by module")
    model = scrambled_model(tok, seed=3)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=1)
    usual = HFGenerator(model, tok).generate(encode(tok), 3, params)
    # as on a GPU whose capture fails (on any machine: the graph cannot even be made)
    monkeypatch.setattr(hf, "graph_path", lambda *a: ("cuda_graph", "test"))

    def no_graph():
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", no_graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    generator = HFGenerator(model, tok)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generator.generate(encode(tok), 3, params)
        again = generator.generate(encode(tok), 3, params)  # not tried again
    notes = [str(w.message) for w in caught if "CUDA graph" in str(w.message)]
    assert len(notes) == 1 and notes[0].startswith("CUDA graph capture failed, decoding eagerly: ")
    assert generator.note == notes[0]
    for rollout in (out, again):
        assert torch.equal(rollout.response_ids, usual.response_ids)
        torch.testing.assert_close(rollout.logprobs, usual.logprobs, atol=2e-5, rtol=0)


def test_fixed_shapes_through_the_models_forward_need_a_kernel_that_takes_a_mask(tok, monkeypatch):
    model = scrambled_model(tok)
    model.config._attn_implementation = "flash_attention_2"
    HFGenerator(model, tok, fixed_shapes=True)  # module by module: the model's kernel is not used in a step
    monkeypatch.setattr(engine_module, "llama_supports", lambda model: False)
    with pytest.raises(ValueError, match="fixed_shapes: needs the sdpa or eager kernel for a model that steps through"):
        HFGenerator(model, tok, fixed_shapes=True)


def test_layer_types_the_engine_does_not_decode_are_refused_in_one_line(tok):
    from lmrl.engine.model_step import ModelStep

    model = scrambled_model(tok, "qwen2")
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"^model: layer types \['linear_attention'\] are not decoded by lmrl's engine"):
        ModelStep(model)


def test_buckets_are_the_cache_or_a_power_of_two_in_half_of_it():
    from lmrl.engine.engine import bucket_of

    assert [bucket_of(b, 6) for b in (6, 5, 4, 3, 2, 1)] == [6, 6, 6, 6, 2, 1]
    assert [bucket_of(b, 512) for b in (512, 300, 256, 129, 100, 9, 1)] == [512, 512, 256, 256, 128, 16, 1]


def test_what_a_fixed_step_reads_stays_put_while_the_cache_keeps_its_size(tok):
    """A CUDA graph replays the kernels it recorded on the memory it recorded: every tensor the fixed-shape step
    reads (the stores, the slots' lengths and prompts, the tokens and positions, the rotary tables) keeps its
    storage from step to step of a bucket while rows end, leave and join, and the shapes stay the bucket's."""
    from lmrl.engine import DecodeEngine, Request
    from lmrl.engine.engine import bucket_of

    model = gqa_model(tok, "qwen2").eval()
    engine = DecodeEngine(model, SamplingParams(temperature=1.0), tok.encode("aeiou"), fixed=True, graphs=False)
    engine.reserve(3, 16, 6, 24)
    prompts = ["hello there", "ab", "what is 2+2?"]
    queue = [Request(tok.encode(p), 24, (p, j), 10 * i + j) for i, p in enumerate(prompts) for j in range(2)]

    def addresses() -> tuple[int, list[int]]:
        cache = engine.cache
        rows = cache.step_rows(bucket_of(len(engine.rows), cache.capacity[2]))
        tensors = [*cache.prompt_keys, *cache.prompt_values, *cache.row_keys, *cache.row_values, *engine._inputs,
                   rows.index, rows.length, rows.prompt, rows.prompt_length, engine.step_fn.cos, engine.step_fn.sin]
        return len(rows.index), [t.data_ptr() for t in tensors] + [rows.prompt_columns, rows.response_columns]

    seen, ended = [], 0
    with torch.inference_mode():
        engine.add(queue[:4])
        for _ in range(60):
            if not len(engine):
                break
            ended += len(engine.step())
            if queue[4:] and len(engine) <= 2:  # the last group joins the slots that ended
                engine.add(queue[4:])
                queue = queue[:4]
            seen.append(addresses())
    assert ended == 6 and engine.rebuilds == 1
    by_bucket = {}
    for bucket, found in seen:
        assert by_bucket.setdefault(bucket, found) == found, bucket
    assert {6, 1} <= set(by_bucket), sorted(by_bucket)  # the cache's 6 slots, then the tail's
