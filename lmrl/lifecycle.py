"""A run's life around its steps: starting or resuming, checkpoints, signals, failures and the final save.

    with lifecycle.held():              the output directory's lock; SIGINT / SIGTERM handlers
        step = lifecycle.begin()        every rank sees the directory; clean half-written checkpoints, clear an
                                        overwritten run, resume
        with lifecycle.running():       a failure or a full disk: one line, exit 1
            with lifecycle.abandonable(step): ...   steps 1-3 of a step: a signal or failure keeps step - 1
            lifecycle.save_checkpoint(step)

What a checkpoint holds and how it is written so that no crash leaves half of one is `lmrl.checkpoint`; this
module decides when to write one and what goes in it, and owns the state of the run's life: the signal that
asked it to stop, the step a signal may abandon, the last step saved and the training time so far.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmrl.checkpoint import (
    RunLock,
    all_finite,
    atomic_directory,
    checkpoint_bytes,
    clear_run,
    load_model_state,
    newest_checkpoint,
    plan_run,
    prune,
    ranks_not_sharing,
    remove_partial,
    rng_state,
    save_model_state,
    set_rng_state,
    storage_cause,
    verify_checkpoint,
)
from lmrl.config import config_to_yaml
from lmrl.distributed import World, whole_state
from lmrl.errors import Interrupted, LmrlError, RunError, print_line
from lmrl.logging.run_log import RunLog
from lmrl.models.loading import dropout_as_loaded, quiet_progress_bars
from lmrl.models.lora import adapter_base, portable_adapter_config

# the real os._exit, kept at import: while reward functions run, lmrl.rewards replaces os._exit so that a
# reward calling it fails instead of ending the run with exit 0; a second Ctrl-C must still exit at once
_EXIT_NOW = os._exit


class _AbandonStep(BaseException):
    """Raised by the signal handler inside steps 1-3. A BaseException, so that no `except Exception` in a
    reward function or library on the way swallows it."""


class RunLifecycle:
    """Checkpoints, resume, signals and failures of one run.

    Args:
        cfg: the run's config (`train.output_dir`, `train.keep_last`, the config recorded beside the weights).
        world: the ranks; every rank writes its part of a checkpoint.
        log: the run's record (`lmrl.logging.run_log.RunLog`): its metrics rows are checkpointed, its console warns.
        result: the run's `TrainResult` (its evaluations are checkpointed; a resume restores its history).
        modules: the trained models by name ("policy", and "critic" when there is one).
        optimizer: their optimizer.
        states: what else trainer_state.json holds, by name: objects with `state_dict` / `load_state_dict`.
        files: what each rank saves in a file of its own (`NAME_RANK.pt`, read with `weights_only=True`), by name:
            objects with `state_dict(step)` / `load_state_dict` (an asynchronous run's batches in flight).
        generators: the random generators a resumed run continues, by name.
        tokenizer: saved beside every model.
    """

    def __init__(self, cfg, world: World, log: RunLog, result, *, modules: dict[str, nn.Module],
                 optimizer: torch.optim.Optimizer, states: dict[str, Any], generators: dict[str, torch.Generator],
                 tokenizer: Any, files: dict[str, Any] | None = None):
        self.cfg, self.world, self.log, self.result = cfg, world, log, result
        self.files = files or {}
        self.out = Path(cfg.train.output_dir)
        self.modules, self.optimizer, self.states, self.generators = modules, optimizer, states, generators
        self.tokenizer = tokenizer
        self.elapsed = 0.0  # training seconds before this process (a resumed run continues the clock)
        self.saved_step: int | None = None
        self.stop_signal: int | None = None  # the signal that asked the run to stop
        self.abandon_at: int | None = None  # the step a signal may abandon now (steps 1-3 of it)
        self.started = False  # inside `running`: steps may checkpoint and be abandoned
        self.warned_space = False  # the output directory's free space was said to be short

    # ------------------------------------------------------------------------------ start, end
    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The output directory's lock (rank 0 holds it) and the signal handlers, for the run's whole life."""
        self.out.mkdir(parents=True, exist_ok=True)
        with RunLock(self.out) if self.world.main else contextlib.nullcontext(), self._signals():
            yield

    def begin(self) -> int:
        """Act on `plan_run` under the run's lock: clean partial checkpoints, clear an overwritten run, load
        the checkpoint to resume from, write lmrl_config.yaml. Returns the step to continue after (0: a new run)."""
        main = self.world.main
        if blind := ranks_not_sharing(self.out, self.world):  # before any rank plans from what is there
            ranks = f"rank {blind[0]} does" if len(blind) == 1 else f"ranks {', '.join(map(str, blind))} do"
            error = RunError(f"train.output_dir: {ranks} not see {self.out} as rank 0 does (a disk of one node, or a "
                             "relative path under another working directory): every rank writes its part of each "
                             "checkpoint there, so it must be one directory that every node mounts at the same path")
            error.every_rank = True
            raise error
        for path in remove_partial(self.out) if main else []:
            self.log.warn(f"removed {path.name}: a checkpoint that a killed run left half-written")
        plan = plan_run(self.cfg)
        for line in plan.warnings if main else []:
            self.log.warn(line)
        self.world.barrier()  # every rank planned before rank 0 writes anything
        if plan.clear and main:
            clear_run(self.out)
        step = self.load_checkpoint(plan.checkpoint) if plan.checkpoint is not None else 0
        if main:  # lmrl_config.yaml, not config.yaml: output_dir may be the folder holding the user's own config
            (self.out / "lmrl_config.yaml").write_text(config_to_yaml(self.cfg))
        return step

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The loop runs inside: a usage error raised once the run started exits 1, and a storage error (a full
        disk, a directory removed under the run) is one line naming the file, not a traceback."""
        self.started = True
        try:
            yield
        except LmrlError as e:
            if not isinstance(e, Interrupted):
                e.exit_code = 1  # the run had started: not a usage error
            raise
        except OSError as e:
            error = RunError(f"cannot write {e.filename or self.out}: {e.strerror or e} ({self.last_good()})")
            error.exit_code = 1
            raise error from e
        finally:
            self.started = False

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, step: int, rng: dict[str, Any] | None = None) -> Path:
        """Everything a resumed run needs to continue exactly after `step` (layout: `lmrl.checkpoint`).
        `rng`: the RNG states to record (default: the current ones)."""
        path = self.out / f"checkpoint-{step}"
        if self.saved_step == step and path.is_dir():
            return path
        if not self.finite():
            raise RunError(f"step {step}: the weights are not finite after the update (optim.lr={self.cfg.optim.lr:g} too "
                           f"high?); no checkpoint written ({self.last_good()})")
        if self.world.main and path.is_dir() and (problem := verify_checkpoint(path)) is not None:
            aside = next(p for i in range(1, 1000) if not (p := path.with_name(f"{path.name}.unverified"
                                                                                + (f"-{i}" if i > 1 else ""))).exists())
            path.rename(aside)  # a resume skipped it: kept for whoever wants to look, never deleted
            self.log.warn(f"{path.name} did not verify: {problem}; kept as {aside.name}, and a new {path.name} is written")
        state = {"step": step, "elapsed": self.elapsed, **{k: s.state_dict() for k, s in self.states.items()},
                 "evals": self.result.evals,
                 "episode": step * self.cfg.rollout.prompts_per_step * self.cfg.rollout.group_size,
                 "world_size": self.world.size}
        with self._storage(path.name), atomic_directory(path, self.world) as tmp:  # every rank writes its part
            save_model_state(tmp / "state", self.modules, self.optimizer)  # collective
            torch.save(rng or rng_state(self.generators), tmp / f"rng_state_{self.world.rank}.pt")
            for name, f in self.files.items():
                torch.save(f.state_dict(step), tmp / f"{name}_{self.world.rank}.pt")
            if self.world.main:
                (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1) + "\n")
                (tmp / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in self.log.rows))
            self._save_model_files(tmp)  # with lmrl_config.yaml, the config a resume is checked against
        if self.world.main:
            prune(self.out, self.cfg.train.keep_last)
        self.saved_step = step
        return path

    def keep_best(self, step: int) -> bool:
        """train.keep_best: write `best/` (the model files a checkpoint holds, and best.json with the step and its
        eval/accuracy) when the evaluation just recorded beats every earlier one of the run (a resumed run's
        included). Every rank calls it (the evaluations are the same on all); returns whether it wrote."""
        *before, now = [e["eval/accuracy"] for e in self.result.evals]
        if not before or not now > max(before):
            return False
        with self._storage("best"), atomic_directory(self.out / "best", self.world) as tmp:
            self._save_model_files(tmp)  # with LoRA: the adapters, as a checkpoint holds them (merging ends training)
            if self.world.main:
                (tmp / "best.json").write_text(json.dumps({"step": step, "eval/accuracy": now}) + "\n")
        return True

    def load_checkpoint(self, path: Path) -> int:
        """Restore the run from a checkpoint directory; returns its step."""
        load_model_state(path / "state", self.modules, self.optimizer)
        state = json.loads((path / "trainer_state.json").read_text())
        for name, s in self.states.items():
            s.load_state_dict(state[name])
        # this rank's RNGs; a rank the saving run did not have (another world size) continues from rank 0's
        rng = path / f"rng_state_{self.world.rank}.pt"
        moved = set_rng_state(torch.load(rng if rng.is_file() else path / "rng_state_0.pt", weights_only=True),
                              self.generators)
        for line in moved if self.world.main else []:
            self.log.warn(f"{path.name}: {line}")
        for name, f in self.files.items():
            if (saved := path / f"{name}_{self.world.rank}.pt").is_file():
                f.load_state_dict(torch.load(saved, weights_only=True))
        self.elapsed, self.saved_step = float(state["elapsed"]), int(state["step"])
        self.log.rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
        self.result.evals = list(state["evals"])
        self.result.history = [{k: math.nan if v is None else v for k, v in r.items() if k not in ("step", "time")}
                               for r in self.log.rows if r["step"] > 0]
        return int(state["step"])

    def save(self, directory: str | Path, final: bool = False) -> None:
        """A model plain transformers loads (`save_pretrained`), its tokenizer and the run's config, written
        atomically. A LoRA run saves adapters in checkpoints and merges them into the final model."""
        if not self.finite():
            raise RunError(f"{directory}: the weights are not finite; refusing to save them ({self.last_good()})")
        with self._storage(Path(directory).name, final=final), atomic_directory(Path(directory), self.world) as tmp:
            self._save_model_files(tmp, final)  # several ranks: every one calls save

    @contextlib.contextmanager
    def _storage(self, name: str, final: bool = False) -> Iterator[None]:
        """Writing `name` in the output directory: warn first when the free space cannot hold a checkpoint the size
        of the last one; a failure the storage caused (`storage_cause`) is one line naming the directory and the
        cause, exit 1 (the partial directory is already gone: `atomic_directory`)."""
        last = newest_checkpoint(self.out)
        needed = checkpoint_bytes(last) if last is not None else self._state_bytes()
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(self.out).free
            if self.world.main and last is not None and free < needed and not self.warned_space:
                self.warned_space = True
                self.log.warn(f"train.output_dir: {self.out} has {free / 1e6:.1f} MB free and "
                              f"{last.name} took {needed / 1e6:.1f} MB: the next checkpoint may not fit")
        try:
            yield
        except (LmrlError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
            if (cause := storage_cause(e, self.out, needed)) is None:
                raise
            result = f"the run's result is its last checkpoint, {last}" if final and last else self.last_good()
            error = RunError(f"cannot write {name} in {self.out}: {cause}; the partial {name} was removed ({result})")
            error.exit_code = 1
            raise error from None

    def _state_bytes(self) -> int:
        """About what a first checkpoint takes: the trained weights, their copy for `from_pretrained`, AdamW's two
        moments."""
        weights = sum(p.numel() * p.element_size() for m in self.modules.values() for p in m.parameters() if p.requires_grad)
        return 4 * weights

    def _save_model_files(self, directory: Path, final: bool = False) -> None:
        """Rank 0 writes; every rank calls it (sharded weights are gathered from all of them first)."""
        policy, critic = self.modules["policy"], self.modules.get("critic")
        whole = [whole_state(m) if self.world.sharded else None for m in (policy, critic)]
        if not self.world.main:
            return
        lora = hasattr(policy, "peft_config")
        with quiet_progress_bars(), dropout_as_loaded(policy, critic):  # the config's dropout as the user gave it
            if lora:  # the adapters (a checkpoint's files, final/adapter/), their base named as the user named it
                adapter = directory / "adapter" if final else directory
                policy.save_pretrained(adapter)
                portable_adapter_config(adapter, adapter_base(self.cfg.model.name_or_path) or self.cfg.model.name_or_path)
            if final or not lora:  # final/ itself is the merged model, which plain transformers loads
                model = policy.merge_and_unload() if lora else policy
                model.save_pretrained(directory, state_dict=whole[0])
            if critic is not None:
                critic.save_pretrained(directory / "critic", state_dict=whole[1])
        self.tokenizer.save_pretrained(directory)
        (directory / "lmrl_config.yaml").write_text(config_to_yaml(self.cfg))

    def finite(self) -> bool:
        """Every trained weight of every rank is finite."""
        return self.world.all(all_finite(list(self.modules.values())))

    def last_good(self) -> str:
        found = newest_checkpoint(self.out)
        return f"last good checkpoint: {found}" if found is not None else "there is no earlier checkpoint"

    # ------------------------------------------------------------------------------ signals and failures
    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
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

    def stopping(self) -> bool:
        """A signal asked the run to stop. Under torchrun, which forwards its signal to every rank, the ranks
        agree at the end of each step, so that they stop after the same one and checkpoint it together."""
        if self.world.distributed:
            signum = self.world.most(self.stop_signal or 0)
            self.stop_signal = signum or None
        return self.stop_signal is not None

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.stop_signal is not None:
            print_line(f"lmrl: {name} again: exiting now, without a checkpoint")
            _EXIT_NOW(128 + signum)
        self.stop_signal = signum
        if self.world.distributed:  # torchrun forwards its signal to every rank; rank 0 says it
            if self.world.main:
                print_line(f"lmrl: {name} received: every rank stops after this step's checkpoint")
            return
        print_line(f"lmrl: {name} received: stopping after a checkpoint ({name} again to exit at once)")
        # not while a component reads a message it must keep (the generator process's batch): the step then runs to
        # its end and stops after its checkpoint, as a signal in the update does
        if self.abandon_at is not None and not any(getattr(f, "receiving", False) for f in self.files.values()):
            raise _AbandonStep(signum)

    @contextlib.contextmanager
    def abandonable(self, step: int) -> Iterator[None]:
        """Steps 1-3 of a step change no state but the RNGs, recorded here: a signal abandons them at once, and
        a failure in them (a reward function raising under reward.on_error=fail, ...) first writes a
        checkpoint of the last completed step, so that the run resumes where it was."""
        if not self.started:  # train_step called on its own: no checkpoints, no signal handling
            yield
            return
        if self.world.distributed:  # other ranks are in the middle of their step: no checkpoint (docs/scaling.md)
            try:
                yield
            except Exception as e:
                self.explain(e, step, None)
                raise
            return
        rng = rng_state(self.generators)
        self.abandon_at = step
        try:
            yield
        except _AbandonStep:
            self.abandon_at = None
            raise self.interrupted(max(step - 1, 0), self._checkpoint_of(step - 1, rng)) from None
        except Exception as e:
            self.abandon_at = None
            try:
                path = self._checkpoint_of(step - 1, rng)
            except Exception:  # noqa: BLE001 - the original failure is the one to report
                path = None
            self.explain(e, step, path)
            raise
        finally:
            self.abandon_at = None

    def explain(self, e: Exception, step: int, path: Path | None) -> None:
        """A failure at `step` names the step and the checkpoint written before it was raised on."""
        where = f"{path} written: add train.resume=auto to continue" if path is not None else ""
        if isinstance(e, LmrlError):
            e.exit_code = 1
            e.args = (f"step {step}: {e}" + (f"; {where}" if where else ""),)
        elif where:  # an unexpected failure keeps its traceback; say what was saved first
            self.log.warn(f"step {step} failed ({type(e).__name__}); {where}")

    def _checkpoint_of(self, step: int, rng: dict[str, Any]) -> Path | None:
        """A checkpoint after `step` (nothing when no step completed)."""
        if step < 1:
            return None
        return self.save_checkpoint(step, rng)

    def interrupted(self, step: int, path: Path | None) -> Interrupted:
        """The error that ends a run a signal stopped after `step`, naming the checkpoint to resume from."""
        name = signal.Signals(self.stop_signal).name
        if path is None:
            return Interrupted(f"{name}: stopped before step {step + 1} ended; no checkpoint to resume from "
                               f"({'no step had completed' if step < 1 else self.last_good()})", self.stop_signal)
        return Interrupted(f"{name}: stopped after step {step}; checkpoint {path} written; add train.resume=auto "
                           "to the same command to continue", self.stop_signal)
