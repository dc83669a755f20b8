"""Training with an environment: multi-turn episodes through the whole trainer, from Python and from config."""

from __future__ import annotations

import json

import pytest
import torch

from lmrl.config import load_config
from lmrl.envs import Step
from lmrl.models.tiny import char_tokenizer, tiny_causal_lm
from lmrl.trainer import Trainer

ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(20)]


class CountDigits:
    """Three turns; each observation says how many digits were written so far; reward: 0.1 per digit."""

    def __init__(self, row):
        self.turn, self.digits = 0, 0

    def step(self, text, token_ids):
        self.turn += 1
        digits = sum(ch.isdigit() for ch in text)
        self.digits += digits
        return Step(observation=f"[{self.digits}]", reward=digits / 10, done=self.turn == 3, info={"tool_calls": 1.0})


def config(tmp_path, *overrides):
    return load_config(None, [
        # a digit ends a turn, so that the turns of a random model end often (its EOS almost never comes)
        "train.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
        'rollout.stop=["0","1","2","3","4","5","6","7","8","9"]',
        "optim.lr=1e-2", f"train.output_dir={tmp_path}", "log.console=false", "train.eval_every=0",
        "algorithm=ppo", "algorithm.num_iterations=2", "algorithm.num_minibatches=2", *overrides])


def test_a_custom_environment_trains_with_its_own_reward_and_logs_episode_metrics(tmp_path):
    tok = char_tokenizer()
    model = tiny_causal_lm(tok, hidden_size=32, num_layers=1, seed=0)
    trainer = Trainer(config(tmp_path, "algorithm=grpo"), model=model, tokenizer=tok, train_dataset=ROWS, env=CountDigits)
    assert trainer.data.rewards.names == ["env_reward"]
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    result = trainer.train()
    last = result.history[-1]
    assert last["env/turns"] > 1 and last["env/observation_tokens"] > 0 and last["env/tool_calls"] == last["env/turns"]
    assert last["env/model_tokens"] > 0 and 0 < last["env/observation_token_frac"] < 1
    assert "reward/env_reward/mean" in last
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "env/turns" in rows[-1]


def test_the_first_minibatch_ratio_is_one_on_multi_turn_rollouts(tmp_path):
    tok = char_tokenizer()
    model = tiny_causal_lm(tok, hidden_size=32, num_layers=1, seed=1)
    trainer = Trainer(config(tmp_path, "algorithm.num_minibatches=1", "train.steps=1"), model=model, tokenizer=tok,
                      train_dataset=ROWS, env=CountDigits)
    c = trainer.collect(1)
    assert c.rollout.response_attention is not None
    exp = trainer.experience(c)  # num_iterations=2: the old log-probs come from a forward over whole episodes
    mask = exp.response_mask
    torch.testing.assert_close(exp.old_logprobs[mask], c.rollout.logprobs[mask], atol=1e-5, rtol=0)


def test_the_tools_environment_from_config(tmp_path):
    tools = tmp_path / "my_tools.py"
    tools.write_text('def double(x: int) -> int:\n    """Double a number.\n\n    Args:\n        x: the number\n    """\n'
                     "    return 2 * x\n")
    cfg = config(tmp_path / "run", "env.name=tools", f"env.tools=[{tools}:double]", "env.max_turns=2",
                 "reward.functions=[exact_match]")
    tok = char_tokenizer()
    trainer = Trainer(cfg, model=tiny_causal_lm(tok, hidden_size=32, num_layers=1), tokenizer=tok, train_dataset=ROWS)
    assert list(trainer.env.tools.tools) == ["double"]
    result = trainer.train()
    assert {"env/turns", "env/tool_calls", "env/malformed_calls", "env/tool_errors"} <= set(result.history[-1])


def test_an_environment_spec_that_does_not_load_is_one_line(tmp_path):
    from lmrl.errors import ConfigError

    tok = char_tokenizer()
    with pytest.raises(ConfigError, match=r"^env.name: environment 'nope.py:Env': file 'nope.py' not found$"):
        Trainer(config(tmp_path, "env.name=nope.py:Env"), model=tiny_causal_lm(tok, hidden_size=32, num_layers=1),
                tokenizer=tok, train_dataset=ROWS)


@pytest.mark.parametrize(("override", "line"), [
    ("env.name=tool", "env.name: environment 'tool': expected a built-in name ['agent', 'tools'], "),
    ("env.tools=[pyhton]", "env.tools[0]: tool spec 'pyhton': expected a built-in name ['python'], "),
])
def test_a_misspelt_builtin_environment_or_tool_is_told_its_own_builtins(tmp_path, override, line):
    """A spec in neither file nor module form lists the names its own field takes, not the reward built-ins."""
    from lmrl.build import make_environment
    from lmrl.errors import ConfigError

    extra = ["env.name=tools"] if override.startswith("env.tools") else []
    with pytest.raises(ConfigError) as e:
        make_environment(config(tmp_path, *extra, override))
    assert str(e.value) == line + "'path/to/file.py:function' or 'module.sub:function'"


def test_the_documented_retry_environment_runs_from_the_command_line(tmp_path):
    """What docs/agents.md tells users to run: a custom environment named in the config, the shipped model."""
    from pathlib import Path

    from tests.forked import lmrl

    root = Path(__file__).resolve().parents[2]
    out = lmrl("train", "env.name=examples/retry_env.py:Retry", "env.max_turns=3", "reward.functions=[env]",
               "train.steps=2", "train.eval_every=0", "rollout.prompts_per_step=4", f"train.output_dir={tmp_path}",
               "log.console=false", cwd=root, timeout=300)  # its own process, forked from one that imported lmrl
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["step"] == 2 and 1 <= last["env/turns"] <= 3
    assert "env/wrong_answers" in last and "reward/env_reward/mean" in last


def test_packed_and_padded_make_the_same_update_on_multi_turn_episodes(tmp_path):
    """Observation tokens inside a response are attended to and not trained on: packing keeps both."""
    tok = char_tokenizer()
    runs = []
    for pack in ("true", "false"):
        trainer = Trainer(config(tmp_path / pack, "train.steps=1", f"train.packing={pack}", "optim.micro_batch_tokens=60"),
                          model=tiny_causal_lm(tok, hidden_size=32, num_layers=1, seed=1), tokenizer=tok,
                          train_dataset=ROWS, env=CountDigits)
        metrics = trainer.train_step(1)
        runs.append((metrics, [p.detach().clone() for p in trainer.policy.parameters()]))
    assert runs[0][0]["env/observation_tokens"] > 0
    assert runs[0][0]["loss/policy_avg"] == pytest.approx(runs[1][0]["loss/policy_avg"], rel=1e-4, abs=1e-6)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
