"""The pieces of a decode step that are plain layer arithmetic: linears, the gated MLP and RMSNorm.

On CPU in float32, where it pays, a linear's weight is reordered once per engine into oneDNN's blocked layout and
the MLP's SiLU and product and the residual adds run inside the matmuls (`Linear`); RMSNorm runs as torch's fused
kernel, or the C one (`lmrl.kernels`). Modules that are not plain, hook-free `nn.Linear`s (LoRA, quantised,
hooked) are called as they are. The switches are module flags so that `benchmarks/decode_ab.py` and the tests can
turn each optimisation off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmrl.kernels import DecodeKernels
from lmrl.models.shared_prompt import hooked

# Decode-step matmuls with weights reordered for oneDNN on CPU in float32, for weights of at least
# PACK_MIN_ELEMENTS elements when torch runs 2+ threads (see `Linear`, `onednn_weight`); None: by
# the CPU, 2**17 with AVX2 and 2**19 with AVX-512, where plain matmuls are faster on small weights.
PACK_WEIGHTS = True
PACK_MIN_ELEMENTS: int | None = None


class Linear:
    """`x @ weight.T + bias` in the decode steps, optionally followed by an activation, `+ add` or `* mul`.

    On CPU in float32, where `onednn_weight` finds it pays, the weight is reordered once per rollout
    into oneDNN's blocked layout and the activation (SiLU), add or multiply run inside the matmul
    kernel (`torch.ops.mkldnn`, what torch.compile's CPU backend emits for linears with frozen
    weights): on an AVX2 CPU, rollouts of the vs-TRL benchmark's hidden 256 / 4 layers model are 1.14x
    faster (`benchmarks/decode_ab.py --toggle pack`). Elsewhere it is `F.linear` (or `addmm` for an
    add) and plain ops.
    A module that is not a plain, hook-free nn.Linear (LoRA, quantised, hooked) is called as is.
    """

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, rows: int,
                 module: nn.Module | None = None, pack: bool = True) -> None:
        self.module, self.bias = module, bias
        self.packed = None if weight is None or not pack else onednn_weight(weight, rows)
        self.weight = weight if self.packed is None else None

    @classmethod
    def of(cls, module: nn.Module, rows: int) -> Linear:
        """`module` as a `Linear`; `rows`: the batch the weight layout is chosen for."""
        if not _plain_linear(module):
            return cls(None, None, rows, module=module)
        return cls(module.weight.detach(), None if module.bias is None else module.bias.detach(), rows)

    @classmethod
    def concat(cls, modules: list[nn.Module], rows: int, pack: bool = True) -> Linear | None:
        """One `Linear` doing the work of `modules` (outputs concatenated), or None if any of them is not
        a plain nn.Linear or only some have a bias. `pack=False`: never oneDNN-packed."""
        biases = [m.bias for m in modules]
        if not all(_plain_linear(m) for m in modules) or (None in biases and any(b is not None for b in biases)):
            return None
        weight = torch.cat([m.weight.detach() for m in modules])
        return cls(weight, None if biases[0] is None else torch.cat([b.detach() for b in biases]), rows, pack=pack)

    def __call__(self, x: torch.Tensor, act: nn.Module | None = None, add: torch.Tensor | None = None,
                 mul: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """act(x @ W.T + b), then `+ add` or `* mul` (at most one of the two). `out`: where a plain `x @ W.T`
        (2-D, no bias, unpacked) is written instead of a fresh tensor (the LM head's `[rows, V]` logits: on a CPU a
        fresh tensor that large faults in new pages every step); elsewhere ignored."""
        if (out is not None and self.packed is None and self.module is None and self.bias is None and act is None
                and add is None and mul is None and x.dim() == 2 and out.dtype == x.dtype):
            return torch.mm(x, self.weight.t(), out=out)
        if self.packed is not None and (act is None or _is_silu(act)):
            if add is not None or mul is not None:
                other, op = (add, "add") if add is not None else (mul, "mul")
                return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, op)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none" if act is None else "swish", [], "")
        if self.packed is not None:  # an activation oneDNN does not fuse
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        elif self.module is not None:
            y = self.module(x)
        elif act is None and add is not None and self.bias is None and x.dim() == 2:
            return torch.addmm(add, x, self.weight.t())  # the add inside the matmul
        else:
            y = F.linear(x, self.weight, self.bias)
        if act is not None:
            y = act(y)
        return y + add if add is not None else y * mul if mul is not None else y


class GatedMLP:
    """A Llama / Qwen2 MLP plus the residual, `down(act(gate(x)) * up(x)) + residual`, from `Linear`s.

    With oneDNN-packed weights, the activation, the product and the add run inside the three matmuls;
    otherwise gate and up are one matmul (weights concatenated) and the add is an `addmm`.
    """

    def __init__(self, mlp: nn.Module, rows: int) -> None:
        self.act = mlp.act_fn
        self.gate, self.up = Linear.of(mlp.gate_proj, rows), Linear.of(mlp.up_proj, rows)
        # the unpacked case: gate / up too small to pack on their own, so their concatenation (twice the
        # size, with no epilogue to fuse) stays unpacked too (packed: 0.94x at hidden 256 on AVX-512)
        self.gate_up = None if self.gate.packed is not None else Linear.concat([mlp.gate_proj, mlp.up_proj], rows, pack=False)
        self.down = Linear.of(mlp.down_proj, rows)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down(self.up(x, mul=self.gate(x, act=self.act)), add=residual)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up, add=residual)


def onednn_weight(weight: torch.Tensor, rows: int) -> torch.Tensor | None:
    """`weight` reordered for oneDNN's matmul with about `rows` input rows, or None where that does not
    pay or apply. Measured at 64 rows on 2 cores: on AVX2, oneDNN beat `F.linear` only with 2+ threads
    and weights of 2**17+ elements (1.2-1.4x at 256 x 768), and lost up to 2x on smaller ones or on one
    thread; on AVX-512 (with AMX) whole rollouts lost 0.92-0.93x at hidden 256-320, broke even at 384
    and won 1.12-1.13x at 512-1024, hence 2**19 there (`pack_min_elements`). Also None off CPU, for
    other dtypes, without oneDNN, or with `PACK_WEIGHTS` off."""
    if not (PACK_WEIGHTS and weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.numel() >= pack_min_elements() and torch.get_num_threads() > 1
            and torch.backends.mkldnn.is_available()):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    except (AttributeError, RuntimeError):  # a torch build without the op
        return None


def pack_min_elements() -> int:
    """The smallest weight (in elements) `onednn_weight` packs: `PACK_MIN_ELEMENTS`, or by the CPU."""
    if PACK_MIN_ELEMENTS is not None:
        return PACK_MIN_ELEMENTS
    return 2**19 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 2**17


def _is_silu(act: nn.Module) -> bool:
    """torch's or transformers' SiLU module, without hooks (what oneDNN's "swish" computes)."""
    return type(act).__name__ in ("SiLU", "SiLUActivation") and not hooked(act)


def _plain_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear and not hooked(module)


def plain_mlp(mlp: nn.Module) -> bool:
    """A Llama / Qwen2 gated MLP: down(act(gate(x)) * up(x)), with no hooks on the module itself."""
    return type(mlp).__name__ in ("LlamaMLP", "Qwen2MLP") and not hooked(mlp)


def rms_norm(norm: nn.Module, x: torch.Tensor, kernels: DecodeKernels | None = None) -> torch.Tensor:
    """Llama / Qwen2 RMSNorm with torch's fused kernel, or the C one (`kernels`, float32 `[b, hidden]`
    on CPU): weight * (x / rms(x)) computed in float32, as transformers does; other norm modules are called."""
    if type(norm).__name__ not in ("LlamaRMSNorm", "Qwen2RMSNorm") or hooked(norm):
        return norm(x)
    if kernels is not None and x.dim() == 2 and x.dtype == norm.weight.dtype == torch.float32 and x.device.type == "cpu":
        return kernels.rms_norm(x.contiguous(), norm.weight.detach(), norm.variance_epsilon)
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], norm.weight, eps=norm.variance_epsilon)
    return norm.weight * F.rms_norm(x.float(), x.shape[-1:], eps=norm.variance_epsilon).to(x.dtype)
