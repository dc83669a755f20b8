"""The training loop, top to bottom.

    for step in 1..steps:
        1. sample prompts        reproducible from (seed, step)
        2. generate and score    G completions per prompt; DAPO refills groups that carry no signal
        3. make experience       old / reference log-probs, values, KL, advantages
        4. update                num_iterations x shuffled minibatches, gradient accumulation
        5. log, evaluate, save

How lmrl departs from a textbook PPO loop, and why:
  1. With one update per batch (num_iterations = num_minibatches = 1) the policy that sampled *is* the
     policy being trained, so the update's own forward, detached, gives the old log-probs: no second
     forward, and the ratio is exactly 1. When a copy in another dtype samples (rollout.dtype), the
     same forward gives the truncated importance weights against the sampler's log-probs.
  2. No reference model is loaded when no KL term uses it (kl_coef = 0 and no adaptive target).
  3. Losses are normalised by the whole minibatch, not each micro-batch: gradient accumulation over
     1 x 8 or 8 x 1 sequences gives the same update.
  4. Rows whose advantages are all 0 (a GRPO group whose completions all scored the same) contribute
     exactly nothing to the loss or its gradient: when no entropy bonus, KL-in-loss term or critic acts
     on them, they are left out of the update's forward and backward (`_rows_with_gradient`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmrl import algorithms as A
from lmrl.build import (
    KLController,
    SlowBf16Warning,
    adapter_base,
    check_rollout_fits,
    copy_weights,
    load_data,
    load_models,
    load_policy_tokenizer,
    make_environment,
    make_optimizer,
    portable_adapter_config,
    slow_bf16_warning,
)
from lmrl.checkpoint import (
    RunLock,
    all_finite,
    atomic_directory,
    clear_run,
    load_model_state,
    newest_checkpoint,
    plan_run,
    prune,
    remove_partial,
    rng_state,
    save_model_state,
    set_rng_state,
)
from lmrl.config import Config, config_to_yaml, config_warnings
from lmrl.data.prompts import PromptSampler
from lmrl.distributed import (
    choose_parallel,
    full_weights,
    idle_batch,
    init_world,
    set_gradient_sync,
    shard,
    whole_state,
)
from lmrl.errors import DataError, Interrupted, LmrlError, ModelError, RunError, print_line
from lmrl.experience import (
    Experience,
    concat_rollouts,
    informative_groups,
    kl_clamp_option,
    make_experience,
    rollout_is_weights,
    select_rollout,
    shape_scores,
)
from lmrl.guards import Guards
from lmrl.logging import Console, make_sinks
from lmrl.logging.sinks import jsonl_row
from lmrl.models.forward import model_forward_logprobs, response_forward
from lmrl.models.loading import quiet_progress_bars, resolve_device
from lmrl.models.prompt_encoding import encode_prompts
from lmrl.rewards import RewardRecipes
from lmrl.rewards import score as score_rewards
from lmrl.rewards.core import TrainerState
from lmrl.rollout import HFGenerator, Rollout, SamplingParams
from lmrl.rollout.multiturn import generate_episodes


@dataclass
class TrainResult:
    output_dir: Path
    history: list[dict[str, float]] = field(default_factory=list)  # one metrics dict per step
    evals: list[dict[str, float]] = field(default_factory=list)  # held-out metrics, with step and time


@dataclass
class Collected:
    """One step's scored rollout, as `Trainer.collect` returns it."""

    rollout: Rollout
    scores: torch.Tensor  # [B] after shaping
    keep: torch.Tensor | None  # [B] False: left out of the loss
    rows: list[dict[str, Any]]  # dataset rows of the kept groups, in group order
    metrics: dict[str, float]
    per_function: dict[str, torch.Tensor]  # "reward/<name>" -> [B] raw scores (NaN where None)
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)  # the reward functions' log_extra, [B] each
    baseline: torch.Tensor | None = None  # [B / G] the greedy completion's reward per prompt (ReMax)


# the real os._exit, kept at import: while reward functions run, lmrl.rewards replaces os._exit so that a
# reward calling it fails instead of ending the run with exit 0; a second Ctrl-C must still exit at once
_EXIT_NOW = os._exit


class _AbandonStep(BaseException):
    """Raised by the signal handler inside steps 1-3. A BaseException, so that no `except Exception` in a
    reward function or library on the way swallows it."""


class Trainer:
    """RL post-training of one causal LM. Give a Config; optionally the model, tokenizer, reward functions
    and prompt rows directly (as with TRL's GRPOTrainer): those override the config's (`reward_funcs` may also
    be `lmrl.rewards.RewardRecipes`: functions per data label). `env` (an
    `lmrl.envs` Environment) makes every rollout a multi-turn episode, as `env.name` does."""

    def __init__(self, cfg: Config, *, model=None, tokenizer=None, reward_funcs=None, train_dataset=None,
                 eval_dataset=None, console: bool | None = None, env=None):
        if model is not None and not cfg.user_set("model.name_or_path"):
            cfg = cfg.for_model(_model_name(model))  # no preset made for another model (the shipped one's 4.5 min)
        self.cfg = cfg = cfg.checked()  # fields assigned after the config was built, checked together
        self.world = init_world()  # one rank unless started by torchrun
        self.world.shard(cfg.rollout.prompts_per_step)  # a share of whole groups per rank, or one line now
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        torch.manual_seed(cfg.train.seed)
        if (note := slow_bf16_warning(cfg)) is not None:
            warnings.warn(note, SlowBf16Warning, stacklevel=2)
        device = resolve_device(cfg.model.device)
        if model is not None and tokenizer is None:
            raise ValueError("tokenizer: pass the tokenizer together with a policy model")
        # every row is checked (prompt, its length in tokens, the rewards' columns) before a model loads
        tokenizer = tokenizer or load_policy_tokenizer(cfg)
        # its sandbox, if any, starts (or refuses) before a model loads; a built-in task may bring its own
        self.env = make_environment(cfg, env, use_task=train_dataset is None)
        if (env is not None and cfg.env.name is None and reward_funcs is None and not cfg.reward.functions
                and not cfg.reward.recipes):
            reward_funcs = ["env"]
        self.data = load_data(cfg, tokenizer, reward_funcs, train_dataset, eval_dataset)
        # what was passed in, recorded in the config a run directory keeps (lmrl_config.yaml)
        self.cfg = cfg = _recorded(cfg, reward_funcs, train_dataset, eval_dataset, self.data)
        self.models = load_models(cfg, model, tokenizer)
        self.policy, self.tokenizer = self.models.policy, self.models.tokenizer
        if not all_finite([self.policy]):
            raise ModelError(f"model: {cfg.model.name_or_path if model is None else 'the given model'} has non-finite "
                             "weights (NaN or inf); refusing to train or evaluate it")
        check_rollout_fits(cfg, self.policy.config, self.data.longest_prompt, device)
        self.notes: list[str] = []  # printed under the run's header
        self.units = self._shard_models()  # FSDP units per model name (empty unless train.parallel is fsdp)
        self.optimizer, self.scheduler = make_optimizer(cfg, self.policy, self.models.critic)
        self.kl = KLController(cfg.algorithm.kl_coef, cfg.algorithm.kl_target, cfg.algorithm.kl_horizon)
        stream = self.data.train_stream
        self.sampler = None if stream else PromptSampler(len(self.data.train_rows), seed=cfg.train.seed)
        self.generator = HFGenerator(self.models.sampler or self.policy, self.tokenizer, batch_size=cfg.rollout.batch_size,
                                     cuda_graph=cfg.rollout.cuda_graph)
        if device.type == "cuda":
            self.notes.append("generation: {} ({})".format(*self.generator.decode_path()))
        self.minibatch_rng = torch.Generator().manual_seed(cfg.train.seed)
        self.out = Path(cfg.train.output_dir)
        shown = (cfg.log.console if console is None else console) and self.world.main  # rank 0 alone prints
        self.console = Console(shown, cfg.train.steps, cfg.log.every)
        self.forward_counts = {"policy": 0, "reference": 0, "critic": 0}
        self.guards = Guards(cfg.guard, self.data.rewards.names, cfg.optim.lr,
                             vocab_size=getattr(self.policy.config.get_text_config(), "vocab_size", None),
                             evaluates=bool(self.data.eval_rows))
        self.result = TrainResult(self.out)
        self.rows: list[dict[str, Any]] = []  # every metrics row written, as metrics.jsonl holds them
        self._elapsed = 0.0  # training seconds before this process (a resumed run continues the clock)
        self._saved_step: int | None = None
        self._stop_signal: int | None = None  # the signal that asked the run to stop
        self._abandon_at: int | None = None  # the step a signal may abandon now (steps 1-3 of it)
        self._running = False
        self._global_step = 0  # optimizer steps done: what reward functions read as trainer_state.global_step

    def train(self) -> TrainResult:
        """Run (or resume) the loop. Holds `output_dir`'s lock for its life; SIGINT / SIGTERM stop it after
        a checkpoint (`lmrl.errors.Interrupted`); a failing step writes a checkpoint of the last good one."""
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        world = self.world
        with RunLock(self.out) if world.main else contextlib.nullcontext(), self._signals():
            start_step = self._begin()
            sinks = make_sinks(self.out, cfg.log.jsonl, cfg.log.tensorboard, cfg.log.wandb, cfg.model_dump(mode="json"),
                               previous=self.rows, purge_step=start_step + 1 if start_step else None) if world.main else []
            self._running = True
            try:
                self._loop(start_step, sinks)
            except LmrlError as e:
                if not isinstance(e, Interrupted):
                    e.exit_code = 1  # the run had started: not a usage error
                raise
            except OSError as e:  # a full disk, a directory removed under the run: one line, not a traceback
                error = RunError(f"cannot write {e.filename or self.out}: {e.strerror or e} ({self._last_good()})")
                error.exit_code = 1
                raise error from e
            finally:
                self._running = False
                for sink in sinks:
                    sink.close()
                self._write_report()  # at the end, and when a signal or a failure stopped the run
        return self.result

    def _write_report(self) -> None:
        """report.html in the output directory (`lmrl.report`), from the files the run wrote; a report that
        cannot be written is a warning, never the run's failure."""
        if not (self.world.main and self.cfg.log.jsonl):
            return
        from lmrl.report import write_report

        try:
            write_report([self.out])
        except Exception as e:  # noqa: BLE001 - the run's result stands without its report
            print_line(f"lmrl: warning: {self.out / 'report.html'} not written: {type(e).__name__}: {e}")

    def _loop(self, start_step: int, sinks) -> None:
        cfg, result = self.cfg, self.result
        self.console.print(f"[bold]lmrl[/] {cfg.algorithm.name} on {cfg.model.name_or_path}: "
                           f"{_prompt_count(self.data)}, output in {self.out}"
                           + (f", resumed at step {start_step}" if start_step else ""))
        for line in self.notes:
            self._note(line)
        for line in self.data.skipped + config_warnings(cfg):
            self._warn(line)
        start, step = time.time() - self._elapsed, start_step
        with self.console:
            self.console.start_at(start_step)
            if self.data.eval_rows and start_step == 0:
                with self._abandonable(0):  # a signal here stops the run: nothing to save yet
                    evals = self.evaluate()
                self.guards.record_eval(evals)
                result.evals.append(self._log(sinks, {**evals, "time/elapsed": 0.0}, 0) | {"step": 0})
            if start_step >= cfg.train.steps:
                self.console.print(f"the run already ended at step {start_step} (train.steps={cfg.train.steps}): "
                                   "raise train.steps to train on")
            for step in range(start_step + 1, cfg.train.steps + 1):
                metrics = self.train_step(step)
                self._elapsed = elapsed = time.time() - start
                metrics["time/elapsed"] = elapsed
                out_of_time = cfg.train.max_minutes is not None and elapsed > 60 * cfg.train.max_minutes
                last = step == cfg.train.steps or out_of_time
                failed = None  # a reward failing in the evaluation: the step is kept (logged, saved), then the run stops
                if self.data.eval_rows and (last or (cfg.train.eval_every and step % cfg.train.eval_every == 0)):
                    try:
                        metrics.update(self.evaluate())
                        result.evals.append({k: v for k, v in metrics.items() if k.startswith("eval/")}
                                            | {"step": step, "time/elapsed": elapsed})
                    except Exception as e:  # noqa: BLE001 - raised again below, once the step is safe
                        failed = e
                try:
                    warned = self.guards.check(step, metrics)
                finally:  # a guard that stops the run still logs the step that tripped it
                    result.history.append(self._log(sinks, metrics, step))
                for line in warned:
                    self._warn(line)
                if failed is not None:  # (several ranks: the others are not here to write a checkpoint with it)
                    self._explain(failed, step, None if self.world.distributed else self.save_checkpoint(step))
                    raise failed
                if cfg.train.save_every and (step % cfg.train.save_every == 0 or last):
                    self.save_checkpoint(step)
                if self._stopping():
                    raise self._interrupted(step, self.save_checkpoint(step))
                if out_of_time:
                    self.console.print(f"train.max_minutes={cfg.train.max_minutes} reached at step {step}")
                    break
        if step > start_step or not self.world.first((self.out / "final").exists()):  # every rank: a collective
            self.save(self.out / "final", final=True)

    def train_step(self, step: int) -> dict[str, float]:
        cfg, t0 = self.cfg, time.time()
        self._global_step = step - 1
        with self._abandonable(step):  # 1-3 change nothing but RNGs: a signal or a failure here keeps step - 1
            # 1-2. sample prompts, generate, score
            c = self.collect(step)
            rollout, rows, metrics = c.rollout, c.rows, c.metrics
            t1 = time.time()
            # 3. experience: old / reference log-probs, values, KL, advantages
            exp = self.experience(c)
            t2 = time.time()
        # 4. update
        updated = self.update(exp)  # reduced over ranks
        self._global_step = step
        t3 = time.time()
        # 5. metrics: this rank's share's, then averaged over ranks (every rank sees the same values)
        # the mean negative log-prob of the sampled tokens estimates the policy's entropy even when the
        # update skipped every row (the collapse guard reads it)
        metrics["rollout/entropy_estimate"] = -A.masked_mean(rollout.logprobs, rollout.response_mask).item()
        metrics.update(self._experience_metrics(exp))
        metrics["guard/empty_update"] = float(self.world.all(c.keep is not None and not bool(c.keep.any())))  # every rank's
        metrics = self.world.reduce_metrics(metrics) | updated
        if "objective/kl" in metrics and math.isfinite(kl := metrics["objective/kl"]):
            self.kl.update(kl, len(exp) * self.world.size)
        metrics.update({"time/generate": t1 - t0, "time/experience": t2 - t1, "time/update": t3 - t2,
                        "time/step": t3 - t0, "eps": len(exp) / (t3 - t0), "lr": self.scheduler.get_last_lr()[0],
                        "episode": step * cfg.rollout.prompts_per_step * cfg.rollout.group_size,
                        "objective/kl_coef": self.kl.value})
        if self.data.train_stream is not None and self.data.train_stream.skipped:  # the same on every rank
            metrics["data/skipped_rows"] = float(self.data.train_stream.skipped)
        metrics.update(_grpo_trainer_names(metrics))
        if cfg.log.samples_every and step % cfg.log.samples_every == 0:
            k = min(cfg.log.num_samples, len(exp))
            prompts = [_prompt_text(rows[int(i)][cfg.data.prompt_column]) for i in exp.group_index[:k]]
            extra = {name: values[:k] for name, values in c.extra_columns.items()}
            self.console.samples(step, prompts, rollout.texts[:k], exp.scores[:k].tolist(), exp.advantages[:k, 0].tolist(), extra)
            self._write_samples(step, prompts, rollout.texts[:k], exp.scores[:k].tolist(), exp.advantages[:k, 0].tolist(), extra)
        return metrics

    def _shard_models(self) -> dict[str, list[torch.nn.Module]]:
        """train.parallel under torchrun: ddp keeps every model whole on every rank; fsdp shards the policy,
        reference and critic (`lmrl.distributed.shard`) and returns their units by name."""
        cfg, world = self.cfg, self.world
        mode, why = choose_parallel(cfg.train.parallel, world, self.policy, cfg.model.lora is not None, cfg.samples_with_copy)
        if mode == "none":
            return {}
        self.notes.append(f"{world.size} ranks, train.parallel={mode} ({why})")
        if mode == "ddp":
            return {}
        self.world = dataclasses.replace(world, sharded=True)
        models = {"policy": self.policy, "reference": self.models.reference, "critic": self.models.critic}
        units = {name: shard(m, world, bf16=cfg.train.autocast_bf16) for name, m in models.items() if m is not None}
        self.notes.append("fsdp: the shared-prompt forward and the fast decoder with its C kernels step aside (they "
                          "bypass the decoder layers' forward, where FSDP gathers a layer's weights); generation "
                          "gathers the whole policy once per batch")
        return units

    def _trained_units(self) -> list[torch.nn.Module]:
        return self.units.get("policy", []) + self.units.get("critic", [])

    def _prompts(self, step: int, r: int, rounds: int, size: int) -> list[dict[str, Any]]:
        """The prompt rows of sampling round `r` of `step`: a pure function of (step, r), so a resumed run
        draws the rows the stopped one would have (a stream is read again up to there). A stream starts at
        its first row; the sampler's batch index (step * rounds + r) keeps the order runs have always had."""
        stream = self.data.train_stream
        if stream is None:
            return [self.data.train_rows[i] for i in self.sampler.indices(step * rounds + r, size)]
        skipped = stream.skipped
        rows = stream.batch((step - 1) * rounds + r, size)
        if stream.skipped and not skipped:
            self._warn(f"{stream.name}: left out a bad row (data.on_bad_row=skip), {stream.first_skipped.where}: "
                       f"{stream.first_skipped.problem}; data/skipped_rows counts them")
        return rows

    # ------------------------------------------------------------------------------------ 1-2. collect
    def collect(self, step: int):
        """Prompts -> scored rollout. With dynamic sampling (DAPO), groups whose rewards are all equal are
        dropped and more prompts are sampled, for at most `max_sampling_rounds` rounds. Several ranks keep
        the groups one process would: each generates its share of a round, and the first informative
        groups of the whole round (in prompt order) are kept, wherever they are."""
        cfg, G, world = self.cfg, self.cfg.rollout.group_size, self.world
        rounds = cfg.algorithm.max_sampling_rounds if cfg.algorithm.dynamic_sampling else 1
        parts, rows_kept, metrics, filtered, kept = [], [], {}, 0, 0  # kept: groups of every rank
        P = cfg.rollout.prompts_per_step
        share = world.shard(P)  # this rank's prompts: whole groups
        for r in range(rounds):
            need = P - kept
            rows = self._prompts(step, r, rounds, P)[share]
            seed = cfg.train.seed * 1_000_003 + step * 101 + r + 7919 * world.rank
            rollout, out = self.generate_and_score(rows, G, seed=seed)
            if r == 0:  # reward metrics of the first round: the unfiltered policy
                metrics = dict(out.metrics) | {"frac_reward_zero_std": 1 - informative_groups(out.scores, G).float().mean().item()}
            scores, per_fn, extra = out.scores, out.per_function, out.extra_columns
            whole = rollout, scores, per_fn, rows
            if cfg.algorithm.dynamic_sampling:
                ok = torch.zeros(P)  # [P] the round's informative groups, every rank's
                ok[share] = informative_groups(scores, G).float()
                ok = world.sum(ok).bool()
                filtered += int((~ok).sum())
                chosen = ok.nonzero().flatten()[:need]
                if r == rounds - 1 and kept == 0 and len(chosen) == 0:
                    chosen = torch.arange(min(need, P))  # nothing informative at all: zero advantages
                kept += len(chosen)
                chosen = chosen[(chosen >= share.start) & (chosen < share.stop)] - share.start  # this rank's
                index = (chosen[:, None] * G + torch.arange(G)).flatten()
                rollout, scores, rows = select_rollout(rollout, index), scores[index], [rows[int(i)] for i in chosen]
                per_fn = {k: v[index] for k, v in per_fn.items()}
                extra = {k: [v[int(i)] for i in index] for k, v in extra.items()}
                rollout.prompt_index = torch.arange(len(rows)).repeat_interleave(G)
            else:
                kept += P
            parts.append((rollout, scores, per_fn, extra))
            rows_kept += rows
            if kept >= P:
                break
        outside = not rows_kept
        if outside:  # the other ranks hold every kept group: this one takes a group to keep in step, outside the loss
            rollout, scores, per_fn, rows = whole
            first = torch.arange(G)
            parts, rows_kept = [(select_rollout(rollout, first), scores[first], {k: v[first] for k, v in per_fn.items()}, {})], rows[:1]
            parts[0][0].prompt_index = torch.zeros(G, dtype=torch.long)
        if cfg.algorithm.dynamic_sampling:  # the same on every rank
            metrics.update({"dynamic_sampling/rounds": float(r + 1), "dynamic_sampling/filtered_groups": float(filtered),
                            "dynamic_sampling/kept_groups": float(min(kept, P))})
        parts = [p for p in parts if len(p[1])]
        rollout = concat_rollouts([p[0] for p in parts], self.tokenizer.pad_token_id)
        raw = torch.cat([p[1] for p in parts])
        scores, keep = shape_scores(rollout, raw, max_new_tokens=cfg.rollout.max_new_tokens, world=self.world,
                                    **cfg.reward.shaping_options())
        if outside:
            keep = torch.zeros(len(scores), dtype=torch.bool)
        metrics["objective/raw_scores"] = raw.mean().item()
        per_function = {f"reward/{k}": torch.cat([p[2][k] for p in parts]) for k in parts[0][2]}  # [B], NaN = None
        names = dict.fromkeys(name for p in parts for name in p[3])  # a column a round did not log is None there
        extra = {name: [v for p in parts for v in p[3].get(name, [None] * len(p[1]))] for name in names}
        baseline = None
        if cfg.algorithm.advantage == "remax":  # ReMax: each prompt's greedy completion, shaped as the samples are
            greedy, out = self.generate_and_score(rows_kept, 1, temperature=0.0)
            # no reward.normalize: a batch statistic of other completions
            baseline, _ = shape_scores(greedy, out.scores, **{**cfg.reward.shaping_options(), "normalize": False},
                                       max_new_tokens=cfg.rollout.max_new_tokens, world=self.world)
            metrics["objective/greedy_scores"] = baseline.mean().item()
        return Collected(rollout, scores, keep, rows_kept, metrics, per_function, extra, baseline)

    def experience(self, c: Collected) -> Experience:
        """A scored rollout (this rank's share of the batch) -> Experience: old / reference log-probs, values,
        KL, advantages."""
        cfg = self.cfg
        return make_experience(
            c.rollout, c.scores, **cfg.algorithm.experience_options(),
            policy_logprobs=self._policy_forward if self._needs_old_forward else None,
            ref_logprobs=self._ref_forward if self.models.has_reference else None,
            critic_values=self._critic_forward if self.models.critic is not None else None,
            kl_coef=self.kl.value, micro_batch_size=cfg.optim.micro_batch_size, loss_mask=c.keep,
            info=c.per_function, world=self.world, baseline=c.baseline,
        )

    def generate_and_score(self, rows: list[dict[str, Any]], n: int, seed: int | None = None,
                           temperature: float | None = None) -> tuple[Rollout, Any]:
        """n completions of each row's prompt and their rewards (`lmrl.rewards.RewardOutput`)."""
        cfg, col = self.cfg, self.cfg.data.prompt_column
        prompts = [row[col] for row in rows]
        tools = getattr(getattr(self.env, "tools", None), "schemas", None)  # chat prompts list the tools
        ids = encode_prompts(self.tokenizer, prompts, cfg.rollout.max_prompt_length, use_chat_template=cfg.model.chat_template,
                             tools=tools)
        params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                                temperature=cfg.rollout.temperature if temperature is None else temperature,
                                stop=list(cfg.rollout.stop), seed=seed)
        if self.models.sampler is not None:  # a copy in another dtype samples: give it the current weights
            copy_weights(self.policy, self.models.sampler)
        episodes = None
        with (self._autocast() if self.models.sampler is None else contextlib.nullcontext(),
              full_weights(self.units.get("policy", []))):  # sharded: gathered once, for every decode step
            if self.env is None:
                rollout = self.generator.generate(ids, n, params)
            else:  # multi-turn: every live episode's next turn in one batch, observations out of the loss
                episodes = generate_episodes(self.generator, self.tokenizer, ids, rows, n, params, self.env,
                                             cfg.env.max_turns, cfg.env.max_tokens or cfg.env.max_turns * params.max_new_tokens)
                rollout = episodes.rollout
        expanded = [rows[int(i)] for i in rollout.prompt_index]
        columns = {k: [row.get(k) for row in expanded] for k in rows[0] if k != col}
        if episodes is not None:
            columns["env_reward"] = episodes.rewards
        kills = _sandbox_kills(self.data.rewards)
        out = score_rewards(self.data.rewards, [row[col] for row in expanded], rollout.texts, columns,
                            completion_ids=[ids_[m].tolist() for ids_, m in zip(rollout.response_ids, rollout.response_mask)],
                            finished=rollout.finished.tolist(), timeout=cfg.reward.timeout, on_error=cfg.reward.on_error,
                            trainer_state=TrainerState(self._global_step, cfg.train.steps))
        for name, count in _sandbox_kills(self.data.rewards).items():
            out.metrics[f"reward/{name}/sandbox_kills"] = float(count - kills[name])
        if episodes is not None:
            out.metrics.update(episodes.metrics)
        return rollout, out

    def train_on_scored(self, records) -> dict[str, float]:
        """One update on completions another system sampled and scored (`lmrl.scored`: a JSONL path or rows)."""
        from lmrl.scored import experience_from_records, load_scored_rollouts

        records = load_scored_rollouts(records) if isinstance(records, (str, Path)) else records
        exp = experience_from_records(records, self.tokenizer, self.cfg.algorithm, policy_logprobs=self._policy_forward,
                                      max_prompt_length=self.cfg.rollout.max_prompt_length,
                                      micro_batch_size=self.cfg.optim.micro_batch_size)
        return self.update(exp)

    # --------------------------------------------------------------------------------------- 4. update
    def update(self, exp: Experience) -> dict[str, float]:
        """num_iterations passes; each splits the batch into num_minibatches shuffled optimizer steps."""
        a, B = self.cfg.algorithm, len(exp)
        size, totals, count = B // a.num_minibatches, {}, 0
        for _ in range(a.num_iterations):
            order = torch.randperm(B, generator=self.minibatch_rng) if a.num_minibatches > 1 else torch.arange(B)
            for m in range(a.num_minibatches):
                rows = order[m * size:(m + 1) * size]
                # the same minibatch with a prompt's rows adjacent, so micro-batches share prompts (the
                # shared-prompt forward) as much as they can; the order inside a minibatch changes nothing else
                rows = rows[torch.argsort(exp.group_index[rows], stable=True)]
                for k, v in self._optimizer_step(exp.select(rows)).items():
                    totals[k] = totals.get(k, 0.0) + v
                count += 1
        return self.world.reduce_metrics({k: v / count for k, v in totals.items()})

    def _optimizer_step(self, mb: Experience) -> dict[str, float]:
        """One optimizer step on a minibatch, accumulating gradients over micro-batches. Every loss is
        normalised by the whole minibatch (`normalizer`), so the micro-batch split never changes the update."""
        cfg, a = self.cfg, self.cfg.algorithm
        norm_length = a.norm_length or cfg.rollout.max_new_tokens
        # normalised by the global minibatch: every rank's share of it (token-sum's normaliser is 1 on every rank)
        norm = A.loss_normalizer(mb.response_mask, a.aggregation, norm_length=norm_length)
        norm = norm if a.aggregation == "token-sum" else self.world.sum(norm)
        vnorm = self.world.sum(A.loss_normalizer(mb.response_mask, "token-mean"))
        loss_fn, options = POLICY_LOSSES[a.loss]
        kw = options(a, self.minibatch_rng)
        live = self._rows_with_gradient(mb)
        stats: dict[str, float] = {"update/rows_skipped": 1.0 - len(live) / len(mb)}
        mb = mb.select(live)  # the losses keep the whole minibatch's normalizer; metrics average over `live`
        metric_norm = A.loss_normalizer(mb.response_mask, a.aggregation, norm_length=norm_length)
        self.optimizer.zero_grad(set_to_none=True)
        finite = True
        starts = range(0, len(mb), cfg.optim.micro_batch_size)
        calls = self.world.calls(len(starts))  # sharded models: as many backwards as the busiest rank makes
        for i in range(calls):
            set_gradient_sync(self._trained_units(), i == calls - 1)  # FSDP: reduce-scatter after the last
            if i >= len(starts):
                self._idle_backward()
                continue
            start = starts[i]
            micro = mb.select(torch.arange(start, min(start + cfg.optim.micro_batch_size, len(mb))))
            share = len(micro) / len(mb)  # metrics average over micro-batches by size
            T, kl_in_loss = micro.num_response_tokens, micro.ref_logprobs is not None and a.kl_in == "loss"
            logp, entropy, *hidden = self._policy_forward(micro.sequences, micro.attention_mask, T, grad=True,
                                                          hidden=self._shared_critic)
            old = micro.old_logprobs if micro.old_logprobs is not None else logp.detach().float()
            weights, tis_stats = micro.weights, {}
            if micro.rollout_logprobs is not None:  # the sampler differs from the trainer: reweight its tokens
                tis = rollout_is_weights(old, micro.rollout_logprobs, micro.response_mask, tis_mode=a.tis_mode,
                                         tis_cap=a.tis_cap, tis_low=a.tis_low)
                weights = tis if weights is None else weights * tis
                tis_stats["val/tis_weight_mean"] = A.masked_mean(tis, micro.response_mask).item()
                tis_stats["val/tis_masked_frac"] = A.masked_mean((tis == 0).float(), micro.response_mask).item()
            loss, m = loss_fn(logp, old, micro.advantages, micro.response_mask,
                              aggregation=a.aggregation, norm_length=norm_length,
                              ref_logp=micro.ref_logprobs if kl_in_loss else None, kl_coef=self.kl.value if kl_in_loss else 0.0,
                              kl_estimator=a.kl_estimator, kl_clamp=kl_clamp_option(a.kl_clamp),
                              weights=weights, normalizer=norm, **kw)
            ent = A.aggregate_loss(entropy, micro.response_mask, a.aggregation, norm_length=norm_length, normalizer=norm)
            ent_metric = A.aggregate_loss(entropy.detach(), micro.response_mask, a.aggregation, norm_length=norm_length,
                                          normalizer=metric_norm)
            with torch.no_grad():  # TapeAgents' mean new log-prob of tokens with positive / negative weights
                lp, adv_tok = logp.detach().float(), micro.advantages
                for name, side in (("positive", adv_tok > 0), ("negative", adv_tok < 0)):
                    tis_stats[f"policy/logprob_{name}_weights"] = A.masked_mean(lp, micro.response_mask & side).item()
            step_stats = {**tis_stats, "policy/approxkl_avg": m.approx_kl, "policy/clipfrac_avg": m.clipfrac,
                          "clip_ratio/low_mean": m.clipfrac_low, "clip_ratio/high_mean": m.clipfrac_high, "val/ratio": m.ratio_mean,
                          "val/ratio_max": m.ratio_max, "loss/policy_avg": loss.item() / share,
                          "policy/entropy_avg": ent_metric.item() / share}
            if m.kl is not None:
                step_stats["objective/kl_loss"] = m.kl
            if a.entropy_coef:
                loss = loss - a.entropy_coef * ent
            if self.models.critic is not None:
                values = self._update_values(micro.sequences, micro.attention_mask, T, hidden)
                vloss, vm = A.value_loss(values, micro.values, micro.returns, micro.response_mask, clip=a.value_clip, normalizer=vnorm)
                loss = loss + a.vf_coef * vloss
                step_stats.update({"loss/value_avg": vloss.item() / share, "val/clipfrac_avg": vm.vf_clipfrac})
            finite = finite and math.isfinite(step_stats["loss/policy_avg"]) and math.isfinite(step_stats.get("loss/value_avg", 0.0))
            loss.backward()
            for k, v in step_stats.items():
                stats[k] = stats.get(k, 0.0) + v * share
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if len(mb) == 0:  # no row carries a gradient: a zero gradient still moves Adam (momentum, decay)
            for p in params:
                p.grad = torch.zeros_like(p)
        if not self.world.sharded:  # (FSDP's reduce-scatter has summed them into each rank's shard)
            self.world.sum_gradients(params)  # the global minibatch's gradient (lmrl.distributed)
        finite = self.world.all(finite)  # every rank skips, or none
        # the norm is needed either way: a non-finite gradient skips the step (max_norm=inf scales by exactly 1)
        max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm is not None else math.inf
        stats["policy/grad_norm"] = grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        stats["guard/skipped_updates"] = 0.0
        if not (finite and math.isfinite(grad_norm)):  # no weight, optimizer state or LR moves (guards.py)
            self.optimizer.zero_grad(set_to_none=True)
            stats["guard/skipped_updates"] = 1.0
            return stats
        self.optimizer.step()
        self.scheduler.step()
        return stats

    def _idle_backward(self) -> None:
        """A forward and backward that add nothing to any gradient, by a rank with fewer micro-batches than
        another: each gathers the sharded weights with the other ranks, so every rank makes as many."""
        seqs, attn, T = idle_batch(self.world.device)
        logp, _, *hidden = self._policy_forward(seqs, attn, T, grad=True, hidden=self._shared_critic)
        loss = logp.sum() * 0.0
        if self.models.critic is not None:
            loss = loss + self._update_values(seqs, attn, T, hidden).sum() * 0.0
        loss.backward()

    def _rows_with_gradient(self, mb: Experience) -> torch.Tensor:
        """Indices of the rows whose loss has a gradient. A row whose advantages are all 0 adds exactly 0 to
        the policy loss and its gradient (GRPO groups whose completions all score the same, REINFORCE rows
        scoring 0); unless an entropy bonus, a KL term in the loss or a critic acts on it, leaving it out
        of the forward and backward changes nothing in the update: the loss normalizer stays the whole
        minibatch's."""
        a = self.cfg.algorithm
        kl_in_loss = mb.ref_logprobs is not None and a.kl_in == "loss" and self.kl.value > 0
        if a.entropy_coef or kl_in_loss or self.models.critic is not None:
            return torch.arange(len(mb))
        return ((mb.advantages != 0) & mb.response_mask).any(1).nonzero().flatten()

    # --------------------------------------------------------------------------------------- forwards
    @property
    def _needs_old_forward(self) -> bool:
        """A separate no-grad policy forward for old log-probs: only when the batch serves more than one update
        (or the entropy filter needs the entropy before the update)."""
        a = self.cfg.algorithm
        return a.num_iterations > 1 or a.num_minibatches > 1 or a.entropy_top_fraction is not None

    def _policy_forward(self, seqs, attn, T: int, grad: bool = False, hidden: bool = False):
        """(log-probs, entropies) of the response tokens; with `hidden`, also the hidden states they were scored
        from, which a value head on the policy's backbone reads (`model.shared_critic`)."""
        self.forward_counts["policy"] += 1
        with torch.set_grad_enabled(grad), self._autocast():
            out = response_forward(self.policy, seqs, attn, T, self.cfg.rollout.temperature,
                                   chunk_size=self.cfg.train.logprob_chunk_size, entropy=True,
                                   hidden=hidden, share_prompt=self.cfg.train.share_prompt)
        return (out.logprobs, out.entropy, out.hidden) if hidden else (out.logprobs, out.entropy)

    def _ref_forward(self, seqs, attn, T: int):
        self.forward_counts["reference"] += 1
        with torch.no_grad(), self._autocast(), self._reference() as reference:
            return model_forward_logprobs(reference, seqs, attn, T, self.cfg.rollout.temperature,
                                          chunk_size=self.cfg.train.logprob_chunk_size,
                                          share_prompt=self.cfg.train.share_prompt)

    @contextlib.contextmanager
    def _reference(self):
        """The reference model: the frozen copy, or for a LoRA run the policy itself with its adapters disabled
        (its base weights, which LoRA never changes) in eval mode, as the copy is."""
        if self.models.reference is not None:
            yield self.models.reference
            return
        training = self.policy.training
        self.policy.eval()
        try:
            with self.policy.disable_adapter():
                yield self.policy
        finally:
            self.policy.train(training)

    def _critic_forward(self, seqs, attn, T: int, grad: bool = False):
        self.forward_counts["critic"] += 1
        share = self.cfg.train.share_prompt
        with torch.set_grad_enabled(grad), self._autocast():
            if self._shared_critic:  # the value head reads the policy's own hidden states
                return self.models.critic.response_values(self.policy, seqs, attn, T, share_prompt=share)
            return self.models.critic.response_values(seqs, attn, T, share_prompt=share)

    def _update_values(self, seqs, attn, T: int, hidden: list[torch.Tensor]) -> torch.Tensor:
        """[b, T] values with their gradient, for the update: a value head on the policy's backbone reads the
        hidden states of the policy's forward (`hidden`, one tensor); a separate critic runs its own forward."""
        if self._shared_critic:
            return self.models.critic(hidden[0])
        return self._critic_forward(seqs, attn, T, grad=True)

    @property
    def _shared_critic(self) -> bool:
        return self.models.critic is not None and self.cfg.model.shared_critic

    def _autocast(self):
        if not self.cfg.train.autocast_bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=next(self.policy.parameters()).device.type, dtype=torch.bfloat16)

    # -------------------------------------------------------------------------------- eval, log, save
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy completions of the held-out prompts: mean reward, and accuracy = fraction scoring > 0. Several
        ranks evaluate a share of the prompts each, and the means are over all of them."""
        rows = self.data.eval_rows[self.world.rank::self.world.size]
        sums = torch.zeros(4, dtype=torch.float64)
        if not rows:  # every rank gathers the sharded weights for generation, even one without prompts
            with full_weights(self.units.get("policy", [])):
                pass
        else:
            rollout, out = self.generate_and_score(rows, 1, temperature=0.0)
            sums = torch.stack([out.scores.double().sum(), (out.scores > 0).double().sum(),
                                rollout.lengths.double().sum(), torch.tensor(float(len(rows)), dtype=torch.float64)])
        reward, correct, length, n = self.world.sum(sums).tolist()
        if n == 0:
            raise DataError("evaluate: no held-out prompts (give eval_dataset, data.eval_path or a task, and "
                            "data.num_eval_prompts > 0)")
        return {"eval/reward": reward / n, "eval/accuracy": correct / n, "eval/response_length": length / n}

    @torch.no_grad()
    def pass_at_k(self, k: int, temperature: float = 1.0) -> float:
        """Fraction of held-out prompts where at least one of k samples scores > 0."""
        _, out = self.generate_and_score(self.data.eval_rows, k, seed=self.cfg.train.seed, temperature=temperature)
        return (out.scores.view(-1, k) > 0).any(1).float().mean().item()

    def _experience_metrics(self, exp: Experience) -> dict[str, float]:
        out = {"objective/scores": exp.scores.mean().item(), "val/response_length": exp.info["length"].float().mean().item(),
               "val/num_eos_tokens": exp.info["finished"].float().sum().item(),
               "val/advantage_mean": A.masked_mean(exp.advantages, exp.response_mask).item()}
        if "kl_k3" in exp.info:  # k3 (>= 0), a mean over every response token (as TRL's GRPOTrainer reports `kl`)
            out["kl"] = exp.info["kl_k3"].sum().item() / max(int(exp.response_mask.sum()), 1)
        lengths, finished = exp.info["length"].float(), exp.info["finished"].bool()
        out |= {"completions/min_length": lengths.min().item(),
                "completions/max_length": lengths.max().item(), "completions/clipped_ratio": 1 - finished.float().mean().item(),
                "completions/mean_terminated_length": lengths[finished].mean().item() if finished.any() else 0.0}
        if "kl" in exp.info:  # summed per sequence, averaged over sequences (as TRL reports it)
            out["objective/kl"] = exp.info["kl"].mean().item()
            out["objective/non_score_reward"] = -self.kl.value * out["objective/kl"]
            out["objective/rlhf_reward"] = out["objective/scores"] + out["objective/non_score_reward"]
        real = max(int(exp.response_mask.sum()), 1)
        if "reward_minus_kl" in exp.info:  # algorithm.reward_minus_kl_coef: the reward the advantages saw
            out["objective/reward_minus_kl"] = exp.info["reward_minus_kl"].double().mean().item()
        if "relu_zeroed" in exp.info:  # algorithm.relu_log_p_weights: share of tokens whose weight became 0
            out["val/relu_zeroed_frac"] = exp.info["relu_zeroed"].sum().item() / real
        if "clip_filter_weight" in exp.info:
            out["val/clip_filter_weight_mean"] = exp.info["clip_filter_weight"].float().mean().item()
        if "tis_weight" in exp.info:  # how far the sampler's probabilities are from the trainer's
            out["val/tis_weight_mean"] = exp.info["tis_weight"].mean().item()
            out["val/tis_masked_frac"] = exp.info["tis_masked"].sum().item() / real
        if "entropy" in exp.info:
            out["objective/entropy"] = exp.info["entropy"].mean().item()
        return out

    def _write_samples(self, step: int, prompts: list[str], completions: list[str], scores: list[float],
                       advantages: list[float], extra: dict[str, list[Any]]) -> None:
        """samples.jsonl: the sample table of each step that shows one, for `lmrl report` (rank 0 writes)."""
        if not (self.world.main and self.cfg.log.jsonl):
            return
        with (self.out / "samples.jsonl").open("a") as f:
            for i, (p, c, s, a) in enumerate(zip(prompts, completions, scores, advantages)):
                row = {"step": step, "prompt": p, "completion": c, "score": s, "advantage": a}
                row |= {name: values[i] for name, values in extra.items()}
                f.write(json.dumps(row, default=str) + "\n")

    def _log(self, sinks, metrics: dict[str, float], step: int) -> dict[str, float]:
        metrics = {k: float(v) for k, v in metrics.items()}
        self.rows.append(jsonl_row(metrics, step))
        for sink in sinks:
            sink.log(metrics, step)
        self.console.step(step, metrics)
        return metrics

    def save(self, directory: str | Path, final: bool = False) -> None:
        """A model plain transformers loads (`save_pretrained`), its tokenizer and the run's config, written
        atomically. A LoRA run saves adapters in checkpoints and merges them into the final model."""
        if not self._finite():
            raise RunError(f"{directory}: the weights are not finite; refusing to save them ({self._last_good()})")
        with atomic_directory(Path(directory), self.world) as tmp:  # several ranks: every one calls save
            self._save_model_files(tmp, final)

    def _save_model_files(self, directory: Path, final: bool = False) -> None:
        """Rank 0 writes; every rank calls it (sharded weights are gathered from all of them first)."""
        policy, critic = (whole_state(m) if self.world.sharded else None for m in (self.policy, self.models.critic))
        if not self.world.main:
            return
        lora = hasattr(self.policy, "peft_config")
        with quiet_progress_bars():
            if lora:  # the adapters (a checkpoint's files, final/adapter/), their base named as the user named it
                adapter = directory / "adapter" if final else directory
                self.policy.save_pretrained(adapter)
                portable_adapter_config(adapter, self._base_model())
            if final or not lora:  # final/ itself is the merged model, which plain transformers loads
                model = self.policy.merge_and_unload() if lora else self.policy
                model.save_pretrained(directory, state_dict=policy)
            if self.models.critic is not None:
                self.models.critic.save_pretrained(directory / "critic", state_dict=critic)
        self.tokenizer.save_pretrained(directory)
        (directory / "lmrl_config.yaml").write_text(config_to_yaml(self.cfg))

    def _base_model(self) -> str:
        """The base model of a LoRA run as the user named it (continuing from an adapter: that adapter's base)."""
        return adapter_base(self.cfg.model.name_or_path) or self.cfg.model.name_or_path

    def _finite(self) -> bool:
        """Every trained weight of every rank is finite."""
        return self.world.all(all_finite(self._trained_modules()))

    # ------------------------------------------------------------------------------ checkpoint, resume
    def save_checkpoint(self, step: int, rng: dict[str, Any] | None = None) -> Path:
        """Everything a resumed run needs to continue exactly after `step` (layout: `lmrl.checkpoint`).
        `rng`: the RNG states to record (default: the current ones)."""
        path = self.out / f"checkpoint-{step}"
        if self._saved_step == step and path.is_dir():
            return path
        if not self._finite():
            raise RunError(f"step {step}: the weights are not finite after the update (optim.lr={self.cfg.optim.lr:g} too "
                           f"high?); no checkpoint written ({self._last_good()})")
        state = {"step": step, "elapsed": self._elapsed, "scheduler": self.scheduler.state_dict(),
                 "kl": self.kl.state_dict(), "guards": self.guards.state_dict(), "evals": self.result.evals,
                 "episode": step * self.cfg.rollout.prompts_per_step * self.cfg.rollout.group_size,
                 "world_size": self.world.size}
        with atomic_directory(path, self.world) as tmp:  # every rank writes its part (a shared filesystem)
            save_model_state(tmp / "state", self._stateful_modules(), self.optimizer)  # collective
            torch.save(rng or rng_state(self._generators()), tmp / f"rng_state_{self.world.rank}.pt")
            if self.world.main:
                (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1) + "\n")
                (tmp / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in self.rows))
            self._save_model_files(tmp)  # with lmrl_config.yaml, the config a resume is checked against
        if self.world.main:
            prune(self.out, self.cfg.train.keep_last)
        self._saved_step = step
        return path

    def _begin(self) -> int:
        """Act on `plan_run` under the run's lock: clean partial checkpoints, clear an overwritten run, load
        the checkpoint to resume from, write lmrl_config.yaml. Returns the step to continue after (0: a new run)."""
        main = self.world.main
        for path in remove_partial(self.out) if main else []:
            self._warn(f"removed {path.name}: a checkpoint that a killed run left half-written")
        plan = plan_run(self.cfg)
        self.world.barrier()  # every rank planned before rank 0 writes anything
        if plan.clear and main:
            clear_run(self.out)
        step = self._load_checkpoint(plan.checkpoint) if plan.checkpoint is not None else 0
        if main:  # lmrl_config.yaml, not config.yaml: output_dir may be the folder holding the user's own config
            (self.out / "lmrl_config.yaml").write_text(config_to_yaml(self.cfg))
        return step

    def _load_checkpoint(self, path: Path) -> int:
        load_model_state(path / "state", self._stateful_modules(), self.optimizer)
        state = json.loads((path / "trainer_state.json").read_text())
        self.scheduler.load_state_dict(state["scheduler"])
        self.kl.load_state_dict(state["kl"])
        self.guards.load_state_dict(state["guards"])
        # this rank's RNGs; a rank the saving run did not have (another world size) continues from rank 0's
        rng = path / f"rng_state_{self.world.rank}.pt"
        set_rng_state(torch.load(rng if rng.is_file() else path / "rng_state_0.pt", weights_only=True), self._generators())
        self._elapsed, self._saved_step = float(state["elapsed"]), int(state["step"])
        self.rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
        self.result.evals = list(state["evals"])
        self.result.history = [{k: math.nan if v is None else v for k, v in r.items() if k not in ("step", "time")}
                               for r in self.rows if r["step"] > 0]
        return int(state["step"])

    def _stateful_modules(self) -> dict[str, torch.nn.Module]:
        """The modules whose trainable weights a checkpoint holds (keys prefix their parameter names)."""
        return {"policy": self.policy} | ({"critic": self.models.critic} if self.models.critic is not None else {})

    def _trained_modules(self) -> list[torch.nn.Module]:
        return list(self._stateful_modules().values())

    def _generators(self) -> dict[str, torch.Generator]:
        return {"minibatch": self.minibatch_rng, "sampler": self.generator._rng}

    def _last_good(self) -> str:
        found = newest_checkpoint(self.out)
        return f"last good checkpoint: {found}" if found is not None else "there is no earlier checkpoint"

    # --------------------------------------------------------------------------- signals and failures
    @contextlib.contextmanager
    def _signals(self):
        """SIGINT / SIGTERM: the first stops the run after a checkpoint (at once when the step can still be
        abandoned, else once it ends); a second one exits immediately. Main thread only (signal's rule)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in previous:
            signal.signal(s, self._on_signal)
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _stopping(self) -> bool:
        """A signal asked the run to stop. Under torchrun, which forwards its signal to every rank, the ranks
        agree at the end of each step, so that they stop after the same one and checkpoint it together."""
        if self.world.distributed:
            signum = self.world.most(self._stop_signal or 0)
            self._stop_signal = signum or None
        return self._stop_signal is not None

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self._stop_signal is not None:
            print_line(f"lmrl: {name} again: exiting now, without a checkpoint")
            _EXIT_NOW(128 + signum)
        self._stop_signal = signum
        if self.world.distributed:  # torchrun forwards its signal to every rank; rank 0 says it
            if self.world.main:
                print_line(f"lmrl: {name} received: every rank stops after this step's checkpoint")
            return
        print_line(f"lmrl: {name} received: stopping after a checkpoint ({name} again to exit at once)")
        if self._abandon_at is not None:
            raise _AbandonStep(signum)

    @contextlib.contextmanager
    def _abandonable(self, step: int):
        """Steps 1-3 of a step change no state but the RNGs, recorded here: a signal abandons them at once, and
        a failure in them (a reward function raising under reward.on_error=fail, ...) first writes a
        checkpoint of the last completed step, so that the run resumes where it was."""
        if not self._running:  # train_step called on its own: no checkpoints, no signal handling
            yield
            return
        if self.world.distributed:  # other ranks are in the middle of their step: no checkpoint (docs/scaling.md)
            try:
                yield
            except Exception as e:
                self._explain(e, step, None)
                raise
            return
        rng = rng_state(self._generators())
        self._abandon_at = step
        try:
            yield
        except _AbandonStep:
            self._abandon_at = None
            raise self._interrupted(max(step - 1, 0), self._checkpoint_of(step - 1, rng)) from None
        except Exception as e:
            self._abandon_at = None
            try:
                path = self._checkpoint_of(step - 1, rng)
            except Exception:  # noqa: BLE001 - the original failure is the one to report
                path = None
            self._explain(e, step, path)
            raise
        finally:
            self._abandon_at = None

    def _explain(self, e: Exception, step: int, path: Path | None) -> None:
        """A failure at `step` names the step and the checkpoint written before it was raised on."""
        where = f"{path} written: add train.resume=auto to continue" if path is not None else ""
        if isinstance(e, LmrlError):
            e.exit_code = 1
            e.args = (f"step {step}: {e}" + (f"; {where}" if where else ""),)
        elif where:  # an unexpected failure keeps its traceback; say what was saved first
            self._warn(f"step {step} failed ({type(e).__name__}); {where}")

    def _checkpoint_of(self, step: int, rng: dict[str, Any]) -> Path | None:
        """A checkpoint after `step` (nothing when no step completed)."""
        if step < 1:
            return None
        return self.save_checkpoint(step, rng)

    def _interrupted(self, step: int, path: Path | None) -> Interrupted:
        name = signal.Signals(self._stop_signal).name
        if path is None:
            return Interrupted(f"{name}: stopped before step {step + 1} ended; no checkpoint to resume from "
                               f"({'no step had completed' if step < 1 else self._last_good()})", self._stop_signal)
        return Interrupted(f"{name}: stopped after step {step}; checkpoint {path} written; add train.resume=auto "
                           "to the same command to continue", self._stop_signal)

    def _note(self, line: str) -> None:
        """A line about how the run runs (rank 0 alone), printed even without the live console."""
        if not self.world.main:
            return
        if self.console.enabled:
            self.console.print(line, markup=False, highlight=False)
        else:
            print(line, flush=True)

    def _warn(self, line: str) -> None:
        if not self.world.main:
            return
        if self.console.enabled:
            self.console.print(f"lmrl: warning: {line}", style="yellow", markup=False, highlight=False)
        else:
            print_line(f"lmrl: warning: {line}")

def _prompt_count(data) -> str:
    return "streamed prompts" if data.train_stream is not None else f"{len(data.train_rows)} prompts"


def _clips(a) -> dict[str, Any]:
    return {"clip_low": a.clip_low, "clip_high": a.clip_high}


# The policy losses by `algorithm.loss`: the function, and its options beyond those every loss takes
# (aggregation, KL to the reference, weights, normalizer), from the algorithm config and a torch.Generator.
POLICY_LOSSES = {
    "ppo": (A.policy_loss, lambda a, rng: {**_clips(a), "dual_clip": a.dual_clip, "ratio_level": a.ratio_level}),
    "cispo": (A.cispo_loss, lambda a, rng: _clips(a)),
    "cpgd": (A.cpgd_loss, lambda a, rng: {**_clips(a), "drift_coef": a.drift_coef}),
    "sapo": (A.sapo_loss, lambda a, rng: {"tau_pos": a.tau_pos, "tau_neg": a.tau_neg}),
    "gmpo": (A.gmpo_loss, lambda a, rng: _clips(a)),
    "clip_cov": (A.clip_cov_loss, lambda a, rng: {**_clips(a), "clip_fraction": a.clip_cov_fraction,
                                                  "cov_low": a.clip_cov_bounds[0], "cov_high": a.clip_cov_bounds[1],
                                                  "generator": rng}),
    "kl_cov": (A.kl_cov_loss, lambda a, rng: {"kl_fraction": a.kl_cov_fraction, "cov_kl_coef": a.kl_cov_coef}),
}


def _recorded(cfg: Config, reward_funcs, train_dataset, eval_dataset, data) -> Config:
    """`cfg` naming the reward functions and datasets passed to the Trainer instead of the task and functions
    it would otherwise load: functions as "module:qualified name", datasets as what they were and their rows."""
    sections = {}
    if isinstance(reward_funcs, RewardRecipes):
        recipes = {label: [{"fn": _reward_record(r.fn), "weight": r.weight} for r in s.rewards]
                   for label, s in reward_funcs.recipes.items()}
        sections["reward"] = cfg.reward.model_copy(update={"functions": [], "recipes": recipes,
                                                           "recipe_column": reward_funcs.column})
    elif reward_funcs is not None:
        named = [_reward_record(f) for f in (reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs])]
        sections["reward"] = cfg.reward.model_copy(update={"functions": named})
    if train_dataset is not None:
        rows = "streamed" if data.train_stream is not None else f"{len(data.train_rows)} rows"
        update = {"task": None, "path": f"<{type(train_dataset).__name__} passed to Trainer: {rows}>"}
        if eval_dataset is not None:
            update["eval_path"] = f"<{type(eval_dataset).__name__} passed to Trainer: {len(data.eval_rows)} rows used>"
        sections["data"] = cfg.data.model_copy(update=update)
    return cfg.model_copy(update=sections) if sections else cfg


def _sandbox_kills(rewards) -> dict[str, int]:
    """Programs the sandbox stopped so far, per reward function that runs code (the `code` reward's `stats`)."""
    return {r.name: int(r.fn.stats.get("kills", 0)) for r in rewards.rewards if isinstance(getattr(r.fn, "stats", None), dict)}


def _grpo_trainer_names(m: dict[str, float]) -> dict[str, float]:
    """The names TRL's GRPOTrainer logs, beside lmrl's, so that its users' dashboards find them (docs/metrics.md)."""
    same = {"reward": "reward/mean", "reward_std": "reward/std", "entropy": "policy/entropy_avg",
            "completions/mean_length": "val/response_length",
            "clip_ratio/region_mean": "policy/clipfrac_avg", "loss": "loss/policy_avg", "grad_norm": "policy/grad_norm",
            "learning_rate": "lr"}
    out = {trl: m[ours] for trl, ours in same.items() if ours in m}
    for key, value in m.items():  # reward/<fn>/mean -> rewards/<fn>/mean
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "reward" and parts[2] in ("mean", "std"):
            out[f"rewards/{parts[1]}/{parts[2]}"] = value
    return out


def _reward_record(fn: Any) -> str:
    """A reward_funcs entry as lmrl_config.yaml names it: a string as given, a model by where it came from."""
    if isinstance(fn, str):
        return fn
    if isinstance(fn, torch.nn.Module):
        return _model_name(fn)
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _model_name(model: Any) -> str:
    """What `model.name_or_path` records for a model object: where transformers loaded it from, or its class."""
    return str(getattr(model, "name_or_path", "") or f"{type(model).__name__} object")


def _prompt_text(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else " | ".join(f"{m.get('role')}: {m.get('content')}" for m in prompt)
