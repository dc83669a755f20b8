"""The C decode kernels (`lmrl.kernels`): each against PyTorch written out, the rollout with and without
them, and the fallbacks (disabled, no compiler)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import lmrl.engine.llama as llama
import lmrl.kernels as kernels
from lmrl.models.shared_prompt import apply_rotary
from lmrl.rollout import HFGenerator, SamplingParams
from tests.rollout.test_hf_generator import encode, gqa_model, reference_logprobs, scrambled_model


@pytest.fixture(scope="module")
def lib():
    loaded = kernels.load()
    assert loaded is not None, "the C kernels did not build: is a C compiler (cc) installed?"
    return loaded


@pytest.fixture(scope="module")
def tok():
    from lmrl.models.tiny import char_tokenizer

    return char_tokenizer()


@pytest.fixture
def kernel_steps(monkeypatch):
    """A list that gets one entry per layer's attention run by the kernel."""
    steps = []
    real = kernels.DecodeKernels.decode_attention
    monkeypatch.setattr(kernels.DecodeKernels, "decode_attention", lambda self, *a, **k: steps.append(1) or real(self, *a, **k))
    return steps


def attention_by_hand(qkv, cos, sin, position, pk, pv, prompt_length, rk, rv, row_prompt, row_length, heads, scale):
    """What `decode_attention` computes, with plain tensor ops (rows one by one)."""
    b = qkv.shape[0]
    _, kv, p, d = pk.shape
    group = heads // kv
    q, k, v = qkv.split([heads * d, kv * d, kv * d], dim=-1)
    c, s = cos[position][:, None], sin[position][:, None]
    q, k = apply_rotary(q.view(b, heads, d), c, s), apply_rotary(k.view(b, kv, d), c, s)
    keys, values = rk.clone(), rv.clone()
    rows = torch.arange(b)
    keys[rows, :, row_length], values[rows, :, row_length] = k, v.view(b, kv, d)
    out = torch.empty(b, heads, d)
    for r in range(b):
        u, n = int(row_prompt[r]), int(row_length[r]) + 1
        m = int(prompt_length[u])
        for h in range(heads):
            kh = h // group
            all_keys = torch.cat([pk[u, kh, p - m:], keys[r, kh, :n]])
            all_values = torch.cat([pv[u, kh, p - m:], values[r, kh, :n]])
            out[r, h] = torch.softmax(all_keys @ q[r, h] * scale, -1) @ all_values
    return out.view(b, heads * d), keys, values


@pytest.mark.parametrize("heads, kv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("lengths", [[0, 0, 0, 0, 0], [5, 0, 2, 7, 1]])
def test_decode_attention_equals_plain_ops(lib, heads, kv, lengths):
    """Rotary, the cache writes and attention over [prompt | response], with grouped-query heads, prompts of
    different lengths (right-aligned, the columns before them never read), rows not in prompt order and of
    different response lengths, a cache with more rows than the step."""
    g = torch.Generator().manual_seed(heads * 10 + kv + sum(lengths))
    b, d, p, capacity, u = 5, 8, 4, 9, 3
    qkv = torch.randn(b, (heads + 2 * kv) * d, generator=g)
    angles = torch.arange(20.0)[:, None] * torch.linspace(0.1, 1.0, d // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [L, D] HF layout
    position = torch.tensor([3, 4, 5, 6, 4])
    pk, pv = torch.randn(u + 1, kv, p, d, generator=g), torch.randn(u + 1, kv, p, d, generator=g)
    prompt_length = torch.tensor([4, 2, 1])
    pk[1, :, :2] = pv[1, :, :2] = float("nan")  # before prompt 1's columns: never read
    rk, rv = torch.randn(b + 2, kv, capacity, d, generator=g), torch.randn(b + 2, kv, capacity, d, generator=g)
    row_prompt, row_length = torch.tensor([1, 0, 2, 1, 0]), torch.tensor(lengths)
    for r, n in enumerate(lengths):
        rk[r, :, n + 1:] = rv[r, :, n + 1:] = float("nan")  # past each row's new column: never read
    expected, keys, values = attention_by_hand(qkv, cos, sin, position, pk, pv, prompt_length, rk, rv, row_prompt,
                                               row_length, heads, 0.3)
    out = lib.decode_attention(qkv, cos, sin, position, pk, pv, prompt_length, rk, rv, row_prompt, row_length, heads, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rk, keys, atol=1e-6, rtol=1e-6, equal_nan=True)  # written at each row's column only
    torch.testing.assert_close(rv, values, atol=0, rtol=0, equal_nan=True)


def test_rms_norm_equals_torch(lib):
    x = torch.randn(7, 48) * 3
    weight = torch.rand(48) + 0.5
    torch.testing.assert_close(lib.rms_norm(x, weight, 1e-6), F.rms_norm(x, (48,), weight, eps=1e-6), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rollout_with_kernels_equals_pytorch_path(lib, tok, arch, monkeypatch, kernel_steps):
    """The same seeded rollout with and without the kernels: same tokens, log-probs to float32 rounding
    and equal to a full forward pass; grouped-query attention, padded prompts, rows leaving the batch."""
    model = gqa_model(tok, arch)
    bias = torch.zeros(model.config.vocab_size)
    bias[tok.eos_token_id] = 1.5  # EOS likely: rows finish early and leave the batch
    handle = model.lm_head.register_forward_hook(lambda module, inputs, output: output + bias)
    try:
        params = SamplingParams(max_new_tokens=40, temperature=0.9, seed=3)
        fast = HFGenerator(model, tok).generate(encode(tok), 3, params)
        assert kernel_steps, "the kernel path did not run"
        monkeypatch.setattr(llama, "load_kernels", lambda: None)
        plain = HFGenerator(model, tok).generate(encode(tok), 3, params)
        expected = reference_logprobs(model, fast, 0.9)
    finally:
        handle.remove()
    assert fast.finished.any() and (~fast.finished).any()
    assert torch.equal(fast.response_ids, plain.response_ids)
    torch.testing.assert_close(fast.logprobs, plain.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(fast.logprobs, expected, atol=1e-4, rtol=0)


def test_kernels_for_float32_attention_and_when_switched_on(lib, tok, monkeypatch):
    """The decoder attends in float32 for float32 and 16-bit models, so both get the kernel; a float64
    model decodes with the PyTorch path, as does any model with `USE_KERNELS` off."""
    model = scrambled_model(tok)
    seen = []
    real = llama.LlamaStep.new_cache

    def spy(self, *args, **kwargs):
        cache = real(self, *args, **kwargs)
        seen.append(self.kernels)
        return cache

    monkeypatch.setattr(llama.LlamaStep, "new_cache", spy)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        HFGenerator(model.to(dtype), tok).generate(encode(tok, ["ab"]), 2, SamplingParams(max_new_tokens=3, seed=0))
    monkeypatch.setattr(llama, "USE_KERNELS", False)
    HFGenerator(model.float(), tok).generate(encode(tok, ["ab"]), 2, SamplingParams(max_new_tokens=3, seed=0))
    assert seen == [lib, lib, None, None]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_sampler_with_kernels_is_as_close_to_the_float32_policy(lib, tok, arch, monkeypatch, kernel_steps):
    """A bfloat16 sampler (rollout.dtype=bfloat16) decodes with the kernel too: its sampled log-probs are
    as close to the float32 policy's (which truncated importance sampling corrects toward) as the
    PyTorch path's. Both attend in float32; the kernel also rotates q / k in float32. Measured on
    seeds 3-5: mean |delta log-prob| 0.019-0.023 with the kernel, 0.021-0.028 without."""
    policy = gqa_model(tok, arch)
    model = copy.deepcopy(policy).to(torch.bfloat16)
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=3)
    fast = HFGenerator(model, tok).generate(encode(tok), 3, params)
    assert kernel_steps
    monkeypatch.setattr(llama, "load_kernels", lambda: None)
    plain = HFGenerator(model, tok).generate(encode(tok), 3, params)

    def error(rollout):
        return (rollout.logprobs - reference_logprobs(policy, rollout, 1.0)).abs()[rollout.response_mask].mean()

    assert error(fast) <= 1.25 * error(plain) and error(fast) < 0.05


def test_disabled_or_no_compiler_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "_library", kernels._UNSET)
    monkeypatch.setenv("LMRL_KERNELS", "0")
    assert kernels.load() is None
    monkeypatch.delenv("LMRL_KERNELS")
    monkeypatch.setenv("LMRL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.warns(UserWarning, match="C decode kernels unavailable"):
        assert kernels.load() is None
    assert kernels.load() is None  # decided once per process


def test_compiled_once_then_loaded_from_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "_library", kernels._UNSET)
    monkeypatch.setenv("LMRL_CACHE_DIR", str(tmp_path))
    first = kernels._build()
    stamp = first.stat().st_mtime_ns
    assert first.parent == tmp_path / "kernels" and kernels._build() == first
    assert first.stat().st_mtime_ns == stamp and [p.name for p in (tmp_path / "kernels").iterdir()] == [first.name]


def test_rollout_under_bf16_autocast_decodes_with_pytorch(lib, tok, monkeypatch, kernel_steps):
    """Under bfloat16 autocast (train.autocast_bf16) the projections come out in bfloat16, which the
    float32 kernel must never read: the step takes the PyTorch path, and samples what it samples."""
    model = gqa_model(tok, "llama")
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = HFGenerator(model, tok).generate(encode(tok), 3, params)
        monkeypatch.setattr(llama, "load_kernels", lambda: None)
        plain = HFGenerator(model, tok).generate(encode(tok), 3, params)
    assert not kernel_steps
    assert torch.equal(fast.response_ids, plain.response_ids)
    torch.testing.assert_close(fast.logprobs, plain.logprobs, atol=0, rtol=0)


def test_kernel_entry_points_refuse_what_they_cannot_read(lib):
    """Wrong dtype, layout or shape, or an index out of range, is an error before any memory is touched."""
    b, heads, kv, d, p, capacity, u = 2, 4, 2, 8, 3, 5, 2

    def args(**change):
        a = dict(qkv=torch.randn(b, (heads + 2 * kv) * d), cos=torch.ones(10, d), sin=torch.zeros(10, d),
                 position=torch.tensor([3, 4]), prompt_keys=torch.randn(u, kv, p, d), prompt_values=torch.randn(u, kv, p, d),
                 prompt_length=torch.tensor([3, 2]), response_keys=torch.zeros(b, kv, capacity, d),
                 response_values=torch.zeros(b, kv, capacity, d), row_prompt=torch.tensor([0, 1]),
                 row_length=torch.tensor([0, 4]), heads=heads, scale=0.5)
        return a | change

    assert lib.decode_attention(**args()).shape == (b, heads * d)
    bad = {
        "qkv": torch.randn(b, (heads + 2 * kv) * d).bfloat16(),
        "prompt_keys": torch.randn(u, kv, d, p).transpose(2, 3),
        "response_values": torch.zeros(b, kv, capacity - 1, d),
        "position": torch.tensor([3, 10]),
        "row_prompt": torch.tensor([0, 2]),
        "row_length": torch.tensor([0, capacity]),
        "prompt_length": torch.tensor([3, p + 1]),
        "heads": 3,
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match="decode_attention"):
            lib.decode_attention(**args(**{name: value}))
    for name in ("qkv", "position", "row_length"):  # checked at every call, also after `check_attention` passed the rest
        with pytest.raises(ValueError, match="decode_attention"):
            lib.decode_attention(**args(**{name: bad[name].bfloat16()}), checked=True)
    with pytest.raises(ValueError, match="decode_attention"):  # more rows than the cache holds
        lib.decode_attention(**args(qkv=torch.randn(3, (heads + 2 * kv) * d), position=torch.tensor([3, 4, 5]),
                                    row_prompt=torch.tensor([0, 1, 1]), row_length=torch.tensor([0, 1, 2])))
    with pytest.raises(ValueError, match="rms_norm"):
        lib.rms_norm(torch.randn(3, 8).bfloat16(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="rms_norm"):
        lib.rms_norm(torch.randn(3, 8), torch.ones(6), 1e-6)
