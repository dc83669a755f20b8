"""Config: presets, overrides, YAML, and one-line errors that name the field."""

import pytest

from lmrl.config import (
    ALGORITHM_PRESETS,
    DEFAULT_TIS_CAP,
    MODEL_PRESETS,
    ConfigError,
    load_config,
    parse_overrides,
)
from lmrl.models.shipped import SHIPPED_MODELS


def test_defaults_are_grpo_on_the_shipped_task():
    cfg = load_config()
    assert cfg.algorithm.name == "grpo" and cfg.algorithm.advantage == "grpo"
    assert cfg.data.task == "addition" and cfg.model.name_or_path == "tiny-addition"
    assert not cfg.needs_reference  # kl_coef 0: no reference model is loaded


@pytest.mark.parametrize("name", list(ALGORITHM_PRESETS))
def test_every_preset_validates(name):
    cfg = load_config(None, [f"algorithm={name}"])
    for key, value in ALGORITHM_PRESETS[name].items():
        assert getattr(cfg.algorithm, key) == value


def test_user_value_beats_preset():
    cfg = load_config(None, ["algorithm.name=dapo", "algorithm.clip_high=0.3"])
    assert cfg.algorithm.clip_high == 0.3 and cfg.algorithm.dynamic_sampling  # the rest of the preset stays
    assert cfg.reward.overlong_buffer is None  # a fifth of the tiny model's 4 new tokens is not a whole token
    assert load_config(None, ["algorithm=dapo", "rollout.max_new_tokens=5"]).reward.overlong_buffer == 1
    assert load_config(None, ['algorithm=dapo', 'model=m', 'data.path=x']).reward.overlong_buffer == 51


def test_yaml_then_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("algorithm: rloo\ntrain:\n  steps: 7\nrollout:\n  group_size: 4\n")
    cfg = load_config(p, ["train.steps=9", "rollout.stop=[\"\\n\"]"])
    assert cfg.algorithm.advantage == "rloo" and cfg.train.steps == 9 and cfg.rollout.group_size == 4
    assert cfg.rollout.stop == ["\n"]


def test_override_values_are_parsed_as_yaml():
    assert parse_overrides(["a.b=1e-3", "a.c=true", "a.d=[1, 2]", "e=x"]) == {
        "a": {"b": 1e-3, "c": True, "d": [1, 2]}, "e": "x"}


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["algorithm.clip_hgh=0.3"], "algorithm.clip_hgh: algorithm has no field 'clip_hgh'; did you mean 'clip_high'?"),
        (["algorithm=foo"], "algorithm.name: unknown algorithm 'foo'"),
        (["rollout.temperature=0"], "rollout.temperature: must be > 0 (got 0)"),
        (["algorithm.aggregation=mean"], "algorithm.aggregation: got 'mean'"),
        (["optim.lr=abc"], "optim.lr: must be a number (got 'abc')"),
        (["rollout.group_size=1"], "rollout.group_size: must be >= 2"),
        (["trian.steps=3"], "did you mean 'train'?"),
        (["algorithm.num_minibatches=3"], "algorithm.num_minibatches: 3 must divide"),
        (["algorithm.dual_clip=0.5"], "algorithm.dual_clip: must be > 1 (got 0.5)"),
        (["steps"], "expected key=value"),
        (["algorithm=ppo", "model.shared_critic=true", "model.critic_name_or_path=critic"],
         "model.shared_critic: the value head sits on the policy's backbone, so there is no separate critic to load"),
    ],
)
def test_bad_values_fail_with_one_line_naming_the_field(overrides, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_shipped_model_preset_under_user_values():
    tiny = load_config()
    assert tiny.optim.lr == 1e-4 and tiny.rollout.max_new_tokens == 4 and tiny.train.threads == 1
    assert load_config(None, ["optim.lr=3e-5"]).optim.lr == 3e-5
    real = load_config(None, ["model=Qwen/Qwen2.5-0.5B-Instruct", "data.path=x.jsonl"])
    assert real.optim.lr == 1e-6 and real.rollout.max_new_tokens == 256 and real.train.threads is None
    # PPO's critic on the shipped model is a value head on the policy, unless a critic is named or set otherwise
    assert load_config(None, ["algorithm=ppo"]).model.shared_critic and not real.model.shared_critic
    assert not load_config(None, ["algorithm=ppo", "model.critic_name_or_path=critic"]).model.shared_critic
    assert not load_config(None, ["algorithm=ppo", "model.shared_critic=false"]).model.shared_critic
    # the model preset never overrides what an algorithm preset defines
    assert load_config(None, ["algorithm=dr_grpo"]).algorithm.aggregation == "seq-mean-token-sum-norm"


def test_a_derived_value_fills_only_what_the_user_left_unset():
    # a sampler in another dtype (rollout.dtype) gets truncated importance sampling, however the config is built
    assert load_config(None, ["rollout.dtype=bfloat16"]).algorithm.tis_cap == DEFAULT_TIS_CAP
    assert load_config(None, ["rollout.dtype=bfloat16", "algorithm.tis_cap=3"]).algorithm.tis_cap == 3
    assert load_config(None, ["rollout.dtype=bfloat16", "model.dtype=bfloat16"]).algorithm.tis_cap is None
    cfg = load_config()
    cfg.rollout.dtype = "float16"  # an assignment is checked at once; derived values follow in checked()
    assert cfg.algorithm.tis_cap is None and cfg.checked().algorithm.tis_cap == DEFAULT_TIS_CAP


def test_model_presets_are_for_shipped_models():
    # SHIPPED_MODELS is the one list of shipped names; a preset for any other name would never apply
    assert set(MODEL_PRESETS) <= set(SHIPPED_MODELS)


def test_reward_recipes_and_a_clip_range_are_checked_on_load():
    cfg = load_config(None, ["reward.recipes={math: [exact_match], code: [{fn: regex, pattern: x, weight: 0.5}]}",
                             "reward.recipe_column=label", "reward.clip=[-1, 3]"])
    assert cfg.reward.recipes == {"math": ["exact_match"], "code": [{"fn": "regex", "pattern": "x", "weight": 0.5}]}
    assert cfg.reward.recipe_column == "label" and cfg.reward.clip == (-1.0, 3.0)
    assert cfg.reward.shaping_options()["clip"] == (-1.0, 3.0)
    assert load_config(None, ["reward.clip=2"]).reward.clip == 2.0  # c still means [-c, c]
    for overrides, line in [
        (["reward.functions=[math]", "reward.recipes={a: [math]}"],
         "reward.recipes: set reward.functions (every row) or reward.recipes (a recipe per data_source), not both"),
        (["reward.weights=[1]", "reward.recipes={a: [math]}"],
         "reward.weights: go with reward.functions; give each reward.recipes entry its own weight, e.g. {fn: math, weight: 0.5}"),
        (["reward.recipes={a: []}"], "reward.recipes: recipe 'a' has no reward functions"),
        (["reward.recipes={1: [math]}"], "reward.recipes: a label must be a string (quote it: '1'), got 1"),
        (["reward.recipe_column="], "reward.recipe_column: must be set (got null or an empty value)"),
        (["reward.clip=[1, -1]"], "reward.clip: [low, high] needs low < high (got [1.0, -1.0])"),
        (["reward.clip=[2, 2]"], "reward.clip: [low, high] needs low < high (got [2.0, 2.0])"),
        (["reward.clip=[1]"], "reward.clip: expected a number c (for [-c, c]) or a pair [low, high], got [1]"),
        (["reward.clip=0"], "reward.clip: must be > 0 (got 0)"),
    ]:
        with pytest.raises(ConfigError) as raised:
            load_config(None, overrides)
        assert str(raised.value) == line
