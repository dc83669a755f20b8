"""Per-token log-probabilities and entropies of a causal LM, computed in chunks.

RL losses need log π(y_t | y_<t) for the sampled token only, yet the textbook way to get it,
`log_softmax(logits.float(), -1).gather(-1, tokens)`, materialises a float32 `[B, T, V]` tensor.
At V = 152k (Qwen) and B·T = 8k tokens that is 5 GB, and autograd keeps it for the backward pass,
where two more tensors of the same size appear. Here rows of the flattened `[B·T, V]` logits are
processed `chunk_size` at a time:

    log π(y_t) = z_t[y_t] - logsumexp(z_t),     z_t = logits_t / temperature

so only `chunk_size × V` float32 temporaries exist at once. The backward pass is written by hand
(`torch.autograd.Function`) and recomputes each chunk's softmax, instead of letting autograd
store every chunk's float32 log-softmax (which would add up to the full tensor again):

    ∂ log π(y_t) / ∂ logits_t = (onehot(y_t) - softmax(z_t)) / temperature

`hidden_logprobs` goes one step further, like Liger-Kernel's fused linear cross-entropy
(Hsu et al., 2024, arXiv:2410.10989): it takes the last hidden states and the LM-head weight and
computes each chunk's logits on the fly, so not even the `[B, T, V]` logits (nor their gradient)
ever exist.

Alignment: position t of `logits` must score `tokens[t]`. A causal LM's logits at position t
predict the token at t + 1, so the caller shifts: `token_logprobs(logits[:, :-1], input_ids[:, 1:])`.

Chunks are counted in rows of the flattened leading dimensions (B·T rows of V logits), not in
sequence positions, so a chunk may span the end of one sequence and the start of the next.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = ["DEFAULT_CHUNK_SIZE", "hidden_logprobs", "token_entropy", "token_logprobs"]

# Rows of B·T per chunk, tuned with benchmarks/logprobs.py on CPU at V = 32k and 152k. Smaller
# chunks are faster on one thread (they stay in cache) but pay a thread-pool barrier per op when
# several threads share busy cores. A chunk's float32 temporaries are DEFAULT_CHUNK_SIZE × V × 4
# bytes each: 16 MB at V = 32k, 78 MB at V = 152k.
DEFAULT_CHUNK_SIZE = 128


# --------------------------------------------------------------------------------------------
# argument checks


def _check_temperature(temperature: float) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature: must be a float > 0, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature: must be a finite float > 0, got {temperature}")
    return float(temperature)


def _check_chunk_size(chunk_size: int | None, rows: int) -> int:
    """The number of rows per chunk; None means all rows in one chunk."""
    if chunk_size is None:
        return max(rows, 1)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size: must be a positive int or None, got {type(chunk_size).__name__}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size: must be a positive int or None, got {chunk_size}")
    return chunk_size


def _check_logits(logits: torch.Tensor, name: str = "logits") -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"{name}: must be a floating-point tensor [B, T, V]")
    if logits.dim() < 2 or logits.shape[-1] == 0:
        raise ValueError(f"{name}: must have shape [B, T, V] with V > 0, got {tuple(logits.shape)}")


def _check_tokens(tokens: torch.Tensor, lead_shape: torch.Size, vocab: int, name: str) -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.is_floating_point() or tokens.is_complex():
        raise TypeError("tokens: must be an integer tensor [B, T] of token ids")
    if tokens.shape != lead_shape:
        raise ValueError(
            f"tokens: shape {tuple(tokens.shape)} must equal {name}.shape[:-1] = {tuple(lead_shape)}"
        )
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"tokens: ids must lie in [0, V) = [0, {vocab})")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # float32 for float32/bf16/fp16 inputs; float64 stays float64 (gradcheck, reference runs).
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------------
# rows of a [..., V] tensor, without copying the whole tensor


class _Rows:
    """Row access to a `[..., D]` tensor as if it were `[N, D]` with N = prod(leading dims).

    `logits[:, :-1]` (the usual shift) is not viewable as `[N, V]`; `reshape` would copy all of it.
    Such tensors are read one chunk at a time through advanced indexing instead.
    """

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.n = math.prod(x.shape[:-1])
        try:
            self.flat: torch.Tensor | None = x.view(self.n, x.shape[-1])
        except RuntimeError:
            self.flat = None

    def __getitem__(self, rows: slice) -> torch.Tensor:
        if self.flat is not None:
            return self.flat[rows]
        idx = torch.arange(rows.start, rows.stop, device=self.x.device)
        return self.x[torch.unravel_index(idx, self.x.shape[:-1])]


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


# --------------------------------------------------------------------------------------------
# per-chunk kernels (chunk: [c, V] in the input dtype; results are in `dtype`, float32 or float64)
#
# Each uses PyTorch's fused row-wise (log_)softmax: one cache-friendly kernel per chunk, no
# separate max / subtract / exp / sum passes over c x V memory.


def _log_softmax(chunk, temperature, dtype, out=None) -> torch.Tensor:
    """log softmax(chunk / temperature) -> `[c, V]` in `dtype` (written into `out` if given)."""
    # dtype= upcasts inside the kernel on CUDA; on CPU it costs one copy of the chunk.
    z = chunk if temperature == 1.0 else chunk.to(dtype) / temperature
    return torch.log_softmax(z, dim=-1, dtype=dtype, out=out)


def _softmax(chunk, temperature, dtype, out=None) -> torch.Tensor:
    """softmax(chunk / temperature) -> `[c, V]` in `dtype` (written into `out` if given)."""
    z = chunk if temperature == 1.0 else chunk.to(dtype) / temperature
    return torch.softmax(z, dim=-1, dtype=dtype, out=out)


def _gather(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _logprob_grad(chunk, tokens, grad, temperature, dtype, out=None) -> torch.Tensor:
    """(onehot(y) - softmax(z)) · grad / temperature -> `[c, V]` in `dtype`."""
    scale = (grad / temperature).unsqueeze(-1)  # [c, 1]
    d = _softmax(chunk, temperature, dtype, out).mul_(-scale)
    return d.scatter_add_(-1, tokens.unsqueeze(-1), scale)


def _entropy(chunk, temperature, dtype) -> torch.Tensor:
    """H = -Σ_v p_v log p_v of p = softmax(chunk / temperature) -> [c]."""
    logp = _log_softmax(chunk, temperature, dtype)
    p = logp.exp()
    # p = 0 where a logit is -inf (masked vocabulary): clamping log p makes 0 · log p = 0, not nan.
    # In place on our own log p; torch's sum is pairwise, a float32 dot product would lose digits.
    return -logp.clamp_(min=torch.finfo(dtype).min).mul_(p).sum(dim=-1)


def _entropy_grad(chunk, entropy, grad, temperature, dtype, out=None) -> torch.Tensor:
    """∂H/∂logits = -p (log p + H) / temperature, times grad -> `[c, V]` in `dtype`.

    From H = -Σ_i p_i log p_i and ∂p_i/∂z_j = p_i (δ_ij - p_j) with z = logits / τ:
    ∂H/∂z_j = -p_j (log p_j + 1) + p_j Σ_i p_i (log p_i + 1) = -p_j (log p_j + H).
    """
    logp = _log_softmax(chunk, temperature, dtype, out)
    p = logp.exp()
    logp.clamp_(min=torch.finfo(dtype).min)
    scale = (-grad / temperature).unsqueeze(-1)
    return logp.add_(entropy.unsqueeze(-1)).mul_(p).mul_(scale)


# --------------------------------------------------------------------------------------------
# autograd functions: forward in chunks; backward recomputes each chunk's softmax rather than
# saving it, so that autograd never holds B·T·V floats.


def _grad_buffer(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous gradient for `x` and its `[N, D]` row view."""
    grad = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return grad, grad.view(math.prod(x.shape[:-1]), x.shape[-1])


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, temperature, chunk_size):
        dtype = _compute_dtype(logits.dtype)
        rows, flat_tokens = _Rows(logits), tokens.reshape(-1)
        out = torch.empty(rows.n, dtype=dtype, device=logits.device)
        for sl in _chunks(rows.n, chunk_size):
            out[sl] = _gather(_log_softmax(rows[sl], temperature, dtype), flat_tokens[sl])
        ctx.save_for_backward(logits, flat_tokens)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        return out.view(tokens.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, flat_tokens = ctx.saved_tensors
        rows, grad_flat = _Rows(logits), grad_out.reshape(-1).to(ctx.dtype)
        grad_logits, grad_rows = _grad_buffer(logits)
        direct = grad_rows.dtype == ctx.dtype  # float32 logits: write into the gradient, no copy
        for sl in _chunks(rows.n, ctx.chunk_size):
            out = grad_rows[sl] if direct else None
            d = _logprob_grad(rows[sl], flat_tokens[sl], grad_flat[sl], ctx.temperature, ctx.dtype, out)
            if not direct:
                grad_rows[sl] = d
        return grad_logits, None, None, None


class _TokenEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, temperature, chunk_size):
        dtype = _compute_dtype(logits.dtype)
        rows = _Rows(logits)
        out = torch.empty(rows.n, dtype=dtype, device=logits.device)
        for sl in _chunks(rows.n, chunk_size):
            out[sl] = _entropy(rows[sl], temperature, dtype)
        ctx.save_for_backward(logits, out)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        return out.view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, entropy = ctx.saved_tensors
        rows, grad_flat = _Rows(logits), grad_out.reshape(-1).to(ctx.dtype)
        grad_logits, grad_rows = _grad_buffer(logits)
        direct = grad_rows.dtype == ctx.dtype
        for sl in _chunks(rows.n, ctx.chunk_size):
            out = grad_rows[sl] if direct else None
            d = _entropy_grad(rows[sl], entropy[sl], grad_flat[sl], ctx.temperature, ctx.dtype, out)
            if not direct:
                grad_rows[sl] = d
        return grad_logits, None, None


class _HiddenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, chunk_size):
        dtype = _compute_dtype(hidden.dtype)
        rows, flat_tokens = _Rows(hidden), tokens.reshape(-1)
        out = torch.empty(rows.n, dtype=dtype, device=hidden.device)
        for sl in _chunks(rows.n, chunk_size):
            # The LM head in the model's dtype, then upcast: the numbers of model(...).logits.float().
            logits = F.linear(rows[sl], weight, bias)  # [c, V]
            out[sl] = _gather(_log_softmax(logits, temperature, dtype), flat_tokens[sl])
        ctx.save_for_backward(hidden, weight, bias, flat_tokens)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        return out.view(tokens.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        hidden, weight, bias, flat_tokens = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        dtype = ctx.dtype
        rows, grad_flat = _Rows(hidden), grad_out.reshape(-1).to(dtype)
        grad_hidden = grad_weight = grad_bias = None
        if need_hidden:
            grad_hidden, grad_hidden_rows = _grad_buffer(hidden)
        # Weight and bias gradients are sums over all chunks: accumulate in float32 (float64 for
        # float64) so that a bf16 model's gradient is rounded once, not once per chunk.
        if need_weight:
            grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
        if need_bias:
            grad_bias = torch.zeros(bias.shape, dtype=dtype, device=bias.device)
        for sl in _chunks(rows.n, ctx.chunk_size):
            h = rows[sl]  # [c, H]
            logits = F.linear(h, weight, bias)  # recomputed, [c, V]
            d = _logprob_grad(logits, flat_tokens[sl], grad_flat[sl], ctx.temperature, dtype)
            del logits
            if need_hidden:
                grad_hidden_rows[sl] = d.to(weight.dtype) @ weight  # [c, H]
            if need_weight:
                grad_weight.addmm_(d.T, h.to(dtype))  # [V, H]
            if need_bias:
                grad_bias += d.sum(dim=0)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None


# --------------------------------------------------------------------------------------------
# public API


def token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Log-probability of each token under softmax(logits / temperature), chunk by chunk.

    log π(y_t) = z_t[y_t] - logsumexp_v z_t[v],   z_t = logits_t / temperature.

    Alignment is the caller's job: `logits[b, t]` must be the distribution that `tokens[b, t]` was
    drawn from. With a causal LM that is the logits one position earlier:
    `token_logprobs(out.logits[:, :-1], input_ids[:, 1:])` (slice both to the response afterwards,
    or slice the logits to `[:, P - 1 : -1]` first). Divide by the same temperature as the sampler.

    Each chunk of rows is upcast to float32 on its own, so bf16 logits are fine and the full
    `[B, T, V]` float32 log-softmax never exists. The backward pass is hand-written and recomputes
    each chunk's softmax: gradient memory is the `[B, T, V]` gradient of `logits` itself (in their
    dtype) plus one chunk of float32 temporaries.

    Args:
        logits: `[B, T, V]` (any leading shape), any floating dtype (float32, bfloat16, ...).
        tokens: `[B, T]` integer ids in [0, V), aligned with `logits` as described above.
        temperature: sampling temperature τ > 0; the logits are divided by it.
        chunk_size: rows of the flattened `[B·T, V]` logits per chunk (a chunk may span two
            sequences). None processes all rows at once (same code, one chunk: the float32 copy
            of the whole tensor exists during the forward pass). `DEFAULT_CHUNK_SIZE` is a good
            value when memory matters.

    Returns:
        `[B, T]` log-probabilities in float32 (float64 when `logits` are float64).

    Raises:
        ValueError: `tokens` shape differs from `logits.shape[:-1]` or ids out of range,
            `temperature <= 0`, `chunk_size <= 0`.
    """
    _check_logits(logits)
    _check_tokens(tokens, logits.shape[:-1], logits.shape[-1], "logits")
    temperature = _check_temperature(temperature)
    size = _check_chunk_size(chunk_size, math.prod(logits.shape[:-1]))
    return _TokenLogprobs.apply(logits, tokens.long(), temperature, size)


def token_entropy(
    logits: torch.Tensor,
    chunk_size: int | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) at each position, chunk by chunk.

    H_t = -Σ_v p_t[v] log p_t[v] = logsumexp(z_t) - Σ_v p_t[v] z_t[v],   z_t = logits_t / τ.

    The temperature defaults to 1 (the model's own distribution); pass the sampling temperature
    to get the entropy of the distribution the tokens were actually drawn from. Differentiable
    (entropy bonus) with a hand-written chunked backward:
    ∂H/∂logits_t = -p_t (log p_t + H_t) / τ.

    Args:
        logits: `[B, T, V]` (any leading shape), any floating dtype.
        chunk_size: rows of the flattened `[B·T, V]` logits per chunk; None means one chunk.
        temperature: τ > 0; the logits are divided by it.

    Returns:
        `[B, T]` entropies in nats, float32 (float64 when `logits` are float64).

    Raises:
        ValueError: `temperature <= 0`, `chunk_size <= 0`, `logits` with fewer than 2 dims.
    """
    _check_logits(logits)
    temperature = _check_temperature(temperature)
    size = _check_chunk_size(chunk_size, math.prod(logits.shape[:-1]))
    return _TokenEntropy.apply(logits, temperature, size)


def hidden_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token log-probs straight from the last hidden states: fused LM head + log-softmax + gather.

    Equals `token_logprobs(F.linear(hidden, weight, bias), tokens, temperature)`, but computes the
    logits chunk by chunk, so neither the `[B, T, V]` logits nor their gradient ever exist (the
    idea of Liger-Kernel's fused linear cross-entropy, arXiv:2410.10989). Backward recomputes each
    chunk's logits (one extra `[c, H] × [H, V]` matmul per chunk) and returns gradients for
    `hidden`, `weight` and `bias`; the weight and bias gradients are accumulated in float32.

    Get `hidden` from `model.model(...)`/`output_hidden_states=True` (after the final norm) and
    `weight` from `model.get_output_embeddings().weight`. Alignment as in `token_logprobs`:
    `hidden[b, t]` must be the state that predicts `tokens[b, t]`.

    Args:
        hidden: `[B, T, H]` final hidden states, any floating dtype.
        weight: `[V, H]` LM-head weight, same dtype as `hidden`.
        tokens: `[B, T]` integer ids in [0, V).
        temperature: τ > 0; the logits are divided by it.
        chunk_size: rows of the flattened `[B·T, H]` hidden states per chunk; None means one chunk.
        bias: optional `[V]` LM-head bias.

    Returns:
        `[B, T]` log-probabilities in float32 (float64 when `hidden` is float64).

    Raises:
        ValueError: shapes that do not fit together, `temperature <= 0`, `chunk_size <= 0`.
    """
    _check_logits(hidden, "hidden")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight: must have shape [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, got {shape}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: dtype {weight.dtype} must equal hidden dtype {hidden.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != weight.dtype):
        raise ValueError(f"bias: must have shape [V] = ({weight.shape[0]},) and dtype {weight.dtype}")
    _check_tokens(tokens, hidden.shape[:-1], weight.shape[0], "hidden")
    temperature = _check_temperature(temperature)
    size = _check_chunk_size(chunk_size, math.prod(hidden.shape[:-1]))
    return _HiddenLogprobs.apply(hidden, weight, bias, tokens.long(), temperature, size)
