"""Rewards: the reward-function protocol, `score()`, built-in verifiers, model, remote and LLM-judge scorers, shaping.

A reward function is `fn(prompts, completions, **kwargs) -> list[float | None]` (sync or async), called
with keyword arguments only, as TRL calls it; see `lmrl.rewards.core` for the arguments lmrl passes
(columns, completion_ids, trainer_state, log_metric, log_extra, finished) and `lmrl.rewards.runner` for how
`score()` calls them and combines their values;
`RewardRecipes` gives each kind of row (a label column such as `data_source`) its own functions.
"""

from lmrl.errors import RewardError
from lmrl.rewards.code import code_reward, extract_code
from lmrl.rewards.core import (
    Failed,
    RewardFn,
    RewardRecipes,
    RewardSet,
    TrainerState,
    WeightedReward,
    call_reward,
    completion_text,
    required_columns,
    reward_name,
)
from lmrl.rewards.judge import JudgeError, JudgeScorer
from lmrl.rewards.math_verifier import MathVerifyWorker, extract_final_answer, verify_answer
from lmrl.rewards.registry import (
    BUILTIN_REWARDS,
    queries_reward,
    resolve_reward,
    reward_recipes_from_config,
    reward_set_from_config,
)
from lmrl.rewards.remote import RemoteRewardError, RemoteScorer
from lmrl.rewards.reward_model import RewardModelScorer
from lmrl.rewards.runner import RewardOutput, score
from lmrl.rewards.shaping import (
    clip_rewards,
    missing_eos_penalty,
    normalize_rewards,
    overlong_filter_mask,
    overlong_penalty,
    shape_scores,
)
from lmrl.rewards.verifiers import (
    THINK_ANSWER_PATTERN,
    exact_match_reward,
    format_reward,
    length_penalty_reward,
    math_reward,
    regex_reward,
)
from lmrl.user_code import load_function

__all__ = [
    "BUILTIN_REWARDS",
    "Failed",
    "JudgeError",
    "JudgeScorer",
    "MathVerifyWorker",
    "THINK_ANSWER_PATTERN",
    "TrainerState",
    "RemoteRewardError",
    "RemoteScorer",
    "RewardError",
    "RewardFn",
    "RewardModelScorer",
    "RewardOutput",
    "RewardRecipes",
    "RewardSet",
    "WeightedReward",
    "call_reward",
    "clip_rewards",
    "code_reward",
    "completion_text",
    "exact_match_reward",
    "extract_code",
    "extract_final_answer",
    "format_reward",
    "length_penalty_reward",
    "load_function",
    "math_reward",
    "missing_eos_penalty",
    "normalize_rewards",
    "overlong_filter_mask",
    "overlong_penalty",
    "queries_reward",
    "regex_reward",
    "required_columns",
    "resolve_reward",
    "reward_name",
    "reward_recipes_from_config",
    "reward_set_from_config",
    "score",
    "shape_scores",
    "verify_answer",
]
