"""Long runs, as a user meets them: real `lmrl train` processes stopped by real signals and SIGKILLs at
named points (tests/fault_driver.py), resumed with train.resume=auto, and compared with a run that was
never interrupted: the same metrics and bit-identical weights. Plus the output-directory rules, the
lock, and the guards that stop a run doing silent harm. Each run is its own process, forked from one
that has imported lmrl (tests/forked.py); a signal from outside is sent to a process forked so too, which it reaches as any process."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmrl.checkpoint import COMPLETE, RunLock, atomic_directory, checkpoints, plan_run, prune
from lmrl.config import load_config
from lmrl.errors import ConfigError, RunError
from lmrl.guards import Guards
from tests.forked import lmrl, script, start

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "fault_driver.py"
# the shipped model and task, small: 4 steps of 4 prompts x 4, a checkpoint every 2 steps
SMALL = ["train.steps=4", "train.save_every=2", "rollout.prompts_per_step=4", "rollout.group_size=4",
         "data.num_eval_prompts=8", "train.eval_every=2", "log.console=false"]
CONFIGS = {
    "grpo": [],
    "ppo": ["algorithm=ppo"],  # the shipped model's preset: the value head on the policy (model.shared_critic)
    "ppo-critic": ["algorithm=ppo", "model.shared_critic=false"],  # a separate critic
    "lora": ["model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj]}", "optim.lr=1e-3"],
}
TIMING = ("time/", "eps", "/seconds", "memory/peak_")  # wall clock and memory peaks: the only metrics a resumed run may change


def lmrl_train(out: Path, *args: str, fault: tuple[str, int] | None = None, timeout: float = 240):
    """`lmrl train` (or the fault driver) as its own process, forked from a zygote that has imported lmrl."""
    if fault is None:
        return lmrl("train", f"train.output_dir={out}", *args, cwd=ROOT, timeout=timeout)
    return script(DRIVER, fault[0], str(fault[1]), f"train.output_dir={out}", *args, cwd=ROOT, timeout=timeout)


def metric_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(a: Path, b: Path) -> None:
    """Same steps, the same metrics (to 1e-6, timings aside) and bit-identical final weights."""
    ra, rb = metric_rows(a), metric_rows(b)
    assert [r["step"] for r in rb] == [r["step"] for r in ra]
    for x, y in zip(ra, rb):
        keys = {k for k in x if k not in ("step", "time") and not any(t in k for t in TIMING)}
        assert keys == {k for k in y if k not in ("step", "time") and not any(t in k for t in TIMING)}
        for k in keys:
            if x[k] is None or y[k] is None:
                assert x[k] is None and y[k] is None, (x["step"], k)
            else:
                assert math.isclose(x[k], y[k], rel_tol=1e-6, abs_tol=1e-6), (x["step"], k, x[k], y[k])
    for name in ("model.safetensors", "adapter_model.safetensors"):
        if (a / "final" / name).exists():
            wa, wb = load_file(a / "final" / name), load_file(b / "final" / name)
            assert wa.keys() == wb.keys()
            assert all(torch.equal(wa[k], wb[k]) for k in wa), f"final/{name} differs"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Each config run start to end without interruption: what a resumed run must reproduce."""
    runs = {}

    def get(name: str) -> Path:
        if name not in runs:
            out = tmp_path_factory.mktemp(f"straight-{name}")
            done = lmrl_train(out, *SMALL, *CONFIGS[name])
            assert done.returncode == 0, done.stderr
            runs[name] = out
        return runs[name]

    return get


# ------------------------------------------------------------------------------------- resume, exact
@pytest.mark.parametrize("name", list(CONFIGS))
def test_sigterm_mid_generation_then_resume_equals_the_straight_run(tmp_path, straight, name):
    stopped = lmrl_train(tmp_path, *SMALL, *CONFIGS[name], fault=("sigterm-in-generation", 4))
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("lmrl: error: SIGTERM: stopped after step 3; checkpoint ") and "train.resume=auto" in last
    assert "Traceback" not in stopped.stderr
    assert [s for s, _ in checkpoints(tmp_path)] == [2, 3]  # the abandoned step 4 left step 3's state
    assert not (tmp_path / "final").exists()
    resumed = lmrl_train(tmp_path, *SMALL, *CONFIGS[name], "train.resume=auto")
    assert resumed.returncode == 0, resumed.stderr
    assert_same_run(straight(name), tmp_path)


def test_sigint_during_the_update_finishes_the_step_then_resumes_exactly(tmp_path, straight):
    stopped = lmrl_train(tmp_path, *SMALL, fault=("sigint-in-update", 3))
    assert stopped.returncode == 128 + signal.SIGINT, stopped.stderr
    assert "SIGINT received: stopping after a checkpoint" in stopped.stderr
    assert "stopped after step 3" in stopped.stderr.strip().splitlines()[-1]
    assert [s for s, _ in checkpoints(tmp_path)] == [2, 3]
    assert lmrl_train(tmp_path, *SMALL, "train.resume=auto").returncode == 0
    assert_same_run(straight("grpo"), tmp_path)


def test_a_second_sigint_exits_at_once_without_a_checkpoint(tmp_path):
    stopped = lmrl_train(tmp_path, *SMALL, fault=("sigint-twice", 3))
    assert stopped.returncode == 128 + signal.SIGINT
    assert "SIGINT again: exiting now, without a checkpoint" in stopped.stderr
    assert [s for s, _ in checkpoints(tmp_path)] == [2]


@pytest.mark.parametrize("fault", ["kill-after-state", "kill-mid-model", "kill-before-rename"])
def test_sigkill_while_a_checkpoint_is_written_resumes_from_the_previous_one(tmp_path, straight, fault):
    killed = lmrl_train(tmp_path, *SMALL, fault=(fault, 4))
    assert killed.returncode == -signal.SIGKILL
    partial = [p.name for p in tmp_path.glob(".tmp-checkpoint-4-*")]
    assert partial, "the kill should leave a half-written checkpoint behind"
    assert [s for s, _ in checkpoints(tmp_path)] == [2]  # the partial one is not taken for a checkpoint
    resumed = lmrl_train(tmp_path, *SMALL, "train.resume=auto", "log.console=true")
    assert resumed.returncode == 0, resumed.stderr
    assert f"removed {partial[0]}" in resumed.stdout and "resumed at step 2" in resumed.stdout
    assert not list(tmp_path.glob(".tmp-*"))
    assert_same_run(straight("grpo"), tmp_path)


def test_external_sigterm_at_any_moment_resumes_exactly(tmp_path, straight):
    """SIGTERM from outside, as a scheduler sends it, once the run has logged a step: wherever it lands the
    resumed run is the straight one (a longer run, so that the signal lands mid-run)."""
    args = [*SMALL, "train.steps=8"]
    proc = start("train", f"train.output_dir={tmp_path}", *args, cwd=ROOT)
    metrics, deadline = tmp_path / "metrics.jsonl", time.time() + 180
    while time.time() < deadline and proc.poll() is None:  # polling for progress, not a tuned delay
        if metrics.exists() and any(json.loads(line)["step"] >= 2 for line in metrics.read_text().splitlines()):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal landed")  # a very fast machine: nothing to test
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert lmrl_train(tmp_path, *args, "train.resume=auto").returncode == 0
    reference = tmp_path.parent / "reference"
    assert lmrl_train(reference, *args).returncode == 0
    assert_same_run(reference, tmp_path)


def test_a_changed_config_is_refused_on_resume_naming_the_fields(tmp_path):
    assert lmrl_train(tmp_path, *SMALL, "train.steps=2").returncode == 0
    refused = lmrl_train(tmp_path, *SMALL, "train.resume=auto", "optim.lr=3e-4", "rollout.group_size=8")
    assert refused.returncode == 2
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("lmrl: error: train.resume: the config differs from ")
    assert "optim.lr (0.0001 -> 0.0003)" in line and "rollout.group_size (4 -> 8)" in line
    # steps and cadences may change: the run goes on from step 2 to 4
    assert lmrl_train(tmp_path, *SMALL, "train.resume=auto", "train.eval_every=1").returncode == 0
    assert [r["step"] for r in metric_rows(tmp_path)] == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------------------- output directory, lock
def test_an_existing_run_is_never_overwritten_by_accident(tmp_path):
    assert lmrl_train(tmp_path, *SMALL, "train.steps=1").returncode == 0
    first = (tmp_path / "metrics.jsonl").read_text()
    again = lmrl_train(tmp_path, *SMALL, "train.steps=1")
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1] == (
        f"lmrl: error: train.output_dir: {tmp_path} holds a run (lmrl_config.yaml, metrics.jsonl, final, checkpoint-1); "
        "resume it with train.resume=auto, or start afresh with train.overwrite=true (deletes it)")
    assert "Loading weights" not in again.stderr  # refused before any model loads
    assert (tmp_path / "metrics.jsonl").read_text() == first
    fresh = lmrl_train(tmp_path, *SMALL, "train.steps=1", "train.overwrite=true", "train.seed=1")
    assert fresh.returncode == 0 and (tmp_path / "metrics.jsonl").read_text() != first


def test_a_directory_in_use_by_another_run_is_refused(tmp_path):
    with RunLock(tmp_path):  # held by this process, as a running `lmrl train` holds it
        refused = lmrl_train(tmp_path, *SMALL, "train.steps=1")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        f"lmrl: error: train.output_dir: {tmp_path} is in use by another lmrl run (pid {os.getpid()}); "
        "wait for it to end or choose another train.output_dir")
    assert "Loading weights" not in refused.stderr  # refused before any model loads
    assert not (tmp_path / "lmrl_config.yaml").exists()


def test_plan_run_rules(tmp_path):
    cfg = lambda *o: load_config(None, [f"train.output_dir={tmp_path}", *o])  # noqa: E731
    assert plan_run(cfg()).checkpoint is None  # an empty directory: a new run
    (tmp_path / "metrics.jsonl").write_text("")
    assert plan_run(cfg("train.resume=auto")).clear  # killed before its first checkpoint: start afresh
    (tmp_path / "final").mkdir()
    with pytest.raises(RunError, match="holds a finished run with no checkpoint to resume"):
        plan_run(cfg("train.resume=auto"))
    with pytest.raises(RunError, match="checkpoint-9 does not exist; give a checkpoint directory, or auto"):
        plan_run(cfg(f"train.resume={tmp_path / 'checkpoint-9'}"))
    (tmp_path / "checkpoint-9").mkdir()
    with pytest.raises(RunError, match="checkpoint-9 is not a complete checkpoint"):
        plan_run(cfg(f"train.resume={tmp_path / 'checkpoint-9'}"))
    with pytest.raises(ConfigError, match=r"train.keep_last: must be >= 1 \(got 0\)"):
        cfg("train.keep_last=0")


# ------------------------------------------------------------------------------------ atomic writes
def test_a_failed_write_leaves_nothing_and_a_complete_one_has_its_marker(tmp_path):
    with pytest.raises(OSError), atomic_directory(tmp_path / "checkpoint-1") as tmp:
        (tmp / "x").write_text("half")
        raise OSError("disk full")
    assert list(tmp_path.iterdir()) == []
    with atomic_directory(tmp_path / "checkpoint-1") as tmp:
        (tmp / "x").write_text("whole")
    assert (tmp_path / "checkpoint-1" / COMPLETE).is_file() and list(tmp_path.iterdir()) == [tmp_path / "checkpoint-1"]


def test_keep_last_prunes_old_checkpoints_and_ignores_incomplete_ones(tmp_path):
    for step in (2, 4, 6):
        with atomic_directory(tmp_path / f"checkpoint-{step}"):
            pass
    (tmp_path / "checkpoint-8").mkdir()  # no COMPLETE: not a checkpoint
    assert [s for s, _ in checkpoints(tmp_path)] == [2, 4, 6]
    prune(tmp_path, keep_last=2)
    assert [s for s, _ in checkpoints(tmp_path)] == [4, 6]


# -------------------------------------------------------------------------------------- faults, guards
REWARDS = '''
import math, os

def boom(prompts, completions, **kw):
    calls = int(os.environ.get("LMRL_TEST_CALLS", "0")) + 1
    os.environ["LMRL_TEST_CALLS"] = str(calls)
    if calls == 3:
        1 / 0
    return [1.0] * len(completions)

def late_inf(prompts, completions, **kw):
    calls = int(os.environ.get("LMRL_TEST_CALLS", "0")) + 1
    os.environ["LMRL_TEST_CALLS"] = str(calls)
    return [math.inf if calls == 4 else 1.0] * len(completions)

def never(prompts, completions, **kw):
    return [None] * len(completions)

def garbage(prompts, completions, **kw):  # a judge whose every answer has no score in it
    from lmrl.rewards.core import Failed
    return [Failed("the judge's answer has no score in it: 'I cannot rate this'")] * len(completions)
'''


def test_a_failing_reward_is_one_line_after_a_checkpoint(tmp_path):
    (tmp_path / "rw.py").write_text(REWARDS)
    out = tmp_path / "run"
    failed = lmrl_train(out, *SMALL, "train.save_every=0", "data.num_eval_prompts=0",
                        f"reward.functions=[{tmp_path / 'rw.py'}:boom]")
    assert failed.returncode == 1
    assert "Traceback" not in failed.stderr
    assert failed.stderr.strip().splitlines()[-1] == (
        "lmrl: error: step 3: reward function 'boom' failed: ZeroDivisionError: division by zero; "
        f"{out / 'checkpoint-2'} written: add train.resume=auto to continue")
    assert [s for s, _ in checkpoints(out)] == [2]


def test_a_reward_failing_in_an_evaluation_keeps_the_step_before_it(tmp_path):
    """The 4th call is the evaluation after step 2: step 2 is logged and saved (save_every=0 saves nothing
    else), the line names the value; the weights saved are finite and the run resumes from them."""
    (tmp_path / "rw.py").write_text(REWARDS)
    out = tmp_path / "run"
    stopped = lmrl_train(out, *SMALL, "train.save_every=0", f"reward.functions=[{tmp_path / 'rw.py'}:late_inf]")
    assert stopped.returncode == 1
    assert stopped.stderr.strip().splitlines() == [
        "lmrl: error: step 2: reward function 'late_inf' returned inf for completion 0 (expected a finite number or "
        f"None); {out / 'checkpoint-2'} written: add train.resume=auto to continue"]
    assert [r["step"] for r in metric_rows(out)] == [0, 1, 2]
    assert [s for s, _ in checkpoints(out)] == [2] and not (out / "final").exists()
    saved = load_file(out / "checkpoint-2" / "model.safetensors")
    assert all(bool(torch.isfinite(t).all()) for t in saved.values())


def test_a_non_finite_loss_skips_the_update_moving_nothing():
    """A NaN in the experience (here an advantage) makes the loss non-finite: no weight, Adam moment or
    learning-rate step moves, and the step is counted in guard/skipped_updates."""
    from lmrl.experience import make_experience
    from lmrl.trainer import Trainer

    cfg = load_config(None, [*SMALL, "algorithm.entropy_coef=0.01", "optim.warmup_steps=4"])
    trainer = Trainer(cfg)
    c = trainer.collect(1)
    exp = make_experience(c.rollout, c.scores, **cfg.algorithm.options_for(make_experience), policy_logprobs=None)
    exp.advantages[0, 0] = math.nan
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    stats = trainer.update(exp)
    assert stats["guard/skipped_updates"] == 1.0 and not math.isfinite(stats["loss/policy_avg"])
    assert all(torch.equal(before[k], v) for k, v in trainer.policy.state_dict().items())
    assert trainer.optimizer.state_dict()["state"] == {} and trainer.scheduler.last_epoch == 0
    exp.advantages[0, 0] = 0.0  # the same batch, finite: the update moves the weights
    assert trainer.update(exp)["guard/skipped_updates"] == 0.0
    assert not all(torch.equal(before[k], v) for k, v in trainer.policy.state_dict().items())


def test_batches_no_reward_function_scores_warn_once_then_stop(tmp_path):
    (tmp_path / "rw.py").write_text(REWARDS)
    out = tmp_path / "run"
    stopped = lmrl_train(out, *SMALL, "train.steps=10", "log.console=true", f"reward.functions=[{tmp_path / 'rw.py'}:never]")
    assert stopped.returncode == 1
    assert stopped.stdout.count("no reward function (never) scored any completion") == 1
    assert stopped.stderr.strip().splitlines()[-1] == (
        "lmrl: error: step 3: 3 steps in a row where no reward function (never) scored any completion "
        "(guard.max_unscored_steps=3); check that the functions' columns and answer format match the dataset")
    assert [r["guard/unscored_steps"] for r in metric_rows(out)[1:]] == [1.0, 2.0, 3.0]


def test_a_reward_failing_for_every_completion_under_on_error_zero_warns_once_then_stops(tmp_path):
    (tmp_path / "rw.py").write_text(REWARDS)
    out = tmp_path / "run"
    stopped = lmrl_train(out, *SMALL, "train.steps=10", "log.console=true", "reward.on_error=zero",
                         f"reward.functions=[{tmp_path / 'rw.py'}:garbage]")
    assert stopped.returncode == 1
    assert stopped.stdout.count("reward function 'garbage' failed for every completion, which") == 1
    assert stopped.stderr.strip().splitlines()[-1] == (
        "lmrl: error: step 3: 3 steps in a row where reward function 'garbage' failed for every completion "
        "(guard.max_failed_steps=3); its scores are all the 0 of reward.on_error=zero, so the run would train on "
        "nothing; fix the function or its endpoint")
    assert [r["reward/garbage/failed_frac"] for r in metric_rows(out)[1:]] == [1.0, 1.0, 1.0]


def test_failed_steps_must_be_in_a_row_and_a_function_not_called_keeps_its_count():
    g = _guards(max_failed_steps=2)
    assert g.check(1, {"reward/f/failed_frac": 1.0})[0].startswith("step 1: reward function 'f' failed for every")
    assert g.check(2, {"reward/f/failed_frac": 0.5}) == []  # some scored: the count starts again
    assert g.check(3, {"reward/f/failed_frac": 1.0}) == []  # warned once
    assert g.check(4, {}) == []  # not called (no completion of its recipe): neither counts nor resets
    state = g.state_dict()
    g = _guards(max_failed_steps=2)
    g.load_state_dict(state)  # a resumed run counts on
    with pytest.raises(RunError, match=r"^step 5: 2 steps in a row where reward function 'f' failed for every"):
        g.check(5, {"reward/f/failed_frac": 1.0})


def _guards(**kw):
    return Guards(load_config(None, [f"guard.{k}={v}" for k, v in kw.items()]).guard, ["f"], lr=1e-4, vocab_size=100)


def test_skipped_steps_must_be_in_a_row_to_stop_the_run():
    g = _guards(max_skipped_steps=2)
    for step, skipped in enumerate([1.0, 0.0, 1.0, 0.0], start=1):
        g.check(step, {"guard/skipped_updates": skipped})
    with pytest.raises(RunError, match=r"step 6: 2 steps in a row .*\(optim.lr=0.0001\)"):
        for step in (5, 6):
            g.check(step, {"guard/skipped_updates": 1.0, "objective/raw_scores": 0.5})


@pytest.mark.parametrize("entropy", [0.001, 4.5])  # one answer for every prompt; a scrambled, uniform policy
def test_collapse_is_warned_once_and_recorded(entropy):
    g = _guards()
    g.record_eval({"eval/accuracy": 0.3})
    assert g.check(1, {"eval/accuracy": 0.25, "rollout/entropy_estimate": entropy}) == []  # not far enough down
    m = {"eval/accuracy": 0.05, "rollout/entropy_estimate": entropy}
    [line] = g.check(2, m)
    assert line.startswith("step 2: the policy may have collapsed: entropy") and "best of 0.3" in line
    assert m["guard/collapse"] == 1.0
    assert g.check(3, dict(m)) == []  # said once
    assert g.check(4, {"eval/accuracy": 0.05, "rollout/entropy_estimate": 1.0}) == []  # a healthy entropy


def test_guard_state_survives_a_checkpoint():
    g = _guards()
    g.record_eval({"eval/accuracy": 0.5})
    g.check(1, {"guard/skipped_updates": 1.0, "reward/all_none_frac": 1.0})
    h = _guards()
    h.load_state_dict(json.loads(json.dumps(g.state_dict())))
    assert h.state_dict() == g.state_dict()


def test_the_sync_check_stops_the_step_whose_sampler_is_not_the_policy():
    """A sampler with weights of its own (an engine) whose log-probs are not the trainer's stops the run at any
    step whose batch the current policy sampled (a sync that breaks later too); within the limit it goes on; an
    asynchronous batch a version behind is not held to it; val/sampler_kl past its line is warned once."""
    from lmrl.guards import SamplerMismatch

    cfg = load_config(None, []).guard
    engine = Guards(cfg, ["f"], lr=1e-4, sampler="rollout.backend=vllm, qwen3_moe",
                    sampler_advice="use rollout.backend=lmrl for this model", sampler_exact=True)
    with pytest.raises(SamplerMismatch, match=r"the sampler \(rollout.backend=vllm, qwen3_moe\) does not compute the "
                                              r"policy: .* by 0.00334 nats per token \(guard.max_sampler_diff=0.001\)"
                                              r".* \(use rollout.backend=lmrl for this model\)$"):
        engine.check(1, {"val/sampler_logprob_diff": 0.00334, "val/sampler_kl": 1e-4})
    stale = Guards(cfg, ["f"], lr=1e-4, sampler="the generator process's copy", sampler_exact=True)
    assert stale.check(1, {"val/sampler_logprob_diff": 0.06, "async/version_lag": 1.0}) == []  # a version behind
    with pytest.raises(SamplerMismatch):  # checked at a batch as new as the policy
        stale.check(2, {"val/sampler_logprob_diff": 0.06, "async/version_lag": 0.0})
    synced = Guards(cfg, ["f"], lr=1e-4, sampler="rollout.backend=vllm, llama", sampler_exact=True)
    assert synced.check(1, {"val/sampler_logprob_diff": 4e-7, "val/sampler_kl": 1e-7}) == []
    lines = synced.check(2, {"val/sampler_logprob_diff": 2e-7, "val/sampler_kl": 0.2})
    assert len(lines) == 1 and lines[0].startswith("step 2: val/sampler_kl is 0.2 (guard.sampler_kl_warn=0.05)")
    assert synced.check(3, {"val/sampler_logprob_diff": 2e-7, "val/sampler_kl": 0.3}) == []  # warned once
    with pytest.raises(SamplerMismatch):  # a sync that breaks at step 4
        synced.check(4, {"val/sampler_logprob_diff": 0.5, "val/sampler_kl": 0.01})
    bf16 = Guards(cfg, ["f"], lr=1e-4, sampler="its rollout.dtype=bfloat16 copy")  # not exact: 0.1
    assert bf16.check(1, {"val/sampler_logprob_diff": 0.02}) == []
    with pytest.raises(SamplerMismatch):
        Guards(cfg, ["f"], lr=1e-4, sampler="x").check(1, {"val/sampler_logprob_diff": float("nan")})
    assert Guards(cfg, ["f"], lr=1e-4).check(1, {"val/sampler_logprob_diff": 5.0}) == []  # the policy samples itself
