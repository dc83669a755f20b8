"""Hugging Face generation backend: lmrl's decode engine over the live model the trainer updates.

`HFGenerator` samples with the live `transformers` model the trainer updates in place, so every rollout uses the
current weights. A call is many requests to one `lmrl.engine.DecodeEngine`: each distinct prompt prefilled once,
at most `batch_size` rows in a step, more joining as rows end, each row sampling from its own random stream
(`lmrl.engine.sampling`). Llama / Qwen2 models step module by module with each prompt's keys shared by its rows;
every other model steps through its own forward (`lmrl.engine.model_step`). Stop strings are checked on the last
few tokens only (`StopChecker`), texts decoded once at the end.

On CUDA with `cuda_graph` the engine's steps take fixed shapes and each is replayed as a CUDA graph (`graph_path`
says where not); run eagerly (`fixed_shapes`), they sample what the other steps sample (tested).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lmrl.engine import DecodeEngine, Ended, Request
from lmrl.engine.engine import step_path
from lmrl.engine.model_step import MASKED_KERNELS
from lmrl.engine.sampling import row_keys
from lmrl.models.vision import Media, media_token_ids
from lmrl.rollout.base import Rollout, SamplingParams
from lmrl.rollout.ops import cut_at_stop, decode_batch

# Stop strings are searched in the decoded last (longest stop string in characters + this) tokens.
STOP_WINDOW_MARGIN = 8


class HFGenerator:
    """Samples completions with a Hugging Face causal LM and its own KV-cached decode loop.

    Args:
        model: A `transformers` causal LM (the live object: generation always uses its current
            weights). It is put in eval mode during `generate` and its previous mode is restored.
            Pass the unwrapped module, not a DDP/FSDP wrapper.
        tokenizer: Its tokenizer; used only to decode texts, detect stop strings and find the
            EOS / pad ids. Generation itself works on token ids.
        batch_size: Most sequences (rows) per forward pass; larger requests are split. None: all
            rows at once.
        device: Device of the inputs and of the returned tensors; defaults to the model's device.
        eos_token_id: Token id(s) that end a completion. None: the union of
            `model.generation_config.eos_token_id` (an id or a list) and `tokenizer.eos_token_id`.
            An empty list disables EOS (completions run to `max_new_tokens`).
        pad_token_id: Id that fills padding; defaults to the tokenizer's pad id, else the first EOS id.
        seed: Seed of the generator's own random stream, used when `SamplingParams.seed` is None (each
            call then draws its seed from it). None draws it from torch's global RNG (so `torch.manual_seed`
            fixes it). Row i of a call samples from its own stream (`lmrl.engine.sampling`): the same
            tokens whichever decode path, `batch_size` or neighbours it has.
        cuda_graph: On CUDA, decode with the engine's fixed-shape steps, each replayed as a CUDA graph, where the
            model allows it (`graph_path`); `decode_path` says why not.
        fixed_shapes: Take the fixed-shape steps even where no graph is captured (a CPU): for tests, which check
            that they sample what the other steps sample.

    The model runs in its own dtype; logits are upcast to float32 for sampling and log-probs. With
    temperature 0 (greedy) the returned log-probs are those of softmax(logits), i.e. temperature 1.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        batch_size: int | None = None,
        device: torch.device | str | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        seed: int | None = None,
        cuda_graph: bool = True,
        fixed_shapes: bool = False,
    ) -> None:
        if batch_size is not None and (isinstance(batch_size, bool) or batch_size < 1):
            raise ValueError(f"batch_size: must be None or an integer >= 1, got {batch_size!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.eos_token_ids = resolve_eos(model, tokenizer, eos_token_id)
        if pad_token_id is None:
            pad_token_id = tokenizer.pad_token_id
        if pad_token_id is None:
            pad_token_id = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.pad_token_id = int(pad_token_id)
        banned = media_token_ids(model)  # image placeholders: never sampled
        self._banned = torch.tensor(banned, dtype=torch.long, device=self.device) if banned else None
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        self._rng = torch.Generator()  # on the host: a call's seed is drawn with no device round trip
        self._rng.manual_seed(seed)

        self.cuda_graph, self.fixed_shapes = cuda_graph, fixed_shapes
        self.note: str | None = None  # why a CUDA graph capture failed, once one did
        kernel = getattr(model.config, "_attn_implementation", None)
        if fixed_shapes and not step_path(model)[0] and kernel not in MASKED_KERNELS:
            raise ValueError("fixed_shapes: needs the sdpa or eager kernel for a model that steps through its own "
                             "forward")

    def decode_path(self) -> tuple[str, str]:
        """The decode path the next call takes, and why: "cuda_graph" (the engine's fixed-shape steps replayed as CUDA
        graphs), "fixed_shapes" (the same steps without graphs) or "engine"; the reason names the engine's step.
        Asked per call: hooks (FSDP's) may come and go."""
        lean, step = step_path(self.model)
        path, why = graph_path(self.model, self.device, self.cuda_graph, lean)
        if self.fixed_shapes and path != "cuda_graph":
            path, why = "fixed_shapes", "fixed_shapes=True"
        return path, f"{step}; {why}"

    def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams, media: Sequence[Media | None] | None = None
    ) -> Rollout:
        """Sample `n` completions for each prompt.

        Args:
            prompts: Token-id lists, one per prompt, each non-empty.
            n: Completions per prompt (>= 1); rows `i * n .. i * n + n - 1` belong to prompt `i`.
            params: Sampling parameters; `params.seed` makes the call reproducible.
            media: For a vision-language model, each prompt's processor outputs besides its ids
                (`lmrl.models.vision.Media`, None for a text prompt), computed once per prompt: the prefill
                runs them with the prompt, once per distinct prompt; decode steps are text only.

        Returns:
            A `Rollout` with `len(prompts) * n` rows, tensors on `self.device`.
        """
        _validate_prompts(prompts)
        if media is not None and len(media) != len(prompts):
            raise ValueError(f"media: {len(media)} bundles for {len(prompts)} prompts")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n: completions per prompt must be an integer >= 1, got {n!r}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        params.validate()
        base = params.seed if params.seed is not None else self.draw_seed()
        return self._generate_engine(prompts, n, params, base, media)

    def draw_seed(self) -> int:
        """The next seed of the generator's own stream (a call without `SamplingParams.seed`)."""
        return int(torch.randint(0, 2**62, (), generator=self._rng))

    def _generate_engine(self, prompts: list[list[int]], n: int, params: SamplingParams, base: int,
                         media: Sequence[Media | None] | None) -> Rollout:
        """Every row through one `DecodeEngine`: rows of prompts of similar length first, at most `batch_size` in a
        step, more joining as rows end (a quarter of the room free, or none in flight)."""
        num_rows = len(prompts) * n
        limit = min(self.batch_size or num_rows, num_rows)
        by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        keys = row_keys(base, torch.arange(num_rows)).tolist()
        queue = [Request(prompts[i], params.max_new_tokens, i * n + j, keys[i * n + j], media[i] if media else None)
                 for i in by_length for j in range(n)]
        stops = StopChecker(self.tokenizer, params.stop) if params.stop else None
        results: list[Ended | None] = [None] * num_rows
        path = self.decode_path()[0]
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                engine = DecodeEngine(self.model, params, self.eos_token_ids, banned=self._banned, stops=stops,
                                      rows=limit, pad_token_id=self.pad_token_id,
                                      fixed=path in ("cuda_graph", "fixed_shapes"),
                                      graphs=path == "cuda_graph" and self.note is None)  # a failed capture: eager
                engine.reserve(min(limit, len(prompts)), max(len(p) for p in prompts), limit, params.max_new_tokens)
                tokens = torch.empty(num_rows, params.max_new_tokens, dtype=torch.long, device=self.device)
                logprobs = torch.empty(num_rows, params.max_new_tokens, dtype=torch.float32, device=self.device)
                engine.collect_into(tokens, logprobs)
                taken = 0
                while taken < num_rows or len(engine):
                    room = limit - len(engine)
                    if taken < num_rows and (not len(engine) or room >= max(1, limit // 4)):
                        engine.add(queue[taken: taken + room])
                        taken += len(queue[taken: taken + room])
                    for ended in engine.step():
                        results[ended.owner] = ended
                self.note = engine.note or self.note
        finally:
            self.model.train(was_training)
        return self._rollout(prompts, n, results, tokens, logprobs, params)

    def stream(self, take: Callable[[], tuple[Any, list[int], int] | None], n: int, params: SamplingParams,
               rows: int, give: Callable[[Any, Rollout], None], version: int = 0,
               swap: Callable[[], Callable[[], int] | None] | None = None, keep_cache: bool = False) -> None:
        """Continuous batching over an open-ended supply of prompts (`train.max_staleness`, `lmrl.streamed`).

        `take()` gives the next prompt as (owner, token ids, seed), or None when none should start now; its `n` rows
        join the decode once there is room for them (of `rows` in flight), the prompts taken together prefilled in
        one forward. `give(owner, rollout)` gets each prompt's `n` completions, a one-prompt `Rollout` whose
        `versions` say which weights sampled each token, the step its last row ends: a long row holds back its own
        group only, and the room a short one frees goes to the next prompt. Returns once nothing is in flight and
        `take` gave None: the weights may change then (the engine reads them when it is built).

        `swap()`, asked between steps (partial rollouts): None, or a function that loads new weights into the model
        and returns their version. Then every row in flight is taken out as it stands, the weights are loaded, and
        the rows go on from their next token under them (their tokens so far prefilled again with the new weights),
        each token keeping the version and the log-prob it was sampled with. `keep_cache`: the rows stay in the engine
        instead, the keys and values cached so far kept (those the earlier weights computed: PipelineRL's in-flight
        weight updates), no prefill; a row's next token, whose logits the earlier weights computed, is theirs.

        Rows sample from the streams of their prompt's seed, as `generate` with that seed would sample them (a row
        that went on under new weights from a stream of its own from there)."""
        params.validate()
        stops = StopChecker(self.tokenizer, params.stop) if params.stop else None
        groups: dict[Any, tuple[list[int], list[_Partial | None]]] = {}  # owner -> prompt, its rows once they end
        so_far: dict[tuple[Any, int], _Partial] = {}  # rows that went on under new weights: what they sampled before
        keys_of: dict[tuple[Any, int], int] = {}  # each row's random stream
        earlier: dict[tuple[Any, int], list[tuple[int, int]]] = {}  # keep_cache: (tokens, version) at each swap
        was_training = self.model.training
        self.model.eval()

        def engine_now() -> DecodeEngine:
            return DecodeEngine(self.model, params, self.eos_token_ids, banned=self._banned, stops=stops, rows=rows,
                                pad_token_id=self.pad_token_id)

        try:
            with torch.inference_mode():
                engine = engine_now()
                while True:
                    if swap is not None and len(engine) and engine.settled and (load := swap()) is not None:
                        if keep_cache:  # the rows stay: each one's next token, its logits computed, is the old weights'
                            for owner, count in engine.sampled().items():
                                earlier.setdefault(owner, []).append((count + 1, version))
                            version = load()
                            engine.reload()
                        else:
                            going_on = []
                            for e in engine.abort():  # what each row sampled so far, under the weights it had
                                so_far[e.owner] = so_far.get(e.owner, _Partial()).extended(e, version)
                                going_on.append(e.owner)
                            version = load()
                            engine = engine_now()
                            engine.add([self._going_on(groups[o[0]][0], o, so_far[o], keys_of[o], params)
                                        for o in going_on])
                    joining = []  # joins once a quarter of the room is free (a prefill and a compaction per join)
                    while (rows - len(engine) - len(joining) >= n
                           and (not len(engine) or rows - len(engine) >= max(n, rows // 4))):
                        if (item := take()) is None:
                            break
                        owner, prompt, seed = item
                        groups[owner] = (prompt, [None] * n)
                        keys = row_keys(seed, torch.arange(n)).tolist()
                        keys_of.update({(owner, j): keys[j] for j in range(n)})
                        joining += [Request(prompt, params.max_new_tokens, (owner, j), keys[j]) for j in range(n)]
                    engine.add(joining)
                    if not len(engine):
                        return
                    for ended in engine.step():
                        owner, j = ended.owner
                        prompt, ended_rows = groups[owner]
                        ended_rows[j] = so_far.pop(ended.owner, _Partial()).extended(ended, version,
                                                                                     earlier.pop(ended.owner, ()))
                        del keys_of[ended.owner]
                        if all(r is not None for r in ended_rows):
                            del groups[owner]
                            give(owner, self._group(prompt, ended_rows, params))
        finally:
            self.model.train(was_training)

    @staticmethod
    def _going_on(prompt: list[int], owner: Any, row: _Partial, key: int, params: SamplingParams) -> Request:
        """The request that continues a row taken out of the engine (`stream`'s swap) under new weights: its prompt
        and every token it sampled so far as the new prompt, the rest of its budget, a random stream of its own (its
        own stream's, moved on by the tokens sampled: not the uniforms its first tokens drew)."""
        key = int(row_keys(key, torch.tensor([len(row.tokens)]))[0])
        return Request(prompt + row.tokens, params.max_new_tokens - len(row.tokens), owner, key, sampled=row.tokens)

    def _group(self, prompt: list[int], rows: list[_Partial], params: SamplingParams) -> Rollout:
        """The one-prompt `Rollout` of rows as lists, with the version of each token."""
        width = max(1, max(len(r.tokens) for r in rows))
        tokens = torch.tensor([r.tokens + [self.pad_token_id] * (width - len(r.tokens)) for r in rows], device=self.device)
        logprobs = torch.tensor([r.logprobs + [0.0] * (width - len(r.tokens)) for r in rows], device=self.device)
        ended = [Ended(None, None, None, r.finished, len(r.tokens)) for r in rows]
        rollout = self._rollout([prompt], len(rows), ended, tokens, logprobs, params)
        rollout.versions = torch.tensor([r.versions + [-1] * (width - len(r.tokens)) for r in rows],
                                        device=self.device)[:, : rollout.response_ids.shape[1]]
        return rollout

    def _rollout(self, prompts: list[list[int]], n: int, rows: list[Ended], tokens: torch.Tensor,
                 logprobs: torch.Tensor, params: SamplingParams) -> Rollout:
        """The `Rollout` of rows the engine copied into `[N, max_new]` `tokens` and `logprobs`: cut to the longest
        row, padding (and log-prob 0) past each row's length."""
        length_list = [r.length for r in rows]
        width = max(length_list)
        lengths = torch.tensor(length_list, device=self.device)
        valid = torch.arange(width, device=self.device) < lengths[:, None]
        tokens = tokens[:, :width].masked_fill(~valid, self.pad_token_id)
        logprobs = logprobs[:, :width].masked_fill(~valid, 0.0)
        finished = torch.tensor([r.finished for r in rows], dtype=torch.bool, device=self.device)
        ids = [row[:k] for row, k in zip(tokens.tolist(), length_list)]
        texts = [cut_at_stop(text, params.stop) for text in decode_batch(self.tokenizer, ids, skip_special_tokens=True)]
        prompt_ids, prompt_mask = self._left_pad(prompts)
        prompt_index = torch.arange(len(prompts), device=self.device).repeat_interleave(n)
        return Rollout(prompt_ids=prompt_ids.index_select(0, prompt_index),
                       prompt_mask=prompt_mask.index_select(0, prompt_index), response_ids=tokens,
                       response_mask=valid, logprobs=logprobs, texts=texts, finished=finished,
                       prompt_index=prompt_index)

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token lists -> `[U, P]` left-padded ids and their bool mask."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
        mask = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
        return ids.to(self.device), mask.to(self.device)


@dataclass
class _Partial:
    """A row's tokens, their log-probs and the version of the weights that sampled each, across the engines it ran
    in (`HFGenerator.stream`'s partial rollouts)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False

    def extended(self, ended: Ended, version: int, earlier: Sequence[tuple[int, int]] = ()) -> _Partial:
        """These tokens followed by `ended`'s, sampled by `version` but where `earlier` says otherwise: each (n, v),
        in order, says its tokens before the n-th not yet accounted for were sampled by version v (swaps that kept the
        cache)."""
        versions, done, n = [], 0, len(ended.tokens)
        for end, v in earlier:
            versions += [v] * (min(end, n) - min(done, n))
            done = end
        versions += [version] * (n - min(done, n))
        return _Partial(self.tokens + ended.tokens, self.logprobs + ended.logprobs, self.versions + versions,
                        ended.finished)


class StopChecker:
    """Finds the token whose decoding completes a stop string, a row's new tokens at a time.

    Only the last `max(len(stop)) + STOP_WINDOW_MARGIN` tokens of a row are decoded (a stop string of L
    characters spans at most L tokens that each decode to at least one character), after each new token, so a
    stop string is first found at the token that completes it. Rows are told apart by a key (`new_key`).
    """

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.window = max(len(s) for s in stop) + STOP_WINDOW_MARGIN
        self.history: list[list[int]] = []

    def new_key(self, sampled=()) -> int:
        """A new row's key; `sampled`: the tokens it sampled before (a row going on under new weights), searched with
        its next ones."""
        self.history.append(list(sampled)[-self.window:])
        return len(self.history) - 1

    def __call__(self, keys: list[int], news: list[list[int]]) -> list[int | None]:
        """Append each row's new tokens; for each, the index in its new tokens of the one that completed a stop
        string (the rest are not appended), or None."""
        hits: list[int | None] = [None] * len(keys)
        for j in range(max((len(new) for new in news), default=0)):
            live = [i for i, new in enumerate(news) if j < len(new) and hits[i] is None]
            tails = []
            for i in live:
                history = self.history[keys[i]]
                history.append(news[i][j])
                tails.append(history[-self.window:])
            for i, text in zip(live, decode_batch(self.tokenizer, tails)):
                if any(s in text for s in self.stop):
                    hits[i] = j
        return hits


def graph_path(model: nn.Module, device: torch.device, cuda_graph: bool, lean: bool) -> tuple[str, str]:
    """("cuda_graph", why) where `HFGenerator` replays the engine's fixed-shape steps as CUDA graphs, else ("engine",
    why not). `lean`: the model steps module by module (`lmrl.engine.engine.step_path`), which takes no mask from
    the model; through the model's own forward, the kernel must take lmrl's 4D mask."""
    kernel = getattr(model.config, "_attn_implementation", None)
    if not cuda_graph:
        reason = "rollout.cuda_graph=false"
    elif device.type != "cuda":
        reason = f"no CUDA graphs on {device.type}"
    elif not lean and kernel not in MASKED_KERNELS:
        reason = f"no CUDA graph: attn_implementation={kernel!r} takes no 4D mask (sdpa or eager do)"
    elif getattr(model, "hf_device_map", None):
        reason = "no CUDA graph: the model is spread over devices"
    else:
        return "cuda_graph", "fixed-shape steps captured in CUDA graphs"
    return "engine", reason


def resolve_eos(model: nn.Module, tokenizer, eos_token_id: int | list[int] | None) -> list[int]:
    if eos_token_id is not None:
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    else:
        config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids = config_eos if isinstance(config_eos, list) else [config_eos]
        ids = [*ids, tokenizer.eos_token_id]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _validate_prompts(prompts: list[list[int]]) -> None:
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("prompts: expected a non-empty list of token-id lists")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
            raise TypeError(f"prompts: prompt {i} must be a list of token ids, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError(f"prompts: prompt {i} has zero tokens; every prompt needs at least one")
