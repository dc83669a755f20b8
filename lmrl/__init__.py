"""lmrl: reinforcement-learning post-training of language models.

Shape notation used across the package:
    B  sequences in a batch (prompts x completions per prompt)
    G  group size: completions per prompt; sample i belongs to group i // G
    P  prompt tokens (left-padded)
    T  response tokens (right-padded)
    V  vocabulary size
"""

__version__ = "0.1.0"

__all__ = ["Config", "RewardTrainer", "Trainer", "load_config"]


def __getattr__(name: str):
    # `from lmrl import Trainer` without importing torch for `import lmrl` or `from lmrl import Config`
    if name in ("Config", "load_config"):
        from lmrl import config

        return getattr(config, name)
    if name == "Trainer":
        from lmrl.trainer import Trainer

        return Trainer
    if name == "RewardTrainer":
        from lmrl.reward_trainer import RewardTrainer

        return RewardTrainer
    raise AttributeError(f"module 'lmrl' has no attribute {name!r}")
