"""Presets: the defaults an algorithm's paper sets (`ALGORITHM_PRESETS`, `REWARD_PRESETS`) and those of the models
shipped with lmrl (`MODEL_PRESETS`), and the step that puts them under a user's values.

Building a Config takes the user's values as nested dicts (`user_values`: shorthands such as `algorithm="rloo"`
expanded), puts the presets under them (`with_presets`: the model's, then the algorithm's; the user's values
win) and validates the result. `without_presets` undoes it for `Config.for_model`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from lmrl.config.sections import ModelConfig, RolloutConfig
from lmrl.errors import ConfigError

# Defaults of each algorithm, as its paper (or the reference implementation) sets them. Fields not listed
# keep AlgorithmConfig's defaults. Reading guide:
#   grpo     Shao et al. 2024: group-normalised advantages, per-sequence token mean, KL (k3) in the loss.
#            lmrl defaults the KL coefficient to 0 as DAPO and Dr. GRPO recommend (set kl_coef=0.04 for the paper).
#   dr_grpo  Liu et al. 2025: no std division, constant length normaliser.
#   dapo     Yu et al. 2025: clip-higher, dynamic sampling, token-level loss, soft overlong penalty.
#   rloo     Ahmadian et al. 2024: leave-one-out baseline, KL in the reward.
#   reinforce_pp  Hu 2025: REINFORCE++ with token-level k1 KL in the reward and batch-whitened returns;
#            the _baseline variant subtracts the group mean first.
#   ppo      Schulman et al. 2017 / Ouyang et al. 2022: GAE with a critic, KL in the reward, whitened advantages.
#   gspo     Zheng et al. 2025: sequence-level ratio with tiny clip ranges.
#   cispo    MiniMax 2025: clipped, stop-gradient importance weights on a REINFORCE objective.
#   sapo     Gao et al. 2025: a soft sigmoid gate on the ratio instead of the clip.
#   gmpo     Zhao et al. 2025: the geometric mean of the token ratios, clipped in log space to (e^-0.4, e^0.4).
#   clip_cov, kl_cov  Cui et al. 2025: drop the gradient of / put a KL on the highest-covariance tokens.
#   gpg      Chu et al. 2025: plain policy gradient (no ratio, no clip), advantages scaled by B / informative.
#   cpgd     Liu et al. 2025: clipped log-ratio plus a policy-drift penalty.
#   remax    Li et al. 2023: REINFORCE with the greedy completion's reward as the baseline.
ALGORITHM_PRESETS: dict[str, dict[str, Any]] = {
    "grpo": dict(advantage="grpo", aggregation="seq-mean-token-mean"),
    "dr_grpo": dict(advantage="dr_grpo", aggregation="seq-mean-token-sum-norm"),
    "dapo": dict(
        advantage="grpo", clip_low=0.2, clip_high=0.28, aggregation="token-mean", dynamic_sampling=True
    ),
    "rloo": dict(advantage="rloo", aggregation="token-mean", kl_coef=0.05, kl_in="reward", kl_estimator="k1",
                 kl_level="sequence"),
    "reinforce": dict(advantage="reinforce", clip_low=None, clip_high=None, aggregation="token-mean"),
    "reinforce_pp": dict(advantage="reinforce", aggregation="token-mean", kl_coef=0.01, kl_in="reward",
                         kl_estimator="k1", whiten_advantages=True),
    "reinforce_pp_baseline": dict(advantage="reinforce_baseline", aggregation="token-mean", kl_coef=0.01,
                                  kl_in="reward", kl_estimator="k1", whiten_advantages=True),
    "ppo": dict(advantage="gae", aggregation="token-mean", kl_coef=0.05, kl_in="reward", kl_estimator="k1",
                whiten_advantages=True, gamma=1.0, lam=0.95),
    "gspo": dict(advantage="grpo", ratio_level="sequence", clip_low=3e-4, clip_high=4e-4,
                 aggregation="seq-mean-token-mean"),
    "cispo": dict(advantage="grpo", loss="cispo", clip_low=None, clip_high=5.0, aggregation="token-mean"),
    "sapo": dict(advantage="grpo", loss="sapo", aggregation="token-mean"),
    "gmpo": dict(advantage="grpo", loss="gmpo", clip_low=0.4, clip_high=0.4, aggregation="seq-mean-token-mean"),
    "clip_cov": dict(advantage="grpo", loss="clip_cov", aggregation="token-mean"),
    "kl_cov": dict(advantage="grpo", loss="kl_cov", aggregation="token-mean"),
    "gpg": dict(advantage="gpg", clip_low=None, clip_high=None, aggregation="token-mean"),
    "cpgd": dict(advantage="grpo", loss="cpgd", aggregation="token-mean"),
    "remax": dict(advantage="remax", clip_low=None, clip_high=None, aggregation="token-mean"),
}
# Reward-side defaults of an algorithm, as fractions of rollout.max_new_tokens. DAPO's soft overlong
# penalty starts in the last fifth of the length budget (4k of 20k tokens in the paper); a budget too short
# for a fifth of it to be a whole token (under 5 tokens: the shipped task's 4, where a correct answer fills
# the budget) gets no buffer, rather than a penalty on every answer that uses the budget.
REWARD_PRESETS: dict[str, dict[str, float]] = {"dapo": dict(overlong_buffer=0.2)}

# Defaults for the model that ships with lmrl (a 0.5M-parameter character-level Llama): the general
# defaults suit billion-parameter models (lr 1e-6); a tiny model learns at 1e-4 and runs fastest on one
# thread. The critic (PPO) learns at 1e-4 too: at the general 1e-5 its value loss took ~100 steps to settle
# instead of ~20 (docs/algorithms.md, "Learning on the shipped task"). It is a value head on the policy's own
# backbone (model.shared_critic): PPO learned as much per step as with a separate copy (300 steps: +27.8 and
# +26.2 points against +27.0 and +27.2) in 0.15 s per step instead of 0.22, so 75 s take it past +25 points
# (benchmarks/preset_gains.py). Measured in scripts/make_tiny_model.py's notes and the README's demo run. User
# values win; model.critic_name_or_path, when given, drops the shared head.
MODEL_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny-addition": {
        "rollout": dict(prompts_per_step=32, group_size=8, max_new_tokens=4),
        "optim": dict(lr=1e-4, critic_lr=1e-4),
        "data": dict(num_eval_prompts=500),
        "train": dict(steps=2000, max_minutes=4.5, eval_every=50, threads=1, output_dir="runs/tiny-addition"),
        "log": dict(every=25, samples_every=250),
        "model": dict(shared_critic=True),
    },
    "tiny-calculator": {  # the calculator task, multi-turn: a tool call, its result, the answer
        "data": dict(task="calculator", num_eval_prompts=500),
        "rollout": dict(prompts_per_step=32, group_size=8, max_new_tokens=24, stop=["</calc>"]),
        "env": dict(max_turns=2),
        "optim": dict(lr=1e-4),
        "train": dict(steps=2000, max_minutes=5.0, eval_every=50, threads=1, output_dir="runs/tiny-calculator"),
        "log": dict(every=25, samples_every=250),
    },
    "tiny-reasoner": {  # the calculator task on a reasoning chat model, through an agent program of the user's:
        # env.name=agent env.command="python examples/reasoning_agent.py" (docs/agents.md)
        "data": dict(task="calculator", num_eval_prompts=500),
        "model": dict(chat_template=True),
        "rollout": dict(prompts_per_step=32, group_size=8, max_new_tokens=48, stop=["</calc>"]),
        "env": dict(max_turns=2),
        "optim": dict(lr=1e-4),
        "train": dict(steps=2000, max_minutes=5.0, eval_every=50, threads=1, output_dir="runs/tiny-reasoner"),
        "log": dict(every=25, samples_every=250),
    },
    "tiny-vision": {  # a tiny LLaVA on the digits task: the digit drawn in the image plus k from the text
        "data": dict(task="digits", num_eval_prompts=200),
        "rollout": dict(prompts_per_step=16, group_size=8, max_new_tokens=3),
        "optim": dict(lr=2e-4),
        "train": dict(steps=3000, max_minutes=5.0, eval_every=20, threads=1, output_dir="runs/tiny-vision"),
        "log": dict(every=10, samples_every=100),
    },
}


# `algorithm=rloo` is `algorithm.name=rloo`: a section given as a string sets this field of it
SHORTHANDS = {"algorithm": "name", "model": "name_or_path", "data": "task"}


def expand_shorthands(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with a section given as a string (`algorithm: rloo`) as the field it stands for (`{name: rloo}`)."""
    raw = dict(raw)
    for section, field in SHORTHANDS.items():
        if isinstance(raw.get(section), str):
            raw[section] = {field: raw[section]}
    return raw


def user_values(data: dict[str, Any]) -> dict[str, Any]:
    """A config's input as plain nested dicts: shorthands expanded (`algorithm="rloo"`), and a section given as
    an object (`algorithm=AlgorithmConfig(name="rloo")`) as the fields set in it."""
    out = {}
    for key, value in expand_shorthands(data).items():
        out[key] = value.model_dump(exclude_unset=True) if isinstance(value, BaseModel) else value
    return out


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` with `extra` over it, section by section (nested dicts merge; anything else in `extra` wins)."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def with_presets(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with the presets under it: the model's (`MODEL_PRESETS`), then the algorithm's (`ALGORITHM_PRESETS`,
    `REWARD_PRESETS`); anything set in `raw` wins."""
    model = (raw.get("model") or {}).get("name_or_path", ModelConfig.model_fields["name_or_path"].default)
    preset = MODEL_PRESETS.get(model, {}) if isinstance(model, str) else {}
    if (raw.get("model") or {}).get("critic_name_or_path"):  # a critic to load: no shared value head from the preset
        preset = {**preset, "model": {k: v for k, v in preset.get("model", {}).items() if k != "shared_critic"}}
    raw = merge(preset, raw) if isinstance(model, str) else dict(raw)
    algo = raw.get("algorithm") or {}
    if not isinstance(algo, dict):
        return raw  # (pydantic names the section and what is wrong with it)
    name = algo.get("name", "grpo")
    if name not in ALGORITHM_PRESETS:
        raise ConfigError(f"algorithm.name: unknown algorithm {name!r}; choose one of {', '.join(ALGORITHM_PRESETS)}")
    raw["algorithm"] = {**ALGORITHM_PRESETS[name], **algo, "name": name}
    max_new = (raw.get("rollout") or {}).get("max_new_tokens", RolloutConfig.model_fields["max_new_tokens"].default)
    reward_preset = {k: (int(f * max_new) or None) if isinstance(max_new, int) else None
                     for k, f in REWARD_PRESETS.get(name, {}).items()}
    if isinstance(raw.get("reward") or {}, dict):
        raw["reward"] = {**reward_preset, **dict(raw.get("reward") or {})}
    return raw


def without_presets(values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """A built config's values (`Config.model_dump()`) less what the presets set and the user (`given`) did not:
    the model preset's values that are still the preset's, and the reward presets that follow the length budget.
    The inverse of `with_presets`, for `Config.for_model`."""
    out = {section: dict(fields) for section, fields in values.items()}
    for section, fields in MODEL_PRESETS.get(out["model"]["name_or_path"], {}).items():
        for key, preset in fields.items():
            if key not in given.get(section, {}) and out[section][key] == preset:
                del out[section][key]
    for key in REWARD_PRESETS.get(out["algorithm"]["name"], {}):
        if key not in given.get("reward", {}):
            del out["reward"][key]
    return out
