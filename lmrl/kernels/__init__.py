"""CPU kernels for the decode step, in C, compiled on first use with the machine's C compiler.

A decode step of a small model on a CPU runs dozens of tiny tensor operations per layer, and each
costs far more than its arithmetic (dispatch, an OpenMP fork and join, a fresh output). `decode.c`
does two of those pieces as one call each:

    decode_attention   rotary of the new query and key, the key / value write into the row's cache, and
                       attention over the row's prompt keys (shared by its group) and its own response keys
                       (see `lmrl.engine.llama`)
    rms_norm           RMSNorm of a `[rows, hidden]` activation

The source is compiled with `$CC` (default `cc`), `-O3 -march=native -fopenmp`, into
`$LMRL_CACHE_DIR/kernels` (default `~/.cache/lmrl/kernels`), once per source, compiler and CPU; later
processes load the cached library. The library uses the OpenMP runtime torch has already loaded, so
its threads are torch's (`torch.set_num_threads`).

Nothing here is required: without a C compiler, or with `LMRL_KERNELS=0`, `load()` returns None and the
engine uses its PyTorch path (same results to float32 rounding; slower). Loaded through ctypes, with
pointers to contiguous float32 CPU tensors the caller checks.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decode.c")
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC"]
_UNSET = object()
_library: object = _UNSET


class DecodeKernels:
    """The compiled `decode.c`, with typed entry points."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library
        self._attention = library.lmrl_decode_attention
        self._attention.restype = ctypes.c_int
        self._attention.argtypes = [ctypes.c_void_p] * 12 + [ctypes.c_int64] * 6 + [ctypes.c_float] + [ctypes.c_int64] * 2
        self._rms_norm = library.lmrl_rms_norm
        self._rms_norm.restype = None
        self._rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]

    def decode_attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position: torch.Tensor,
                         prompt_keys: torch.Tensor, prompt_values: torch.Tensor, prompt_length: torch.Tensor,
                         response_keys: torch.Tensor, response_values: torch.Tensor, row_prompt: torch.Tensor,
                         row_length: torch.Tensor, heads: int, scale: float, checked: bool = False) -> torch.Tensor:
        """`[b, heads * D]` attention output of each row's next token; writes its key and value into the row's cache.

        Args:
            qkv: `[b, (heads + 2K) * D]` the fused q / k / v projection of each row's new token.
            cos, sin: `[L, D]` rotary tables by position; position: `[b]` int64 position of each row.
            prompt_keys, prompt_values: `[U, K, P, D]`, each prompt right-aligned; prompt_length: `[u]` (u <= U) the
                columns of each prompt in use.
            response_keys, response_values: `[R, K, capacity, D]` (R >= b), row r written at column row_length[r].
            row_prompt: `[b]` int64 prompt of each row; row_length: `[b]` int64 response tokens it has so far.
            checked: the caches and `prompt_length` already passed `check_attention` (an engine checks them once
                per change of its buffers, not at every step).
        All float32 / int64, contiguous, on the CPU: anything else, or an index out of range, is a
        ValueError before the kernel touches memory.
        """
        if not checked:
            self.check_attention(cos, sin, prompt_keys, prompt_values, prompt_length, response_keys, response_values,
                                 heads)
        (_, kv, capacity, d), (u, _, p, _) = response_keys.shape, prompt_keys.shape
        b = qkv.shape[0]
        _check("decode_attention", "qkv", qkv, torch.float32, (b, (heads + 2 * kv) * d))
        for name, x in (("position", position), ("row_prompt", row_prompt), ("row_length", row_length)):
            _check("decode_attention", name, x, torch.int64, (b,))
        if b > response_keys.shape[0]:
            raise ValueError(f"lmrl decode_attention: {b} rows for a cache of {response_keys.shape[0]}")
        out = qkv.new_empty((b, heads * d))
        failed = self._attention(
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), position.data_ptr(), prompt_keys.data_ptr(),
            prompt_values.data_ptr(), prompt_length.data_ptr(), response_keys.data_ptr(), response_values.data_ptr(),
            row_prompt.data_ptr(), row_length.data_ptr(), out.data_ptr(), b, heads, kv, d, p, capacity, scale,
            cos.shape[0], prompt_length.shape[0],
        )
        if failed == 2:
            raise ValueError(f"lmrl decode_attention: a position, a row's prompt or length, or a prompt's length is "
                             f"out of range (capacity {capacity}, {cos.shape[0]} rotary positions, {u} prompts of "
                             f"{p} columns)")
        if failed:
            raise MemoryError("lmrl decode_attention: could not allocate its scratch memory")
        return out

    @staticmethod
    def check_attention(cos: torch.Tensor, sin: torch.Tensor, prompt_keys: torch.Tensor, prompt_values: torch.Tensor,
                        prompt_length: torch.Tensor, response_keys: torch.Tensor, response_values: torch.Tensor,
                        heads: int) -> None:
        """ValueError unless `decode_attention` can read these (see there) through raw pointers."""
        u, kv, p, d = prompt_keys.shape if prompt_keys.dim() == 4 else (-1,) * 4
        rows, capacity = (response_keys.shape[0], response_keys.shape[2]) if response_keys.dim() == 4 else (-1, -1)
        f32 = torch.float32
        for name, x, dtype, shape in [
            ("cos", cos, f32, (cos.shape[0], d)), ("sin", sin, f32, cos.shape),
            ("prompt_keys", prompt_keys, f32, (u, kv, p, d)), ("prompt_values", prompt_values, f32, (u, kv, p, d)),
            ("prompt_length", prompt_length, torch.int64, (min(prompt_length.shape[0], u),)),
            ("response_keys", response_keys, f32, (rows, kv, capacity, d)),
            ("response_values", response_values, f32, (rows, kv, capacity, d)),
        ]:
            _check("decode_attention", name, x, dtype, shape)
        if d % 2 or kv < 1 or heads % kv:
            raise ValueError(f"lmrl decode_attention: {heads} query heads over {kv} kv heads of size {d} "
                             "(need whole groups and an even head size)")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`weight * x / sqrt(mean(x^2) + eps)` over the last dim of a contiguous float32 `[rows, n]` x."""
        _check("rms_norm", "x", x, torch.float32, (x.shape[0], weight.shape[-1]))
        _check("rms_norm", "weight", weight, torch.float32, (x.shape[-1],))
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
        return out


def _check(kernel: str, name: str, x: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """What the C code reads through a raw pointer: `x` must be a contiguous CPU tensor of this dtype and shape."""
    if x.dtype != dtype or not x.is_cpu or x.shape != shape or not x.is_contiguous():
        raise ValueError(f"lmrl {kernel}: {name} must be a contiguous {dtype} CPU tensor of shape {tuple(shape)}, "
                         f"got {x.dtype} {x.device.type} {tuple(x.shape)}{'' if x.is_contiguous() else ' (not contiguous)'}")


def load() -> DecodeKernels | None:
    """The decode kernels, compiled on the first call of the process if not cached; None when
    `LMRL_KERNELS=0` or they cannot be built (a warning says why, once)."""
    global _library
    if os.environ.get("LMRL_KERNELS", "1") == "0":
        return None
    if _library is _UNSET:
        try:
            _library = DecodeKernels(ctypes.CDLL(str(_build())))
        except (OSError, subprocess.SubprocessError, AttributeError) as err:
            warnings.warn(f"lmrl: C decode kernels unavailable, using the PyTorch path ({err})", stacklevel=2)
            _library = None
    return _library


def _build() -> Path:
    """Path of the compiled library: from the cache, or compiled now (written under a temporary name and
    renamed, so concurrent processes never load a half-written file)."""
    compiler = os.environ.get("CC", "cc")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(FLAGS).encode(), _cpu_id()])).hexdigest()[:16]
    cache = Path(os.environ.get("LMRL_CACHE_DIR", Path.home() / ".cache" / "lmrl")) / "kernels"
    target = cache / f"decode-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / target.name
        # with OpenMP (torch's runtime, already loaded, serves the library), else single-threaded
        for extra in (["-fopenmp"], []):
            result = subprocess.run([compiler, *FLAGS, *extra, "-o", str(built), str(SOURCE), "-lm"],
                                    capture_output=True, text=True, timeout=120)
            if result.returncode == 0:
                os.replace(built, target)
                return target
    raise OSError(f"{compiler} could not compile {SOURCE.name}: {result.stderr.strip().splitlines()[-1:]}")


def _cpu_id() -> bytes:
    """What `-march=native` compiles for: the machine and, on Linux, the CPU's model and feature flags."""
    parts = [platform.machine()]
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        parts += sorted({line for line in info if line.startswith(("model name", "flags"))})
    except OSError:
        pass
    return "\n".join(parts).encode()
