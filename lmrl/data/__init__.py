"""Prompt datasets (local JSONL / JSON / parquet, in-memory lists, hub datasets) and built-in tasks."""

from lmrl.data.prompts import BadRow, CheckedRows, PromptDataset, PromptSampler, check_rows, load_prompts

__all__ = ["BadRow", "CheckedRows", "PromptDataset", "PromptSampler", "check_rows", "load_prompts"]
