"""Rollout operations: joining rollouts of different widths and selecting rows keep every row aligned."""

from __future__ import annotations

import torch

from lmrl.rollout import concat_rollouts, select_rollout
from tests.test_experience import rollout


def test_concat_and_select_rollouts_keep_alignment():
    a, b = rollout(P=3, T=5), rollout(P=2, T=3, lengths=(3, 1, 2, 3), seed=1)
    both = concat_rollouts([a, b], pad_id=0)
    assert both.prompt_ids.shape == (8, 3) and both.response_ids.shape == (8, 5)
    assert torch.equal(both.prompt_ids[4:, 1:], b.prompt_ids) and not both.prompt_mask[4:, 0].any()
    assert torch.equal(both.response_mask[4:, :3], b.response_mask) and not both.response_mask[4:, 3:].any()
    assert both.prompt_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    sub = select_rollout(both, torch.tensor([5, 6]))
    assert sub.response_ids.shape == (2, 2)  # trimmed to the longest kept response
    assert sub.texts == ["t1", "t2"]
