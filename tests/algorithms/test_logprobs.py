"""Tests for lmrl.algorithms.logprobs: values, gradients, alignment and memory of the chunked paths."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from lmrl.algorithms.logprobs import hidden_logprobs, token_entropy, token_logprobs


def plain_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The textbook computation every chunked path must reproduce."""
    logp = torch.log_softmax(logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
                             / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def plain_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def make(b: int, t: int, v: int, seed: int = 0, dtype=torch.float32, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, t, v, generator=g) * scale).to(dtype)
    tokens = torch.randint(0, v, (b, t), generator=g)
    return logits, tokens


# ---------------------------------------------------------------------------------------------- values


@settings(max_examples=50, deadline=None)
@given(
    b=st.integers(1, 3),
    t=st.integers(1, 7),
    v=st.integers(1, 40),
    chunk=st.integers(1, 25),
    temperature=st.floats(0.25, 4.0),
    seed=st.integers(0, 2**16),
)
def test_chunked_equals_unchunked_equals_plain(b, t, v, chunk, temperature, seed):
    logits, tokens = make(b, t, v, seed)
    expected = plain_logprobs(logits, tokens, temperature)
    unchunked = token_logprobs(logits, tokens, temperature)
    chunked = token_logprobs(logits, tokens, temperature, chunk_size=chunk)
    assert chunked.shape == (b, t) and chunked.dtype == torch.float32
    torch.testing.assert_close(unchunked, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked, expected, rtol=0, atol=1e-5)

    entropy = token_entropy(logits, chunk_size=chunk, temperature=temperature)
    torch.testing.assert_close(entropy, token_entropy(logits, temperature=temperature), rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, plain_entropy(logits, temperature), rtol=0, atol=1e-5)


def test_temperature_divides_logits_two_token_vocab():
    # logits (0, 1) at temperature 2 -> softmax of (0, 0.5): p(1) = 1 / (1 + e^-0.5) = 0.6224593.
    logits = torch.tensor([[[0.0, 1.0], [0.0, 1.0]]])
    tokens = torch.tensor([[1, 0]])
    for chunk in (None, 1):
        out = token_logprobs(logits, tokens, temperature=2.0, chunk_size=chunk)
        torch.testing.assert_close(out, torch.tensor([[-0.4740770, -0.9740770]]), rtol=0, atol=1e-6)
        # at temperature 1: p(1) = 1 / (1 + e^-1) = 0.7310586
        out = token_logprobs(logits, tokens, chunk_size=chunk)
        torch.testing.assert_close(out, torch.tensor([[-0.3132617, -1.3132617]]), rtol=0, atol=1e-6)
        # entropy at temperature 2: -(p log p + q log q), p = 0.6224593, q = 0.3775407
        h = token_entropy(logits, chunk_size=chunk, temperature=2.0)
        torch.testing.assert_close(h, torch.full((1, 2), 0.6628473), rtol=0, atol=1e-6)


@pytest.mark.parametrize("v", [1, 2, 7, 1000])
def test_entropy_of_uniform_logits_is_log_v(v):
    logits = torch.full((2, 3, v), 1.5)
    for chunk in (None, 4):
        torch.testing.assert_close(token_entropy(logits, chunk_size=chunk), torch.full((2, 3), math.log(v)))


def test_bf16_logits_match_float32_computation():
    logits32, tokens = make(2, 33, 300, seed=1)
    logits16 = logits32.to(torch.bfloat16)
    out = token_logprobs(logits16, tokens, temperature=0.7, chunk_size=10)
    assert out.dtype == torch.float32
    # Each chunk is upcast before any arithmetic: identical to the float32 math on the bf16 values.
    torch.testing.assert_close(out, plain_logprobs(logits16.float(), tokens, 0.7), rtol=0, atol=1e-5)
    # And close to the unrounded float32 logits: bf16 keeps ~3 significant digits of |logits| <~ 12.
    torch.testing.assert_close(out, plain_logprobs(logits32, tokens, 0.7), rtol=0, atol=0.15)
    entropy = token_entropy(logits16, chunk_size=10, temperature=0.7)
    torch.testing.assert_close(entropy, plain_entropy(logits16.float(), 0.7), rtol=0, atol=1e-5)


def test_alignment_with_a_causal_lm():
    # logits[:, t] of a causal LM predict input_ids[:, t + 1]: the caller shifts, as documented.
    from lmrl.models.tiny import char_tokenizer, tiny_causal_lm

    tok = char_tokenizer()
    model = tiny_causal_lm(tok, hidden_size=32, num_layers=1)
    ids = torch.tensor([tok.encode("abcab"), tok.encode("bacca")])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    got = token_logprobs(out.logits[:, :-1], ids[:, 1:], chunk_size=3)
    for b in range(2):
        for t in range(ids.shape[1] - 1):
            expected = torch.log_softmax(out.logits[b, t].float(), -1)[ids[b, t + 1]]
            assert abs(got[b, t].item() - expected.item()) < 1e-5
    # The fused path from the final hidden states and the (tied) LM head gives the same numbers.
    fused = hidden_logprobs(
        out.hidden_states[-1][:, :-1], model.get_output_embeddings().weight, ids[:, 1:], chunk_size=3
    )
    torch.testing.assert_close(fused, got, rtol=0, atol=1e-5)


def test_masked_vocabulary_with_minus_inf_logits():
    logits, tokens = make(2, 4, 6, seed=2)
    logits[..., 5] = -math.inf
    tokens = tokens.clamp(max=4)
    finite = logits[..., :5]
    for chunk in (None, 3):
        torch.testing.assert_close(
            token_entropy(logits, chunk_size=chunk), plain_entropy(finite), rtol=0, atol=1e-5
        )
        torch.testing.assert_close(
            token_logprobs(logits, tokens, chunk_size=chunk), plain_logprobs(finite, tokens), rtol=0, atol=1e-5
        )
    x = logits.clone().requires_grad_()
    (token_entropy(x, chunk_size=3).sum() + token_logprobs(x, tokens, chunk_size=3).sum()).backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[..., 5] == 0).all()


def test_empty_batch():
    logits = torch.zeros(0, 5, 7, requires_grad=True)
    tokens = torch.zeros(0, 5, dtype=torch.long)
    out = token_logprobs(logits, tokens, chunk_size=4)
    assert out.shape == (0, 5)
    out.sum().backward()
    assert logits.grad.shape == (0, 5, 7)
    assert token_entropy(logits, chunk_size=4).shape == (0, 5)


# ------------------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("chunk", [None, 1, 5, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_gradients_equal_autograd_of_plain_path(chunk, temperature):
    logits, tokens = make(3, 7, 50, seed=3)
    w = torch.randn(3, 7, generator=torch.Generator().manual_seed(4))

    def grad(fn):
        x = logits.clone().requires_grad_()
        (fn(x) * w).sum().backward()
        return x.grad

    torch.testing.assert_close(
        grad(lambda x: token_logprobs(x, tokens, temperature, chunk)),
        grad(lambda x: plain_logprobs(x, tokens, temperature)),
        rtol=0,
        atol=1e-5,
    )
    torch.testing.assert_close(
        grad(lambda x: token_entropy(x, chunk, temperature)),
        grad(lambda x: plain_entropy(x, temperature)),
        rtol=0,
        atol=1e-5,
    )


def test_gradients_through_shifted_non_contiguous_logits():
    # logits[:, :-1] cannot be viewed as [B*T, V]; rows are then read chunk by chunk.
    logits, tokens = make(2, 6, 9, seed=5)
    x1 = logits.clone().requires_grad_()
    x2 = logits.clone().requires_grad_()
    a = token_logprobs(x1[:, :-1], tokens[:, 1:], 0.8, chunk_size=4)
    b = plain_logprobs(x2[:, :-1], tokens[:, 1:], 0.8)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    a.sum().backward()
    b.sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=1e-5)


def test_bf16_gradients_match_float32_math():
    logits, tokens = make(2, 5, 40, seed=6, dtype=torch.bfloat16)
    x = logits.clone().requires_grad_()
    token_logprobs(x, tokens, 0.9, chunk_size=3).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    ref = logits.float().requires_grad_()
    plain_logprobs(ref, tokens, 0.9).sum().backward()
    # Gradients are in [-1/τ, 1/τ]; bf16 keeps 8 bits of mantissa.
    torch.testing.assert_close(x.grad.float(), ref.grad, rtol=0, atol=8e-3)


def test_gradcheck_float64():
    logits, tokens = make(2, 3, 5, seed=7, dtype=torch.float64, scale=1.0)
    x = logits.requires_grad_()
    for chunk in (None, 4):
        assert torch.autograd.gradcheck(lambda z, c=chunk: token_logprobs(z, tokens, 0.7, c), (x,))
        assert torch.autograd.gradcheck(lambda z, c=chunk: token_entropy(z, c, 1.3), (x,))


# ----------------------------------------------------------------------------------- hidden_logprobs


def _hidden_case(dtype=torch.float32, seed=8):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 5, 16, generator=g).to(dtype)
    weight = (torch.randn(37, 16, generator=g) / 4).to(dtype)
    bias = torch.randn(37, generator=g).to(dtype)
    tokens = torch.randint(0, 37, (3, 5), generator=g)
    return hidden, weight, bias, tokens


def _grads(fn, *tensors):
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    w = torch.linspace(-1, 2, out.numel()).view(out.shape)
    (out * w).sum().backward()
    return out, [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("chunk", [None, 1, 4, 100])
def test_hidden_logprobs_equals_plain_values_and_grads(chunk):
    hidden, weight, bias, tokens = _hidden_case()
    out, grads = _grads(lambda h, w, b: hidden_logprobs(h, w, tokens, 0.7, chunk, bias=b), hidden, weight, bias)
    ref, ref_grads = _grads(lambda h, w, b: plain_logprobs(F.linear(h, w, b), tokens, 0.7), hidden, weight, bias)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    for got, expected in zip(grads, ref_grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_hidden_logprobs_bf16_close_to_plain():
    hidden, weight, _, tokens = _hidden_case(torch.bfloat16)
    out, grads = _grads(lambda h, w: hidden_logprobs(h, w, tokens, chunk_size=4), hidden, weight)
    ref, ref_grads = _grads(lambda h, w: plain_logprobs(F.linear(h, w), tokens), hidden, weight)
    assert out.dtype == torch.float32 and grads[1].dtype == torch.bfloat16
    # Same bf16 logits per chunk: the values agree with the plain path to float32 accuracy.
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    for got, expected in zip(grads, ref_grads):
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_hidden_logprobs_frozen_head_and_gradcheck():
    hidden, weight, bias, tokens = _hidden_case(torch.float64)
    h = hidden.clone().requires_grad_()
    hidden_logprobs(h, weight, tokens, chunk_size=4).sum().backward()  # weight needs no grad
    assert h.grad is not None and weight.grad is None
    small = (hidden[:1, :3].clone().requires_grad_(), weight[:6].clone().requires_grad_(),
             bias[:6].clone().requires_grad_())
    assert torch.autograd.gradcheck(
        lambda h, w, b: hidden_logprobs(h, w, tokens[:1, :3] % 6, 1.4, 2, bias=b), small
    )


# -------------------------------------------------------------------------------------------- memory


class LargestFloat32(TorchDispatchMode):
    """Records the element count of every float32 buffer allocated by aten ops while active.

    Views and in-place results share an input's storage and are not allocations: only outputs
    whose storage is new are recorded.
    """

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seen = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    self.sizes.append(storage.nbytes() // 4)
        return out


def test_chunked_path_never_builds_a_full_float32_tensor():
    b, t, v, chunk = 4, 16, 512, 7  # chunk does not divide B*T = 64
    logits, tokens = make(b, t, v, seed=9, dtype=torch.bfloat16)
    x = logits.requires_grad_()
    with LargestFloat32() as spy:
        (token_logprobs(x, tokens, 0.8, chunk) + token_entropy(x, chunk, 0.8)).sum().backward()
    assert x.grad is not None
    assert max(spy.sizes) <= chunk * v < b * t * v

    # The spy does see full-size tensors: the plain path builds several.
    with LargestFloat32() as spy:
        plain_logprobs(logits.detach().requires_grad_(), tokens, 0.8).sum().backward()
    assert max(spy.sizes) == b * t * v

    # float32 logits: the only full-size float32 tensor is their gradient, made once in backward.
    x = logits.float().requires_grad_()
    with LargestFloat32() as spy:
        token_logprobs(x, tokens, 0.8, chunk).sum().backward()
    assert sorted(spy.sizes)[-2:] == [chunk * v, b * t * v]

    # hidden_logprobs: not even the logits exist in full.
    hidden = torch.randn(b, t, 8, requires_grad=True)
    weight = torch.randn(v, 8, requires_grad=True)
    with LargestFloat32() as spy:
        hidden_logprobs(hidden, weight, tokens, chunk_size=chunk).sum().backward()
    assert max(spy.sizes) <= max(chunk * v, weight.numel()) < b * t * v


# ---------------------------------------------------------------------------------------- bad inputs


def test_bad_inputs_raise_naming_the_argument():
    logits, tokens = make(2, 3, 5)
    with pytest.raises(ValueError, match="tokens"):
        token_logprobs(logits, tokens[:, :2])
    with pytest.raises(ValueError, match="tokens"):
        token_logprobs(logits, tokens + 5)
    with pytest.raises(TypeError, match="tokens"):
        token_logprobs(logits, tokens.float())
    for bad in (0, -3):
        with pytest.raises(ValueError, match="chunk_size"):
            token_logprobs(logits, tokens, chunk_size=bad)
        with pytest.raises(ValueError, match="chunk_size"):
            token_entropy(logits, chunk_size=bad)
        with pytest.raises(ValueError, match="temperature"):
            token_logprobs(logits, tokens, temperature=bad)
        with pytest.raises(ValueError, match="temperature"):
            token_entropy(logits, temperature=bad)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, tokens, temperature=math.inf)
    with pytest.raises(ValueError, match="logits"):
        token_entropy(torch.zeros(4))
    hidden, weight, bias, tokens = _hidden_case()
    with pytest.raises(ValueError, match="weight"):
        hidden_logprobs(hidden, weight[:, :4], tokens)
    with pytest.raises(ValueError, match="bias"):
        hidden_logprobs(hidden, weight, tokens, bias=bias[:3])
    with pytest.raises(ValueError, match="tokens"):
        hidden_logprobs(hidden, weight, tokens[:2])
    with pytest.raises(ValueError, match="chunk_size"):
        hidden_logprobs(hidden, weight, tokens, chunk_size=0)
