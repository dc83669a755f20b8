"""Storage faults (issue 29): a checkpoint whose files are not the bytes that were written (cut short by a failed
copy or a quota, a flipped bit) is found before anything loads. train.resume=auto skips it with a warning naming
the file, leaves it in place and resumes from the newest one that verifies, exactly; an explicit path that does not
verify, or a run whose checkpoints all fail, is one line."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from lmrl import Config, Trainer
from lmrl.checkpoint import COMPLETE, checkpoints, storage_cause, verify_checkpoint
from lmrl.errors import RunError
from tests.forked import forked, torchrun
from tests.test_async_rollouts import same_metrics
from tests.test_long_runs import ROOT, metric_rows

RUN = dict(rollout={"prompts_per_step": 4, "group_size": 4}, data={"num_eval_prompts": 4},
           train={"eval_every": 0, "save_every": 1, "max_minutes": None}, log={"console": False, "samples_every": 0})


def train(out: Path, steps: int, **train_fields) -> Trainer:
    cfg = Config(**{**RUN, "train": {**RUN["train"], **train_fields, "steps": steps, "output_dir": str(out)}})
    trainer = Trainer(cfg)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run stopped after step 3 (checkpoints 1-3), and the same run straight to step 4."""
    stopped, straight = tmp_path_factory.mktemp("stopped"), tmp_path_factory.mktemp("straight")
    train(stopped, 3)
    train(straight, 4)
    return stopped, straight


def flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# every kind of file a checkpoint holds: the weights `lmrl eval` loads, the sharded state (at 10% of the file the
# policy's weights, at 95% AdamW's moments: read from its .metadata), the RNGs, the trainer's state
FAULTS = {
    "model weights": ("model.safetensors", flip_byte),
    "sharded state: policy weights": ("state/__0_0.distcp", lambda p: flip_byte(p, 0.1)),
    "sharded state: optimizer moments": ("state/__0_0.distcp", lambda p: flip_byte(p, 0.95)),
    "sharded state, cut short": ("state/__0_0.distcp", truncate),
    "RNG": ("rng_state_0.pt", flip_byte),
    "trainer state": ("trainer_state.json", lambda p: p.write_text(p.read_text().replace('"step": 3', '"step": 2'))),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_resume_auto_skips_a_damaged_checkpoint_and_resumes_exactly(tmp_path, runs, fault, capsys):
    stopped, straight = runs
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    name, damage = FAULTS[fault]
    damage(out / "checkpoint-3" / name)
    assert verify_checkpoint(out / "checkpoint-3").startswith(name)
    capsys.readouterr()
    train(out, 4, resume="auto")
    err = capsys.readouterr().err
    assert f"lmrl: warning: checkpoint-3 does not verify: {name} " in err
    assert "left in place, resuming from checkpoint-2" in err
    assert (out / "checkpoint-3.unverified").is_dir()  # kept aside when the resumed run wrote a new checkpoint-3
    assert [s for s, _ in checkpoints(out)] == [1, 2, 3, 4]
    same_metrics(metric_rows(straight), metric_rows(out))


def test_an_explicit_checkpoint_that_does_not_verify_is_refused_in_one_line(tmp_path, runs):
    stopped, _ = runs
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    truncate(out / "checkpoint-2" / "model.safetensors")
    with pytest.raises(RunError, match=rf"^train.resume: {out / 'checkpoint-2'} does not verify: model.safetensors is "
                                       r"\d+ bytes, COMPLETE says \d+ \(cut short or overwritten\); nothing was loaded$"):
        train(out, 4, resume=str(out / "checkpoint-2"))


def test_when_no_checkpoint_verifies_one_line_says_so_and_keeps_them(tmp_path, runs):
    stopped, _ = runs
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    for step in (1, 2, 3):
        flip_byte(out / f"checkpoint-{step}" / "rng_state_0.pt")
    with pytest.raises(RunError, match=r"^train.resume=auto: no checkpoint in .* verifies \(checkpoint-3: "
                                       r"rng_state_0.pt has CRC-32 .*; every one is left in place$"):
        train(out, 4, resume="auto")
    assert [s for s, _ in checkpoints(out)] == [1, 2, 3]


def test_complete_lists_every_file_and_an_older_marker_without_a_list_still_verifies(tmp_path, runs):
    stopped, _ = runs
    marker = json.loads((stopped / "checkpoint-3" / COMPLETE).read_text())
    on_disk = {p.relative_to(stopped / "checkpoint-3").as_posix() for p in (stopped / "checkpoint-3").rglob("*")
               if p.is_file() and p.name != COMPLETE}
    assert set(marker["files"]) == on_disk
    assert all(f["size"] == (stopped / "checkpoint-3" / n).stat().st_size for n, f in marker["files"].items())
    old = tmp_path / "checkpoint-3"
    shutil.copytree(stopped / "checkpoint-3", old)
    (old / COMPLETE).write_text(json.dumps({"name": "checkpoint-3", "time": marker["time"]}))
    assert verify_checkpoint(old) is None
    (old / COMPLETE).write_text("{not json")
    assert verify_checkpoint(old).startswith("COMPLETE cannot be read")


# ------------------------------------------------------------------------------ storage errors while saving
@contextlib.contextmanager
def small_disk(path: Path, mb: int):
    """A real filesystem of `mb` MB at `path` (tmpfs; needs root), or None where this machine does not allow it."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(path)],
                             capture_output=True).returncode == 0
    try:
        yield path if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=True)


def test_a_full_disk_at_the_second_checkpoint_is_one_line_and_the_first_resumes_elsewhere(tmp_path, runs):
    with small_disk(tmp_path / "disk", 14) as disk:  # the first checkpoint (about 9 MB) fits, the second does not
        if disk is None:
            pytest.skip("no tmpfs here (not root): test_a_file_size_limit_... makes the same fault with a limit")
        out = disk / "run"
        with pytest.raises(RunError) as raised:
            train(out, 3)
        line = str(raised.value)
        assert raised.value.exit_code == 1 and "\n" not in line
        assert line == (f"cannot write checkpoint-2 in {out}: No space left on device (ENOSPC); the partial checkpoint-2 "
                        f"was removed (last good checkpoint: {out / 'checkpoint-1'})")
        assert [s for s, _ in checkpoints(out)] == [1] and verify_checkpoint(out / "checkpoint-1") is None
        assert not list(out.glob(".tmp-*"))
        elsewhere = tmp_path / "elsewhere"
        shutil.copytree(out, elsewhere)
    train(elsewhere, 4, resume="auto")
    _, straight = runs
    same_metrics(metric_rows(straight), metric_rows(elsewhere))


def test_a_final_save_the_disk_cannot_take_leaves_the_last_checkpoint_as_the_result(tmp_path):
    with small_disk(tmp_path / "disk", 10) as disk:  # checkpoint-1 (about 9 MB) fits, final/ beside it does not
        if disk is None:
            pytest.skip("no tmpfs here (not root)")
        out = disk / "run"
        with pytest.raises(RunError) as raised:
            train(out, 1)
        assert str(raised.value) == (f"cannot write final in {out}: No space left on device (ENOSPC); the partial final "
                                     f"was removed (the run's result is its last checkpoint, {out / 'checkpoint-1'})")
        assert raised.value.exit_code == 1 and not (out / "final").exists()
        assert verify_checkpoint(out / "checkpoint-1") is None


# a 2 MiB file-size limit, set in the process before lmrl runs (as preexec_fn would), and `lmrl ARGS...` under it
LIMIT = """
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
"""
LIMITED_LMRL = LIMIT + "import sys\nfrom lmrl.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def test_a_file_size_limit_is_one_line_naming_the_directory_and_the_cause(tmp_path):
    """The same fault without root: a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes the first checkpoint's
    write fail with EFBIG, as a quota does. The run is a process forked from one that has imported lmrl."""
    out = tmp_path / "run"
    args = ["train", f"train.output_dir={out}", "train.steps=1", "train.save_every=1", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "data.num_eval_prompts=4", "train.eval_every=0", "log.console=false"]
    done = forked("main", [LIMITED_LMRL, "lmrl", *args], ROOT, 300, "lmrl " + " ".join(args),
                  {**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # CPU ranks, also on a one-GPU machine
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == (f"lmrl: error: cannot write checkpoint-1 in {out}: File too large (EFBIG); the partial checkpoint-1 "
                    "was removed (there is no earlier checkpoint)"), done.stderr
    assert "Traceback" not in done.stderr and not checkpoints(out) and not list(out.glob(".tmp-*"))


def test_the_storage_cause_is_found_inside_torch_distributed_checkpoints_wrapper(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        try:
            raise OSError(errno.EROFS, "Read-only file system")
        except OSError as inner:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from inner
    except RuntimeError as e:
        wrapped = CheckpointException("CheckpointException ranks:dict_keys([0])", {0: (e, None)})
    assert storage_cause(wrapped, tmp_path, 0) == "Read-only file system (EROFS)"
    assert storage_cause(RuntimeError("unexpected pos 704 vs 598"), tmp_path, 1 << 60).startswith("no space left on device")
    assert storage_cause(ValueError("a bug"), tmp_path, 0) is None  # not the storage's doing: the traceback stays


def test_under_torchrun_every_rank_stops_with_the_storage_line(tmp_path):
    out = tmp_path / "run"
    done = torchrun("train", f"train.output_dir={out}", "train.steps=1", "train.save_every=1",
                    "rollout.prompts_per_step=4", "rollout.group_size=4", "data.num_eval_prompts=4", "train.eval_every=0",
                    "log.console=false", cwd=ROOT, before=LIMIT,  # the launcher's limit: every rank's files 2 MiB at most
                    env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # CPU ranks, also on a one-GPU machine
    assert done.returncode == 1, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("lmrl: error: ")]
    assert sorted(lines) == [f"lmrl: error: rank {r}: cannot write checkpoint-1 in {out}: File too large (EFBIG); the "
                             "partial checkpoint-1 was removed (there is no earlier checkpoint)" for r in (0, 1)], done.stderr
    assert not checkpoints(out) and not list(out.glob(".tmp-*"))
