"""Multi-turn rollouts: model turns and environment observations in one sequence per episode.

    episodes = generate_episodes(generator, tokenizer, prompt_ids, rows, n, params, env, max_turns=4)
    episodes.rollout            # a Rollout: response = turn 1, observation 1, turn 2, ... ; trained on: turns only

Each turn samples, for every live episode of the batch at once, one `generator.generate` call on
the episodes' whole sequences so far (prompt, turns, observations): all rows' turns are batched
together, and an episode that is done leaves the batch while the others go on. The first turn is
exactly the single-turn call `generator.generate(prompts, n, params)`, so a one-turn episode gives
the single-turn rollout. A turn ends at EOS or a stop string (put the end of a tool call, e.g.
"</tool_call>", in `rollout.stop`).

In the returned Rollout, observation tokens are part of the sequence (`response_attention` True) but
not of the loss (`response_mask` False, log-prob 0). The sampling log-probs of model tokens are
those of the sequence the trainer sees: the same tokens at the same positions after the same context,
so the ratio at the first minibatch is still 1.

A vision-language policy's episodes show its prompt's images, and an environment may show more: a step's
`images` go with its observation, whose text holds the processor's image token once per image (or chat
messages with an `{"type": "image"}` part per image). The processor expands them in the observation's tokens
(attended, never trained on), and from there on the episode's bundle is its prompt's images then each
observation's, in order (`lmrl.models.vision.join_media`): every later turn's prefill and the trainer's forwards
see the same images in the same order. Such a rollout carries one bundle per episode (`Rollout.media_index`);
episodes that showed none keep one bundle per prompt, as a single-turn rollout. An engine that processes images
itself (vLLM, a generation server: `images`) gets each turn as the episode's ids before the images are expanded and
its images, in the same order.

Where the prompts went through a chat template (`conversations`) and an environment answers with chat messages, a
template that writes an earlier turn otherwise than it was sampled (a reasoning model's cuts its reasoning) is
followed: the episode's tokens so far close as a training sample and the next turn samples after the conversation as
the template writes it (`lmrl.rollout.chat_history`, `Rollout.contexts`).

An episode ends when its step says done, after `max_turns` turns, when a turn was cut at
`max_new_tokens` (it is then unfinished: `finished` False), or when the next turn or observation
would exceed `max_tokens` response tokens (observations included; also unfinished).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmrl.errors import RunError
from lmrl.models.prompt_encoding import encode_text
from lmrl.models.vision import ImagePrompt, Media, encode_with_media, image_token, join_media, open_image
from lmrl.rollout.base import Generator, Rollout, SamplingParams
from lmrl.rollout.chat_history import ChatHistory
from lmrl.rollout.samples import sample_metrics

# counted per episode from each Step's info; every key a step reports is averaged the same way
STEP_COUNTS = ("tool_calls", "malformed_calls", "tool_errors", "tool_seconds", "sandbox_kills")


@dataclass
class Episodes:
    """A batch of finished episodes.

    Attributes:
        rollout: the sequences (B = prompts x n rows), observation tokens masked out of the loss.
        rewards: [B] each episode's reward (the sum of its steps' rewards), None where no step gave one.
        turns: [B] model turns taken.
        metrics: `env/*` means per episode: turns, model and observation tokens, the steps' info counts.
        images: [B] the images each episode's observations showed, in order (a vision-language policy's; None
            for a text policy): what `samples.jsonl` names after the prompt's own.
    """

    rollout: Rollout
    rewards: list[float | None]
    turns: list[int]
    metrics: dict[str, float] = field(default_factory=dict)
    images: list[list[Any]] | None = None


def render_observation(tokenizer: Any, observation: str | list[dict[str, Any]]) -> str:
    """An observation as text: a string as is; chat messages through the tokenizer's chat template, as the
    continuation of a conversation (the text the template adds after a first message, up to the next
    assistant turn's header)."""
    if isinstance(observation, str):
        return observation
    first = [{"role": "user", "content": "."}]
    before = tokenizer.apply_chat_template(first, tokenize=False)
    after = tokenizer.apply_chat_template(first + list(observation), tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        raise RunError("env: the chat template does not render a conversation as a prefix of its continuation; "
                       "return observations as text")
    return after[len(before):]


def generate_episodes(
    generator: Generator,
    tokenizer: Any,
    prompts: list[list[int]],
    rows: Sequence[Mapping[str, Any]],
    n: int,
    params: SamplingParams,
    env: Any,
    max_turns: int,
    max_tokens: int | None = None,
    media: Sequence[Media | None] | None = None,
    processor: Any = None,
    images: Sequence[Any] | None = None,
    conversations: Sequence[Sequence[dict[str, Any]]] | None = None,
    tools: Any = None,
) -> Episodes:
    """Run `n` episodes per prompt to their end; see the module docstring.

    Args:
        generator: any `Generator` (the HF one, or another backend).
        tokenizer: encodes observations (no special tokens added) and renders chat observations.
        prompts: token ids of each prompt.
        rows: the dataset row of each prompt; `env(row)` starts an episode.
        n: episodes per prompt; rows `i * n .. i * n + n - 1` belong to prompt `i`.
        params: sampling parameters of every turn (`max_new_tokens` per turn); with a seed, turn k uses seed + k.
        env: an Environment: `env(row)` returns an Episode with `step(text, token_ids) -> Step`. Its `stop`
            attribute, if any, lists strings that also end a turn.
        max_turns: most model turns per episode (>= 1).
        max_tokens: most response tokens per episode, observations included; None: no limit but the turns'.
        media: a vision-language policy's bundle of each prompt (None for a prompt without images); with
            `processor`, every turn samples with its episode's images.
        processor: a vision-language policy's processor: it expands the images a step shows (`Step.images`) and
            renders chat observations; None for a text policy, whose steps may show no image.
        images: for a generator that processes images itself (vLLM, a generation server): each prompt as it takes
            them (`lmrl.models.vision.ImagePrompt`); every turn then gets its episode's ids before the images are
            expanded (the prompt's, the turns', each observation's) and its images, and `media` is what the trainer
            scores with.
        conversations: each prompt's chat messages, where the prompts were made by the chat template (with
            `tools`, as they were given to it): where an environment answers with chat messages and the template
            writes an earlier turn otherwise than it was sampled (a reasoning model's cuts its reasoning), the
            episode's tokens so far close as a sample and it goes on from the conversation as the template writes it
            (`lmrl.rollout.chat_history`, `Rollout.contexts`). None: observations always continue the tokens.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns: must be >= 1, got {max_turns!r}")
    views = _EpisodeMedia(media, processor, len(prompts), n, images)
    if hasattr(env, "run_episodes"):  # its episodes are driven by a program of its own (`lmrl.agents.programs`)
        if views.on:
            raise RunError("env: an environment that runs its own episodes (run_episodes) is not supported with a "
                           "vision-language policy")
        return env.run_episodes(generator, tokenizer, prompts, rows, n, params, max_turns, max_tokens)
    params = _with_stop(params, env)
    num_rows = len(prompts) * n
    episodes = [env(rows[i // n]) for i in range(num_rows)]
    budget = max_tokens if max_tokens is not None else float("inf")
    chat = conversations is not None and not views.on  # a chat environment follows the template (`_Track`)
    tracks = [_Track(ChatHistory(tokenizer, conversations[i // n], tools) if chat else None) for i in range(num_rows)]
    texts, finished = [""] * num_rows, [False] * num_rows
    rewards: list[float | None] = [None] * num_rows
    turns = [0] * num_rows
    counts: dict[str, float] = {}
    first = generator.generate(prompts, n, params, **views.first())  # turn 1: exactly the single-turn rollout
    active, out = list(range(num_rows)), first
    for turn in range(max_turns):
        if turn > 0:
            room = max(budget - len(tracks[i].ids) for i in active)
            turn_params = dataclasses.replace(params, max_new_tokens=int(min(params.max_new_tokens, room)),
                                              seed=None if params.seed is None else params.seed + turn)
            out = generator.generate([tracks[i].context(prompts[i // n]) for i in active], 1, turn_params,
                                     **views.of(active))
        lengths = out.response_mask.sum(1).tolist()
        next_active = []
        for j, i in enumerate(active):
            track, length = tracks[i], lengths[j]
            room = budget - len(track.ids)
            cut = length > room  # this episode's budget is smaller than the turn's max_new_tokens
            length = int(min(length, room))
            turn_ids = out.response_ids[j, :length].tolist()
            track.add(turn_ids, out.logprobs[j, :length].tolist(), True)
            text = tokenizer.decode(turn_ids, skip_special_tokens=True) if cut else out.texts[j]
            texts[i] += text
            turns[i] += 1
            finished[i] = bool(out.finished[j]) and not cut
            step = _record(episodes[i].step(text, turn_ids), i, rewards, counts)
            if step.done or not finished[i] or turn == max_turns - 1:
                continue
            observation, obs_ids, shown = views.observe(tokenizer, step)
            if len(track.ids) + len(obs_ids) >= budget:  # no room for the observation and a next turn
                finished[i] = False
                counts["budget_cuts"] = counts.get("budget_cuts", 0.0) + 1
                continue
            texts[i] += observation
            next_active.append(i)
            if track.observe(turn_ids, text, step.observation, obs_ids):
                views.add(i, turn_ids, shown)
        active = next_active
        if not active:
            break
    ids, trained = [t.ids for t in tracks], [t.trained for t in tracks]
    rollout = _assemble(first, ids, [t.logps for t in tracks], trained, texts, finished, generator)
    rollout.contexts = [t.contexts for t in tracks] if any(t.contexts for t in tracks) else None
    rollout.media, rollout.media_index = views.of_rollout(rollout.response_ids.device)
    shown = [views.tail.get(i, ([], []))[1] for i in range(len(ids))] if views.on else None
    metrics = _metrics(ids, trained, turns, counts)
    if chat:  # a chat environment's episodes may be several samples
        metrics.update(sample_metrics(rollout, "env"))
    return Episodes(rollout, rewards, turns, metrics, shown)


def _with_stop(params: SamplingParams, env: Any) -> SamplingParams:
    """`params` with the environment's turn ends (a tool call's closing tag, its `stop`) on top of the rollout's."""
    extra_stop = [s for s in getattr(env, "stop", None) or [] if s not in params.stop]
    return dataclasses.replace(params, stop=[*params.stop, *extra_stop]) if extra_stop else params


@dataclass
class _Track:
    """One episode's tokens so far: its model turns (trained on) and observations (attended only), in its samples."""

    history: ChatHistory | None  # a chat environment's conversation (`lmrl.rollout.chat_history`)
    ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    contexts: list[tuple[int, list[int]]] = field(default_factory=list)  # `Rollout.contexts`: each later sample's

    def add(self, ids: list[int], logps: list[float], trained: bool) -> None:
        self.ids += ids
        self.logps += logps
        self.trained += [trained] * len(ids)

    def context(self, prompt: list[int]) -> list[int]:
        """What the next turn samples after: the prompt and the tokens so far, or, once a new sample began, its
        context and its tokens since."""
        if not self.contexts:
            return prompt + self.ids
        start, context = self.contexts[-1]
        return context + self.ids[start:]

    def observe(self, turn_ids: list[int], text: str, observation: Any, obs_ids: list[int]) -> bool:
        """After a turn, its observation: True where it continues the tokens (appended); False where the chat template
        wrote an earlier turn otherwise than it was sampled, so that the next turn begins a sample of its own."""
        if not isinstance(observation, list):  # a text observation: the tokens go on, whatever the template
            self.history = None
        restart = self.history.add(turn_ids, text, observation) if self.history is not None else None
        if restart is not None:
            self.contexts.append((len(self.ids), restart))
            return False
        self.add(obs_ids, [0.0] * len(obs_ids), False)
        return True


def _record(step: Any, i: int, rewards: list[float | None], counts: dict[str, float]) -> Any:
    """Episode `i`'s step, checked: its reward added to the episode's, its info to the counts."""
    if not hasattr(step, "done") or not hasattr(step, "observation"):
        raise RunError(f"env: episode.step returned a {type(step).__name__}, expected an lmrl.envs.Step")
    if step.reward is not None:
        rewards[i] = (rewards[i] or 0.0) + float(step.reward)
    for key, value in (step.info or {}).items():
        counts[key] = counts.get(key, 0.0) + float(value)
    return step


class _EpisodeMedia:
    """Each episode's images so far, for a vision-language policy: its prompt's bundle, then each observation's
    (`join_media`); for a generator that processes images itself, also its ids before the images are expanded and
    its images (`ImagePrompt`). `on` False (a text policy): every call is as it was, and a step that shows an image
    is refused."""

    def __init__(self, media: Sequence[Media | None] | None, processor: Any, prompts: int, n: int,
                 engine: Sequence[Any] | None = None) -> None:
        self.processor, self.n, self.engine = processor, n, list(engine) if engine is not None else None
        self.on = processor is not None or media is not None
        self.media = list(media) if media is not None else [None] * prompts
        self.shown: dict[int, Media | None] = {}  # episode -> its joined bundle, once an observation showed images
        self.tail: dict[int, tuple[list[int], list[Any]]] = {}  # episode -> unexpanded ids and images after its prompt

    def first(self) -> dict[str, Any]:
        if self.engine is not None:
            return {"images": self.engine}
        return {"media": self.media} if self.on else {}

    def of(self, rows: list[int]) -> dict[str, Any]:
        """The `media` (or `images`) argument of a turn's call for episodes `rows`."""
        if self.engine is not None:
            return {"images": [self.engine_prompt(i) for i in rows]}
        return {"media": [self.episode(i) for i in rows]} if self.on else {}

    def episode(self, i: int) -> Media | None:
        return self.shown[i] if i in self.shown else self.media[i // self.n]

    def engine_prompt(self, i: int) -> Any:
        prompt = self.engine[i // self.n]
        ids, images = self.tail.get(i, ([], []))
        return ImagePrompt([*prompt.ids, *ids], [*prompt.images, *images])

    def observe(self, tokenizer: Any, step: Any) -> tuple[str, list[int], tuple | None]:
        """A step's observation as text, its token ids (each image's tokens expanded) and, for a vision-language
        policy, what it shows: (its images' bundle, its ids before the images are expanded, its images)."""
        images = list(getattr(step, "images", None) or [])
        if images and self.processor is None:
            raise RunError(f"env: a step returned {len(images)} image(s) but the policy is a text-only model; "
                           "return text observations, or train a vision-language policy")
        chat = self.processor if self.on and getattr(self.processor, "chat_template", None) else tokenizer
        text = render_observation(chat, step.observation or "")
        token = image_token(self.processor) if self.on else None
        if token is not None and text.count(token) != len(images):
            raise RunError(f"env: a step's observation holds {text.count(token)} image placeholder(s) ({token}) for "
                           f"{len(images)} image(s) in Step.images")
        plain = encode_text(tokenizer, text) if text else []
        if not images:
            return text, plain, (None, plain, []) if self.on else None
        opened = [open_image(v).convert("RGB") for v in images]
        ids, bundles = encode_with_media(self.processor, [text], [opened], add_special_tokens=False)
        return text, ids[0], (bundles[0], plain, opened)

    def add(self, i: int, turn_ids: list[int], shown: tuple | None) -> None:
        """Episode `i` goes on after its turn `turn_ids` and an observation that showed `shown` (`observe`)."""
        if shown is None:
            return
        bundle, plain, images = shown
        if bundle is not None:
            self.shown[i] = join_media([self.episode(i), bundle])
        ids, before = self.tail.get(i, ([], []))
        self.tail[i] = ([*ids, *turn_ids, *plain], [*before, *images])

    def of_rollout(self, device: torch.device) -> tuple[list | None, torch.Tensor | None]:
        """The rollout's `media` and `media_index`: per prompt while no episode showed an image, else per episode."""
        if not self.on:
            return None, None
        if not self.shown:
            return self.media, None
        rows = len(self.media) * self.n
        return [self.episode(i) for i in range(rows)], torch.arange(rows, device=device)


def _assemble(first: Rollout, ids, logps, trained, texts, finished, generator: Any) -> Rollout:
    device = first.response_ids.device
    pad = int(getattr(generator, "pad_token_id", 0))
    width = max(1, max(len(x) for x in ids))
    num_rows = len(ids)
    response_ids = torch.full((num_rows, width), pad, dtype=torch.long)
    logprobs = torch.zeros(num_rows, width, dtype=torch.float32)
    response_mask = torch.zeros(num_rows, width, dtype=torch.bool)
    attention = torch.zeros(num_rows, width, dtype=torch.bool)
    for i in range(num_rows):
        length = len(ids[i])
        response_ids[i, :length] = torch.tensor(ids[i], dtype=torch.long)
        logprobs[i, :length] = torch.tensor(logps[i], dtype=torch.float32)
        response_mask[i, :length] = torch.tensor(trained[i], dtype=torch.bool)
        attention[i, :length] = True
    observed = bool((attention & ~response_mask).any())
    return Rollout(
        prompt_ids=first.prompt_ids,
        prompt_mask=first.prompt_mask,
        response_ids=response_ids.to(device),
        response_mask=response_mask.to(device),
        logprobs=logprobs.to(device),
        texts=texts,
        finished=torch.tensor(finished, dtype=torch.bool, device=device),
        prompt_index=first.prompt_index,
        response_attention=attention.to(device) if observed else None,
    )


def _metrics(ids, trained, turns, counts) -> dict[str, float]:
    episodes = max(len(ids), 1)
    model_tokens = sum(sum(t) for t in trained)
    observation_tokens = sum(len(x) for x in ids) - model_tokens
    metrics = {
        "env/turns": sum(turns) / episodes,
        "env/model_tokens": model_tokens / episodes,
        "env/observation_tokens": observation_tokens / episodes,
        "env/observation_token_frac": observation_tokens / max(model_tokens + observation_tokens, 1),
    }
    for key in (*STEP_COUNTS, *sorted(set(counts) - set(STEP_COUNTS))):
        metrics[f"env/{key}"] = counts.get(key, 0.0) / episodes
    return metrics
