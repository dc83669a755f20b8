"""Checkpoints: what one holds, how it is written so that no crash leaves one that looks complete, and
how a run finds the newest one to resume from.

    runs/x/
      .lmrl.lock               held (flock) by the run writing here; a second run is refused
      lmrl_config.yaml         the resolved config (never a user's config.yaml)
      metrics.jsonl
      samples.jsonl            the sample tables (appended to; a resumed run's rewritten steps follow the old ones)
      report.html              `lmrl report`: written at the end and when the run stops
      checkpoint-40/
        COMPLETE               written last: {"name", "time", "files": {path: {"size", "crc32"}}}
        state/                 torch.distributed.checkpoint: trainable policy weights, critic, optimizer
        trainer_state.json     step, LR scheduler, KL controller, guard counters, elapsed time, evaluations
        rng_state_<r>.pt       rank r's RNGs: Python, NumPy, torch (CPU, CUDA), minibatch shuffler, sampler
        metrics.jsonl          the metrics rows up to step 40
        lmrl_config.yaml       the resolved config of the run
        config.json, model.safetensors, tokenizer files, critic/
                               the policy (its adapters for LoRA) as `from_pretrained` loads it
      final/                   a plain `from_pretrained` model directory, written the same atomic way
      .tmp-checkpoint-48-1234/ a checkpoint a killed process was writing: removed at the next start

Writing: everything goes into `.tmp-<name>-<pid>/`; files and directories are fsynced, COMPLETE is
written, listing every file with its size and CRC-32, then one `rename` makes `<name>/` appear. A reader trusts
only directories with COMPLETE, and a resume only one whose files are what COMPLETE lists (`verify_checkpoint`).

The state goes through `torch.distributed.checkpoint` (one process here; the same calls save and
load sharded state under torchrun). Frozen weights (a LoRA run's base model) are not saved: a resumed
run loads them from `model.name_or_path` as the first run did.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import sys
import time
import warnings
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml
from torch import nn

from lmrl.distributed import ONE_PROCESS, World, local
from lmrl.errors import RunError

if TYPE_CHECKING:
    from lmrl.config import Config

COMPLETE = "COMPLETE"
LOCK = ".lmrl.lock"
TMP_PREFIX = ".tmp-"
PROBE_PREFIX = f"{TMP_PREFIX}ranks-"  # `ranks_not_sharing`'s file, there for a moment
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# what makes a directory "hold a run": a new run into it must resume or overwrite
RUN_FILES = ("lmrl_config.yaml", "metrics.jsonl", "final", "best", "tensorboard")
RUN_RECORDS = ("samples.jsonl", "report.html")  # what a run writes about itself, named after its checkpoints


# ------------------------------------------------------------------------------------ atomic writes
@contextlib.contextmanager
def atomic_directory(target: Path, world: World = ONE_PROCESS) -> Iterator[Path]:
    """Yield a temporary directory beside `target`; when the block succeeds, fsync it, write COMPLETE
    and rename it to `target` (replacing an older `target`). When it fails, nothing appears.

    With several ranks every rank enters the block with the same directory (each writes its part: its
    shard of the state, its RNGs); rank 0 makes it, and finishes it once every rank is done."""
    target = Path(target)
    tmp = target.parent / f"{TMP_PREFIX}{target.name}-{world.first(os.getpid())}"
    if not world.main:
        world.barrier()  # rank 0 has made the directory
        yield tmp
        world.barrier()  # every rank has written its part
        world.barrier()  # rank 0 has renamed it
        return
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    world.barrier()
    try:
        yield tmp
        world.barrier()
        files = _seal(tmp)
        _write_synced(tmp / COMPLETE, json.dumps({"name": target.name, "time": round(time.time(), 3), "files": files},
                                                 indent=1) + "\n")
        _fsync_dir(tmp)
        if target.exists():  # an older copy: move it aside first, so that the rename below is one step
            old = target.parent / f"{TMP_PREFIX}old-{target.name}-{os.getpid()}"
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
        _fsync_dir(target.parent)
        world.barrier()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def ranks_not_sharing(directory: Path, world: World = ONE_PROCESS) -> list[int]:
    """The ranks that do not see `directory` as rank 0 does (a collective: every rank calls it). Rank 0 leaves a
    file there under a name drawn for the call, and every rank looks for it. Under torchrun on several nodes a
    directory on a disk of rank 0's node, or a relative path under another working directory, is another directory
    on the other nodes: their parts of a checkpoint (`atomic_directory`) would go there, and rank 0 would seal a
    checkpoint without them."""
    if not world.distributed:
        return []
    probe = Path(directory) / f"{PROBE_PREFIX}{world.first(secrets.token_hex(8))}"
    try:
        if world.main:
            probe.touch()
        world.barrier()
        seen = world.gather(probe.is_file())
    finally:
        if world.main:
            probe.unlink(missing_ok=True)
    return [rank for rank, found in enumerate(seen) if not found]


def is_complete(directory: Path) -> bool:
    return (Path(directory) / COMPLETE).is_file()


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _seal(root: Path) -> dict[str, dict[str, Any]]:
    """fsync every file and directory under `root`; return each file's size and CRC-32 by its path under `root`:
    what COMPLETE lists and `verify_checkpoint` checks (the files are read back once, from the page cache)."""
    paths = []
    for dirpath, _, filenames in os.walk(root):
        paths += [Path(dirpath) / name for name in sorted(filenames)]
        _fsync_dir(Path(dirpath))
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:  # as `_verify`: the disk's speed
        sums = list(pool.map(_checksum_synced, paths))
    return {path.relative_to(root).as_posix(): found for path, found in zip(paths, sums)}


def _checksum_synced(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        found = _checksum(f)
        os.fsync(f.fileno())
    return found


def _checksum(f) -> dict[str, Any]:
    """{"size", "crc32"} of an open binary file, read in 16 MiB pieces."""
    crc, size = 0, 0
    while chunk := f.read(16 << 20):
        crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"size": size, "crc32": f"{crc:08x}"}


def verify_checkpoint(directory: Path) -> str | None:
    """None when every file COMPLETE lists is there with its size and CRC-32; else what is wrong, in a few words
    naming the first file that differs. A COMPLETE that lists no files (written before lmrl listed them) verifies as is.
    Checked once per directory and COMPLETE in a process (`plan_run` runs twice before a resume)."""
    directory = Path(directory)
    try:
        stat = (directory / COMPLETE).stat()
        key = (str(directory.resolve()), stat.st_mtime_ns, stat.st_size)
        if key not in _VERIFIED:
            _VERIFIED[key] = _verify(directory, json.loads((directory / COMPLETE).read_text()))
        return _VERIFIED[key]
    except (OSError, ValueError) as e:
        return f"{COMPLETE} cannot be read ({getattr(e, 'strerror', None) or e})"


_VERIFIED: dict[tuple[str, int, int], str | None] = {}


def _verify(directory: Path, marker: dict[str, Any]) -> str | None:
    """The first problem of the files `marker` lists, in its order; files are read on several threads (zlib lets
    go of the GIL), so a checkpoint of several files verifies at the disk's speed rather than one core's."""
    listed = marker.get("files") or {}
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        for problem in pool.map(lambda item: _problem(directory, *item), listed.items()):
            if problem is not None:
                return problem
    return None


def _problem(directory: Path, name: str, saved: dict[str, Any]) -> str | None:
    try:
        with open(directory / name, "rb") as f:
            found = _checksum(f)
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as e:
        return f"{name} cannot be read ({e.strerror or e})"
    if found["size"] != saved["size"]:
        return f"{name} is {found['size']} bytes, {COMPLETE} says {saved['size']} (cut short or overwritten)"
    if found["crc32"] != saved["crc32"]:
        return f"{name} has CRC-32 {found['crc32']}, {COMPLETE} says {saved['crc32']} (its bytes changed)"
    return None


# ------------------------------------------------------------------------------ finding checkpoints
def checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete `checkpoint-N` directories of a run, oldest first."""
    found = []
    for path in Path(output_dir).glob("checkpoint-*"):
        m = _CHECKPOINT.match(path.name)
        if m and path.is_dir() and is_complete(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def newest_checkpoint(output_dir: Path) -> Path | None:
    found = checkpoints(output_dir)
    return found[-1][1] if found else None


def checkpoint_bytes(directory: Path) -> int:
    """The bytes of the files a checkpoint's COMPLETE lists (0 when it lists none)."""
    try:
        marker = json.loads((Path(directory) / COMPLETE).read_text())
    except (OSError, ValueError):
        return 0
    return sum(int(f.get("size", 0)) for f in (marker.get("files") or {}).values())


def storage_cause(error: BaseException, directory: Path, needed: int) -> str | None:
    """Why writing under `directory` failed, when the storage is the reason: the system's words for the first
    OSError in `error`'s chain (no space, quota, read-only, permission, a vanished mount, a file-size limit), or,
    for a writer that lost the errno (torch's "unexpected pos"), what a probe write of `needed` bytes meets.
    None when the storage is not to blame."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        code = e.errno if isinstance(e, OSError) else None
        if code is None and (found := _OS_ERROR.search(str(e))):  # safetensors: "IoError(Os { code: 28, ... })"
            code = int(found.group(1))
        if code is not None and code in errno.errorcode:
            return f"{os.strerror(code)} ({errno.errorcode[code]})"
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException: per rank
        todo += [e.__cause__, e.__context__, *(f[0] for f in (failures.values() if isinstance(failures, dict) else []))]
    return _probe(Path(directory), needed)


_OS_ERROR = re.compile(r"(?:os error|code:)\s*(\d+)")


def _probe(directory: Path, needed: int) -> str | None:
    """Ask the storage itself: write a file of `needed` bytes (at most 256 MB) beside the failed write, and say why
    that fails too (a full disk, a file-size limit, a read-only or vanished filesystem); or the free space, when
    it is less than `needed`."""
    probe = directory / f".lmrl-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            for start in range(0, max(1, min(needed, 256 << 20)), 1 << 20):
                f.write(bytes(min(1 << 20, max(needed - start, 1))))
            f.flush()
            os.fsync(f.fileno())
        free = shutil.disk_usage(directory).free
    except OSError as e:
        return f"{e.strerror or os.strerror(e.errno)} ({errno.errorcode.get(e.errno, e.errno)})"
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    if free < needed:
        return f"no space left on device ({free / 1e6:.1f} MB free, the write needs about {needed / 1e6:.1f} MB)"
    return None


def newest_verified(output_dir: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and a warning line for each newer one that does not (left in place);
    a RunError when there are checkpoints and none verifies."""
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(checkpoints(output_dir)):
        if (problem := verify_checkpoint(path)) is None:
            return path, [f"{bad.name} does not verify: {why}; left in place, resuming from {path.name}"
                          for bad, why in skipped]
        skipped.append((path, problem))
    if skipped:
        raise RunError(f"train.resume=auto: no checkpoint in {output_dir} verifies ("
                       + "; ".join(f"{bad.name}: {why}" for bad, why in skipped) + "); every one is left in place")
    return None, []


def remove_partial(output_dir: Path) -> list[Path]:
    """Remove what killed processes left half-written (`.tmp-*`); return what was removed."""
    removed = []
    for path in Path(output_dir).glob(f"{TMP_PREFIX}*"):
        if path.name.startswith(PROBE_PREFIX) and path.is_file():  # a run killed while it looked at its ranks
            path.unlink(missing_ok=True)
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def prune(output_dir: Path, keep_last: int | None) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints (None keeps all)."""
    found = checkpoints(output_dir)
    if keep_last is None or len(found) <= keep_last:
        return []
    doomed = [path for _, path in found[: len(found) - keep_last]]
    for path in doomed:
        # rename first: a kill during rmtree leaves a .tmp- directory, never a half-deleted checkpoint
        trash = path.parent / f"{TMP_PREFIX}pruned-{path.name}-{os.getpid()}"
        path.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def holds_run(output_dir: Path) -> list[str]:
    """What in `output_dir` belongs to an earlier run (empty when nothing does)."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [name for name in RUN_FILES if (out / name).exists()]
    found += sorted(p.name for p in out.glob("checkpoint-*") if _CHECKPOINT.match(p.name))
    return found + [name for name in RUN_RECORDS if (out / name).exists()]


def clear_run(output_dir: Path) -> None:
    """Remove an earlier run's files (`train.overwrite=true`): only what lmrl writes."""
    out = Path(output_dir)
    for name in holds_run(out):
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    remove_partial(out)


@dataclass
class RunPlan:
    checkpoint: Path | None  # the checkpoint to resume from
    clear: bool  # delete the earlier run's files first
    warnings: list[str] = field(default_factory=list)  # newer checkpoints that did not verify, one line each


def _check_writable(out: Path) -> None:
    """A RunError naming train.output_dir when it is a file, or lies under a file or a read-only directory."""
    if out.exists() and not out.is_dir():
        raise RunError(f"train.output_dir: {out} is a file, not a directory")
    parent = next(p for p in [out, *out.absolute().parents] if p.exists())
    if not parent.is_dir():
        raise RunError(f"train.output_dir: {out} cannot be created: {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RunError(f"train.output_dir: {out} cannot be written: {parent} is not writable by this user")


def plan_run(cfg) -> RunPlan:
    """What a run into `cfg.train.output_dir` will do, given train.resume and train.overwrite; a RunError (one
    line) when it must not start. No side effects: the CLI calls it before any model loads, the trainer again
    under the run's lock."""
    t = cfg.train
    out, resume, checkpoint, warned = Path(t.output_dir), t.resume, None, []
    _check_writable(out)
    if resume == "auto":
        checkpoint, warned = newest_verified(out)
    elif resume is not None:
        checkpoint = Path(resume)
        if not checkpoint.is_dir():
            raise RunError(f"train.resume: {checkpoint} does not exist; give a checkpoint directory, or auto")
        if not is_complete(checkpoint):
            raise RunError(f"train.resume: {checkpoint} is not a complete checkpoint (no {COMPLETE} file in it)")
        if (problem := verify_checkpoint(checkpoint)) is not None:
            raise RunError(f"train.resume: {checkpoint} does not verify: {problem}; nothing was loaded")
    own = checkpoint is not None and checkpoint.resolve().parent == out.resolve()
    if t.overwrite and own:
        raise RunError(f"train.overwrite=true would delete {checkpoint}, which train.resume={resume} resumes from; "
                       "use one or the other")
    earlier = holds_run(out)
    if earlier and not t.overwrite and not own and not (resume == "auto" and "final" not in earlier):
        if resume == "auto":
            raise RunError(f"train.output_dir: {out} holds a finished run with no checkpoint to resume "
                           f"({', '.join(earlier[:4])}); start afresh with train.overwrite=true (deletes it), "
                           "or choose another train.output_dir")
        raise RunError(f"train.output_dir: {out} holds a run ({', '.join(earlier[:4])}); resume it with "
                       "train.resume=auto, or start afresh with train.overwrite=true (deletes it)")
    if checkpoint is not None:
        saved = yaml.safe_load((checkpoint / "lmrl_config.yaml").read_text()) or {}
        if diffs := resume_differences(saved, cfg):
            allowed = ", ".join(k + ("*" if k.endswith(".") else "") for k in RESUMABLE_CHANGES)
            raise RunError(f"train.resume: the config differs from {checkpoint}'s in {', '.join(diffs)}; "
                           f"only {allowed} may change on resume")
    # a run killed before its first checkpoint (resume=auto finds none) has nothing to keep: start afresh
    return RunPlan(checkpoint, clear=bool(earlier) and not own, warnings=warned)


# fields a resumed run may change: none of them can make the saved state mean something else
RESUMABLE_CHANGES = ("train.steps", "train.eval_every", "train.save_every", "train.keep_last", "train.keep_best",
                     "train.max_minutes",
                     "train.resume", "train.overwrite", "train.threads", "train.parallel", "train.output_dir",
                     "train.generator_threads", "train.generator_device",
                     "rollout.cuda_graph", "rollout.vllm.", "reward.timeout", "log.")


def resume_differences(saved: dict[str, Any], cfg: Config) -> list[str]:
    """`section.field (old -> new)` for every field that differs from a checkpoint's config and may not."""
    out = []
    now = cfg.model_dump(mode="json")
    for section, fields in now.items():
        for name, value in fields.items():
            key = f"{section}.{name}"
            old = (saved.get(section) or {}).get(name, value)
            if old != value and not any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE_CHANGES):
                out.append(f"{key} ({old!r} -> {value!r})")
    return out


# ------------------------------------------------------------------------------------------- lock
class RunLock:
    """An exclusive `flock` on `<output_dir>/.lmrl.lock` for the life of a run. The kernel drops it when
    the process ends, however it ends (SIGKILL included), so a stale lock cannot outlive its run."""

    def __init__(self, output_dir: Path):
        self.path = Path(output_dir) / LOCK
        self._file = None

    def acquire(self) -> RunLock:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock, one run at a time is the user's to ensure
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 - held open for the run's life
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise RunError(f"train.output_dir: {self.path.parent} is in use by another lmrl run (pid {holder}); "
                           "wait for it to end or choose another train.output_dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f
        return self

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing drops the flock
            self._file = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# ------------------------------------------------------------------------------- model + optimizer
def _state_dict_options(loading: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # frozen weights (a LoRA base) come from model.name_or_path, as when the run started; the load is not
    # strict about them, while dcp.load itself fails on any saved key the checkpoint lacks
    return StateDictOptions(ignore_frozen_params=True, strict=not loading)


@contextlib.contextmanager
def _single_process_quiet():
    with warnings.catch_warnings():  # one process without a process group is what we mean: no warning
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        yield


def save_model_state(directory: Path, modules: dict[str, nn.Module], optimizer: torch.optim.Optimizer) -> None:
    """Trainable weights of `modules` and the optimizer's state, with torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(nn.ModuleDict(modules), optimizer, options=_state_dict_options(False))
    with _single_process_quiet():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory))


def load_model_state(directory: Path, modules: dict[str, nn.Module], optimizer: torch.optim.Optimizer) -> None:
    """Load what `save_model_state` wrote into the same (freshly built) modules and optimizer, in place."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    wrapper = nn.ModuleDict(modules)
    model_sd, optim_sd = get_state_dict(wrapper, optimizer, options=_state_dict_options(False))
    state = {"model": model_sd, "optim": optim_sd}
    with _single_process_quiet():
        try:
            dcp.load(state, checkpoint_id=str(directory))
        except Exception as e:  # noqa: BLE001 - one line naming the checkpoint
            first = " ".join(str(e).split())[:300]
            raise RunError(f"train.resume: cannot load {directory}: {type(e).__name__}: {first}") from e
    set_state_dict(wrapper, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_state_dict_options(True))


def all_finite(modules: list[nn.Module]) -> bool:
    """True when every parameter of every module is finite (nothing non-finite is ever saved)."""
    params = [local(p.detach()) for m in modules for p in m.parameters() if p.is_floating_point()]  # this rank's shard
    if not params:
        return True
    norms = torch._foreach_norm(params)  # one fused pass; a NaN or inf anywhere makes its norm non-finite
    return bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())


# -------------------------------------------------------------------------------------------- RNGs
def rng_state(generators: dict[str, torch.Generator]) -> dict[str, Any]:
    """Every RNG a step can draw from: Python's, NumPy's (when imported), torch's CPU and CUDA
    generators, and the trainer's own `torch.Generator`s. Plain values and tensors only, so that
    `torch.load(weights_only=True)` reads it back."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state(),
                             "generators": {k: g.get_state() for k, g in generators.items()},
                             "generator_devices": {k: g.device.type for k, g in generators.items()}}
    if "numpy" in sys.modules:
        kind, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], generators: dict[str, torch.Generator]) -> list[str]:
    """Restore what `rng_state` saved. A generator saved on another kind of device (a run moved from the CPU to a
    GPU, or back) cannot take that state: it is seeded from it instead, and the returned lines say which."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    moved = []
    for k, g in generators.items():
        if k not in state["generators"]:
            continue
        saved, was = state["generators"][k], state.get("generator_devices", {}).get(k)
        if was in (None, g.device.type) and saved.numel() == g.get_state().numel():
            g.set_state(saved)
        else:  # a CPU generator's state is 5,056 bytes, a CUDA one's 16: seed from what was saved
            g.manual_seed(int.from_bytes(hashlib.sha256(saved.numpy().tobytes()).digest()[:8], "little"))
            moved.append(f"the {k} random state was saved on {was or 'another device'} and this run draws on "
                         f"{g.device.type}: it is seeded from the saved one, so the resumed run samples other numbers "
                         "than the saving one would have")
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    return moved
