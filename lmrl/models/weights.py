"""The policy's sampler copy: a frozen copy in another dtype that generates (`rollout.dtype`), and the copy
of the policy's weights into it before every generation; the policy's weights as a generator that holds its own
copy takes them (`export_weights`: a vLLM engine, another process).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator

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
    one decoder layer at a time: what a generator holding its own copy loads (`RemoteGenerator.load_weights`).

    The names and shapes are those `save_pretrained` writes, not the model's in memory: transformers 5 holds some
    weights in another layout than its checkpoints (a mixture-of-experts layer's experts fused into one tensor,
    `mlp.experts.gate_up_proj`, which a Mixtral checkpoint stores as `block_sparse_moe.experts.0.w1.weight`, ...),
    and an engine that loads checkpoints (vLLM) knows only those. transformers' own conversion mapping is reverted
    (`revert_weight_conversion`, as `save_pretrained` does), a layer at a time; the tensors it splits or renames are
    views of the live ones.

    A LoRA policy (peft) yields its base weights with the adapters merged in, W + scale * B @ A, computed per
    tensor: its own weights never change, and no merged copy of the whole model exists at once. A DDP wrapper is
    looked through. Sharded (FSDP) weights must be gathered around the iteration (`lmrl.distributed.full_weights`).
    Tensors are detached views of the live parameters (merged ones are new): read them before the next update.
    """
    model = getattr(policy, "module", policy)  # DDP
    if hasattr(model, "get_base_model"):  # a PeftModel (the model inside holds the adapters' layers too)
        model = model.get_base_model()
    yield from checkpoint_names(model, _merged_weights(model))


def _merged_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(in-memory name, tensor) of every weight, LoRA adapters merged in per tensor."""
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


_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")  # the weights of one decoder layer convert together


def checkpoint_names(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights`, (in-memory name, tensor) pairs of `model` in its order, under checkpoint names and layouts: the
    conversion `from_pretrained` applied reverted, one decoder layer (or one tensor outside the layers) at a time."""
    from transformers.core_model_loading import revert_weight_conversion

    for group in _by_layer(weights):
        yield from revert_weight_conversion(model, group).items()


def _by_layer(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
    """(name, tensor) pairs in order, in runs of one decoder layer (or one tensor outside the layers): what
    converts together. Read lazily: one layer is held at a time."""
    group: dict[str, torch.Tensor] = {}
    key = None
    for name, tensor in weights:
        match = _LAYER.match(name)
        here = match.group(1) if match else name
        if group and here != key:
            yield group
            group = {}
        key, group[name] = here, tensor
    if group:
        yield group


class CheckpointLayout:
    """Writes weights given under checkpoint names (`export_weights`) into a model's own layout: what a model of
    lmrl's own that takes a policy's weights by name does (`lmrl.rollout.server.ModelGenerator`, the generator
    process's copy). A checkpoint tensor that is a view of a parameter is copied into it; one that transformers'
    conversion builds from several (an expert's slice of a fused tensor, ...) is scattered into them through an
    index map learned once, per layer, by converting the parameters' element indices the way `export_weights`
    converts their values. Conversions only move elements, so the map is exact; a layout where it is not (a
    conversion that computes) is refused here rather than loaded wrong."""

    def __init__(self, model: nn.Module):
        from transformers.core_model_loading import revert_weight_conversion

        self.views: dict[str, torch.Tensor] = {}  # checkpoint name -> a view of a parameter
        self.maps: dict[str, tuple[torch.Tensor, list[tuple[torch.Tensor, int, int]]]] = {}  # name -> (index, ranges)
        for group in _by_layer((name, p.detach()) for name, p in model.named_parameters()):
            values = revert_weight_conversion(model, dict(group))
            storages = {p.untyped_storage().data_ptr() for p in group.values()}
            copies = [n for n, t in values.items() if t.untyped_storage().data_ptr() not in storages]
            if not copies:
                self.views.update(values)
                continue
            ranges, offset, ids = [], 0, {}
            for n, p in group.items():  # element indices of the group's parameters, one index space
                ids[n] = torch.arange(offset, offset + p.numel(), dtype=torch.float64).view(p.shape)
                ranges.append((p.view(-1), offset, offset + p.numel()))
                offset += p.numel()
            indices = revert_weight_conversion(model, ids)
            flat = torch.cat([p.reshape(-1) for p in group.values()])
            for n, t in values.items():
                if n not in copies:
                    self.views[n] = t
                    continue
                index = indices[n].reshape(-1)
                moved = bool((index == index.round()).all() and (index >= 0).all() and (index < len(flat)).all())
                index = index.long()
                if not moved or not torch.equal(flat[index], t.reshape(-1)):
                    raise ValueError(f"weights: {type(model).__name__}'s checkpoint layout of {n} is not a rearrangement "
                                     "of its weights: it cannot take weights by name")
                self.maps[n] = (index, ranges)

    def names(self) -> set[str]:
        return set(self.views) | set(self.maps)

    @torch.no_grad()
    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The checkpoint tensor `name` into the model's parameters."""
        if name in self.views:
            self.views[name].copy_(tensor)
            return
        index, ranges = self.maps[name]
        values = tensor.reshape(-1)
        for flat, start, end in ranges:
            here = (index >= start) & (index < end)
            if here.any():  # the values where the parameter is (pushed ones come from the CPU's shared memory)
                flat[index[here] - start] = values[here].to(flat.device, flat.dtype)
