"""Asynchronous rollouts (train.async_steps = k > 0): a generator process samples and scores the batches of the
next k steps while the trainer trains on this one.

    trainer process                                    generator process (spawned: its own threads or device)
    step t:  wait for batch t  <------- a pipe -------  collect(s): prompts -> completions -> rewards -> shaping
             experience, update                         (`lmrl.collect.Collector`, built from the run's inputs)
             publish weights t  --- shared memory --->  before batch t + k + 1: take weights t (between batches)

The batch of step s is sampled by exactly the policy after step max(s - 1 - k, start) (`start`: the step the run
began or resumed at), never by "the newest weights there are". So once the pipeline is full every batch is k
steps old and none is older, and the run is a function of its seed, not of timing: the same seed gives the same
run, and a resumed run equals an uninterrupted one, because a checkpoint after step t holds the batches t+1..t+k
that older weights sampled (`state_dict`); later batches are sampled again from the checkpoint's weights.

The trainer corrects for the lag with the decoupled PPO objective (`lmrl.algorithms.decoupled_policy_loss`): the
ratio and its clip are taken against the policy at the start of the update (the proximal policy), and every token
is weighted by pi_proximal / pi_behaviour, the sampler's probabilities recorded with the batch, truncated or masked
as algorithm.tis_mode says (tis_cap is 2.0 unless set).

How lmrl departs from AReaL's and verl's fully asynchronous modes: the lag is fixed rather than bounded (a little
throughput lost when generation and training times drift, in exchange for runs that repeat exactly); one process
samples a whole batch with one version of the weights (no update in the middle of a sequence); the weights reach
the generator process through shared memory on one machine (a generation server elsewhere takes them over HTTP:
rollout.backend=vllm-server).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing

from lmrl import errors
from lmrl.build import Inputs, async_threads, load_inputs, start_method
from lmrl.collect import Collected, Collector
from lmrl.distributed import ONE_PROCESS, World, full_weights
from lmrl.errors import ConfigError, LmrlError, RunError
from lmrl.generators import process_generator
from lmrl.models.forward import sequence_logprobs
from lmrl.models.weights import export_weights
from lmrl.rollout import Rollout
from lmrl.rollout.remote import die_with_parent


def sampling_version(step: int, k: int, start: int) -> int:
    """The policy version (steps done) that samples the batch of `step` in a run that started after step `start`."""
    return max(step - 1 - k, start)


@dataclass
class Spec:
    """What the generator process is built from (pickled into it)."""

    cfg: Any  # the run's Config
    inputs: Inputs  # the config and objects the prompts, rewards and environment are loaded from
    tokenizer: Any
    skeleton: SimpleNamespace  # the policy's config, generation_config and dtype: a model without weights
    device: str
    threads: int
    world: tuple[int, int, int]  # (rank, size, local rank) of the trainer: the generator processes' world
    parent: int  # the trainer's pid: the generator process ends with it
    processor: Any = None  # a vision-language policy's: the process makes each prompt's images into a bundle


class AsyncRollouts:
    """The trainer's side of asynchronous rollouts: starts the generator process, hands out its batches, publishes
    the weights after each step, and checkpoints the batches in flight. See the module docstring.

    Args:
        cfg: the run's config (`train.async_steps`, `train.steps`, the placement fields).
        inputs: what the run was built from (`lmrl.build.Inputs`): the generator process loads its own prompts,
            reward functions and environment from them.
        policy: the trained model; `units`: its FSDP units (gathered to read the weights).
        tokenizer: the policy's tokenizer.
        device: the trainer's device (the generator's unless train.generator_device says otherwise).
        world: the trainer's ranks. Under torchrun every rank has its own generator process, sampling the rank's
            share of each batch; the generator processes form a process group of their own (gloo), for what spans
            every rank's share (dynamic sampling's choice of groups, reward.normalize).
        warn: prints a warning line (the generator process's warnings come through it).
    """

    def __init__(self, cfg, inputs: Inputs, policy: torch.nn.Module, units: list[torch.nn.Module], tokenizer: Any,
                 device: torch.device, world: World, warn, processor: Any = None):
        self.cfg, self.k, self.steps, self.world = cfg, cfg.train.async_steps, cfg.train.steps, world
        self.processor = processor  # a vision-language policy's: its bundles come back with each batch
        self.inputs, self.policy, self.units, self.tokenizer, self.warn = inputs, policy, units, tokenizer, warn
        self.device = cfg.train.generator_device or str(device)  # the generator process's
        self.trainer_device = device
        self.threads, self.method = placement(cfg)
        self.ready: dict[int, dict[str, Any]] = {}  # batches received or restored, by step, until their step ends
        self.receiving = False  # a message is being read: a signal must not abandon the step now (`_receive`)
        self.process, self.channel, self.snapshot = None, None, None
        self.start_step, self.published, self.taken = 0, 0, -1
        self.failed: RunError | None = None  # the generator process's failure, seen while publishing
        # the sync probe (guard.sync_probe_every): a sequence of the last batch, the trainer's log-probs of it per
        # published version still to be answered, and the differences answered since the last batch was handed out
        self.probe_every = cfg.guard.sync_probe_every
        self.probe_row: tuple[list[int], list[int]] | None = None
        self.probes: dict[int, torch.Tensor] = {}
        self.probe_diffs: list[float] = []

    # ------------------------------------------------------------------------------ start, stop
    @staticmethod
    def main(spec: Spec, snapshot: dict[str, torch.Tensor], channel) -> None:
        """The generator process's body (`lmrl.streamed` has another schedule)."""
        _generator_main(spec, snapshot, channel)

    def shared(self, context) -> tuple:
        """What else the generator process is given besides its spec, the weights and its pipe."""
        return ()

    def spawn(self) -> None:
        """Start the generator process, with the policy's weights as they are: it imports, loads its prompts,
        reward functions and model while this process builds and resumes the run (`start` sets it going)."""
        base = getattr(self.policy, "module", self.policy)
        base = base.get_base_model() if hasattr(base, "peft_config") else base
        with full_weights(self.units):
            self.snapshot = {name: t.detach().to("cpu", copy=True).share_memory_() for name, t in export_weights(self.policy)}
        skeleton = SimpleNamespace(config=base.config, generation_config=base.generation_config,
                                   dtype=next(base.parameters()).dtype)
        w = self.world
        spec = Spec(self.cfg, self.inputs, self.tokenizer, skeleton, self.device, self.threads,
                     (w.rank, w.size, w.local_rank), os.getpid(), self.processor)
        method = self.method
        try:
            if method == "spawn":
                pickle.dumps(spec)
        except Exception as e:  # noqa: BLE001 - any pickling failure is the same problem
            raise ConfigError(f"train.async_steps: the generator process cannot be given the run's inputs ({_line(e)}); "
                              "define reward functions and environments at module level, or set train.async_steps=0") from e
        context = torch.multiprocessing.get_context(method)
        self.channel, theirs = context.Pipe()
        self.process = context.Process(target=self.main, args=(spec, self.snapshot, theirs, *self.shared(context)),
                                       name="lmrl-generator")
        self.process.start()
        theirs.close()
        atexit.register(self.close)  # a Trainer built and never trained: before multiprocessing waits for its children

    def start(self, step: int) -> None:
        """Set the generator process going on the batches after `step` (where the run begins or resumes, the
        batches a checkpoint held aside), from the policy's current weights as version `step`."""
        self.start_step = self.published = step
        first = step + 1
        while first in self.ready:  # restored from the checkpoint
            first += 1
        rendezvous = self.world.first(_rendezvous()) if self.world.distributed else None  # every rank: a collective
        if first > self.steps:
            self.close()
            return
        self._write_snapshot()  # a resumed run's weights
        self.channel.send(("start", step, first, rendezvous))
        self.channel.send(("weights", step, None))  # (the first batch is the current policy's: the step checks it)

    def close(self) -> None:
        """Stop the generator process (it also ends when the trainer dies: Linux's parent-death signal)."""
        process, self.process = self.process, None
        if process is None:
            return
        atexit.unregister(self.close)
        with contextlib.suppress(OSError):
            self.channel.send(("stop",))
        # it reads "stop" between batches; one it is sampling now, nothing needs (a resumed run samples it again)
        process.join(2)
        if process.is_alive():
            process.terminate()
            process.join(10)
        if process.is_alive():
            process.kill()
            process.join()
        self.channel.close()

    # ------------------------------------------------------------------------------ the step
    def batch(self, step: int) -> Collected:
        """The scored batch of `step`, waiting for the generator process if it has not sent it yet; its metrics
        carry how long the trainer waited and how old the batch is."""
        start = time.perf_counter()
        while step not in self.ready:
            if self.failed is not None:
                raise self.failed
            if self.process is None:
                raise RunError(f"the generator process was stopped before it sent the batch of step {step}")
            self._receive(step)
        waited = time.perf_counter() - start
        c, version = _collected(self.ready[step], self.trainer_device)
        lag = float((step - 1) - version)  # one version per batch: every row is as old
        c.metrics |= {"time/wait_for_batch": waited, "async/version_lag": lag, "async/staleness_mean": lag,
                      "async/policy_version": float(version)}
        if self.probe_diffs:  # the sync probes answered while this batch was awaited
            c.metrics["val/sampler_probe_diff"] = max(self.probe_diffs)
            self.probe_diffs = []
        self.probe_row = probe_row(c.rollout)
        return c

    def publish(self, step: int) -> None:
        """After step `step`'s update: its batch is done with, and its weights go to the generator process if a
        batch still to be sampled needs them (every one it publishes is taken, in order)."""
        for s in [s for s in self.ready if s <= step]:
            del self.ready[s]
        if self.process is None or self.failed is not None or step + 1 + self.k > self.steps:
            return
        try:
            while self.taken < self.published:  # the weights in shared memory are still to be read
                self._receive(None)
            self._write_snapshot()
            self.published = step
            self.channel.send(("weights", step, self._probe(step)))
        except (RunError, OSError) as e:  # raised by the next step's `batch`, which checkpoints this one first
            self.failed = e if isinstance(e, RunError) else self._died(None)

    def _probe(self, step: int) -> tuple[list[int], list[int]] | None:
        """Every guard.sync_probe_every steps: a sequence of the batch just trained, for the generator process to
        score once it has taken these weights, and the trainer's log-probs of it under them, kept until it answers."""
        if not self.probe_every or step % self.probe_every or self.probe_row is None:
            return None
        training = self.policy.training
        self.policy.eval()
        try:
            with torch.no_grad():
                self.probes[step] = sequence_logprobs(self.policy, *self.probe_row)
        finally:
            self.policy.train(training)
        return self.probe_row

    def _write_snapshot(self) -> None:
        """The policy's current weights into the shared memory the generator process loads from."""
        with full_weights(self.units), torch.no_grad():
            for name, tensor in export_weights(self.policy):
                self.snapshot[name].copy_(tensor)

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self, step: int) -> list[dict[str, Any]]:
        """The batches a run resumed after `step` needs and could not sample again: those after `step` sampled by
        older weights than the checkpoint's. Waits for them; a dead generator process leaves out what it did not send
        (those are sampled again from the checkpoint's weights, and the resumed run differs from here on)."""
        wanted = [s for s in range(step + 1, min(step + self.k, self.steps) + 1)
                  if sampling_version(s, self.k, self.start_step) < step]
        try:
            for s in wanted:
                while s not in self.ready and self.process is not None:
                    self._receive(s)
        except RunError as e:
            self.warn(f"checkpoint of step {step}: {len(wanted) - sum(s in self.ready for s in wanted)} batch(es) in "
                      f"flight are lost ({e}); a resumed run samples them again from this checkpoint's weights")
        return [self.ready[s] for s in wanted if s in self.ready]

    def load_state_dict(self, batches: list[dict[str, Any]]) -> None:
        self.ready = {int(b["step"]): b for b in batches}

    # ------------------------------------------------------------------------------ messages
    def _receive(self, step: int | None) -> None:
        """Read one message of the generator process; one line if it died or failed. While a message is read and
        kept (`receiving`), a signal does not abandon the step (`RunLifecycle`): a batch read off the pipe and dropped
        by the abandon was lost, and the checkpoint that followed waited for it forever."""
        while not self.channel.poll(0.25):
            if not self.process.is_alive():
                raise self._died(step)
        self.receiving = True
        try:
            self._keep(pickle.loads(self.channel.recv_bytes()))
        except (EOFError, OSError) as e:
            raise self._died(step) from e
        finally:
            self.receiving = False

    def _keep(self, message: tuple) -> None:
        kind = message[0]
        if kind == "batch":
            self.ready[message[1]["step"]] = message[1]
        elif kind == "taken":
            self.taken = message[1]
        elif kind == "probe":  # the sampler's log-probs of the probe under the weights of that version
            trainer = self.probes.pop(message[1], None)
            if trainer is not None and message[2] is not None:
                self.probe_diffs.append((trainer - torch.tensor(message[2])).abs().mean().item())
        elif kind == "warn":
            self.warn(message[1])
        elif kind == "error":
            error = getattr(errors, message[1], None)
            raise (error if isinstance(error, type) and issubclass(error, LmrlError) else RunError)(message[2])


    def _died(self, step: int | None) -> RunError:
        """The one line for a generator process that is gone: how it ended (signal or exit code)."""
        self.process.join(5)
        return RunError(f"the generator process died ({_how(self.process.exitcode)})"
                        + (f" before it sent the batch of step {step}" if step is not None else ""))


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def _line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def placement(cfg) -> tuple[int, str]:
    """The generator process's torch threads and how it starts (`start_method`): train.generator_threads, else half
    the cores where it is spawned and one thread where it can be forked (`async_threads`: a forked child of several
    hangs, and forking keeps what spawning loses: lambdas, a start in a fraction of a second)."""
    threads = async_threads(cfg)[1]
    return threads, start_method(threads)


# ------------------------------------------------------------------------------ batches on the wire and on disk
def _state(c: Collected, step: int, version: int) -> dict[str, Any]:
    """A batch as plain values and tensors: what `torch.load(weights_only=True)` reads back from a checkpoint."""
    out = {f.name: getattr(c, f.name) for f in fields(Collected)}
    out["rollout"] = {f.name: getattr(c.rollout, f.name) for f in fields(Rollout)}
    return out | {"step": step, "version": version}


def _collected(state: dict[str, Any], device: torch.device) -> tuple[Collected, int]:
    """A batch from `_state`, with its tensors on the trainer's `device` (the generator process's may differ)."""
    def here(x):
        return x.to(device) if isinstance(x, torch.Tensor) else x

    values = {f.name: here(state[f.name]) for f in fields(Collected)}
    values["rollout"] = rollout_from_state(state["rollout"], device)
    values["per_function"] = {name: here(x) for name, x in values["per_function"].items()}
    values["metrics"] = dict(values["metrics"])
    return Collected(**values), int(state["version"])


def rollout_from_state(state: dict[str, Any], device: torch.device) -> Rollout:
    """A rollout sent as its fields, with its tensors on `device`."""
    return Rollout(**{name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in state.items()})


# ------------------------------------------------------------------------------ the generator process
class _SharedWeights:
    """The generator process's `Collector(weights=...)`: before a batch sampled by a newer version than the one it
    holds, wait for the trainer to publish that version, load it from shared memory, and say so."""

    def __init__(self, generator, snapshot: dict[str, torch.Tensor], channel):
        self.generator, self.snapshot, self.channel = generator, snapshot, channel
        self.seconds = self.waited = 0.0

    @contextlib.contextmanager
    def __call__(self, version: int):
        if self.generator.version != version:
            start = time.perf_counter()
            while (message := self.channel.recv())[0] != "weights" or message[1] < version:
                if message[0] == "stop":
                    raise Stopped
            loaded = time.perf_counter()
            self.generator.load_weights(self.snapshot.items(), version)
            self.seconds += time.perf_counter() - loaded
            self.waited += loaded - start
            send_message(self.channel, ("taken", version))
            if (probe := message[2]) is not None:
                answer_probe(self.channel, self.generator, version, probe)
        yield

    def take_seconds(self) -> float:
        """Seconds spent loading weights since the last call (`time/weight_sync`)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def answer_probe(channel, generator, version: int, sequence: tuple[list[int], list[int]]) -> None:
    """The sync probe: the sequence's log-probs under the weights of `version`, just taken, sent to the trainer (None
    from a generator that cannot score)."""
    score = getattr(generator, "score", None)
    send_message(channel, ("probe", version, score(*sequence).tolist() if score is not None else None))


def probe_row(rollout: Rollout) -> tuple[list[int], list[int]] | None:
    """The sync probe's sequence from a batch: its first row's prompt and the tokens the model sampled before
    anything else joined the response (a multi-turn episode's first observation), at most 64; None where the row
    shows images (the probe scores text: a vision-language policy's sync is checked by val/sampler_logprob_diff)."""
    if rollout.media is not None and rollout.media[int(rollout.media_rows[0])] is not None:
        return None
    sampled = rollout.response_mask[0].long().cumprod(0).sum().item()  # the leading run of sampled tokens
    if sampled == 0:
        return None
    prompt = rollout.prompt_ids[0][rollout.prompt_mask[0].bool()].tolist()
    return prompt, rollout.response_ids[0][: min(sampled, 64)].tolist()


class Stopped(Exception):
    """The trainer asked the generator process to stop."""


def send_message(channel, message: tuple) -> None:
    channel.send_bytes(pickle.dumps(message))


def in_generator(spec: Spec, channel, body) -> None:
    """Run `body` as the generator process: Ctrl-C left to the trainer, ending with it, named in `ps`, its threads
    set; a failure reaches the trainer as one line (the traceback here), a stop or a closed pipe ends it quietly."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's: it checkpoints, then stops this process
    die_with_parent(spec.parent)
    with contextlib.suppress(OSError, AttributeError):  # `ps` and `top` name it
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, b"lmrl-generator")  # PR_SET_NAME
    try:
        torch.set_num_threads(spec.threads)
        body()
    except (Stopped, EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except LmrlError as e:
        with contextlib.suppress(OSError):
            send_message(channel, ("error", type(e).__name__, str(e)))
    except BaseException as e:  # noqa: BLE001 - reported to the trainer as one line, the traceback here
        traceback.print_exc(file=sys.stderr)
        with contextlib.suppress(OSError):
            send_message(channel, ("error", "RunError", f"the generator process failed: {_line(e)}"))


def _generator_main(spec: Spec, snapshot: dict[str, torch.Tensor], channel) -> None:
    """The generator process: sample and score the batch of every step from `spec.first` on, in order, each with
    the weights its `sampling_version` names, and send it to the trainer."""
    in_generator(spec, channel, lambda: _fixed_lag(spec, snapshot, channel))


def _fixed_lag(spec: Spec, snapshot: dict[str, torch.Tensor], channel) -> None:
    collector, weights = generator_collector(spec, snapshot, channel)
    # where the run begins or resumes (`start`), the first batch to sample, where the ranks' processes meet
    while (message := channel.recv())[0] != "start":
        if message[0] == "stop":
            return
    _, begun, first, rendezvous = message
    if rendezvous is not None:  # one generator process per rank: their own group, for what spans the ranks
        rank, size, local_rank = spec.world
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # torchrun's store is the trainers'; rank 0 hosts this
        torch.distributed.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=size,
                                             timeout=datetime.timedelta(minutes=5))
        collector.world = World(rank, size, local_rank, "cpu")
    for step in range(first, spec.cfg.train.steps + 1):
        version = sampling_version(step, spec.cfg.train.async_steps, begun)
        collector.global_step = version  # what reward functions read: the steps done by the sampling policy
        start, weights.waited = time.perf_counter(), 0.0
        c = collector.collect(step)
        c.metrics |= {"time/generate": time.perf_counter() - start - weights.waited,
                      "time/wait_for_weights": weights.waited}
        send_message(channel, ("batch", _state(c, step, version)))
    while channel.recv()[0] != "stop":
        pass


def generator_collector(spec: Spec, snapshot: dict[str, torch.Tensor], channel) -> tuple[Collector, _SharedWeights]:
    """The generator process's Collector: its own prompts, reward functions, environment and generator."""
    from lmrl.data.prompts import PromptSampler

    cfg = spec.cfg
    env, data, _ = load_inputs(spec.inputs, spec.tokenizer, processor=spec.processor)
    sampler = None if data.train_stream else PromptSampler(len(data.train_rows), seed=cfg.train.seed)
    generator = process_generator(cfg, spec.skeleton, spec.tokenizer, env, torch.device(spec.device), spec.processor)
    weights = _SharedWeights(generator, snapshot, channel)
    warn = lambda line: send_message(channel, ("warn", line))  # noqa: E731
    return (Collector(cfg, data, sampler, generator, spec.tokenizer, env, ONE_PROCESS, weights, warn,
                      processor=spec.processor), weights)


def _rendezvous() -> str:
    """Where rank 0's generator process waits for the others': a free port on torchrun's MASTER_ADDR."""
    import socket

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("", 0))
        return f"tcp://{host}:{s.getsockname()[1]}"
