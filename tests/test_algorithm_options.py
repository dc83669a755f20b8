"""Every algorithm option issue 19 added, chosen by config, trains a tiny model end to end."""

from __future__ import annotations

import math

import pytest
import torch

from lmrl.config import load_config
from lmrl.errors import ConfigError
from tests.test_trainer import make_trainer

OPTIONS = [
    ["algorithm.advantage=grpo_batch_std"],
    ["algorithm=rloo", "algorithm.kl_clamp=verl", "algorithm.kl_estimator=k3"],
    ["algorithm.kl_coef=0.05", "algorithm.kl_clamp=openrlhf", "algorithm.kl_estimator=k3+"],
    ["algorithm=reinforce_pp", "algorithm.whiten_std=population"],
    ["algorithm=rloo", "algorithm.ratio_level=sequence-sum", "algorithm.aggregation=seq-mean-token-sum",
     "algorithm.num_iterations=2"],
]


@pytest.mark.parametrize("overrides", OPTIONS, ids=lambda o: " ".join(o))
def test_option_trains_end_to_end(tmp_path, overrides):
    trainer = make_trainer(tmp_path, *overrides)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    history = trainer.train().history
    assert all(math.isfinite(v) for k, v in history[-1].items() if k.startswith(("loss/", "policy/")))
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters())), "no weight changed"


@pytest.mark.parametrize("override, key", [
    ("algorithm.kl_clamp=trl", "algorithm.kl_clamp"),
    ("algorithm.whiten_std=sample", "algorithm.whiten_std"),
    ("algorithm.ratio_level=seq", "algorithm.ratio_level"),
])
def test_bad_option_values_name_the_field(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])
