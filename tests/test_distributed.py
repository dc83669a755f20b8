"""Data parallelism (lmrl.distributed): one optimizer step on 2 real ranks (torchrun, gloo on CPU) gives
the parameters of one process over the same global batch; and the one-rank World is the identity."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmrl import algorithms as A
from lmrl.distributed import World, masked_whiten
from lmrl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "dist_driver.py"
# grpo: group statistics (local to a rank); rloo: KL in the reward against a reference model; ppo: a critic,
# GAE and batch whitening; reinforce_pp: whitening across the batch of both ranks
ALGORITHMS = ["grpo", "rloo", "ppo", "reinforce_pp"]


def _run(cmd: list[str], out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, str(DRIVER), str(out), *ALGORITHMS], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_two_ranks_take_the_step_one_process_takes(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    _run([sys.executable], one)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"], two)
    from safetensors.torch import load_file

    from lmrl.models.shipped import SHIPPED_MODEL

    start = load_file(SHIPPED_MODEL / "model.safetensors")
    for name in ALGORITHMS:
        a, b = torch.load(one / f"{name}.pt"), torch.load(two / f"{name}.pt")
        assert a.keys() == b.keys() and any(k.startswith("critic.") for k in a) == (name == "ppo")
        moved = max((a[f"policy.{k}"] - v).abs().max().item() for k, v in start.items())
        assert moved > 5e-4, name  # the step did something (lr 1e-3)
        for k in a:  # without the gradient sum over ranks the difference is 2e-3
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=f"{name}: {k}")


def test_one_rank_is_the_identity():
    world = World()
    x = torch.tensor([1.0, 2.0, 4.0])
    assert world.sum(x) is x and world.all(True) and not world.all(False)
    assert world.reduce_metrics({"loss/policy_avg": 0.5}) == {"loss/policy_avg": 0.5}
    assert world.shard(16) == slice(0, 16)
    mask = torch.tensor([[True, True, False], [True, False, True]])
    y = torch.tensor([[1.0, 3.0, 9.0], [2.0, 7.0, 4.0]])
    torch.testing.assert_close(masked_whiten(y, mask, world), A.masked_whiten(y, mask))


def test_a_share_is_whole_and_even():
    assert World(rank=1, size=2).shard(16) == slice(8, 16)
    with pytest.raises(ConfigError, match=r"^rollout.prompts_per_step: 6 does not split evenly over 4 ranks"):
        World(rank=0, size=4).shard(6)
