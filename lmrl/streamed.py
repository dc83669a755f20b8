"""Bounded staleness (train.max_staleness = k): a generator process samples without pause, with the newest weights
it holds, and hands each group over the step it ends; a training step takes the first groups ready.

    trainer process                                         generator process
    step t:  the first P groups ready, none sampled  <----  continuous batching (`HFGenerator.stream`): a prompt's G
             by a policy older than t - 1 - k (those         rows join when there is room, its group is scored and
             are dropped and counted)                        sent the step its last row ends, the next prompt takes
             experience, update                              the room; it takes newer weights once nothing is in
             publish weights t  --- shared memory ---->      flight (rollout.partial: at the rows' next token)

What holds the bound: the trainer never trains on a group sampled more than k versions before the policy being
updated (it drops it: `async/dropped_groups`), and the generator process begins a group only while, counting the
groups begun before it and not yet taken (P a step) and the versions its weights are behind, the trainer would take it
within the bound (`_Sampler._room`): what it samples is taken before it is too old, at the pace the trainer goes.

A step's batch is whatever groups ended first, so a long completion holds back its own group, not the step: with
completion lengths that have a long tail, the generator spends its time on full batches instead of on a few long
rows. The price: runs depend on timing, not on the seed alone (`train.async_steps` keeps runs that repeat exactly).
A sequence is sampled by one version of the weights, unless partial rollouts (rollout.partial) let the rows in
flight take new weights at their next token; every token carries the version and the log-prob it was sampled with
(`Rollout.versions`, `Rollout.logprobs`), a group's staleness is its oldest token's, and the trainer corrects for the
lag per token with the decoupled objective, as with a fixed lag.

Prompts are a stream of positions (this rank's: position p is the run's prompt p x ranks + rank), each sampled once:
a checkpoint holds the groups received and not trained on, and which positions were trained on or dropped; a resumed
run samples again, from the checkpoint's weights, the positions that were in flight, and no other.

How lmrl departs from AReaL's and verl's fully asynchronous modes: without partial rollouts the weights change only
when nothing is in flight, kept for up to k versions so that a long row's wait is paid once in several steps; with
them, the rows in flight are prefilled again under the new weights (rollout.partial=true, as AReaL and verl do) or
go on from the keys and values the older weights cached (rollout.partial=keep_cache, PipelineRL's in-flight weight
updates); the bound is enforced by dropping what is too old (with partial rollouts, by leaving a group's too-old
tokens out of the loss); rewards are scored in the generator process, group by group.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import fields, replace
from typing import Any

import torch

from lmrl.algorithms import informative_groups
from lmrl.async_rollouts import (
    AsyncRollouts,
    Spec,
    Stopped,
    answer_probe,
    generator_collector,
    in_generator,
    probe_row,
    rollout_from_state,
    send_message,
)
from lmrl.collect import Collected
from lmrl.distributed import World
from lmrl.errors import ConfigError, RunError
from lmrl.rollout import Rollout, select_rollout
from lmrl.rollout.hf import HFGenerator

# metrics summed over a batch's groups rather than averaged
_SUMMED = ("/errors", "/seconds", "/sandbox_kills", "/wait_for_trainer")


class StreamedRollouts(AsyncRollouts):
    """The trainer's side of bounded staleness: the generator process (`AsyncRollouts`' start, stop, failures and
    weights), with groups taken as they come instead of whole batches on a fixed schedule. See the module docstring.

    Args:
        shape: `(parts, rows, metrics) -> Collected`, the trainer's `Collector.shaped`: the groups taken as one batch,
            scores shaped over the whole batch (penalties, reward.normalize).
        the others: as `AsyncRollouts`.
    """

    def __init__(self, cfg, inputs, policy, units, tokenizer, device, world: World, warn, processor=None, shape=None):
        super().__init__(cfg, inputs, policy, units, tokenizer, device, world, warn, processor)
        self.k, self.shape = cfg.train.max_staleness, shape
        self.share = _share(cfg, world)  # groups this rank trains on per step
        self.stamp = torch.zeros(1, dtype=torch.long).share_memory_()  # the version of the weights in shared memory
        self.lock = None  # held while the weights in shared memory are written or read
        self.pool: list[dict[str, Any]] = []  # groups received and not taken, in the order they came
        self.training: list[dict[str, Any]] = []  # the groups of the step under way, until its update is done
        self.low, self.done = 0, set()  # positions below `low`, and those in `done`, were trained on or dropped
        self.consumed = self.told = 0  # groups taken or dropped since the process started; as the process last heard

    @staticmethod
    def main(spec: Spec, snapshot: dict[str, torch.Tensor], channel, lock=None, stamp=None) -> None:
        in_generator(spec, channel, lambda: _stream(spec, snapshot, channel, lock, stamp))

    def shared(self, context) -> tuple:
        self.lock = context.Lock()
        return self.lock, self.stamp

    def start(self, step: int) -> None:
        """Set the generator process going from the policy's current weights as version `step`, skipping the
        positions a checkpoint says were trained on, dropped, or are waiting in the pool."""
        self.start_step = self.published = step
        if step >= self.steps:
            self.close()
            return
        self._weights(step)
        waiting = {g["position"] for g in self.pool}
        self.consumed = self.told = 0
        self.channel.send(("start", step, self.low, sorted(self.done | waiting), len(self.pool)))

    def close(self) -> None:
        super().close()
        self.lock = None  # its semaphore goes now, not at exit (where a spawned run's resource tracker warns of it)

    def _weights(self, version: int) -> None:
        with self.lock:
            self._write_snapshot()
            self.stamp[0] = version

    def publish(self, step: int) -> None:
        """After step `step`'s update: its weights into shared memory for the generator process to take when it can
        (it never waits for them, and this process never waits for it)."""
        self.published = step
        for g in self.training:  # the step's update is done: its groups were trained on
            self._done(g)
        self.training = []
        if self.process is None or self.failed is not None or step >= self.steps:
            return
        try:
            self._weights(step)
            self.channel.send(("weights", step, self._probe(step)))
            self.probes = {v: t for v, t in self.probes.items() if v >= step - 1}  # versions it skipped go unanswered
            self._tell()
        except OSError:
            self.failed = self._died(None)

    def _tell(self) -> None:
        """The generator process's room to sample ahead grows with every group taken or dropped: tell it."""
        if self.consumed != self.told:
            self.channel.send(("consumed", self.consumed))
            self.told = self.consumed

    def _keep(self, message: tuple) -> None:
        if message[0] == "group":
            self.pool.append(_tensors(message[1]))
        else:
            super()._keep(message)

    def _consume(self, group: dict[str, Any]) -> None:
        self.consumed += 1
        self._done(group)

    def _done(self, group: dict[str, Any]) -> None:
        self.done.add(group["position"])
        while self.low in self.done:
            self.done.remove(self.low)
            self.low += 1

    # ------------------------------------------------------------------------------ the step
    def batch(self, step: int) -> Collected:
        """`share` groups ready that the policy being updated (version step - 1) may train on, the oldest first (then
        in the order they came), waiting for the generator process while there are fewer. A group sampled more than k
        versions earlier is dropped for good; with partial rollouts, a group only some of whose tokens are that old
        is trained on its newer tokens, the older ones attended but left out of the loss (`_without_stale`). With
        dynamic sampling, a group whose rewards are all equal is dropped too, up to (max_sampling_rounds - 1) x P a
        step. The groups taken count as trained on once the step's update is done (`publish`): a signal that abandons
        the step keeps them for the checkpoint."""
        cfg, start = self.cfg, time.perf_counter()
        self.pool[:0], self.training = self.training, []  # a step abandoned earlier: its groups come first
        oldest = step - 1 - self.k
        dynamic, G = cfg.algorithm.dynamic_sampling, cfg.rollout.group_size
        limit = (cfg.algorithm.max_sampling_rounds - 1) * self.share if dynamic else 0
        dropped = filtered = 0
        while self.process is not None and self.channel.poll(0):  # every group that has come: the first ready
            self._receive(step)
        while True:
            fresh = []
            for g in self.pool:
                if g.get("newest", g["version"]) < oldest:  # every token too old
                    dropped += 1
                elif filtered < limit and not informative_groups(g["scores"], G).any():
                    filtered += 1
                else:
                    fresh.append(g)
                    continue
                self._consume(g)
            self.pool = fresh
            if len(fresh) >= self.share:
                break
            if self.failed is not None:
                raise self.failed
            if self.process is None:
                raise RunError(f"the generator process was stopped before it sent the groups of step {step}")
            self._tell()
            self._receive(step)
        self.pool.sort(key=lambda g: g["version"])  # the oldest first (stable: then as they came): before they age out
        taken = self.pool[: self.share]
        waited = time.perf_counter() - start
        c = self._assembled(taken)
        self.pool, self.training = self.pool[self.share:], taken
        self.consumed += len(taken)  # room for the generator process at once; trained on at `publish`
        lags = [(step - 1) - max(g["version"], oldest) for g in taken]  # of the oldest token trained on
        c.metrics |= {"time/wait_for_batch": waited, "async/staleness_mean": sum(lags) / len(lags),
                      "async/staleness_max": float(max(lags)), "async/version_lag": float(max(lags)),
                      "async/policy_version": sum(g["version"] for g in taken) / len(taken),
                      "async/dropped_groups": float(dropped), "async/waiting_groups": float(len(self.pool))}
        if (versions := c.rollout.versions) is not None:  # per token: partial rollouts take new weights mid-sequence
            sampled = versions >= 0
            first = versions.masked_fill(~sampled, torch.iinfo(versions.dtype).max).amin(1, keepdim=True)
            several = (versions > first).any(1, keepdim=True) & sampled  # [B, T] tokens of rows that span versions
            c.metrics["async/multi_version_frac"] = several.sum().item() / max(1, int(sampled.sum()))
            c.metrics["async/stale_tokens_masked"] = float(_without_stale(c.rollout, oldest))
            trained = c.rollout.response_mask & sampled
            c.metrics["async/token_staleness_mean"] = ((step - 1 - versions) * trained).sum().item() / max(1, int(trained.sum()))
        if dynamic:
            c.metrics["dynamic_sampling/filtered_groups"] = float(filtered)
        if self.probe_diffs:
            c.metrics["val/sampler_probe_diff"] = max(self.probe_diffs)
            self.probe_diffs = []
        self.probe_row = probe_row(c.rollout)
        return c

    def _assembled(self, groups: list[dict[str, Any]]) -> Collected:
        """Groups as one batch (on the trainer's device), shaped as a synchronous step's is, with the reward metrics
        of the whole batch."""
        def here(x):
            return x.to(self.trainer_device) if isinstance(x, torch.Tensor) else x

        parts = [(rollout_from_state(g["rollout"], self.trainer_device), here(g["scores"]),
                  {k: here(v) for k, v in g["per_function"].items()}, g["extra"]) for g in groups]
        raw = torch.cat([p[1] for p in parts]).float()
        per_function = {k: torch.cat([p[2][k] for p in parts]).float() for k in parts[0][2]}
        metrics = _batch_metrics([g["metrics"] for g in groups], raw, per_function)
        G = self.cfg.rollout.group_size
        metrics["frac_reward_zero_std"] = 1 - informative_groups(raw, G).float().mean().item()
        return self.shape(parts, [g["row"] for g in groups], metrics)

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self, step: int) -> list[dict[str, Any]]:
        """The groups received and not trained on, and the positions trained on or dropped; what is in flight is
        sampled again by the resumed run."""
        return [{"streamed": True, "pool": self.training + self.pool, "low": self.low, "done": sorted(self.done)}]

    def load_state_dict(self, batches: list[dict[str, Any]]) -> None:
        state = next((b for b in batches if b.get("streamed")), None)
        if state is None:  # a fixed-lag run's batches: nothing to take from them
            return
        self.pool, self.low, self.done = list(state["pool"]), int(state["low"]), set(state["done"])


def _share(cfg, world: World) -> int:
    """Groups a rank trains on per step: its share of rollout.prompts_per_step."""
    shard = world.shard(cfg.rollout.prompts_per_step)
    return shard.stop - shard.start


def _without_stale(rollout: Rollout, oldest: int) -> int:
    """Leave the tokens sampled by versions before `oldest` out of the loss, in place: they stay in the sequence as
    context (attended, as an environment's observations are), the newer tokens of their rows train. Returns how many
    were left out."""
    stale = (rollout.versions >= 0) & (rollout.versions < oldest) & rollout.response_mask  # [B, T]
    count = int(stale.sum())
    if count:
        rollout.response_attention = rollout.response_mask if rollout.response_attention is None else rollout.response_attention
        rollout.response_mask = rollout.response_mask & ~stale
        rollout.logprobs = rollout.logprobs.masked_fill(stale, 0.0)
    return count


def _arrays(x: Any) -> Any:
    """A group's tensors as numpy arrays, for the pipe: unpickling a tensor costs about 0.1 ms, an array 40x less (a
    step of 32 groups read 22 ms of tensors on the shipped task)."""
    if isinstance(x, dict):
        return {k: _arrays(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor) and x.dtype != torch.bfloat16:
        return _Array(x.detach().cpu().numpy())
    return x


def _tensors(x: Any) -> Any:
    """`_arrays` undone (a checkpoint holds tensors: `torch.load(weights_only=True)` reads no numpy)."""
    if isinstance(x, dict):
        return {k: _tensors(v) for k, v in x.items()}
    return torch.from_numpy(x.array) if isinstance(x, _Array) else x


class _Array:
    """A numpy array that stood for a tensor (a row's own numpy values stay numpy)."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def __reduce__(self):
        return _Array, (self.array,)


def _batch_metrics(groups: list[dict[str, float]], raw: torch.Tensor, per_function: dict[str, torch.Tensor]) -> dict[str, float]:
    """The reward metrics of groups scored one by one, as one batch's: counts and seconds summed, spreads taken over
    the batch, the rest averaged (groups are the same size)."""
    out: dict[str, float] = {}
    for name in dict.fromkeys(k for m in groups for k in m):
        values = [m[name] for m in groups if name in m and not math.isnan(m[name])]
        out[name] = (sum(values) if name.endswith(_SUMMED) else sum(values) / len(values)) if values else math.nan
    out["reward/std"] = raw.std(correction=0).item()
    for key, values in per_function.items():
        kept = values[~values.isnan()]
        if f"reward/{key}/std" in out:
            out[f"reward/{key}/std"] = kept.std(correction=0).item() if kept.numel() else math.nan
    return out


# ------------------------------------------------------------------------------ the generator process
def _stream(spec: Spec, snapshot: dict[str, torch.Tensor], channel, lock, stamp) -> None:
    collector, _ = generator_collector(spec, snapshot, channel)
    collector.weights = lambda version: contextlib.nullcontext()  # it takes the weights itself, between groups
    while (message := channel.recv())[0] != "start":
        if message[0] == "stop":
            return
    _Sampler(spec, collector, channel, snapshot, lock, stamp, message).run()


class _Sampler:
    """The generator process's loop: take the newest weights, begin groups while there is room, send each as it
    ends. With lmrl's decode and no environment, groups stream through one continuous batch (`HFGenerator.stream`);
    otherwise (vLLM, an environment's episodes, images) they are sampled a batch of P at a time and sent one by one."""

    def __init__(self, spec: Spec, collector, channel, snapshot, lock, stamp, start: tuple):
        cfg = spec.cfg
        self.cfg, self.collector, self.channel, self.snapshot, self.lock, self.stamp = cfg, collector, channel, snapshot, lock, stamp
        self.generator = collector.generator
        self.rank, self.size, _ = spec.world
        self.share = _share(cfg, World(self.rank, self.size, 0, "cpu"))
        self.k = cfg.train.max_staleness
        _, begun, self.cursor, skip, self.started = start
        self.skip = set(skip)
        self.version, self.newest, self.consumed = -1, begun, 0
        self.probe: tuple[int, Any] | None = None  # (version, sequence) to score once that version is taken
        self.waited = 0.0  # seconds waited for the trainer since the last group was sent (`time/wait_for_trainer`)
        self.rows: dict[int, dict[str, Any]] = {}  # position -> its row, while its group is sampled
        decoder = getattr(self.generator, "decoder", self.generator)  # lmrl's decode over the process's own model
        self.decoder = decoder if isinstance(decoder, HFGenerator) and collector.env is None and collector.processor is None else None
        self.partial = cfg.rollout.partial
        if self.partial and self.decoder is None:  # the config refuses engines and environments; this is images
            raise ConfigError("rollout.partial: a vision-language policy's groups are sampled whole calls at a time, "
                              "which cannot take new weights mid-sequence; set rollout.partial=false")

    def run(self) -> None:
        G = self.cfg.rollout.group_size
        while True:
            self._poll(block=False)
            if self.newest > self.version:  # nothing in flight: newer weights cost nothing to take now
                self._take()
            if self._room() <= 0:
                start = time.perf_counter()
                self._poll(block=True)  # the trainer is behind: wait for it to take groups
                self.waited += time.perf_counter() - start
                continue
            if self.decoder is not None:
                rows = self.decoder.batch_size or (self.k + 1) * self.share * G  # room for every group it may begin
                self.decoder.stream(self._next, G, self.collector.sampling_params(), rows, self._give,
                                    version=self.version, swap=self._swap if self.partial else None,
                                    keep_cache=self.partial == "keep_cache")
            else:
                self._batch()

    def _room(self) -> int:
        """Groups it may begin with the weights it holds: a group begun now is taken after those begun before it
        (`started - consumed`, a share P of them a step), so it trains at staleness (newest - version) + that / P;
        at most k. Each version the weights age shrinks the room by P: once none is left the groups in flight end
        and newer weights are taken, a long completion's wait paid once in several steps rather than every step."""
        return (self.k + 1 - (self.newest - self.version)) * self.share - (self.started - self.consumed)

    def _poll(self, block: bool) -> None:
        """Read the trainer's messages: newer weights, groups taken, stop."""
        while block or self.channel.poll(0):
            block = False
            message = self.channel.recv()
            if message[0] == "stop":
                raise Stopped
            if message[0] == "weights":
                self.newest = max(self.newest, message[1])
                if message[2] is not None:
                    self.probe = (message[1], message[2])
            elif message[0] == "consumed":
                self.consumed = message[1]

    def _take(self) -> None:
        """The newest weights in shared memory (a newer version than announced may be there already)."""
        with self.lock:
            version = int(self.stamp[0])
            self.generator.load_weights(self.snapshot.items(), version)
        self.version = self.newest = max(self.newest, version)
        send_message(self.channel, ("taken", version))
        if self.probe is not None and self.probe[0] == version:  # the sync probe, under exactly those weights
            answer_probe(self.channel, self.generator, version, self.probe[1])
        if self.probe is not None and self.probe[0] <= version:
            self.probe = None

    def _position(self) -> int:
        while self.cursor in self.skip:
            self.skip.remove(self.cursor)
            self.cursor += 1
        self.cursor += 1
        return self.cursor - 1

    def _row(self, position: int) -> dict[str, Any]:
        """This rank's prompt `position`: the run's prompt position x ranks + rank, in the sampler's order."""
        q, data = position * self.size + self.rank, self.collector.data
        if data.train_stream is not None:
            return data.train_stream.rows_at(q, 1)[0]
        return data.train_rows[self.collector.sampler.indices_at(q, 1)[0]]

    def _seed(self, position: int) -> int:
        return (self.cfg.train.seed * 1_000_003 + 7919 * (position * self.size + self.rank) + 104_729) % 2**62

    def _next(self) -> tuple[int, list[int], int] | None:
        """`HFGenerator.stream`'s next prompt: none while there is no room (`_room`): the rows in flight end, then
        newer weights are taken, or the trainer is waited for."""
        self._poll(block=False)
        if self._room() <= 0 or (self.partial and self.newest > self.version):  # (partial: new rows wait for the swap)
            return None
        position = self._position()
        row = self.rows[position] = self._row(position)
        self.started += 1
        return position, self.collector.encode([row[self.cfg.data.prompt_column]])[0], self._seed(position)

    def _swap(self):
        """`HFGenerator.stream`'s partial rollouts: once newer weights are published, a function that takes them."""
        self._poll(block=False)
        if self.newest <= self.version:
            return None

        def load() -> int:
            self._take()
            return self.version
        return load

    def _give(self, position: int, rollout: Rollout) -> None:
        row = self.rows.pop(position)
        self.collector.global_step = self.version  # what reward functions read: the steps done by the sampler
        self._send_group(position, row, rollout, self.collector.score([row], rollout))

    def _batch(self) -> None:
        """Up to P groups sampled as one batch (every backend and environment), then sent one by one."""
        G, n = self.cfg.rollout.group_size, min(self.share, self._room())
        positions = [self._position() for _ in range(n)]
        rows = [self._row(p) for p in positions]
        self.started += n
        self.collector.global_step = self.version
        rollout, out = self.collector.generate_and_score(rows, G, seed=self._seed(positions[0]))
        for i, (position, row) in enumerate(zip(positions, rows)):
            index = torch.arange(i * G, (i + 1) * G)
            part = select_rollout(rollout, index)
            part.prompt_index = torch.zeros(G, dtype=torch.long)
            if rollout.media is not None and rollout.media_index is None:
                part.media = rollout.media[i: i + 1]
            group = replace(out, scores=out.scores[index], per_function={k: v[index] for k, v in out.per_function.items()},
                            extra_columns={k: [v[int(j)] for j in index] for k, v in out.extra_columns.items()})
            self._send_group(position, row, part, group)

    def _send_group(self, position: int, row: dict[str, Any], rollout: Rollout, out: Any) -> None:
        sampled = rollout.versions[rollout.versions >= 0] if rollout.versions is not None else None
        real = sampled is not None and sampled.numel() > 0
        version = int(sampled.min()) if real else self.version  # its oldest token's
        send_message(self.channel, ("group", _arrays({
            "position": position, "version": version, "newest": int(sampled.max()) if real else self.version, "row": row,
            "rollout": {f.name: getattr(rollout, f.name) for f in fields(Rollout)},
            "scores": out.scores, "per_function": out.per_function, "extra": out.extra_columns,
            "metrics": dict(out.metrics) | {"time/wait_for_trainer": self.waited}})))
        self.waited = 0.0


def generator_process(cfg, run, policy, units, tokenizer, world: World, warn, shape) -> AsyncRollouts | None:
    """An asynchronous run's generator process on the schedule its config names (a fixed lag, train.async_steps, or a
    bound, train.max_staleness); None for a synchronous run. `run`: the built run (`lmrl.build.Run`)."""
    args = (cfg, run.inputs, policy, units, tokenizer, run.device, world, warn, run.models.processor)
    if cfg.train.max_staleness is not None:
        return StreamedRollouts(*args, shape=shape)
    return AsyncRollouts(*args) if cfg.train.async_steps else None
