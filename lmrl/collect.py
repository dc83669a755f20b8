"""Collecting a step's data: prompts -> completions -> rewards -> shaped scores.

    rows    = the step's prompt rows             a pure function of (seed, step): a resumed run draws the same
    rollout = generator.generate(prompts, G)     or multi-turn episodes with an environment (`lmrl.rollout.multiturn`)
    scores  = rewards(prompts, completions)      `lmrl.rewards.score`, with the rows' columns
    scores  = shape(scores)                      penalties, clipping, normalisation (`lmrl.rewards.shaping`)

DAPO's dynamic sampling repeats the first three for more prompts when groups carry no signal (all G rewards
equal). Everything here runs before the update and changes no weight: what the step trains on is decided here,
and the trainer's `make_experience` takes it from there.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lmrl.algorithms import informative_groups
from lmrl.distributed import World, full_weights
from lmrl.models.prompt_encoding import encode_prompts
from lmrl.models.weights import copy_weights, export_weights
from lmrl.rewards import score as score_rewards
from lmrl.rewards import shape_scores
from lmrl.rewards.core import TrainerState
from lmrl.rollout import Rollout, SamplingParams, concat_rollouts, select_rollout
from lmrl.rollout.multiturn import generate_episodes

# the extra column of the images an episode's environment showed ([B] lists of images), which `samples.jsonl` names
SHOWN_IMAGES = "env_images"


@dataclass
class Collected:
    """One step's scored rollout, as `Collector.collect` returns it."""

    rollout: Rollout
    scores: torch.Tensor  # [B] after shaping
    keep: torch.Tensor | None  # [B] False: left out of the loss
    rows: list[dict[str, Any]]  # dataset rows of the kept groups, in group order
    metrics: dict[str, float]
    per_function: dict[str, torch.Tensor]  # "reward/<name>" -> [B] raw scores (NaN where None)
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)  # the reward functions' log_extra, [B] each
    baseline: torch.Tensor | None = None  # [B / G] the greedy completion's reward per prompt (ReMax)


class Collector:
    """Prompts to scored rollouts, with the current weights of the policy.

    Args:
        cfg: the run's config (`data`, `rollout`, `reward`, `env`, `algorithm`'s sampling fields, `train.seed`).
        data: the run's prompts and reward functions (`lmrl.build.Data`).
        sampler: the prompt sampler (`lmrl.data.prompts.PromptSampler`), None for a stream.
        generator: the generation backend (`lmrl.rollout.Generator`).
        tokenizer: the policy's tokenizer.
        env: a multi-turn environment (`lmrl.envs`), or None for single-turn completions.
        world: the ranks; each generates its share of a step's prompts.
        weights: a context manager factory, given the policy's version (optimizer steps done), that readies the
            generator's weights for a batch: the sampler copy synced, sharded weights gathered, autocast
            (`generation_weights`); or the weights pushed to a generator that holds its own (`PushedWeights`).
        warn: prints a warning line.
        processor: a vision-language policy's processor, or None for a text policy.
        device: where the step's arithmetic happens (the policy's device): every rollout is moved there, whatever
            device its generator built it on (a server's and an agent program's are built on the CPU); None: left
            where it is.
    """

    def __init__(self, cfg, data, sampler, generator, tokenizer, env, world: World,
                 weights: Callable[[int], contextlib.AbstractContextManager], warn: Callable[[str], None],
                 processor: Any = None, device: torch.device | None = None):
        self.processor = processor  # a vision-language policy's: prompts become ids and one bundle of media each
        self.device = device
        self.cfg, self.data, self.sampler, self.generator, self.tokenizer = cfg, data, sampler, generator, tokenizer
        self.env, self.world, self.weights, self.warn = env, world, weights, warn
        self.global_step = 0  # optimizer steps done: what reward functions read as trainer_state.global_step

    def prompts(self, step: int, r: int, rounds: int, size: int) -> list[dict[str, Any]]:
        """The prompt rows of sampling round `r` of `step`: a pure function of (step, r), so a resumed run
        draws the rows the stopped one would have (a stream is read again up to there). A stream starts at
        its first row; the sampler's batch index (step * rounds + r) keeps the order runs have always had."""
        stream = self.data.train_stream
        if stream is None:
            return [self.data.train_rows[i] for i in self.sampler.indices(step * rounds + r, size)]
        skipped = stream.skipped
        rows = stream.batch((step - 1) * rounds + r, size)
        if stream.skipped and not skipped:
            self.warn(f"{stream.name}: left out a bad row (data.on_bad_row=skip), {stream.first_skipped.where}: "
                      f"{stream.first_skipped.problem}; data/skipped_rows counts them")
        return rows

    def collect(self, step: int) -> Collected:
        """Prompts -> scored rollout. With dynamic sampling (DAPO), groups whose rewards are all equal are
        dropped and more prompts are sampled, for at most `max_sampling_rounds` rounds. Several ranks keep
        the groups one process would: each generates its share of a round, and the first informative
        groups of the whole round (in prompt order) are kept, wherever they are."""
        cfg, G, world = self.cfg, self.cfg.rollout.group_size, self.world
        rounds = cfg.algorithm.max_sampling_rounds if cfg.algorithm.dynamic_sampling else 1
        parts, rows_kept, metrics, kept = [], [], {}, 0  # kept: groups of every rank
        share = world.shard(cfg.rollout.prompts_per_step)  # this rank's prompts: whole groups
        filtered = 0
        for r in range(rounds):
            rows = self.prompts(step, r, rounds, cfg.rollout.prompts_per_step)[share]
            seed = cfg.train.seed * 1_000_003 + step * 101 + r + 7919 * world.rank
            rollout, out = self.generate_and_score(rows, G, seed=seed)
            if r == 0:  # reward metrics of the first round: the unfiltered policy
                metrics = dict(out.metrics) | {"frac_reward_zero_std": 1 - informative_groups(out.scores, G).float().mean().item()}
            part = (rollout, out.scores, out.per_function, out.extra_columns)
            whole = rollout, out.scores, out.per_function, rows
            if cfg.algorithm.dynamic_sampling:
                part, rows, chosen, informative = self._keep_informative(part, rows, share, kept, last=r == rounds - 1)
                filtered += informative
                kept += chosen
            else:
                kept += cfg.rollout.prompts_per_step
            parts.append(part)
            rows_kept += rows
            if kept >= cfg.rollout.prompts_per_step:
                break
        outside = not rows_kept
        if outside:  # the other ranks hold every kept group: this one takes a group to keep in step, outside the loss
            rollout, scores, per_fn, rows = whole
            first = torch.arange(G)
            parts, rows_kept = [(select_rollout(rollout, first), scores[first], {k: v[first] for k, v in per_fn.items()}, {})], rows[:1]
            parts[0][0].prompt_index = torch.zeros(G, dtype=torch.long)
            if rollout.media is not None and rollout.media_index is None:
                parts[0][0].media = rollout.media[:1]
        sync = getattr(self.weights, "take_seconds", None)
        if sync is not None:  # a generator that holds its own weights took the policy's
            metrics["time/weight_sync"] = sync()
        if cfg.algorithm.dynamic_sampling:  # the same on every rank
            metrics.update({"dynamic_sampling/rounds": float(r + 1), "dynamic_sampling/filtered_groups": float(filtered),
                            "dynamic_sampling/kept_groups": float(min(kept, cfg.rollout.prompts_per_step))})
        return self.shaped(parts, rows_kept, metrics, outside)

    def _keep_informative(self, part: tuple, rows: list[dict[str, Any]], share: slice, kept: int,
                          last: bool) -> tuple[tuple, list[dict[str, Any]], int, int]:
        """Dynamic sampling's choice in one round: the first groups of the whole round (every rank's) whose
        rewards differ, as many as the step still needs. Returns this rank's part of them and its rows, the number
        of groups chosen on every rank and the number left out as uninformative."""
        G, P = self.cfg.rollout.group_size, self.cfg.rollout.prompts_per_step
        rollout, scores, per_fn, extra = part
        ok = torch.zeros(P)  # [P] the round's informative groups, every rank's
        ok[share] = informative_groups(scores, G).float()
        ok = self.world.sum(ok).bool()
        chosen = ok.nonzero().flatten()[:P - kept]
        if last and kept == 0 and len(chosen) == 0:
            chosen = torch.arange(P)  # nothing informative at all (nothing kept either): zero advantages
        count = len(chosen)
        chosen = chosen[(chosen >= share.start) & (chosen < share.stop)] - share.start  # this rank's
        index = (chosen[:, None] * G + torch.arange(G)).flatten()
        rollout, scores, rows = select_rollout(rollout, index), scores[index], [rows[int(i)] for i in chosen]
        per_fn = {k: v[index] for k, v in per_fn.items()}
        extra = {k: [v[int(i)] for i in index] for k, v in extra.items()}
        rollout.prompt_index = torch.arange(len(rows)).repeat_interleave(G)
        if rollout.media is not None and rollout.media_index is None:  # the kept prompts' bundles, renumbered
            rollout.media = [rollout.media[int(i)] for i in chosen]
        return (rollout, scores, per_fn, extra), rows, count, int((~ok).sum())

    def shaped(self, parts: list[tuple], rows: list[dict[str, Any]], metrics: dict[str, float],
               outside: bool = False) -> Collected:
        """The rounds' parts as one rollout with shaped scores (and ReMax's greedy baselines)."""
        cfg = self.cfg
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
            greedy, out = self.generate_and_score(rows, 1, temperature=0.0)
            # no reward.normalize: a batch statistic of other completions
            baseline, _ = shape_scores(greedy, out.scores, **{**cfg.reward.shaping_options(), "normalize": False},
                                       max_new_tokens=cfg.rollout.max_new_tokens, world=self.world)
            metrics["objective/greedy_scores"] = baseline.mean().item()
        return Collected(rollout, scores, keep, rows, metrics, per_function, extra, baseline)

    def generate_and_score(self, rows: list[dict[str, Any]], n: int, seed: int | None = None,
                           temperature: float | None = None) -> tuple[Rollout, Any]:
        """n completions of each row's prompt and their rewards (`lmrl.rewards.RewardOutput`)."""
        cfg, col = self.cfg, self.cfg.data.prompt_column
        prompts = [row[col] for row in rows]
        media, images = None, None
        if self.processor is not None:  # each prompt's images processed once, whatever n
            # vLLM processes the images its own way; lmrl's decode takes the bundles
            ids, media, images = prompt_media(self.processor, prompts, rows,
                                              for_engine=getattr(self.generator, "processes_images", False))
        else:
            ids = self.encode(prompts)
        params = self.sampling_params(seed, temperature)
        episodes = None
        with self.weights(self.global_step):
            if self.env is not None:  # multi-turn: every live episode's next turn in one batch, observations out of the loss
                episodes = generate_episodes(self.generator, self.tokenizer, ids, rows, n, params, self.env,
                                             cfg.env.max_turns, cfg.env.max_tokens or cfg.env.max_turns * params.max_new_tokens,
                                             media=media, processor=self.processor, images=images,
                                             conversations=self.conversations(prompts), tools=self.tools())
                rollout = episodes.rollout
            elif images is not None:  # the engine processes the images; the trainer's forward takes the bundles
                rollout = self.generator.generate(ids, n, params, images=images)
                rollout.media = media
            elif media is not None:
                rollout = self.generator.generate(ids, n, params, media=media)
                rollout.media = media
            else:
                rollout = self.generator.generate(ids, n, params)
        if self.device is not None:
            rollout = rollout.to(self.device)
        return rollout, self.score(rows, rollout, episodes)

    def encode(self, prompts: list[Any]) -> list[list[int]]:
        """Prompts (texts or chat messages) as token ids, as the policy is prompted."""
        return encode_prompts(self.tokenizer, prompts, self.cfg.rollout.max_prompt_length,
                              use_chat_template=self.cfg.model.chat_template, tools=self.tools())

    def tools(self) -> list[dict] | None:
        """The environment's tools as a chat template lists them (chat prompts list the tools)."""
        return getattr(getattr(self.env, "tools", None), "schemas", None)

    def conversations(self, prompts: list[Any]) -> list[list[dict]] | None:
        """Each prompt's chat messages, where every prompt went through the chat template (a string wrapped as a user
        message by model.chat_template); None where one is plain text."""
        wrap = self.cfg.model.chat_template and getattr(self.tokenizer, "chat_template", None) is not None
        if not all(isinstance(p, list) or wrap for p in prompts) or self.cfg.model.chat_template is False:
            return None
        return [p if isinstance(p, list) else [{"role": "user", "content": p}] for p in prompts]

    def sampling_params(self, seed: int | None = None, temperature: float | None = None) -> SamplingParams:
        """The run's sampling parameters (rollout.*), with a seed and, where given, another temperature."""
        r = self.cfg.rollout
        return SamplingParams(max_new_tokens=r.max_new_tokens, top_p=r.top_p, top_k=r.top_k,
                              temperature=r.temperature if temperature is None else temperature,
                              stop=list(r.stop), seed=seed)

    def verify(self, rows: list[dict[str, Any]], rollout: Rollout) -> Any:
        """The verifier's scores of a rollout's completions (reward.verifier, `lmrl.build.Data.verifier`): what a
        learned reward is checked against on held-out prompts."""
        return self.score(rows, rollout, None, self.data.verifier)

    def score(self, rows: list[dict[str, Any]], rollout: Rollout, episodes=None, rewards: Any = None) -> Any:
        """The rewards of a rollout's completions, with their rows' columns (and the episodes' own rewards)."""
        cfg, col = self.cfg, self.cfg.data.prompt_column
        rewards = self.data.rewards if rewards is None else rewards
        expanded = [rows[int(i)] for i in rollout.prompt_index]
        columns = {k: [row.get(k) for row in expanded] for k in rows[0] if k != col}
        if episodes is not None:
            columns["env_reward"] = episodes.rewards
        kills = _sandbox_kills(rewards)
        out = score_rewards(rewards, [row[col] for row in expanded], rollout.texts, columns,
                            completion_ids=[ids_[m].tolist() for ids_, m in zip(rollout.response_ids, rollout.response_mask)],
                            finished=rollout.finished.tolist(), timeout=cfg.reward.timeout, on_error=cfg.reward.on_error,
                            trainer_state=TrainerState(self.global_step, cfg.train.steps))
        for name, count in _sandbox_kills(rewards).items():
            out.metrics[f"reward/{name}/sandbox_kills"] = float(count - kills[name])
        if episodes is not None:
            out.metrics.update(episodes.metrics)
            if episodes.images is not None and any(episodes.images):  # travels with its rows, as log_extra does
                out.extra_columns[SHOWN_IMAGES] = episodes.images
        # rewards are computed on the CPU; the step's arithmetic with them happens where the rollout is
        device = rollout.lengths.device
        out.scores = out.scores.to(device)
        out.per_function = {name: v.to(device) for name, v in out.per_function.items()}
        return out


def generation_weights(policy: torch.nn.Module, sampler: torch.nn.Module | None, units: list[torch.nn.Module],
                       autocast: Callable[[], contextlib.AbstractContextManager]
                       ) -> Callable[[int], contextlib.AbstractContextManager]:
    """A context manager factory for `Collector(weights=...)` when the policy (or a copy of it) generates in this
    process: a copy in another dtype first takes the policy's current weights; sharded weights are gathered once
    for the whole batch; the policy itself generates under the run's autocast."""

    @contextlib.contextmanager
    def ready(version: int):
        if sampler is not None:  # a copy in another dtype samples: give it the current weights
            copy_weights(policy, sampler)
        with autocast() if sampler is None else contextlib.nullcontext(), full_weights(units):
            yield

    return ready


class PushedWeights:
    """The `Collector(weights=...)` factory for a generator that holds its own copy of the weights
    (`lmrl.rollout.RemoteGenerator`: a vLLM engine, another process): before a batch, a generator whose version is
    behind the policy's takes the policy's weights, streamed one tensor at a time (sharded weights gathered once
    for the sync, LoRA adapters merged in: `lmrl.models.weights.export_weights`). The trainer waits for it. So a
    generator always samples with the weights of the last optimizer step, and syncs once per step whatever the
    number of optimizer steps in between; on a GPU it sleeps (frees its memory) outside generation."""

    def __init__(self, policy: torch.nn.Module, generator, units: list[torch.nn.Module]):
        self.policy, self.generator, self.units = policy, generator, units
        self.seconds = 0.0  # spent syncing since `take_seconds` last read it

    @contextlib.contextmanager
    def __call__(self, version: int):
        if self.generator.version != version:
            start = time.perf_counter()
            with full_weights(self.units):
                self.generator.load_weights(export_weights(self.policy), version)
            self.seconds += time.perf_counter() - start
        try:
            yield
        finally:
            getattr(self.generator, "sleep", lambda: None)()

    def take_seconds(self) -> float:
        """Seconds spent syncing since the last call (`time/weight_sync`)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def prompt_media(processor: Any, prompts: list[Any], rows: list[dict[str, Any]],
                 for_engine: bool = False) -> tuple[list[list[int]], list, list | None]:
    """A vision-language policy's prompt ids and media bundles (`lmrl.models.vision.encode_with_media`): each
    row's prompt as its processor writes it, with the row's images opened in order; and, `for_engine`, each prompt
    as an engine that processes images itself takes it (`lmrl.models.vision.ImagePrompt`, for vLLM), else None."""
    from lmrl.data.images import open_image, row_images
    from lmrl.models.vision import encode_with_media, prompt_text
    from lmrl.models.vision import image_prompts as unexpanded

    texts = [prompt_text(processor, p) for p in prompts]
    images = [[open_image(v).convert("RGB") for v in row_images(row)] for row in rows]
    ids, media = encode_with_media(processor, texts, images)
    return ids, media, unexpanded(processor, texts, images) if for_engine else None


def _sandbox_kills(rewards) -> dict[str, int]:
    """Programs the sandbox stopped so far, per reward function that runs code (the `code` reward's `stats`)."""
    return {r.name: int(r.fn.stats.get("kills", 0)) for r in rewards.rewards if isinstance(getattr(r.fn, "stats", None), dict)}
