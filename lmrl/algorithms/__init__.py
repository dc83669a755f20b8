"""Pure tensor math for RL post-training. Imports torch only, never the rest of lmrl.

Conventions: per-token tensors are [B, T] over response tokens; `mask` [B, T] marks real response
tokens; sequence-level tensors are [B]. Groups are contiguous: sample i belongs to group i // G.
"""

from lmrl.algorithms.masking import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]
