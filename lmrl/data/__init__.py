"""Prompt datasets (local JSONL / JSON / parquet, in-memory lists, hub datasets) and built-in tasks."""

from lmrl.data.prompts import (
    BadRow,
    CheckedRows,
    PromptDataset,
    PromptSampler,
    PromptStream,
    check_rows,
    is_stream,
    load_prompts,
)

__all__ = ["BadRow", "CheckedRows", "PromptDataset", "PromptSampler", "PromptStream", "check_rows", "is_stream", "load_prompts"]
