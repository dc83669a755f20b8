"""Guards that stop a run from doing silent harm, checked once per step from its metrics.

- non-finite: a step whose loss or gradient is not finite is skipped by the update (no weight moves,
  `guard/skipped_updates`); `max_skipped_steps` such steps in a row stop the run with one line naming
  the step and the likely cause. Nothing non-finite is ever saved (`lmrl.checkpoint.all_finite`).
- unscored: a step where no reward function scored any completion (every value None) trains on
  nothing; warned once with the functions' names, counted (`guard/unscored_steps`), and
  `max_unscored_steps` in a row stop the run.
- failed: under reward.on_error=zero a failure scores 0; a function that failed for every completion it was called
  on (`reward/<name>/failed_frac` = 1: a judge answering garbage, an endpoint down) trains on zeros, so it is
  warned once, and `max_failed_steps` such steps in a row stop the run.
- empty: a step whose every completion was left out of the loss (reward.drop_truncated with every
  completion cut at rollout.max_new_tokens) learns nothing; warned once with the cause (`guard/empty_update`),
  and `max_empty_steps` in a row stop the run. A step whose groups all scored alike (no learning signal:
  `update/rows_skipped` = 1) is normal now and then; `max_empty_steps` of them in a row are warned once.
- collapse: the policy's entropy near 0 (it says one thing whatever the prompt) or near the uniform
  ln V (a step too large scrambled it: measured with optim.lr=1e3 on the shipped model) while held-out
  accuracy (or the recent mean reward) fell far below its best. Warned once and recorded as
  `guard/collapse`; the run goes on.
- sync: a sampler that holds its own copy of the weights (a vLLM engine, a server, a copy in another dtype) must
  compute the policy. At every step whose batch the current policy sampled (each step of a synchronous run), the
  mean |log-prob| difference per token between the sampler's tokens and the trainer's forward on them
  (`val/sampler_logprob_diff`, from the step's own experience: no extra forward) must be within
  `guard.max_sampler_diff`; above it the run stops after a checkpoint (`SamplerMismatch`), naming the sampler.
  An asynchronous run's later batches are a version behind: there the probe of the weights the generator process
  took (`val/sampler_probe_diff`, `lmrl.async_rollouts`) is held to the same limit.
  `val/sampler_kl` past `guard.sampler_kl_warn` is warned once.

- reward hacking: a run whose reward is learned (a reward model, a judge) and whose evaluation verifies held-out
  answers (reward.verifier) logs `eval/learned_reward` beside `eval/accuracy`; when, against the evaluation
  `guard.hacking_window` evaluations before, the learned reward rose while the verified accuracy fell by at least
  `guard.hacking_drop` (`reward_hacking`), the policy is finding what the learned reward scores wrongly. Warned once
  and recorded as `guard/reward_hacking`; the run goes on.

`Guards.check` returns the warnings to print and raises `RunError` to stop; its state is part of a
checkpoint, so a resumed run counts on from where it was.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

from lmrl.errors import RunError


class SamplerMismatch(RunError):
    """The sampler does not compute the policy: the run stops after a checkpoint of the step."""

UNIFORM_FRACTION = 0.9  # entropy above this fraction of ln V counts as a scrambled policy
RECENT = 10  # steps in the running mean of the reward that the collapse check uses without evaluation


class Guards:
    def __init__(self, cfg, reward_names: list[str], lr: float, vocab_size: int | None = None, evaluates: bool = True,
                 sampler: str | None = None, sampler_advice: str = "", sampler_exact: bool = False):
        """`sampler`: what samples with its own copy of the weights, as the sync check's line names it (None: the
        policy samples itself, nothing to check), and `sampler_advice` what to do instead; `sampler_exact`: it and
        the trainer both compute in float32."""
        self.cfg, self.reward_names, self.lr, self.evaluates = cfg, reward_names, lr, evaluates
        self.sampler, self.sampler_advice = sampler, sampler_advice
        default = 1e-3 if sampler_exact else 0.1
        self.sync_limit = cfg.max_sampler_diff if cfg.max_sampler_diff is not None else default
        self.warned_sampler_kl = False
        self.uniform_entropy = math.log(vocab_size) if vocab_size else math.inf  # ln V: a uniform policy
        self.skipped_in_a_row = self.unscored_in_a_row = self.unscored_total = 0
        self.empty_in_a_row = self.unsignalled_in_a_row = 0
        self.warned_unscored = self.warned_collapse = self.warned_empty = self.warned_unsignalled = False
        self.best_eval: float | None = None
        self.best_recent: float | None = None
        self.recent: deque[float] = deque(maxlen=RECENT)
        self.evals: list[tuple[int, float, float]] = []  # (step, eval/learned_reward, eval/accuracy)
        self.warned_hacking = False
        self.failed_in_a_row: dict[str, int] = {}  # reward function -> steps in a row it failed for every completion
        self.warned_failed = False

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

        warnings += self._failed(step, metrics)
        warnings += self._empty(step, metrics)
        warnings += self._sampler(step, metrics)

        warnings += self._hacking(step, metrics)

        metrics["guard/collapse"] = 0.0
        line = self._collapse(step, metrics)
        if line is not None:
            metrics["guard/collapse"] = 1.0
            if not self.warned_collapse:
                self.warned_collapse = True
                warnings.append(line)
        return warnings

    def _failed(self, step: int, m: dict[str, float]) -> list[str]:
        """Reward functions that failed for every completion they were called on (scored 0 under
        reward.on_error=zero): warned once, and `max_failed_steps` steps in a row stop the run."""
        limit, warnings = self.cfg.max_failed_steps, []
        for name in self.reward_names:
            frac = m.get(f"reward/{name}/failed_frac")
            if frac is None:  # not called this step (no completion of its recipe): the count holds
                continue
            n = self.failed_in_a_row[name] = self.failed_in_a_row.get(name, 0) + 1 if frac >= 1.0 else 0
            if n and not self.warned_failed:
                self.warned_failed = True
                warnings.append(f"step {step}: reward function {name!r} failed for every completion, which "
                                "reward.on_error=zero scores 0 (its error is on stderr)")
            if n >= limit:
                raise RunError(f"step {step}: {n} steps in a row where reward function {name!r} failed for every "
                               f"completion (guard.max_failed_steps={limit}); its scores are all the 0 of "
                               "reward.on_error=zero, so the run would train on nothing; fix the function or its endpoint")
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

    def _sampler(self, step: int, m: dict[str, float]) -> list[str]:
        """The sync check at a step whose batch the current policy sampled; `val/sampler_kl` past its warning line."""
        diff = m.get("val/sampler_logprob_diff")
        if self.sampler is None or diff is None:
            return []
        # (an asynchronous batch a version behind differs from the trainer by the update in between: the probe's)
        if m.get("async/version_lag", 0.0) == 0 and not diff <= self.sync_limit:  # NaN too
            raise SamplerMismatch(
                f"the sampler ({self.sampler}) does not compute the policy: its log-probs of its own tokens differ "
                f"from the trainer's by {diff:.3g} nats per token (guard.max_sampler_diff={self.sync_limit:g}), so "
                "the weights it took are not the policy's or it computes the model otherwise; every step would "
                f"train on another model's samples" + (f" ({self.sampler_advice})" if self.sampler_advice else ""))
        probe = m.get("val/sampler_probe_diff")  # an asynchronous run's: weights the generator took lately
        if probe is not None and not probe <= self.sync_limit:
            raise SamplerMismatch(
                f"the sampler ({self.sampler}) does not compute the policy: its log-probs of a probe sequence under "
                f"the weights it last took differ from the trainer's under the same weights by {probe:.3g} nats per "
                f"token (guard.max_sampler_diff={self.sync_limit:g}, guard.sync_probe_every="
                f"{self.cfg.sync_probe_every}), so the weights it took are not the policy's or it computes the model "
                "otherwise; every step would train on another model's samples"
                + (f" ({self.sampler_advice})" if self.sampler_advice else ""))
        kl = m.get("val/sampler_kl")
        if kl is not None and kl > self.cfg.sampler_kl_warn and not self.warned_sampler_kl:
            self.warned_sampler_kl = True
            return [f"step {step}: val/sampler_kl is {kl:.3g} (guard.sampler_kl_warn={self.cfg.sampler_kl_warn:g}): "
                    f"the sampler ({self.sampler}) has drifted from the trainer; truncated importance sampling "
                    "corrects for some of it (algorithm.tis_cap)"]
        return []

    def record_eval(self, metrics: dict[str, float]) -> None:
        """The evaluation before the first step: the first best the collapse check compares against, and the first
        evaluation the reward-hacking check looks back to."""
        if _finite(acc := metrics.get("eval/accuracy")):
            self.best_eval = acc if self.best_eval is None else max(self.best_eval, acc)
            if _finite(learned := metrics.get("eval/learned_reward")):
                self.evals.append((0, learned, acc))

    def _hacking(self, step: int, m: dict[str, float]) -> list[str]:
        """The reward-hacking check at a step that evaluated with a verifier (`reward_hacking`)."""
        learned, acc = m.get("eval/learned_reward"), m.get("eval/accuracy")
        if not (_finite(learned) and _finite(acc)):
            return []
        self.evals.append((step, learned, acc))
        line = reward_hacking(self.evals, self.cfg.hacking_window, self.cfg.hacking_drop)
        m["guard/reward_hacking"] = float(line is not None)
        if line is None or self.warned_hacking:
            return []
        self.warned_hacking = True
        return [f"step {step}: {line} (guard.hacking_drop={self.cfg.hacking_drop:g}, guard.hacking_window="
                f"{self.cfg.hacking_window}): the policy is finding what the learned reward scores wrongly; keep the "
                "model of the best eval/accuracy (train.keep_best=true), raise algorithm.kl_coef, or train the reward model again on "
                "pairs from the current policy's samples (docs/rewards.md, the whole loop on a laptop)"]

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
                "best_recent": self.best_recent, "recent": list(self.recent), "warned_sampler_kl": self.warned_sampler_kl,
                "evals": [list(e) for e in self.evals], "warned_hacking": self.warned_hacking,
                "failed_in_a_row": dict(self.failed_in_a_row), "warned_failed": self.warned_failed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            if k == "recent":
                self.recent = deque(v, maxlen=RECENT)
            elif k == "evals":
                self.evals = [tuple(e) for e in v]
            elif hasattr(self, k):
                setattr(self, k, v)


def reward_hacking(evals: Sequence[tuple[int, float, float]], window: int, drop: float) -> str | None:
    """The reward-hacking rule, over the evaluations so far, oldest first, each (step, learned reward, verified
    accuracy): against the evaluation `window` evaluations before the last (the first when there are fewer), the
    learned reward rose (strictly) and the accuracy fell by at least `drop` (absolute). Returns the line that says
    so, or None."""
    if len(evals) < 2:
        return None
    (s0, r0, a0), (s1, r1, a1) = evals[max(0, len(evals) - 1 - window)], evals[-1]
    if not (r1 > r0 and a0 - a1 >= drop - 1e-9):  # (1e-9: 0.4 - 0.3 is 0.09999999999999998 in floats)
        return None
    return (f"the learned reward may be hacked: eval/learned_reward rose from {r0:.4g} to {r1:.4g} between steps {s0} "
            f"and {s1} while the verified eval/accuracy fell from {a0:.4g} to {a1:.4g}")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
