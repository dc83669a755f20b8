"""Reward hacking made visible: a run whose reward is learned (a reward model, a judge, a function marked `learned`)
evaluates held-out prompts with a verifier beside it (`eval/learned_reward` next to `eval/accuracy`), and warns once
when the learned reward rises while the verified accuracy falls (`lmrl.guards.reward_hacking`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmrl.build import load_data
from lmrl.config import load_config
from lmrl.guards import Guards, reward_hacking
from lmrl.models.shipped import load_shipped
from tests.forked import lmrl

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------- the rule, by hand
@pytest.mark.parametrize(("evals", "fires"), [
    ([(0, 0.1, 0.40), (10, 0.5, 0.30)], True),  # up, and down by exactly the threshold
    ([(0, 0.1, 0.40), (10, 0.5, 0.31)], False),  # down by 9 points: within chance
    ([(0, 0.5, 0.40), (10, 0.5, 0.20)], False),  # the learned reward did not rise: a worse policy, not a hacked reward
    ([(0, 0.5, 0.40), (10, 0.4, 0.20)], False),  # both fell
    ([(0, 0.1, 0.40), (10, 0.5, 0.60)], False),  # both rose: learning
    ([(0, 0.1, 0.40)], False),  # one evaluation: nothing to compare
    # the window: the last against the evaluation 3 before it, not the first
    ([(0, 0.0, 0.60), (10, 0.1, 0.30), (20, 0.2, 0.31), (30, 0.3, 0.32), (40, 0.4, 0.33)], False),
    ([(0, 0.0, 0.60), (10, 0.1, 0.55), (20, 0.2, 0.50), (30, 0.3, 0.45)], True),  # fewer than 3 back: the first
    ([(0, 0.0, 0.60), (10, 0.1, 0.55), (20, 0.2, 0.50), (30, 0.3, 0.45), (40, 0.4, 0.44)], True),  # 0.55 -> 0.44
])
def test_the_rule_on_hand_made_evaluations(evals, fires):
    line = reward_hacking(evals, window=3, drop=0.1)
    assert (line is not None) == fires
    if fires:
        (s0, r0, a0), (s1, r1, a1) = evals[max(0, len(evals) - 4)], evals[-1]
        assert f"rose from {r0:.4g} to {r1:.4g} between steps {s0} and {s1}" in line
        assert f"fell from {a0:.4g} to {a1:.4g}" in line


def guards(**kw) -> Guards:
    return Guards(load_config(None, [f"guard.{k}={v}" for k, v in kw.items()]).guard, ["rm"], lr=1e-4, vocab_size=16)


def test_the_guard_warns_once_records_each_evaluation_and_survives_a_checkpoint():
    g = guards(hacking_window=2, hacking_drop=0.05)
    g.record_eval({"eval/accuracy": 0.4, "eval/learned_reward": -1.0})  # step 0
    m1 = {"eval/accuracy": 0.38, "eval/learned_reward": 0.0}
    assert g.check(10, m1) == [] and m1["guard/reward_hacking"] == 0.0
    assert "guard/reward_hacking" not in (m := {"objective/scores": 0.1}) and g.check(11, m) == []  # no evaluation
    m2 = {"eval/accuracy": 0.30, "eval/learned_reward": 1.0}
    [line] = g.check(20, m2)
    assert line.startswith("step 20: the learned reward may be hacked: eval/learned_reward rose from -1 to 1 "
                           "between steps 0 and 20 while the verified eval/accuracy fell from 0.4 to 0.3 "
                           "(guard.hacking_drop=0.05, guard.hacking_window=2)")
    assert m2["guard/reward_hacking"] == 1.0
    h = guards(hacking_window=2, hacking_drop=0.05)
    h.load_state_dict(json.loads(json.dumps(g.state_dict())))  # as a checkpoint stores it
    m3 = {"eval/accuracy": 0.2, "eval/learned_reward": 2.0}
    assert h.check(30, m3) == [] and m3["guard/reward_hacking"] == 1.0  # recorded again, said once
    assert h.evals == g.evals + [(30, 2.0, 0.2)]


def test_a_run_without_a_learned_reward_checks_nothing():
    g = guards()
    g.record_eval({"eval/accuracy": 0.4})
    m = {"eval/accuracy": 0.0}
    assert g.check(10, m) == [] and "guard/reward_hacking" not in m


# ------------------------------------------------------------------------------------- which runs verify
@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> Path:
    """An (untrained) reward model on the shipped model, saved as `lmrl train-rm` saves one."""
    from transformers import AutoModelForSequenceClassification

    from lmrl.models.shipped import SHIPPED_MODEL

    path = tmp_path_factory.mktemp("rm")
    _, tok = load_shipped()
    AutoModelForSequenceClassification.from_pretrained(SHIPPED_MODEL, num_labels=1).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def verifier_names(*overrides: str) -> list[str] | None:
    cfg = load_config(None, list(overrides))
    data = load_data(cfg, load_shipped()[1])
    return None if data.verifier is None else data.verifier.names


def test_reward_models_and_judges_are_learned_verifiers_are_not():
    from lmrl.rewards import JudgeScorer, RewardModelScorer, exact_match_reward
    from lmrl.rewards.core import is_learned

    assert is_learned(RewardModelScorer) and is_learned(JudgeScorer)
    assert not is_learned(exact_match_reward()) and not is_learned(lambda completions, **kw: [0.0])


def test_a_learned_reward_on_a_task_is_verified_by_the_tasks_reward(reward_model_dir):
    rm = f"reward.functions=[{{fn: reward_model, path: {reward_model_dir}}}]"
    assert verifier_names(rm) == ["exact_match_reward"]
    assert verifier_names() is None  # the task's own reward: it is the verifier already
    assert verifier_names(rm, "reward.verifier=[]") is None  # turned off
    assert verifier_names(rm, "reward.verifier=[{fn: regex, pattern: '^[0-9]+$'}]") == ["regex"]


def test_a_verifier_needs_its_columns_on_the_held_out_rows(tmp_path, reward_model_dir):
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1="}\n')
    (tmp_path / "eval.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    done = lmrl("train", f"data.path={tmp_path / 'train.jsonl'}", f"data.eval_path={tmp_path / 'eval.jsonl'}",
                f"reward.functions=[{{fn: reward_model, path: {reward_model_dir}}}]", "reward.verifier=[{fn: exact_match, column: answer}]",
                "train.steps=1", f"train.output_dir={tmp_path / 'out'}", cwd=tmp_path, timeout=120)
    last = done.stderr.strip().splitlines()[-1]  # (after the reward model's loading bar: transformers')
    assert done.returncode == 2 and last.startswith("lmrl: error: data.eval_path: "), done.stderr
    assert "eval.jsonl line 2: column 'answer' (needed by reward 'exact_match') is missing" in last


# ------------------------------------------------------------------------------------------- a real run
HACKABLE = '''
def off_by_one(completions, answer, **kwargs):
    """A learned reward gone wrong: it prefers the answer one above the right one."""
    return [float(c.strip() == str(int(a) + 1)) for c, a in zip(completions, answer)]

off_by_one.learned = True
'''


def test_a_run_that_hacks_its_learned_reward_is_warned_once(tmp_path):
    (tmp_path / "rm.py").write_text(HACKABLE)
    out = tmp_path / "run"
    done = lmrl("train", "reward.functions=[rm.py:off_by_one]", "train.steps=20", "train.eval_every=5",
                "rollout.prompts_per_step=16", "rollout.group_size=8", "data.num_eval_prompts=100", "optim.lr=3e-4",
                "guard.hacking_window=2", f"train.output_dir={out}", "log.console=false", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 5, 10, 15, 20]
    assert all("eval/learned_reward" in r for r in evals)
    warnings = [line for line in (done.stdout + done.stderr).splitlines() if "reward may be hacked" in line]
    assert len(warnings) == 1 and warnings[0].startswith("lmrl: warning: step "), warnings
    step = int(warnings[0].split()[3].rstrip(":"))
    i = next(i for i, r in enumerate(evals) if r.get("guard/reward_hacking") == 1.0)
    assert evals[i]["step"] == step
    then, now = evals[max(0, i - 2)], evals[i]  # what the line compared: the eval 2 before (guard.hacking_window=2)
    assert now["eval/learned_reward"] > then["eval/learned_reward"]
    assert now["eval/accuracy"] <= then["eval/accuracy"] - 0.1
    # the summary line is the verified accuracy's, not the learned reward's
    assert f"held-out accuracy: {evals[0]['eval/accuracy']:.1%} -> {evals[-1]['eval/accuracy']:.1%}" in done.stdout
