"""Prompt datasets (local JSONL / JSON / parquet, in-memory lists, hub datasets) and built-in tasks."""

from lmrl.data.prompts import PromptDataset, PromptSampler, load_prompts

__all__ = ["PromptDataset", "PromptSampler", "load_prompts"]
