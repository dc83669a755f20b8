"""Bounded staleness (train.max_staleness, `lmrl.streamed`): a generator process that streams groups, a trainer that
takes the first ready. What must hold: no group trained on was sampled more than k versions before the policy being
updated, whether the generator is the slower side or the faster; groups too old are dropped and counted, never
trained on; no prompt is trained twice, across a SIGKILL and a resume too; a signal leaves no process behind; bad
input is one line before a model loads."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lmrl import Config, Trainer
from lmrl.collect import Collected
from lmrl.distributed import ONE_PROCESS
from lmrl.errors import ConfigError
from lmrl.rollout import Rollout, concat_rollouts
from lmrl.streamed import StreamedRollouts, _batch_metrics
from tests import forked
from tests.test_async_rollouts import SMALL, alive, generator_pids, wait_for_step
from tests.test_long_runs import ROOT, lmrl_train, metric_rows

STREAMED = [*SMALL, "log.samples_every=1", "log.num_samples=32"]  # every completion's prompt in samples.jsonl


def trained_prompts(out: Path) -> dict[int, list[str]]:
    """Each step's prompts (one per group) as the run's record has them: a resumed run's steps replace the stopped
    run's steps after its checkpoint (samples.jsonl is appended to, by both)."""
    steps: dict[int, list[str]] = {}
    last = 0
    for line in (out / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["step"] < last:  # a resumed run: its steps from here on are the ones trained
            steps = {s: p for s, p in steps.items() if s < row["step"]}
        last = row["step"]
        steps.setdefault(row["step"], [])
        if row["prompt"] not in steps[row["step"]]:
            steps[row["step"]].append(row["prompt"])
    return steps


# ------------------------------------------------------------------------------ the trainer's side, by hand
G = 2


def group(position: int, version: int, scores=(1.0, 0.0)) -> dict:
    rollout = Rollout(prompt_ids=torch.tensor([[5, 6]] * G), prompt_mask=torch.ones(G, 2, dtype=torch.bool),
                      response_ids=torch.tensor([[7, 8]] * G), response_mask=torch.ones(G, 2, dtype=torch.bool),
                      logprobs=torch.full((G, 2), -1.0), texts=["ab"] * G, finished=torch.ones(G, dtype=torch.bool),
                      prompt_index=torch.zeros(G, dtype=torch.long))
    return {"position": position, "version": version, "row": {"prompt": f"p{position}"},
            "rollout": {f: getattr(rollout, f) for f in rollout.__dataclass_fields__},
            "scores": torch.tensor(scores, dtype=torch.float64), "per_function": {}, "extra": {},
            "metrics": {"reward/mean": sum(scores) / G}}


class Pipe:
    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)

    def poll(self, timeout=None):
        return False


def streamed(k: int, prompts: int = 2, dynamic: bool = False) -> StreamedRollouts:
    cfg = Config(rollout={"prompts_per_step": prompts, "group_size": G}, train={"max_staleness": k, "steps": 100},
                 algorithm={"dynamic_sampling": dynamic, "max_sampling_rounds": 2})

    def shape(parts, rows, metrics):
        rollout = concat_rollouts([p[0] for p in parts], 0)
        return Collected(rollout, torch.cat([p[1] for p in parts]), None, rows, metrics, {})

    s = StreamedRollouts(cfg, None, None, [], None, torch.device("cpu"), ONE_PROCESS, print, shape=shape)
    s.channel, s.process = Pipe(), object()
    return s


def test_a_step_takes_the_first_groups_within_the_bound_and_drops_older_ones_for_good():
    s = streamed(k=1)
    s.pool = [group(0, 0), group(1, 3), group(2, 2), group(3, 1), group(4, 3), group(5, 3)]
    c = s.batch(5)  # updates version 4: versions 3 and 4 may train (k = 1), older ones are dropped
    assert [row["prompt"] for row in c.rows] == ["p1", "p4"]  # the first fresh ones, in the order they came
    assert c.rollout.prompt_index.tolist() == [0, 0, 1, 1]
    assert c.metrics["async/dropped_groups"] == 3 and c.metrics["async/waiting_groups"] == 1
    assert c.metrics["async/staleness_mean"] == 1 and c.metrics["async/staleness_max"] == 1
    assert [g["position"] for g in s.pool] == [5]
    assert s.consumed == 5  # what the generator process is told (its room to sample ahead)
    state = s.state_dict(4)[0]  # a checkpoint before the step's update is done (a signal): its groups are kept
    assert state["low"] == 1 and state["done"] == [2, 3] and [g["position"] for g in state["pool"]] == [1, 4, 5]
    s.process = None
    s.publish(5)  # the update is done: its groups were trained on
    state = s.state_dict(5)[0]
    assert state["low"] == 5 and state["done"] == [] and [g["position"] for g in state["pool"]] == [5]


def test_a_step_that_waits_tells_the_generator_its_room_first_and_a_signal_while_waiting_keeps_the_groups(monkeypatch):
    """The generator process begins at most (k + 1) x P groups not yet taken: a trainer waiting for groups after
    dropping some tells it first (or both would wait forever); a signal that abandons the step leaves the fresh groups
    in the pool (the step runs again after the resume, or the checkpoint keeps them)."""
    s = streamed(k=0)
    s.pool = [group(0, 1), group(1, 2)]

    def interrupted(step):
        raise KeyboardInterrupt

    monkeypatch.setattr(s, "_receive", interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.batch(3)  # version 2 trains: version 1 is too old, one fresh group of the two needed
    assert s.channel.sent == [("consumed", 1)]
    assert [g["position"] for g in s.pool] == [1] and s.state_dict(2)[0]["low"] == 1


def test_a_partial_group_trains_on_its_tokens_within_the_bound_and_attends_to_the_older_ones():
    """Partial rollouts: a group whose first tokens are older than the bound and its last ones not is trained on the
    newer ones only, the older ones left in the sequence as context; a group all of whose tokens are too old is
    dropped."""
    s = streamed(k=1)
    partly, wholly = group(0, 2), group(1, 1)
    partly["newest"], wholly["newest"] = 4, 2
    partly["rollout"]["versions"] = torch.tensor([[2, 3], [3, 4]])
    wholly["rollout"]["versions"] = torch.tensor([[1, 2], [1, 1]])
    fresh = group(2, 4)
    fresh["rollout"]["versions"] = torch.tensor([[4, 4], [4, 4]])
    s.pool = [wholly, partly, fresh]
    c = s.batch(5)  # version 4 trains: versions 3 and 4 may
    assert [row["prompt"] for row in c.rows] == ["p0", "p2"] and c.metrics["async/dropped_groups"] == 1
    assert c.rollout.response_mask[:2].tolist() == [[False, True], [True, True]]  # version 2 left out of the loss
    assert c.rollout.attention_mask[:2].all()  # and still attended
    assert c.rollout.logprobs[0, 0] == 0 and c.metrics["async/stale_tokens_masked"] == 1
    assert c.metrics["async/staleness_max"] == 1  # of the tokens trained on
    assert c.metrics["async/multi_version_frac"] == 0.5  # the first group's rows span versions; the second's not


def test_dynamic_sampling_leaves_out_groups_without_signal_up_to_its_rounds():
    s = streamed(k=2, dynamic=True)  # 2 prompts a step, 2 rounds: at most 2 groups left out a step
    s.pool = [group(0, 0, (1.0, 1.0)), group(1, 0), group(2, 0, (0.0, 0.0)), group(3, 0, (0.0, 0.0)), group(4, 0)]
    c = s.batch(1)
    assert [row["prompt"] for row in c.rows] == ["p1", "p3"]  # the third without signal is taken: the rounds ran out
    assert c.metrics["dynamic_sampling/filtered_groups"] == 2 and c.metrics["frac_reward_zero_std"] == 0.5


def test_the_batch_metrics_of_groups_scored_one_by_one():
    groups = [{"reward/mean": 1.0, "reward/f/std": 0.0, "reward/f/errors": 1.0, "reward/f/seconds": 0.5},
              {"reward/mean": 0.0, "reward/f/std": 0.0, "reward/f/errors": 2.0, "reward/f/seconds": 0.25}]
    raw = torch.tensor([1.0, 1.0, 0.0, 0.0])
    out = _batch_metrics(groups, raw, {"f": torch.tensor([1.0, 1.0, 0.0, math.nan])})
    assert out["reward/mean"] == 0.5 and out["reward/std"] == 0.5  # the batch's spread, not the groups' mean spread
    assert out["reward/f/errors"] == 3 and out["reward/f/seconds"] == 0.75
    assert out["reward/f/std"] == pytest.approx(torch.tensor([1.0, 1.0, 0.0]).std(correction=0).item())


# ------------------------------------------------------------------------------ runs
@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A max_staleness=1 run of 6 steps, a checkpoint every 2, every completion in samples.jsonl."""
    out = tmp_path_factory.mktemp("streamed")
    done = lmrl_train(out, *STREAMED, "train.steps=6", "train.save_every=2", "train.max_staleness=1")
    assert done.returncode == 0, done.stderr
    return out


def test_every_step_trains_on_fresh_groups_each_prompt_once(straight):
    rows = [r for r in metric_rows(straight) if r["step"] > 0]
    assert len(rows) == 6
    assert all(r["async/staleness_max"] <= 1 and r["async/staleness_mean"] <= r["async/staleness_max"] for r in rows)
    assert rows[0]["async/staleness_max"] == 0  # the first step: nothing older than the start
    # the decoupled correction sees the sampler: the trainer's own policy at step 1, an older one after it
    assert abs(rows[0]["val/sampler_kl"]) < 1e-5 and rows[0]["val/tis_weight_mean"] == pytest.approx(1, abs=1e-5)
    assert all(abs(r["val/tis_weight_mean"] - 1) > 1e-4 for r in rows if r["async/staleness_mean"] > 0)
    prompts = trained_prompts(straight)
    assert sorted(prompts) == [1, 2, 3, 4, 5, 6] and all(len(p) == 8 for p in prompts.values())
    every = [p for ps in prompts.values() for p in ps]
    assert len(set(every)) == len(every)  # no prompt trained twice


def run_with(tmp_path, k: int, steps: int, monkeypatch, slow_trainer: float = 0.0, slow_reward: float = 0.0):
    """An in-process run whose trainer (its update) or generator (its reward function) is made slow at will."""
    monkeypatch.delenv("LMRL_START_METHOD", raising=False)  # forked: the generator process takes this reward function

    def reward(completions, **_):
        time.sleep(slow_reward)
        return [float(c.strip().isdigit()) for c in completions]

    cfg = Config(rollout={"prompts_per_step": 8, "group_size": 4}, data={"num_eval_prompts": 0},
                 train={"steps": steps, "eval_every": 0, "max_staleness": k, "output_dir": str(tmp_path)},
                 log={"console": False, "samples_every": 0})
    trainer = Trainer(cfg, reward_funcs=[reward])
    update = trainer.update
    monkeypatch.setattr(trainer, "update", lambda exp: (time.sleep(slow_trainer), update(exp))[1])
    return trainer.train().history


def test_the_bound_holds_whichever_side_is_slower(tmp_path, monkeypatch):
    ahead = run_with(tmp_path / "fast", 2, 8, monkeypatch, slow_trainer=0.15)  # the generator runs ahead of the trainer
    assert all(r["async/staleness_max"] <= 2 for r in ahead)
    assert max(r["async/waiting_groups"] for r in ahead) > 0  # it did run ahead
    assert max(r["async/staleness_max"] for r in ahead) >= 1
    assert sum(r["time/wait_for_trainer"] for r in ahead) > 0.1  # and then waited for the trainer, within its bound
    behind = run_with(tmp_path / "slow", 0, 4, monkeypatch, slow_reward=0.05)  # the trainer waits for every group
    assert all(r["async/staleness_max"] == 0 and r["async/dropped_groups"] == 0 for r in behind)
    assert all(r["time/wait_for_batch"] > 0.05 for r in behind[1:])


def test_a_sigkill_then_a_resume_trains_no_prompt_twice_and_a_sigterm_leaves_no_process(tmp_path):
    args = [*STREAMED, "train.steps=8", "train.save_every=1", "train.max_staleness=2"]
    proc = forked.start("train", f"train.output_dir={tmp_path}", *args, cwd=ROOT)
    wait_for_step(proc, tmp_path, 4)
    generators = generator_pids(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    deadline = time.time() + 30
    while any(alive(pid) for pid in generators) and time.time() < deadline:  # the parent-death signal, not a delay
        time.sleep(0.05)
    assert generators and not any(alive(pid) for pid in generators)
    proc = forked.start("train", f"train.output_dir={tmp_path}", *args, "train.resume=auto", cwd=ROOT)
    wait_for_step(proc, tmp_path, 6)
    generators = generator_pids(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (0, 128 + signal.SIGTERM), err
    assert generators and not any(alive(pid) for pid in generators) and "Traceback" not in err
    resumed = lmrl_train(tmp_path, *args, "train.resume=auto")
    assert resumed.returncode == 0, resumed.stderr
    prompts = trained_prompts(tmp_path)
    assert sorted(prompts) == list(range(1, 9)) and all(len(p) == 8 for p in prompts.values())
    every = [p for ps in prompts.values() for p in ps]
    assert len(set(every)) == len(every)  # nothing trained twice
    rows = {r["step"]: r for r in metric_rows(tmp_path) if r["step"] > 0}
    assert all(r["async/staleness_max"] <= 2 for r in rows.values())


def test_two_ranks_each_stream_their_share_within_the_bound(tmp_path):
    """Under torchrun every rank's generator process streams the rank's own prompts (every other one) and the rank
    takes its share of each step; the spawned processes leave nothing behind (no semaphore the resource tracker
    warns of). 7-15 s on 2 cores: each generator process is spawned (a rank has a process group, which a fork would
    share), a fresh interpreter importing torch and transformers, as under a real torchrun."""
    done = forked.torchrun("train", f"train.output_dir={tmp_path}", *SMALL, "train.steps=3", "train.max_staleness=1",
                           cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr
    rows = [r for r in metric_rows(tmp_path) if r["step"] > 0]
    assert len(rows) == 3 and all(r["async/staleness_max"] <= 1 for r in rows) and rows[0]["async/staleness_max"] == 0
    assert "leaked" not in done.stderr


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("values, message", [
    ({"train": {"max_staleness": 1, "async_steps": 1}},
     "train.max_staleness: a bound on staleness and a fixed lag (train.async_steps=1) are two schedules; set one of them"),
    ({"train": {"max_staleness": -1}}, "train.max_staleness: "),
    ({"rollout": {"partial": True}}, "rollout.partial: partial rollouts are a way of bounded staleness; set "
                                     "train.max_staleness"),
    ({"rollout": {"partial": True}, "train": {"max_staleness": 0}},
     "rollout.partial: with train.max_staleness=0 every token must come from the policy being updated"),
    ({"rollout": {"partial": True, "backend": "vllm-server", "vllm": {"server_url": "http://127.0.0.1:1"}},
      "train": {"max_staleness": 1}},
     "rollout.partial: needs lmrl's decode without an environment: rollout.backend=vllm-server samples whole calls"),
    ({"rollout": {"partial": True}, "env": {"name": "calculator"}, "train": {"max_staleness": 1}},
     "rollout.partial: needs lmrl's decode without an environment: env.name=calculator samples whole calls"),
    ({"rollout": {"partial": "keep_cache"}, "train": {"max_staleness": 0}},
     "rollout.partial: with train.max_staleness=0 every token must come from the policy being updated"),
    ({"rollout": {"partial": "keep"}, "train": {"max_staleness": 1}},
     "rollout.partial: true, false or keep_cache (got 'keep')"),
])
def test_bad_bounds_are_one_line_before_a_model_loads(values, message):
    with pytest.raises(ConfigError) as e:
        Config(**values)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_the_cli_says_it_in_one_line():
    done = subprocess.run([sys.executable, "-m", "lmrl.cli", "train", "train.max_staleness=0", "rollout.partial=true",
                           "--dry-run"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and done.stderr.startswith("lmrl: error: rollout.partial: with train.max_staleness=0 ")
    assert len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize("partial", [True, "keep_cache"])
def test_partial_rollouts_train_on_tokens_of_several_versions_each_weighted_by_its_own_log_prob(tmp_path, monkeypatch,
                                                                                                partial):
    """rollout.partial=true (or keep_cache) through a real generator process: rows span versions (that each token's
    log-prob is the one the weights that sampled it gave is tests/rollout/test_hf_generator.py's), and the loss weighs
    every token by min(pi_prox / pi_behaviour, 2) with its own pi_behaviour, worked out here by hand from the batch."""
    from lmrl.engine import DecodeEngine

    monkeypatch.delenv("LMRL_START_METHOD", raising=False)
    step = DecodeEngine.step  # a decode slower than the update (the forked generator inherits it): rows span publishes
    monkeypatch.setattr(DecodeEngine, "step", lambda self: (time.sleep(0.025), step(self))[1])
    cfg = Config(rollout={"prompts_per_step": 8, "group_size": 4, "partial": partial}, data={"num_eval_prompts": 0},
                 train={"steps": 8, "eval_every": 0, "max_staleness": 2, "output_dir": str(tmp_path)},
                 log={"console": False, "samples_every": 0})
    trainer = Trainer(cfg)
    batches, checked = [], []
    batch, update = trainer.rollouts.batch, trainer.update

    def update_spy(exp):
        with torch.no_grad():
            prox, _ = trainer.forwards.policy_logprobs(exp.sequences, exp.attention_mask, exp.num_response_tokens)
        stats = update(exp)
        versions = batches[-1].rollout.versions[:, : exp.response_mask.shape[1]]
        if (versions.amax(1) > versions.masked_fill(versions < 0, 10**9).amin(1)).any():  # rows of several versions
            mask = exp.response_mask
            weights = torch.clamp(torch.exp(prox - exp.rollout_logprobs), max=2.0) * mask
            per_token = -weights * exp.advantages  # ratio 1 at the one update of a batch
            by_hand = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()  # seq-mean-token-mean
            assert stats["loss/policy_avg"] == pytest.approx(by_hand.item(), rel=1e-5, abs=1e-7)
            assert torch.equal(exp.rollout_logprobs, batches[-1].rollout.logprobs.float()[:, : mask.shape[1]])
            checked.append(versions)
        return stats

    monkeypatch.setattr(trainer.rollouts, "batch", lambda step: batches.append(batch(step)) or batches[-1])
    monkeypatch.setattr(trainer, "update", update_spy)
    rows = trainer.train().history
    assert checked, "no batch had a row that took new weights mid-sequence"
    assert all(r["async/staleness_max"] <= 2 for r in rows)
    assert max(r["async/multi_version_frac"] for r in rows) > 0
