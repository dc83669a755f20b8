"""Guards that stop a run from doing silent harm, checked once per step from its metrics.

- non-finite: a step whose loss or gradient is not finite is skipped by the update (no weight moves,
  `guard/skipped_updates`); `max_skipped_steps` such steps in a row stop the run with one line naming
  the step and the likely cause. Nothing non-finite is ever saved (`lmrl.checkpoint.all_finite`).
- unscored: a step where no reward function scored any completion (every value None) trains on
  nothing; warned once with the functions' names, counted (`guard/unscored_steps`), and
  `max_unscored_steps` in a row stop the run.
- empty: a step whose every completion was left out of the loss (reward.drop_truncated with every
  completion cut at rollout.max_new_tokens) learns nothing; warned once with the cause (`guard/empty_update`),
  and `max_empty_steps` in a row stop the run. A step whose groups all scored alike (no learning signal:
  `update/rows_skipped` = 1) is normal now and then; `max_empty_steps` of them in a row are warned once.
- collapse: the policy's entropy near 0 (it says one thing whatever the prompt) or near the uniform
  ln V (a step too large scrambled it: measured with optim.lr=1e3 on the shipped model) while held-out
  accuracy (or the recent mean reward) fell far below its best. Warned once and recorded as
  `guard/collapse`; the run goes on.

`Guards.check` returns the warnings to print and raises `RunError` to stop; its state is part of a
checkpoint, so a resumed run counts on from where it was.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from lmrl.errors import RunError

UNIFORM_FRACTION = 0.9  # entropy above this fraction of ln V counts as a scrambled policy
RECENT = 10  # steps in the running mean of the reward that the collapse check uses without evaluation


class Guards:
    def __init__(self, cfg, reward_names: list[str], lr: float, vocab_size: int | None = None, evaluates: bool = True):
        self.cfg, self.reward_names, self.lr, self.evaluates = cfg, reward_names, lr, evaluates
        self.uniform_entropy = math.log(vocab_size) if vocab_size else math.inf  # ln V: a uniform policy
        self.skipped_in_a_row = self.unscored_in_a_row = self.unscored_total = 0
        self.empty_in_a_row = self.unsignalled_in_a_row = 0
        self.warned_unscored = self.warned_collapse = self.warned_empty = self.warned_unsignalled = False
        self.best_eval: float | None = None
        self.best_recent: float | None = None
        self.recent: deque[float] = deque(maxlen=RECENT)

    def check(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Update the counters with one step's metrics (adding `guard/*` to them); return warning lines."""
        warnings = []
        skipped = metrics.get("guard/skipped_updates", 0.0) > 0
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        if self.skipped_in_a_row >= self.cfg.max_skipped_steps:
            raise RunError(f"step {step}: {self.skipped_in_a_row} steps in a row had a non-finite loss or gradient "
                           f"and were skipped (guard.max_skipped_steps={self.cfg.max_skipped_steps}); "
                           f"likely cause: {self._nonfinite_cause(metrics)}")

        unscored = metrics.get("reward/all_none_frac", 0.0) >= 1.0
        self.unscored_in_a_row = self.unscored_in_a_row + 1 if unscored else 0
        self.unscored_total += unscored
        metrics["guard/unscored_steps"] = float(self.unscored_total)
        names = ", ".join(self.reward_names)
        if unscored and not self.warned_unscored:
            self.warned_unscored = True
            warnings.append(f"step {step}: no reward function ({names}) scored any completion: every value was "
                            "None or NaN, so the batch scores 0 and trains nothing")
        if self.unscored_in_a_row >= self.cfg.max_unscored_steps:
            raise RunError(f"step {step}: {self.unscored_in_a_row} steps in a row where no reward function ({names}) "
                           f"scored any completion (guard.max_unscored_steps={self.cfg.max_unscored_steps}); "
                           "check that the functions' columns and answer format match the dataset")

        warnings += self._empty(step, metrics)

        metrics["guard/collapse"] = 0.0
        line = self._collapse(step, metrics)
        if line is not None:
            metrics["guard/collapse"] = 1.0
            if not self.warned_collapse:
                self.warned_collapse = True
                warnings.append(line)
        return warnings

    def _empty(self, step: int, m: dict[str, float]) -> list[str]:
        """Steps whose update had nothing to learn from: every completion dropped (stops the run after
        `max_empty_steps` in a row), or no group with a signal (warned once after as many in a row)."""
        limit, warnings = self.cfg.max_empty_steps, []
        empty = m.get("guard/empty_update", 0.0) > 0
        self.empty_in_a_row = self.empty_in_a_row + 1 if empty else 0
        why = ("every completion was cut at rollout.max_new_tokens and reward.drop_truncated=true leaves them all "
               "out of the loss; raise rollout.max_new_tokens or set reward.drop_truncated=false")
        if empty and not self.warned_empty:
            self.warned_empty = True
            warnings.append(f"step {step}: the update learned nothing: {why}")
        if self.empty_in_a_row >= limit:
            raise RunError(f"step {step}: {self.empty_in_a_row} steps in a row learned nothing "
                           f"(guard.max_empty_steps={limit}): {why}")
        unsignalled = not empty and m.get("update/rows_skipped", 0.0) >= 1.0
        self.unsignalled_in_a_row = self.unsignalled_in_a_row + 1 if unsignalled else 0
        if self.unsignalled_in_a_row >= limit and not self.warned_unsignalled:
            self.warned_unsignalled = True
            warnings.append(f"step {step}: {self.unsignalled_in_a_row} steps in a row where every group's completions "
                            "scored alike, so no completion had an advantage to learn from; the task may be too hard "
                            "or too easy for the policy, or the reward may not tell completions apart")
        return warnings

    def record_eval(self, metrics: dict[str, float]) -> None:
        """The evaluation before the first step: the first best the collapse check compares against."""
        if _finite(acc := metrics.get("eval/accuracy")):
            self.best_eval = acc if self.best_eval is None else max(self.best_eval, acc)

    def _nonfinite_cause(self, m: dict[str, float]) -> str:
        bad = lambda key: key in m and not _finite(m[key])  # noqa: E731
        if bad("objective/raw_scores"):
            return f"the rewards are not finite (mean raw score {m['objective/raw_scores']})"
        if bad("objective/scores") or bad("val/advantage_mean"):
            return "the shaped rewards or advantages are not finite (overflow in reward scaling?)"
        return (f"the update diverged (loss {m.get('loss/policy_avg')}, grad norm {m.get('policy/grad_norm')}): "
                f"a learning rate too high (optim.lr={self.lr:g}) or low-precision overflow")

    def _collapse(self, step: int, m: dict[str, float]) -> str | None:
        """A warning line when entropy is near 0 and quality fell `collapse_drop` of the way from its best."""
        entropy = m.get("policy/entropy_avg", m.get("rollout/entropy_estimate"))
        quality, label = None, ""
        if _finite(m.get("eval/accuracy")):
            quality, label = m["eval/accuracy"], "eval/accuracy"
            self.best_eval = quality if self.best_eval is None else max(self.best_eval, quality)
            best = self.best_eval
        elif not self.evaluates and _finite(m.get("objective/scores")):  # held-out accuracy is the better signal
            self.recent.append(m["objective/scores"])
            if len(self.recent) < RECENT:
                return None
            quality, label = sum(self.recent) / len(self.recent), f"mean reward of the last {RECENT} steps"
            self.best_recent = quality if self.best_recent is None else max(self.best_recent, quality)
            best = self.best_recent
        if quality is None or not _finite(entropy) or best == 0 or quality > best - self.cfg.collapse_drop * abs(best):
            return None
        if entropy < self.cfg.collapse_entropy:
            why = f"entropy {entropy:.4f} < guard.collapse_entropy={self.cfg.collapse_entropy:g}"
        elif entropy > UNIFORM_FRACTION * self.uniform_entropy:
            why = f"entropy {entropy:.3f} is near a uniform policy's (ln V = {self.uniform_entropy:.3f})"
        else:
            return None
        return f"step {step}: the policy may have collapsed: {why}, and {label} is {quality:.4g} against a best of {best:.4g}"

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_in_a_row": self.skipped_in_a_row, "unscored_in_a_row": self.unscored_in_a_row,
                "unscored_total": self.unscored_total, "warned_unscored": self.warned_unscored,
                "empty_in_a_row": self.empty_in_a_row, "unsignalled_in_a_row": self.unsignalled_in_a_row,
                "warned_empty": self.warned_empty, "warned_unsignalled": self.warned_unsignalled,
                "warned_collapse": self.warned_collapse, "best_eval": self.best_eval,
                "best_recent": self.best_recent, "recent": list(self.recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            if k == "recent":
                self.recent = deque(v, maxlen=RECENT)
            elif hasattr(self, k):
                setattr(self, k, v)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
