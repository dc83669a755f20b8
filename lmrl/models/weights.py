"""The policy's sampler copy: a frozen copy in another dtype that generates (`rollout.dtype`), and the copy
of the policy's weights into it before every generation; the policy's weights as a generator that holds its own
copy takes them (`export_weights`: a vLLM engine, another process).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import nn

from lmrl.models.loading import DTYPES


def sampler_copy(policy: nn.Module, dtype: str | None) -> nn.Module | None:
    """A frozen copy of the policy in `dtype` for generation (`rollout.dtype`), or None when the policy
    itself samples. `copy_weights(policy, copy)` refreshes it."""
    if dtype is None or all(p.dtype == DTYPES[dtype] for p in policy.parameters() if p.is_floating_point()):
        return None
    sampler = copy.deepcopy(policy).to(DTYPES[dtype])
    sampler.eval()
    sampler.requires_grad_(False)
    return sampler


@torch.no_grad()
def copy_weights(src: nn.Module, dst: nn.Module) -> None:
    """dst's parameters := src's (cast to dst's dtype); both have the same structure (`sampler_copy`)."""
    for d, s in zip(dst.parameters(), src.parameters(), strict=True):
        d.copy_(s)


def export_weights(policy: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under the names of its Hugging Face checkpoint (`model.layers.0.mlp.up_proj.weight`),
    one tensor at a time: what a generator holding its own copy loads (`RemoteGenerator.load_weights`).

    A LoRA policy (peft) yields its base weights with the adapters merged in, W + scale * B @ A, computed per
    tensor: its own weights never change, and no merged copy of the whole model exists at once. A DDP wrapper is
    looked through. Sharded (FSDP) weights must be gathered around the iteration (`lmrl.distributed.full_weights`).
    Tensors are detached views of the live parameters (merged ones are new): read them before the next update.
    """
    model = getattr(policy, "module", policy)  # DDP
    if hasattr(model, "get_base_model"):  # a PeftModel (the model inside holds the adapters' layers too)
        model = model.get_base_model()
    adapted = {name: m for name, m in model.named_modules() if hasattr(m, "get_delta_weight") and hasattr(m, "base_layer")}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                continue
            module, _, leaf = name.rpartition(".")
            layer = adapted.get(module.removesuffix(".base_layer")) if module.endswith(".base_layer") else None
            tensor = p.detach()
            if layer is not None and leaf == "weight" and not getattr(layer, "merged", False):
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A:
                        tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
            yield name.replace(".base_layer.", "."), tensor
