"""Asynchronous rollouts (train.async_steps, `lmrl.async_rollouts`) as a user runs them: real CLI processes, a real
generator process, real signals. What must hold: async_steps=0 is the synchronous loop; every batch is sampled by
exactly the policy k steps older (none older); the loss reweights the generator's own log-probs by the decoupled
objective; runs repeat given their seed and resume exactly; a dead generator is one line after a checkpoint; a
signal leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from lmrl import Config, Trainer
from lmrl import algorithms as A
from lmrl.checkpoint import checkpoints
from lmrl.errors import ConfigError
from tests import forked
from tests.test_long_runs import ROOT, lmrl_train, metric_rows

# the shipped model and task, small: 8 prompts x 4 per step, a short evaluation
SMALL = ["rollout.prompts_per_step=8", "rollout.group_size=4", "data.num_eval_prompts=8", "train.eval_every=0",
         "log.console=false", "log.samples_every=0", "train.max_minutes=null"]
TIMING = ("time/", "eps", "/seconds", "memory/peak_")
# model.device=auto runs these on a GPU where there is one, whose backward kernels add in no fixed order (atomics): two
# runs agree to float rounding there (a grad norm 2e-6 apart on the H100, 2026-11-27), bit for bit on the CPU
SAME = 1e-4 if torch.cuda.is_available() else 1e-6


def same_metrics(a: list[dict], b: list[dict]) -> None:
    """The same steps with the same metrics to 1e-6 (1e-4 on a GPU), wall-clock timings aside."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        keys = {k for k in x if k not in ("step", "time") and not any(t in k for t in TIMING)}
        assert keys == {k for k in y if k not in ("step", "time") and not any(t in k for t in TIMING)}
        for k in keys:
            assert x[k] == pytest.approx(y[k], rel=SAME, abs=SAME, nan_ok=True), (x["step"], k)


def generator_pids(parent: int) -> list[int]:
    """The trainer's generator process: its child named lmrl-generator."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            name = (entry / "comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and name == "lmrl-generator":
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for_step(proc: forked.Started, out: Path, step: int, timeout: float = 180) -> None:
    metrics, deadline = out / "metrics.jsonl", time.time() + timeout
    while time.time() < deadline and proc.poll() is None:  # polling for progress, not a tuned delay
        if metrics.exists() and any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines()):
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {step}")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted async_steps=1 run of 6 steps, a checkpoint every 2."""
    out = tmp_path_factory.mktemp("straight")
    done = lmrl_train(out, *SMALL, "train.steps=6", "train.save_every=2", "train.async_steps=1")
    assert done.returncode == 0, done.stderr
    return out


# ------------------------------------------------------------------------------ the schedule
def test_every_batch_is_exactly_k_steps_old(straight):
    rows = [r for r in metric_rows(straight) if r["step"] > 0]
    assert [r["async/policy_version"] for r in rows] == [0, 0, 1, 2, 3, 4]  # the batch of step s: version s - 2
    assert [r["async/version_lag"] for r in rows] == [0, 1, 1, 1, 1, 1]
    # a stale batch is reweighted: the sampler's log-probs are not the trainer's any more
    assert all(r["val/sampler_kl"] != 0 and r["val/tis_weight_mean"] != 1 for r in rows[1:])
    # that a run repeats given its seed, whatever the timing: the resumed run below equals this one


def test_two_steps_ahead_lag_two_versions(tmp_path):
    cfg = Config(rollout={"prompts_per_step": 8, "group_size": 4}, data={"num_eval_prompts": 8},
                 train={"steps": 4, "eval_every": 0, "async_steps": 2, "output_dir": str(tmp_path)},
                 log={"console": False, "samples_every": 0})
    rows = Trainer(cfg).train().history  # in this process: the CLI's runs are tested above
    assert [r["async/policy_version"] for r in rows] == [0, 0, 0, 1]
    assert max(r["async/version_lag"] for r in rows) == 2


def test_async_steps_zero_is_the_synchronous_loop(tmp_path):
    cfg = dict(rollout={"prompts_per_step": 4, "group_size": 4}, data={"num_eval_prompts": 4},
               train={"steps": 2, "eval_every": 0}, log={"console": False, "samples_every": 0})
    runs = []
    for name, extra in (("default", {}), ("zero", {"async_steps": 0})):
        c = Config(**{**cfg, "train": {**cfg["train"], **extra, "output_dir": str(tmp_path / name)}})
        trainer = Trainer(c)
        assert trainer.rollouts is None
        runs.append(trainer.train().history)
    same_metrics([{"step": i, **h} for i, h in enumerate(runs[0])], [{"step": i, **h} for i, h in enumerate(runs[1])])
    assert not any(k.startswith("async/") for k in runs[0][0])


# ------------------------------------------------------------------------------ the correction
def test_the_loss_is_the_decoupled_objective_on_the_generators_log_probs(tmp_path):
    """Step 2 trains on a batch the starting policy sampled, one update later: the loss must weigh each token by
    min(pi_prox / pi_behaviour, 2), with pi_behaviour the log-probs the generator process sent and pi_prox the
    policy at the start of the update, the ratio against pi_prox (exactly 1 at the one update of a batch)."""
    cfg = Config(rollout={"prompts_per_step": 8, "group_size": 4}, data={"num_eval_prompts": 4},
                 train={"steps": 3, "eval_every": 0, "async_steps": 1, "output_dir": str(tmp_path)},
                 log={"console": False, "samples_every": 0})
    trainer = Trainer(cfg)
    sent, seen = {}, []
    batch, update = trainer.rollouts.batch, trainer.update

    def batch_spy(step):
        c = batch(step)
        sent[step] = c.rollout.logprobs.clone()
        return c

    def update_spy(exp):
        with torch.no_grad():
            prox, _ = trainer.forwards.policy_logprobs(exp.sequences, exp.attention_mask, exp.num_response_tokens)
        stats = update(exp)
        seen.append((exp, prox, stats))
        return stats

    trainer.rollouts.batch, trainer.update = batch_spy, update_spy
    trainer.train()
    exp, prox, stats = seen[1]  # step 2: sampled by version 0, trained by version 1
    behaviour = exp.rollout_logprobs
    mask = exp.response_mask
    assert torch.equal(behaviour, sent[2].float()[:, : behaviour.shape[1]])
    weights = torch.clamp(torch.exp(prox - behaviour), max=2.0) * mask  # pi_prox / pi_behaviour, truncated at 2
    assert not torch.allclose(weights[mask], torch.ones_like(weights[mask]))  # the batch is stale
    per_token = -weights * exp.advantages  # ratio 1: -w * min(A, clip(1) A)
    by_hand = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()  # seq-mean-token-mean
    assert stats["loss/policy_avg"] == pytest.approx(by_hand.item(), rel=1e-5, abs=1e-7)
    loss, _ = A.decoupled_policy_loss(prox, prox, behaviour, exp.advantages, mask, behav_cap=2.0,
                                      aggregation="seq-mean-token-mean")
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-5, abs=1e-7)


# ------------------------------------------------------------------------------ failures and signals
def test_a_killed_generator_is_one_line_after_a_checkpoint(tmp_path):
    proc = forked.start("train", f"train.output_dir={tmp_path}", *SMALL, "train.steps=500", "train.async_steps=1",
                        cwd=ROOT)
    wait_for_step(proc, tmp_path, 2)
    (pid,) = generator_pids(proc.pid)
    os.kill(pid, signal.SIGKILL)
    start = time.time()
    _, err = proc.communicate(timeout=60)
    assert time.time() - start < 60
    assert proc.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("lmrl: error: step ") and "the generator process died (killed by SIGKILL)" in last, err
    assert "Traceback" not in err
    (step, path), = checkpoints(tmp_path)
    assert f"{path} written: add train.resume=auto to continue" in last
    assert step >= 2


def test_sigterm_stops_both_processes_and_the_resumed_run_is_the_straight_one(tmp_path, straight):
    args = [*SMALL, "train.steps=6", "train.save_every=2", "train.async_steps=1"]
    proc = forked.start("train", f"train.output_dir={tmp_path}", *args, cwd=ROOT)
    wait_for_step(proc, tmp_path, 3)
    generators = generator_pids(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal landed")  # a very fast machine: nothing to test
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert generators and not any(alive(pid) for pid in generators)
    assert "Traceback" not in err
    resumed = lmrl_train(tmp_path, *args, "train.resume=auto")
    assert resumed.returncode == 0, resumed.stderr
    same_metrics(metric_rows(straight), metric_rows(tmp_path))


def test_ctrl_c_in_a_terminal_stops_both_processes_after_a_checkpoint(tmp_path):
    """Ctrl-C reaches the terminal's whole process group: the generator process ignores it, the trainer checkpoints
    and stops it; nothing is left running."""
    proc = forked.start("train", f"train.output_dir={tmp_path}", *SMALL, "train.steps=500", "train.async_steps=1",
                        cwd=ROOT, start_new_session=True)
    wait_for_step(proc, tmp_path, 2)
    generators = generator_pids(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends on Ctrl-C
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "SIGINT: stopped after step " in err.strip().splitlines()[-1] and "Traceback" not in err
    assert generators and not any(alive(pid) for pid in generators)
    assert checkpoints(tmp_path)


def test_a_signal_while_a_batch_is_read_keeps_the_batch_and_stops_after_the_step():
    """A signal abandons steps 1-3 at once, but not while the trainer reads the generator process's message: a
    batch read off the pipe and dropped by the abandon was lost, and the checkpoint that followed waited for it
    forever (Ctrl-C hung about once in 8 runs on a loaded machine). Here the signal arrives mid-read."""
    import pickle
    from types import SimpleNamespace

    from lmrl.async_rollouts import AsyncRollouts
    from lmrl.distributed import World
    from lmrl.lifecycle import RunLifecycle

    rollouts = AsyncRollouts.__new__(AsyncRollouts)  # its message handling alone: no generator process
    rollouts.ready, rollouts.receiving = {}, False
    life = SimpleNamespace(stop_signal=None, world=World(), abandon_at=3, files={"async_batches": rollouts})
    batch = {"step": 3, "version": 1}

    class Pipe:
        def poll(self, timeout):
            return True

        def recv_bytes(self):
            RunLifecycle._on_signal(life, signal.SIGINT, None)  # as the handler runs when Ctrl-C lands here
            return pickle.dumps(("batch", batch))

    rollouts.channel, rollouts.process = Pipe(), SimpleNamespace(is_alive=lambda: True)
    rollouts._receive(3)
    assert rollouts.ready == {3: batch} and not rollouts.receiving
    assert life.stop_signal == signal.SIGINT  # the run stops after this step's checkpoint
    life.stop_signal = None  # outside a read, the step is abandoned at once, as before
    with pytest.raises(BaseException) as abandoned:
        RunLifecycle._on_signal(life, signal.SIGINT, None)
    assert type(abandoned.value).__name__ == "_AbandonStep"


def test_a_multi_turn_lora_run_samples_with_the_merged_adapters(tmp_path):
    """The calculator task (episodes with a tool) on a LoRA policy: the generator process gets the base weights with
    the adapters merged, so its first batch is on-policy, and episodes run there as in a synchronous step."""
    cfg = Config(model={"name_or_path": "tiny-calculator", "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
                 rollout={"prompts_per_step": 4, "group_size": 4}, data={"num_eval_prompts": 8},
                 train={"steps": 2, "eval_every": 0, "async_steps": 1, "output_dir": str(tmp_path)},
                 log={"console": False, "samples_every": 0})
    rows = Trainer(cfg).train().history
    assert abs(rows[0]["val/sampler_kl"]) < 1e-5
    assert all(r["env/turns"] >= 1 for r in rows)


def test_a_forked_generator_takes_any_reward_function_a_spawned_one_says_what_it_cannot_take(tmp_path, monkeypatch):
    """Forked (Linux, CUDA unused), the generator process inherits a lambda; spawned (CUDA, other systems) it would
    have to unpickle it, and a run that cannot be given its inputs is refused in one line when the Trainer is built."""
    monkeypatch.setenv("LMRL_START_METHOD", "fork")  # what a CPU run chooses on Linux, also on a GPU machine
    cfg = Config(rollout={"prompts_per_step": 4, "group_size": 2}, data={"num_eval_prompts": 4}, model={"device": "cpu"},
                 train={"steps": 2, "async_steps": 1, "eval_every": 0, "output_dir": str(tmp_path / "fork")},
                 log={"console": False, "samples_every": 0})
    length = lambda prompts, completions, **kw: [float(len(c)) for c in completions]  # noqa: E731
    history = Trainer(cfg, reward_funcs=[length]).train().history
    assert [h["async/policy_version"] for h in history] == [0, 0] and history[1]["reward/mean"] > 0
    monkeypatch.setenv("LMRL_START_METHOD", "spawn")
    cfg.train.output_dir = str(tmp_path / "spawn")
    with pytest.raises(ConfigError, match=r"^train.async_steps: the generator process cannot be given the run's inputs"):
        Trainer(cfg, reward_funcs=[length])


# ------------------------------------------------------------------------------ ranks
def test_two_ranks_each_with_a_generator_keep_dapos_groups_together(tmp_path):
    """Under torchrun every rank has its own generator process; the generator processes form their own group,
    so DAPO's choice of informative groups spans every rank's share, as in a synchronous run. 7-10 s on 2 cores: the
    two generator processes are spawned, fresh interpreters (a rank's process group rules out a fork)."""
    done = forked.torchrun("train", f"train.output_dir={tmp_path}", *SMALL, "train.steps=3", "train.async_steps=1",
                           "algorithm=dapo", cwd=ROOT,
                           env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # CPU ranks, also on a one-GPU machine
    assert done.returncode == 0, done.stderr
    rows = [r for r in metric_rows(tmp_path) if r["step"] > 0]
    assert [r["async/policy_version"] for r in rows] == [0, 0, 1]
    assert all(r["dynamic_sampling/kept_groups"] == 8 for r in rows)  # both ranks' groups: 8 prompts in all


def test_a_generator_process_of_several_threads_is_spawned_and_runs(tmp_path, monkeypatch):
    """A forked generator process whose OpenMP runs several threads hung at its first parallel region once the
    trainer had run one with several (GNU libgomp's thread pool does not survive fork): the default on any machine of
    4 cores or more. It is spawned instead, and the run ends. 5-10 s on 2 cores: the spawned process is a fresh
    interpreter importing torch and transformers (it ends itself unless the trainer is its parent, so it cannot be a
    stand-in's program, tests/forked.py)."""
    import lmrl.async_rollouts as a

    monkeypatch.delenv("LMRL_START_METHOD", raising=False)
    assert a.start_method(1) == "fork" and a.start_method(2) == "spawn"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)  # 8 cores
    assert a.placement(Config()) == (1, "fork")  # unless set, a generator that can be forked runs one thread
    assert a.placement(Config(train={"generator_threads": 4})) == (4, "spawn")
    unset = {"threads": None}  # (the shipped task's preset sets 1)
    assert a.async_threads(Config(train={**unset, "async_steps": 1})) == (8, 1)  # a fixed lag: the trainer every core
    assert a.async_threads(Config(train={**unset, "max_staleness": 2})) == (7, 1)  # streamed: the others
    assert a.async_threads(Config(train={**unset, "max_staleness": 2, "generator_threads": 3})) == (5, 3)
    monkeypatch.setenv("LMRL_START_METHOD", "spawn")
    assert a.async_threads(Config(train={**unset, "max_staleness": 2})) == (4, 4)  # spawned: half the cores each
    monkeypatch.delenv("LMRL_START_METHOD")
    done = lmrl_train(tmp_path, *SMALL, "train.steps=2", "train.async_steps=1", "train.threads=2",
                      "train.generator_threads=2", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# ------------------------------------------------------------------------------ the sync probe
def probed_run(tmp_path, steps: int = 4) -> Trainer:
    cfg = Config(rollout={"prompts_per_step": 8, "group_size": 4}, data={"num_eval_prompts": 0},
                 train={"steps": steps, "eval_every": 0, "async_steps": 1, "output_dir": str(tmp_path)},
                 guard={"sync_probe_every": 1}, log={"console": False, "samples_every": 0})
    return Trainer(cfg)


def test_the_sync_probe_checks_the_weights_the_generator_takes_after_the_first_step(tmp_path):
    """The batches after the first are a version behind, so their log-probs cannot be held to the trainer's; the
    probe compares one sequence's under the weights of step s, from the trainer as it publishes them and from the
    generator process once it has taken them (answered with batch s + 2)."""
    rows = probed_run(tmp_path).train().history
    probed = {step: r["val/sampler_probe_diff"] for step, r in enumerate(rows, 1) if "val/sampler_probe_diff" in r}
    assert sorted(probed) == [3, 4], probed  # the weights of steps 1 and 2; step 1 is checked by its own batch
    assert all(diff < 1e-5 for diff in probed.values()), probed  # float32 on the CPU: the same model


def test_a_generator_that_takes_wrong_weights_is_stopped_by_the_probe_after_a_checkpoint(tmp_path, monkeypatch):
    """From version 1 on the generator process's model takes weights one layer of which is 5% off (forked: it runs
    the patched method). Step 1's batch is sampled by version 0 and passes; the probe of version 1 stops the run."""
    from lmrl.guards import SamplerMismatch
    from lmrl.rollout.server import ModelGenerator

    load = ModelGenerator.load_weights

    def wrong(self, weights, version):
        off = ((n, t * 1.05 if version >= 1 and n.endswith("layers.0.mlp.down_proj.weight") else t) for n, t in weights)
        return load(self, off, version)

    monkeypatch.setattr(ModelGenerator, "load_weights", wrong)
    monkeypatch.delenv("LMRL_START_METHOD", raising=False)
    trainer = probed_run(tmp_path, steps=6)
    with pytest.raises(SamplerMismatch, match=r"^step 3: the sampler \(the generator process's copy, train.async_steps=1\) does "
                                              r"not compute the policy: its log-probs of a probe sequence under the "
                                              r"weights it last took differ from the trainer's"):
        trainer.train()
    assert len(trainer.result.history) == 3  # steps 1-3 logged: the probe of version 1 came with batch 3
    assert [step for step, _ in checkpoints(tmp_path)] == [3]
