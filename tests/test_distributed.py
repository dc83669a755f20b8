"""Data parallelism (lmrl.distributed): one optimizer step on 2 real ranks (torchrun, gloo on CPU) gives
the parameters of one process over the same global batch; and the one-rank World is the identity."""

from __future__ import annotations

import json
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


RECORD = '''
import json
import os

def record(prompts, completions, answer, **kw):
    with open(f"prompts-{os.environ.get('RANK', '0')}.txt", "a") as f:
        f.write("".join(p + "\\n" for p in prompts))
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]
'''


def test_lmrl_train_under_torchrun_is_one_job(tmp_path):
    """Two ranks share each step's prompts and the evaluation's (no prompt on both), and one rank prints
    and writes: one output directory, one metrics row per step, one final model."""
    (tmp_path / "rec.py").write_text(RECORD)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "lmrl.cli", "train",
         "train.steps=2", "rollout.prompts_per_step=8", "rollout.group_size=4", "data.num_eval_prompts=10",
         "train.output_dir=out", "log.console=false", "reward.functions=[rec.py:record]", "train.threads=1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("resolved config:") == 1 and proc.stdout.count("model saved to out/final") == 1
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    ranks = [(tmp_path / f"prompts-{r}.txt").read_text().splitlines() for r in (0, 1)]
    # per rank: 5 held-out prompts at step 0, 4 prompts x 4 completions at steps 1 and 2, 5 held-out at the end
    assert [len(p) for p in ranks] == [42, 42]
    assert not set(ranks[0]) & set(ranks[1])
    from lmrl.models.shipped import load_shipped

    model, _ = load_shipped(tmp_path / "out" / "final")
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_checkpoints_under_torchrun_are_refused_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "lmrl.cli", "train",
         "train.save_every=1", "train.output_dir=out", "log.console=false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lmrl: error:")]
    assert errors and set(errors) == {"lmrl: error: train.save_every / train.resume: checkpoints of a run on 2 ranks "
                                      "are not built yet (docs/scaling.md); use train.save_every=0 under torchrun for now"}
    assert not (tmp_path / "out").exists()
