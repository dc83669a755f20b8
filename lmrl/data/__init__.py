"""Prompt datasets (local JSONL / JSON / parquet, in-memory lists, hub datasets) and built-in tasks."""

from lmrl.data.prompts import PromptDataset, PromptSampler, PromptStream, is_stream, load_prompts
from lmrl.data.row_checks import BadRow, CheckedRows, check_rows

__all__ = ["BadRow", "CheckedRows", "PromptDataset", "PromptSampler", "PromptStream", "check_rows", "is_stream", "load_prompts"]
