"""The training loop, top to bottom.

    for step in 1..steps:
        1. sample prompts        reproducible from (seed, step)
        2. generate and score    G completions per prompt; DAPO refills groups that carry no signal
        3. make experience       old / reference log-probs, values, KL, advantages
        4. update                num_iterations x shuffled minibatches, gradient accumulation
        5. log, evaluate, save

Each stage lives in the module of its concern, and the trainer calls them in order:

    lmrl.build         everything built from the config before the first step (`build_run`)
    lmrl.generators    the generator rollout.backend names, over the built models (`make_generator`)
    lmrl.collect       1-2: prompts -> completions -> rewards -> shaped scores
    lmrl.experience    3: log-probs, values, KL, advantages (the math: lmrl.algorithms)
    lmrl.update        4: the losses and the optimizer steps
    lmrl.logging       5: metric names, sinks, the console, samples and the report
    lmrl.lifecycle     around the steps: checkpoints, resume, signals, failures, the final save

How lmrl departs from a textbook PPO loop, and why: no reference model is loaded when no KL term uses it
(kl_coef = 0 and no adaptive target); the update's departures are listed in `lmrl.update`.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmrl import algorithms as A
from lmrl.agents.programs import close_agents
from lmrl.algorithms import KLController
from lmrl.build import build_run
from lmrl.collect import SHOWN_IMAGES, Collected, Collector, PushedWeights, generation_weights
from lmrl.config import Config, config_warnings
from lmrl.data.prompts import PromptSampler
from lmrl.distributed import full_weights
from lmrl.errors import DataError
from lmrl.experience import Experience, make_experience
from lmrl.generators import check_backend, make_generator, sampler_of
from lmrl.guards import Guards, SamplerMismatch
from lmrl.lifecycle import RunLifecycle
from lmrl.logging import Console
from lmrl.logging.metrics import Phases, experience_metrics, grpo_trainer_names, prompt_text
from lmrl.logging.run_log import RunLog
from lmrl.models.forward import Forwards
from lmrl.rewards.core import learned_scores
from lmrl.rollout import HFGenerator, RemoteGenerator
from lmrl.streamed import generator_process
from lmrl.update import Updater, needs_old_logprobs

__all__ = ["Collected", "TrainResult", "Trainer"]


@dataclass
class TrainResult:
    output_dir: Path
    history: list[dict[str, float]] = field(default_factory=list)  # one metrics dict per step
    evals: list[dict[str, float]] = field(default_factory=list)  # held-out metrics, with step and time


class Trainer:
    """RL post-training of one causal LM. Give a Config; optionally the model, tokenizer, reward functions
    and prompt rows directly (as with TRL's GRPOTrainer): those override the config's (`reward_funcs` may also
    be `lmrl.rewards.RewardRecipes`: functions per data label; `tokenizer` may be a vision-language model's
    processor, as TRL's `processing_class`). `env` (an
    `lmrl.envs` Environment) makes every rollout a multi-turn episode, as `env.name` does."""

    def __init__(self, cfg: Config, *, model=None, tokenizer=None, reward_funcs=None, train_dataset=None,
                 eval_dataset=None, console: bool | None = None, env=None):
        run = build_run(cfg, model=model, tokenizer=tokenizer, reward_funcs=reward_funcs, train_dataset=train_dataset,
                        eval_dataset=eval_dataset, env=env)
        self.cfg = cfg = run.cfg
        check_backend(cfg, run.models.policy.config, run.device)  # before any engine, server or process starts
        self.world, self.env, self.data, self.models, self.units = run.world, run.env, run.data, run.models, run.units
        self.policy, self.tokenizer, self.device = run.models.policy, run.models.tokenizer, run.device
        self.optimizer, self.scheduler = run.optimizer, run.scheduler
        self.kl = KLController(cfg.algorithm.kl_coef, cfg.algorithm.kl_target, cfg.algorithm.kl_horizon)
        sampler = None if self.data.train_stream else PromptSampler(len(self.data.train_rows), seed=cfg.train.seed)
        # asynchronous rollouts: a generator process samples the batches, this process's generator evaluates
        self.generator = make_generator(cfg, self.models, self.env, run.device, local=cfg.asynchronous)
        if run.device.type == "cuda" and isinstance(self.generator, HFGenerator):
            run.notes.append("generation: {} ({})".format(*self.generator.decode_path()))
        self.notes = run.notes
        self.minibatch_rng = torch.Generator().manual_seed(cfg.train.seed)
        self.out = Path(cfg.train.output_dir)
        shown = (cfg.log.console if console is None else console) and self.world.main  # rank 0 alone prints
        self.console = Console(shown, cfg.train.steps, cfg.log.every)
        self.guards = Guards(cfg.guard, self.data.rewards.names, cfg.optim.lr,
                             vocab_size=getattr(self.policy.config.get_text_config(), "vocab_size", None),
                             evaluates=bool(self.data.eval_rows), **sampler_of(cfg, self.policy))
        self.result = TrainResult(self.out)
        self.log = RunLog(self.out, self.console, self.world.main, cfg.log)
        self.rollouts = generator_process(cfg, run, self.policy, self.units.get("policy", []), self.tokenizer, self.world,
                                          self.log.warn, shape=lambda *a: self.collector.shaped(*a))
        if self.rollouts is not None:  # it starts up while this process builds and resumes the run
            self.rollouts.spawn()
        self.forwards = Forwards(self.policy, self.models.reference, self.models.critic,
                                 temperature=cfg.rollout.temperature, chunk_size=cfg.train.logprob_chunk_size,
                                 share_prompt=cfg.train.share_prompt, autocast_bf16=cfg.train.autocast_bf16,
                                 shared_critic=cfg.model.shared_critic, teacher=self.models.teacher, pack=cfg.train.packing)
        self.collector = Collector(cfg, self.data, sampler, self.generator, self.tokenizer, self.env, self.world,
                                   self._generation_weights(), self.log.warn, processor=self.models.processor,
                                   device=run.device)
        self.updater = Updater(cfg, self.forwards, self.optimizer, self.scheduler, self.kl, self.world,
                               self.units.get("policy", []) + self.units.get("critic", []), self.minibatch_rng)
        trained = {"policy": self.policy} | ({"critic": self.models.critic} if self.models.critic is not None else {})
        self.lifecycle = RunLifecycle(cfg, self.world, self.log, self.result, modules=trained, optimizer=self.optimizer,
                                      states={"scheduler": self.scheduler, "kl": self.kl, "guards": self.guards},
                                      generators={"minibatch": self.minibatch_rng, "sampler": self.generator._rng},
                                      tokenizer=self.models.processor or self.tokenizer, files={"async_batches": self.rollouts} if self.rollouts else {})

    def _generation_weights(self):
        """How the generator gets the policy's weights before a batch (`lmrl.collect`): it reads them in place, or
        it holds its own copy and takes them (a vLLM engine)."""
        units = self.units.get("policy", [])
        if isinstance(self.generator, RemoteGenerator):
            return PushedWeights(self.policy, self.generator, units)
        return generation_weights(self.policy, self.models.sampler, units, self.forwards.autocast)

    @property
    def forward_counts(self) -> dict[str, int]:
        """How many forwards of each model (policy, reference, critic) the run made."""
        return self.forwards.counts

    def train(self) -> TrainResult:
        """Run (or resume) the loop. Holds `output_dir`'s lock for its life; SIGINT / SIGTERM stop it after
        a checkpoint (`lmrl.errors.Interrupted`); a failing step writes a checkpoint of the last good one."""
        life = self.lifecycle
        with life.held():
            start_step = life.begin()
            with life.running(), self.log.open(start_step, self.cfg.model_dump(mode="json")), self._rollouts(start_step):
                self._header(start_step)
                with self.console:
                    last = self._loop(start_step)
                if last > start_step or not self.world.first((self.out / "final").exists()):  # every rank: a collective
                    self.save(self.out / "final", final=True)
        return self.result

    @contextlib.contextmanager
    def _rollouts(self, start_step: int):
        """An asynchronous run's generator process, for the loop's life; then agent programs hear the run is over."""
        try:
            getattr(self.rollouts, "start", lambda _: None)(start_step)
            yield
        finally:
            getattr(self.rollouts, "close", lambda: None)()
            close_agents(self.env)

    def _header(self, start_step: int) -> None:
        """The run's first lines: what trains on what, where it writes, how it runs, what to look at."""
        data = self.data
        prompts = "streamed prompts" if data.train_stream is not None else f"{len(data.train_rows)} prompts"
        self.console.print(f"[bold]lmrl[/] {self.cfg.algorithm.name} on {self.cfg.model.name_or_path}: {prompts}, "
                           f"output in {self.out}" + (f", resumed at step {start_step}" if start_step else ""))
        for line in self.notes:
            self.log.note(line)
        for line in data.skipped + config_warnings(self.cfg):
            self.log.warn(line)

    def _loop(self, start_step: int) -> int:
        """Steps after `start_step` until train.steps or train.max_minutes; returns the last step done."""
        cfg, life = self.cfg, self.lifecycle
        start, step = time.time() - life.elapsed, start_step
        self.console.start_at(start_step)
        if self.data.eval_rows and start_step == 0:
            with life.abandonable(0):  # a signal here stops the run: nothing to save yet
                evals = self.evaluate()
            self.guards.record_eval(evals)
            self.result.evals.append(self.log.log({**evals, "time/elapsed": 0.0}, 0) | {"step": 0})
        if start_step >= cfg.train.steps:
            self.console.print(f"the run already ended at step {start_step} (train.steps={cfg.train.steps}): "
                               "raise train.steps to train on")
        for step in range(start_step + 1, cfg.train.steps + 1):
            metrics = self.train_step(step)
            life.elapsed = elapsed = time.time() - start
            metrics["time/elapsed"] = elapsed
            out_of_time = cfg.train.max_minutes is not None and elapsed > 60 * cfg.train.max_minutes
            self._end_step(step, metrics, last=step == cfg.train.steps or out_of_time)
            if out_of_time:
                self.console.print(f"train.max_minutes={cfg.train.max_minutes} reached at step {step}")
                break
        return step

    def _end_step(self, step: int, metrics: dict[str, float], last: bool) -> None:
        """5. evaluate when due, check the guards, log, and checkpoint when due or when a signal asked to stop."""
        cfg, life = self.cfg, self.lifecycle
        failed = None  # a reward failing in the evaluation: the step is kept (logged, saved), then the run stops
        if self.data.eval_rows and (last or (cfg.train.eval_every and step % cfg.train.eval_every == 0)):
            try:
                metrics.update(self.evaluate())
                self.result.evals.append({k: v for k, v in metrics.items() if k.startswith("eval/")}
                                         | {"step": step, "time/elapsed": metrics["time/elapsed"]})
                if cfg.train.keep_best:
                    life.keep_best(step)
            except Exception as e:  # noqa: BLE001 - raised again below, once the step is safe
                failed = e
        warned = []
        try:
            warned = self.guards.check(step, metrics)
        except SamplerMismatch as e:  # the step is kept (logged, saved), then the run stops
            failed = e
        finally:  # a guard that stops the run still logs the step that tripped it
            self.result.history.append(self.log.log(metrics, step))
        for line in warned:
            self.log.warn(line)
        if failed is not None:  # (several ranks: the others are not here to write a checkpoint with it)
            life.explain(failed, step, None if self.world.distributed else life.save_checkpoint(step))
            raise failed
        if cfg.train.save_every and (step % cfg.train.save_every == 0 or last):
            life.save_checkpoint(step)
        if life.stopping():
            raise life.interrupted(step, life.save_checkpoint(step))

    def train_step(self, step: int) -> dict[str, float]:
        """One step: collect, make experience, update; returns its metrics (the same on every rank)."""
        cfg, phases = self.cfg, Phases(self.device)  # each phase's time and memory peak
        self.collector.global_step = step - 1
        with self.lifecycle.abandonable(step):  # 1-3 change nothing but RNGs: a signal or a failure here keeps step - 1
            # 1-2. sample prompts, generate, score
            c = self.collect(step)
            rollout, metrics = c.rollout, c.metrics
            t1 = phases.end("generate")
            # 3. experience: old / reference log-probs, values, KL, advantages
            exp = self.experience(c)
            t2 = phases.end("experience")
        # 4. update
        updated = self.update(exp)  # reduced over ranks
        self.collector.global_step = step
        if self.rollouts is not None:  # the generator process takes these weights for its next batch
            self.rollouts.publish(step)
        t3, t0 = phases.end("update"), phases.start
        # 5. metrics: this rank's share's, then averaged over ranks (every rank sees the same values)
        # the mean negative log-prob of the sampled tokens estimates the policy's entropy even when the
        # update skipped every row (the collapse guard reads it)
        metrics["rollout/entropy_estimate"] = -A.masked_mean(rollout.logprobs, rollout.response_mask).item()
        metrics.update(experience_metrics(exp, self.kl.value))
        metrics["guard/empty_update"] = float(self.world.all(c.keep is not None and not bool(c.keep.any())))  # every rank's
        metrics = self.world.reduce_metrics(metrics) | updated
        if "objective/kl" in metrics and math.isfinite(kl := metrics["objective/kl"]):
            self.kl.update(kl, len(exp) * self.world.size)
        metrics.setdefault("time/generate", t1 - t0)  # an asynchronous run's: the generator process's time
        metrics.update({"time/experience": t2 - t1, "time/update": t3 - t2, **phases.peaks,
                        "time/step": t3 - t0, "eps": len(exp) / (t3 - t0), "lr": self.scheduler.get_last_lr()[0],
                        "episode": step * cfg.rollout.prompts_per_step * cfg.rollout.group_size,
                        "objective/kl_coef": self.kl.value})
        if self.data.train_stream is not None and self.data.train_stream.skipped:  # the same on every rank
            metrics["data/skipped_rows"] = float(self.data.train_stream.skipped)
        metrics.update(grpo_trainer_names(metrics))
        if cfg.log.samples_every and step % cfg.log.samples_every == 0:
            self._samples(step, c, exp.per_episode())
        return metrics

    def _samples(self, step: int, c: Collected, exp: Experience) -> None:
        """The step's first log.num_samples completions, with their prompts, scores and advantages."""
        k = min(self.cfg.log.num_samples, len(exp))
        prompts = [prompt_text(c.rows[int(i)][self.cfg.data.prompt_column]) for i in exp.group_index[:k]]
        extra = {name: values[:k] for name, values in c.extra_columns.items()}
        shown = extra.pop(SHOWN_IMAGES, None) or [[]] * k  # the images each sample's environment showed
        if self.models.processor is not None:  # what each sample saw, the run's images/ keeping in-memory ones
            from lmrl.data.images import image_refs

            keep = self.out / "images" if self.log.main and self.cfg.log.jsonl else None
            extra["images"] = [image_refs(c.rows[int(i)], keep, later) for i, later in zip(exp.group_index[:k], shown)]
        self.log.samples(step, prompts, c.rollout.texts[:k], exp.scores[:k].tolist(), exp.advantages[:k, 0].tolist(), extra)

    # ------------------------------------------------------------------------------ the step's stages
    def collect(self, step: int) -> Collected:
        """1-2. Prompts -> scored rollout (`lmrl.collect.Collector.collect`), or the batch an asynchronous run's
        generator process sampled (`lmrl.async_rollouts`)."""
        return self.collector.collect(step) if self.rollouts is None else self.rollouts.batch(step)

    def generate_and_score(self, rows: list[dict[str, Any]], n: int, seed: int | None = None,
                           temperature: float | None = None) -> tuple[Any, Any]:
        """n completions of each row's prompt and their rewards (`lmrl.rewards.RewardOutput`)."""
        return self.collector.generate_and_score(rows, n, seed=seed, temperature=temperature)

    def experience(self, c: Collected) -> Experience:
        """3. A scored rollout (this rank's share of the batch) -> Experience: old / reference log-probs, values,
        KL, advantages."""
        cfg, f = self.cfg, self.forwards
        # distillation alone: the task's reward is logged (and evaluates), the teacher's signal alone trains
        scores = c.scores if cfg.trains_on_rewards else torch.zeros_like(c.scores)
        return make_experience(
            c.rollout, scores, **cfg.algorithm.options_for(make_experience),
            policy_logprobs=f.policy_logprobs if needs_old_logprobs(cfg.algorithm) else None,
            ref_logprobs=f.reference if self.models.has_reference else None,
            critic_values=f.critic if self.models.critic is not None else None,
            teacher_logprobs=f.teacher if self.models.teacher is not None else None,
            kl_coef=self.kl.value, micro_batch_size=cfg.optim.micro_batch_size, loss_mask=c.keep, info=c.per_function,
            micro_batch_tokens=cfg.optim.micro_batch_tokens, world=self.world, baseline=c.baseline,
        )

    def update(self, exp: Experience) -> dict[str, float]:
        """4. Optimizer steps on a batch of experience (`lmrl.update.Updater.update`)."""
        return self.updater.update(exp)

    def train_on_scored(self, records) -> dict[str, float]:
        """One update on completions another system sampled and scored (`lmrl.scored`: a JSONL path or rows)."""
        from lmrl.scored import experience_from_records, load_scored_rollouts

        records = load_scored_rollouts(records) if isinstance(records, (str, Path)) else records
        exp = experience_from_records(records, self.tokenizer, self.cfg.algorithm, policy_logprobs=self.forwards.policy_logprobs,
                                      max_prompt_length=self.cfg.rollout.max_prompt_length,
                                      micro_batch_size=self.cfg.optim.micro_batch_size, device=self.device)
        return self.update(exp)

    # ------------------------------------------------------------------------------ evaluate, save
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy completions of the held-out prompts: mean reward, and accuracy = fraction scoring > 0 (under
        reward.verifier when the run has one: then `eval/learned_reward` is the learned functions' mean beside it).
        Several ranks evaluate a share of the prompts each, and the means are over all of them."""
        rows = self.data.eval_rows[self.world.rank::self.world.size]
        sums = torch.zeros(5, dtype=torch.float64)
        if not rows:  # every rank gathers the sharded weights for generation, even one without prompts
            with full_weights(self.units.get("policy", [])):
                pass
        else:
            rollout, out = self.generate_and_score(rows, 1, temperature=0.0)
            scores = out.scores.double().cpu()
            verified = scores if self.data.verifier is None else self.collector.verify(rows, rollout).scores.double().cpu()
            sums = torch.tensor([scores.sum(), (verified > 0).sum(), rollout.lengths.double().sum().item(), len(rows),
                                 learned_scores(self.data.rewards, out).sum()], dtype=torch.float64)
        reward, correct, length, n, learned = self.world.sum(sums).tolist()
        if n == 0:
            raise DataError("evaluate: no held-out prompts (give eval_dataset, data.eval_path or a task, and "
                            "data.num_eval_prompts > 0)")
        verified = {} if self.data.verifier is None else {"eval/learned_reward": learned / n}
        return {"eval/reward": reward / n, "eval/accuracy": correct / n, **verified, "eval/response_length": length / n}

    @torch.no_grad()
    def pass_at_k(self, k: int, temperature: float = 1.0) -> float:
        """Fraction of held-out prompts where at least one of k samples scores > 0."""
        _, out = self.generate_and_score(self.data.eval_rows, k, seed=self.cfg.train.seed, temperature=temperature)
        return (out.scores.view(-1, k) > 0).any(1).float().mean().item()

    def save_checkpoint(self, step: int) -> Path:
        """A resumable checkpoint after `step` (`lmrl.lifecycle.RunLifecycle.save_checkpoint`)."""
        return self.lifecycle.save_checkpoint(step)

    def save(self, directory: str | Path, final: bool = False) -> None:
        """A model plain transformers loads (`save_pretrained`), its tokenizer and the run's config, written
        atomically. A LoRA run saves adapters in checkpoints and merges them into the final model."""
        self.lifecycle.save(directory, final)
