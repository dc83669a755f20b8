"""RL works: a short GRPO run on the shipped model and the built-in task raises held-out accuracy."""

from __future__ import annotations

from lmrl.config import load_config
from lmrl.trainer import Trainer


def test_short_grpo_run_raises_heldout_accuracy_and_reward(tmp_path):
    # the shipped-model preset (lr 1e-4, 32 prompts x 8, one thread), seeds fixed, 60 steps (~20 s)
    cfg = load_config(None, ["train.steps=60", "train.eval_every=0", "train.max_minutes=null", "data.num_eval_prompts=200",
                             f"train.output_dir={tmp_path}", "log.console=false", "train.seed=0"])
    result = Trainer(cfg).train()
    before, after = result.evals[0]["eval/accuracy"], result.evals[-1]["eval/accuracy"]
    assert after >= before + 0.08, (before, after)
    assert result.evals[-1]["eval/reward"] > result.evals[0]["eval/reward"] + 0.08  # the task reward, held out


def test_rl_teaches_the_calculator_model_to_use_its_tool(tmp_path):
    # the tiny-calculator preset, 20 steps of 8 prompts x 8 episodes: the tool-call rate and accuracy rise
    cfg = load_config(None, ["model.name_or_path=tiny-calculator", "train.steps=20", "train.eval_every=0",
                             "train.max_minutes=null", "data.num_eval_prompts=100", "rollout.prompts_per_step=8",
                             "optim.lr=3e-4", f"train.output_dir={tmp_path}", "log.console=false", "train.seed=0"])
    result = Trainer(cfg).train()
    before, after = result.evals[0]["eval/accuracy"], result.evals[-1]["eval/accuracy"]
    assert after >= before + 0.2, (before, after)
    assert result.history[-1]["env/tool_calls"] > result.history[0]["env/tool_calls"]
