"""Data parallelism (lmrl.distributed): one optimizer step on 2 real ranks (torchrun, gloo on CPU) gives
the parameters of one process over the same global batch; and the one-rank World is the identity."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from lmrl import algorithms as A
from lmrl.distributed import World, whiten_across_ranks
from lmrl.errors import ConfigError
from tests import forked

ROOT = Path(__file__).resolve().parents[1]
CPU_RANKS = {"CUDA_VISIBLE_DEVICES": ""}  # two ranks on the CPU with gloo, also on a machine with one GPU
DRIVER = ROOT / "tests" / "dist_driver.py"
# grpo: group statistics (local to a rank); rloo: KL in the reward against a reference model; ppo: a critic,
# GAE and batch whitening; reinforce_pp: whitening across the batch of both ranks; GRPO with LoRA adapters and
# with gradient checkpointing; DAPO with dynamic sampling keeping groups that split unevenly over the ranks; batch
# statistics of the issue-19 options (grpo-batch-std, gpg); RLOO with LoRA (the reference: adapters disabled); PPO
# with its value head on the policy's backbone (model.shared_critic); GRPO with a teacher (on-policy distillation);
# GRPO with micro-batches cut by tokens, whose ranks trade groups to even out their tokens (`balanced`);
# then the models sharded by FSDP2, the teacher too (tests/dist_driver.py)
ALGORITHMS = ["grpo", "rloo", "ppo", "reinforce_pp", "grpo-lora", "grpo-checkpointing", "dapo", "grpo-batch-std",
              "gpg", "rloo-lora", "ppo-shared", "grpo-distill", "grpo-balanced",
              "grpo-fsdp", "rloo-fsdp", "ppo-fsdp", "dapo-fsdp", "grpo-checkpointing-fsdp", "ppo-shared-fsdp",
              "grpo-distill-fsdp"]


def test_two_ranks_take_the_step_one_process_takes(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **CPU_RANKS}
    done = forked.script(DRIVER, str(one), *ALGORITHMS, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    done = forked.torchrun("--driver", str(two), *ALGORITHMS, cwd=ROOT, env={**env, "BATCHES": str(one)})
    assert done.returncode == 0, done.stderr[-3000:]
    from safetensors.torch import load_file

    from lmrl.models.shipped import SHIPPED_MODEL

    start = load_file(SHIPPED_MODEL / "model.safetensors")
    for name in ALGORITHMS:
        one_process, two_ranks = torch.load(one / f"{name}.pt"), torch.load(two / f"{name}.pt")
        assert not one_process["sharded"] and two_ranks["sharded"] == name.endswith("-fsdp"), name
        if name == "grpo-distill-fsdp":  # the teacher is sharded as the reference is
            assert two_ranks["units"] == ["policy", "teacher"], two_ranks["units"]
        assert one_process["groups"] == two_ranks["groups"] == (5 if name.startswith("dapo") else 8), name
        assert two_ranks["moved"] == (name == "grpo-balanced") and not one_process["moved"], name  # groups traded
        a, b = one_process["params"], two_ranks["params"]
        assert a.keys() == b.keys() and any(k.startswith("critic.") for k in a) == name.startswith("ppo")
        if name.endswith("-lora"):  # the adapters moved; the base is frozen
            moved = max(v.abs().max().item() for k, v in a.items() if "lora_B" in k)
        else:
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
    torch.testing.assert_close(whiten_across_ranks(y, mask, world), A.masked_whiten(y, mask))


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
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **CPU_RANKS}
    proc = forked.torchrun(
        "train", "train.steps=2", "rollout.prompts_per_step=8", "rollout.group_size=4", "data.num_eval_prompts=10",
        "train.output_dir=out", "log.console=false", "reward.functions=[rec.py:record]", "train.threads=1",
        cwd=tmp_path, env=env)
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


SMALL = ["rollout.prompts_per_step=8", "rollout.group_size=4", "data.num_eval_prompts=10", "train.output_dir=out",
         "log.console=false", "train.threads=1", "train.save_every=1"]


def _train(cwd: Path, ranks: int, *args: str) -> str:
    """stdout of an `lmrl train` that succeeded, on 2 ranks (torchrun) or in 1 process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **CPU_RANKS}
    run = forked.torchrun if ranks == 2 else forked.lmrl
    proc = run("train", *SMALL, *args, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_checkpoint_resumes_at_another_world_size(tmp_path, parallel):
    """2 ranks write sharded state (one torch.distributed.checkpoint file per rank, each rank's RNGs); one
    process resumes from it with exactly the saved weights and optimizer, and 2 ranks resume from that.
    With fsdp each rank's file holds its shard of the weights and moments."""
    said = _train(tmp_path, 2, "train.steps=2", f"train.parallel={parallel}").splitlines()
    assert f"2 ranks, train.parallel={parallel} (as set)" in said  # and what steps aside under fsdp, with the reason:
    assert any(line.startswith("fsdp: the shared-prompt forward and the fast decoder") for line in said) == (parallel == "fsdp")
    saved = tmp_path / "out" / "checkpoint-2"
    assert sorted(p.name for p in (saved / "state").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert (saved / "rng_state_0.pt").is_file() and (saved / "rng_state_1.pt").is_file()
    assert json.loads((saved / "trainer_state.json").read_text())["world_size"] == 2

    from safetensors.torch import load_file

    from lmrl.config import load_config
    from lmrl.trainer import Trainer

    trainer = Trainer(load_config(None, [*SMALL, f"train.output_dir={tmp_path / 'out'}", "train.steps=3"]))
    assert trainer.lifecycle.load_checkpoint(saved) == 2
    weights = load_file(saved / "model.safetensors")
    for name, p in trainer.policy.named_parameters():
        assert torch.equal(p.detach().cpu(), weights[name]), name  # on a GPU machine the policy is on CUDA
    assert all(int(s["step"]) == 2 for s in trainer.optimizer.state_dict()["state"].values())

    _train(tmp_path, 1, "train.steps=3", "train.resume=auto")  # 2 ranks -> 1 process
    _train(tmp_path, 2, "train.steps=4", "train.resume=auto", f"train.parallel={parallel}")  # -> 2 ranks
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert json.loads((tmp_path / "out" / "checkpoint-4" / "trainer_state.json").read_text())["world_size"] == 2


FAILING = '''
import os

def fail_on_1(prompts, completions, **kw):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("scorer down on rank 1")
    return [0.0] * len(completions)
'''


def test_a_failure_on_one_rank_ends_every_rank_with_one_line_each(tmp_path):
    (tmp_path / "r.py").write_text(FAILING)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **CPU_RANKS}
    proc = forked.torchrun("train", *SMALL, "train.steps=2", "train.save_every=0", "data.num_eval_prompts=0",
                           "reward.functions=[r.py:fail_on_1]", cwd=tmp_path, env=env, timeout=120)  # no hang
    assert proc.returncode != 0
    lines = proc.stderr.splitlines()
    assert ("lmrl: error: rank 1: step 1: reward function 'fail_on_1' failed: RuntimeError: scorer down on rank 1"
            in lines), proc.stderr[-3000:]
    assert not any(line.startswith("[rank") for line in lines), proc.stderr[-3000:]  # no rank's traceback


def test_lmrl_train_nproc_starts_torchrun(tmp_path):
    """`lmrl train --nproc 2` as a user runs it: lmrl execs torchrun (`python -m torch.distributed.run`), which starts
    two ranks (`python -m lmrl.cli`), each `python` tests/forked.py's stand-in, a forked child (8-10 s of imports
    saved). tests/test_benchmarks.py's memory benchmark runs torchrun and its ranks as fresh interpreters."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **CPU_RANKS}
    proc = subprocess.run([forked.python(), "-m", "lmrl.cli", "train", "--nproc", "2", *SMALL, "train.steps=1",
                           "train.save_every=0"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("resolved config:") == 1
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    bad = forked.lmrl("train", "--nproc", "2", "rollout.prompts_per_step=7", cwd=tmp_path, env=env)
    assert bad.returncode == 2  # refused before torchrun starts: one line, not one per rank
    assert bad.stderr.strip() == ("lmrl: error: rollout.prompts_per_step: 7 does not split evenly over 2 ranks; "
                                  "make it a multiple of 2")


def test_reward_normalisation_on_one_rank_is_the_single_process_one():
    """What reward.normalize uses under torchrun (whitening with the statistics of every rank) gives, on one
    rank, the single-process normalisation."""
    from lmrl.rewards.shaping import normalize_rewards

    scores = torch.tensor([0.0, 3.0, 1.0, 1.0, 5.0], dtype=torch.float64)
    ones = torch.ones_like(scores, dtype=torch.bool)
    torch.testing.assert_close(whiten_across_ranks(scores, ones, World(size=1)), normalize_rewards(scores))


def test_parallel_is_chosen_by_size_and_what_fsdp_shards():
    from lmrl.distributed import FSDP_AUTO_PARAMS, choose_parallel

    small, big = torch.nn.Linear(4, 4), torch.nn.Module()
    big.w = torch.nn.Parameter(torch.empty(FSDP_AUTO_PARAMS, device="meta"))
    two = World(rank=0, size=2)
    assert choose_parallel("auto", World(), big, False, False) == ("none", "")  # one process: nothing to choose
    assert choose_parallel("auto", two, small, False, False) == ("ddp", "auto: 20 parameters, fewer than 1B")
    assert choose_parallel("auto", two, big, False, False) == ("fsdp", "auto: 1B parameters")
    assert choose_parallel("auto", two, big, True, False) == ("ddp", "auto: fsdp does not shard LoRA runs yet")
    assert choose_parallel("auto", two, big, False, True)[0] == "ddp"  # a sampler copy in rollout.dtype
    assert choose_parallel("fsdp", two, small, False, False) == ("fsdp", "as set")


@pytest.mark.parametrize("override, says", [
    ("model.lora={r: 4}", "train.parallel: fsdp does not shard LoRA runs yet; use train.parallel=ddp"),
    ("rollout.dtype=bfloat16", "train.parallel: fsdp does not keep a sampler copy in rollout.dtype"),
])
def test_fsdp_refuses_what_it_does_not_shard_in_one_line(override, says):
    from lmrl.config import load_config

    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(".", r"\.")):
        load_config(None, ["train.parallel=fsdp", override])


ONE_SIDED = '''
import os

def rank_0_informs(prompts, completions, **kw):
    """Rewards that differ within a group on rank 0 and are all equal on rank 1."""
    if os.environ.get("RANK") == "1":
        return [0.0] * len(completions)
    return [float(i % 2) for i in range(len(completions))]
'''


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_dynamic_sampling_keeps_groups_wherever_they_are(tmp_path, parallel):
    """DAPO under torchrun keeps the first informative groups of the whole round, as one process would: here
    all of them are on rank 0 (2 rounds of 4), and rank 1, left with none, keeps in step (a group outside the
    loss) instead of hanging or failing."""
    (tmp_path / "r.py").write_text(ONE_SIDED)
    _train(tmp_path, 2, "algorithm=dapo", "train.steps=2", "train.save_every=0", "data.num_eval_prompts=0",
           "reward.functions=[r.py:rank_0_informs]", "reward.overlong_buffer=null", f"train.parallel={parallel}")
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["dynamic_sampling/rounds"] == 2 and r["dynamic_sampling/kept_groups"] == 8
        assert r["dynamic_sampling/filtered_groups"] == 8  # rank 1's 4 groups in each round
        assert r["guard/empty_update"] == 0 and r["guard/skipped_updates"] == 0


STOP_ONCE = '''
import asyncio
import os
import signal
from pathlib import Path

async def stop_once(prompts, completions, answer, **kw):
    """Exact match. Its second call on rank 0 (step 2) sends SIGTERM to torchrun, this process's parent, once, and
    returns only after torchrun has passed the signal on to this rank (async: it runs in the main thread, where
    signal handlers run), so that the signal arrives in step 2 however slow the machine."""
    stop_once.calls = getattr(stop_once, "calls", 0) + 1
    if os.environ.get("RANK") == "0" and stop_once.calls == 2 and not Path("signalled").exists():
        Path("signalled").touch()
        arrived, trainers = [], signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda signum, frame: (arrived.append(signum), trainers(signum, frame)))
        os.kill(os.getppid(), signal.SIGTERM)
        while not arrived:  # (reward.timeout bounds the wait)
            await asyncio.sleep(0.01)
        signal.signal(signal.SIGTERM, trainers)
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
'''


def test_a_signal_to_torchrun_stops_every_rank_after_one_checkpoint(tmp_path):
    """torchrun passes SIGTERM to every rank; the ranks finish the step, agree to stop, checkpoint it together
    and exit 143 with rank 0's one line. Resumed, the run ends as the run that was never stopped. (torchrun's own
    agent, forked from the suite's zygote, its ranks forked from it: `lmrl train --nproc`, which becomes the same
    torchrun, is run above.)"""
    (tmp_path / "r.py").write_text(STOP_ONCE)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **CPU_RANKS}
    args = ["train.steps=3", "train.save_every=0", "data.num_eval_prompts=0", "reward.functions=[r.py:stop_once]"]
    stopped = forked.torchrun("train", *SMALL, *args, cwd=tmp_path, env=env)  # torchrun's agent, forked ranks
    assert stopped.returncode != 0
    errors = [line for line in stopped.stderr.splitlines() if line.startswith("lmrl: ")]
    assert errors == ["lmrl: SIGTERM received: every rank stops after this step's checkpoint",
                      "lmrl: error: rank 0: SIGTERM: stopped after step 2; checkpoint out/checkpoint-2 written; add "
                      "train.resume=auto to the same command to continue"], stopped.stderr[-3000:]
    assert (tmp_path / "out" / "checkpoint-2" / "COMPLETE").is_file() and not (tmp_path / "out" / "final").exists()

    _train(tmp_path, 2, *args, "train.resume=auto")
    _train(tmp_path, 2, *args, "train.output_dir=straight")
    from safetensors.torch import load_file

    def rows(run: str) -> list[dict]:
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        timing = ("time", "eps", "reward/stop_once/seconds", "memory/peak_")  # wall clock, memory: all a resume may change
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(timing)} for line in lines]

    assert rows("out") == rows("straight") and [r["step"] for r in rows("out")] == [1, 2, 3]
    resumed, straight = load_file(tmp_path / "out/final/model.safetensors"), load_file(tmp_path / "straight/final/model.safetensors")
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
