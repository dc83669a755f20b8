"""The policy's sampler copy: a frozen copy in another dtype that generates (`rollout.dtype`), and the copy
of the policy's weights into it before every generation.
"""

from __future__ import annotations

import copy

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
