"""The errors a user can act on: one small family, each message one line.

    LmrlError        any of them; the CLI prints `lmrl: error: <message>`
      ConfigError    an invalid configuration, found before a model loads (exit 2)
      RunError       a run that cannot start or cannot go on: its output directory, its checkpoint,
                     a guard that stopped it (exit 2 before the first step, 1 after)
      DataError      a prompt dataset (file or in-memory rows) that cannot be trained on: names the file and
                     line, or the dataset index, and counts the other bad rows
      ModelError     a model or tokenizer that cannot be loaded or used (its path and the reason)
      RewardError    a reward function failed, timed out or returned something unusable
      Interrupted    SIGINT / SIGTERM stopped the run cleanly after writing a checkpoint (exit 128 + signal)
"""

from __future__ import annotations

import sys


class LmrlError(Exception):
    """An error with a one-line message that says what is wrong and, where it can, what to do."""

    exit_code = 2
    every_rank = False  # under torchrun: every rank raised it alike, and rank 0 alone says it


class ConfigError(LmrlError, ValueError):
    """An invalid configuration: one line naming the field and what is allowed."""


class RunError(LmrlError, RuntimeError):
    """The run cannot start (its directory, lock or checkpoint) or a guard stopped it."""


class DataError(LmrlError, ValueError):
    """A bad prompt dataset: one line naming the file and line (or the dataset index) and what is wrong."""


class ModelError(LmrlError, ValueError):
    """A model or tokenizer that cannot be loaded or used: one line naming its path and the reason."""


class RewardError(LmrlError, RuntimeError):
    """A reward function failed, timed out or returned something unusable (one-line message)."""


class Interrupted(LmrlError):
    """A signal stopped the run; a checkpoint was written first (when a step had completed)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum
        self.every_rank = True  # every rank stopped after the same checkpoint


def print_line(line: str) -> None:
    """`line` to stderr in one write, so that another process writing the same stream (torchrun, another rank)
    cannot split it: print() writes the text and its newline separately."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
