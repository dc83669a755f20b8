"""Several nodes, as far as one machine shows them: two torchrun launchers started apart, as two nodes would start
them (`--nnodes 2 --nproc_per_node 1`, c10d rendezvous on 127.0.0.1), make one job of 2 ranks (gloo, CPU), and
every node must see the output directory rank 0 writes. Each launcher runs in a working directory of its own, its
"node"; what runs on a node writes there what it writes relative to its working directory. Not shown here: NCCL,
GPUs, and hosts that are really apart (docs/scaling.md)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import torch

from tests import forked

ROOT = Path(__file__).resolve().parents[1]
CPU_RANKS = {"CUDA_VISIBLE_DEVICES": ""}  # ranks on the CPU with gloo, also on a machine with a GPU
SMALL = ["train.steps=2", "rollout.prompts_per_step=8", "rollout.group_size=4", "data.num_eval_prompts=10",
         "log.console=false", "train.threads=1", "train.save_every=1", "train.parallel=fsdp",
         "reward.functions=[rec.py:record]"]
RECORD = '''
import json
import os

def record(prompts, completions, answer, **kw):
    """Exact match; writes, in this node's working directory, what torchrun told this rank."""
    names = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    with open(f"rank-{os.environ['RANK']}.json", "w") as f:
        json.dump({name: os.environ[name] for name in names}, f)
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
'''
TIMEOUT = 180  # seconds for a job, its launchers together


def _free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now (the kernel's pick): the first launcher serves the
    rendezvous on it, the second joins."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **CPU_RANKS}


def _output(log: Path) -> str:
    return "\n".join(f"--- {path.name}:\n{path.read_text()[-3000:]}" for path in sorted(log.parent.glob(f"{log.name}.*")))


def _descendants(pid: int) -> list[int]:
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:  # gone, or not Linux
        return []
    return [d for c in children for d in (c, *_descendants(c))]


def _kill_tree(pid: int) -> None:
    """SIGKILL a launcher and what it started, found first (torchrun starts each rank in a session of its own, so
    killing the launcher's process group would leave its rank running)."""
    for each in [pid, *_descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGKILL)


def _nodes(nodes: list[Path], *args: str) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each launcher of `torchrun --nnodes 2 ... -m lmrl train ARGS`, one started in
    each node's directory (torchrun's own launcher, forked: `forked.start_torchrun`). A job past TIMEOUT is killed
    (each launcher with its ranks) and fails the test with every launcher's output."""
    port = _free_port()
    rendezvous = ("--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}")
    launchers = []
    deadline = time.monotonic() + TIMEOUT
    try:
        for node in nodes:  # torchrun in a forked child, its rank forked from it (tests/forked.py)
            launchers.append(forked.start_torchrun("train", *args, cwd=node, launcher=rendezvous, env=_env(),
                                                   output=node.parent / node.name, start_new_session=True))
        for launcher in launchers:
            launcher.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the 2-node job ran past {TIMEOUT} s and was killed\n"
                             + "\n".join(_output(node.parent / node.name) for node in nodes)) from None
    finally:  # however the wait ended: no launcher, nor a rank of one, outlives the test
        for launcher in launchers:
            if launcher.poll() is None:
                _kill_tree(launcher.pid)
                launcher.wait(timeout=30)
    return [(launcher.returncode, (node.parent / f"{node.name}.stdout").read_text(),
             (node.parent / f"{node.name}.stderr").read_text()) for launcher, node in zip(launchers, nodes)]


def _make_nodes(root: Path) -> list[Path]:
    nodes = [root / "node-a", root / "node-b"]
    for node in nodes:
        node.mkdir(parents=True)
        (node / "rec.py").write_text(RECORD)  # each node has the code, as it would have on its own disk
    return nodes


def _rows(out: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock metrics."""
    timing = ("time", "eps", "reward/record/seconds", "memory/peak_")
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(timing)}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def _files(run: Path) -> list[str]:
    return sorted(path.relative_to(run).as_posix() for path in run.rglob("*"))


def test_two_launchers_make_one_job_of_two_nodes(tmp_path):
    """Two launchers on one machine, with an output directory both see at the same path: one world of 2 ranks, one
    per node (local rank 0 on both), rank 0's node alone prints and writes the run's files, each checkpoint holds
    both ranks' FSDP shards once, and the run is the one `--standalone --nproc_per_node 2` makes on one node: the
    same metrics, the same final weights, the same shard files byte for byte."""
    nodes, out = _make_nodes(tmp_path), tmp_path / "shared" / "out"
    ran = _nodes(nodes, *SMALL, f"train.output_dir={out}")
    said = "\n".join(f"--- node {node.name} (exit {code}):\n{stdout[-2000:]}\n{stderr[-3000:]}"
                     for node, (code, stdout, stderr) in zip(nodes, ran))
    assert [code for code, _, _ in ran] == [0, 0], said

    # one rank on each node, as torchrun placed them: ranks 0 and 1 of 2, each its node's local rank 0
    seen = {node.name: [json.loads(p.read_text()) for p in node.glob("rank-*.json")] for node in nodes}
    assert all(len(records) == 1 for records in seen.values()), seen
    ranks = sorted((records[0] for records in seen.values()), key=lambda r: r["RANK"])
    assert ranks == [{"RANK": str(r), "LOCAL_RANK": "0", "GROUP_RANK": str(r), "WORLD_SIZE": "2",
                      "LOCAL_WORLD_SIZE": "1"} for r in (0, 1)], seen
    first = next(i for i, node in enumerate(nodes) if seen[node.name][0]["RANK"] == "0")  # which is torchrun's to say
    (_, main_out, main_err), (_, other_out, other_err) = ran[first], ran[1 - first]
    assert main_out.count("resolved config:") == 1 and main_out.count(f"model saved to {out}/final") == 1, said
    assert "2 ranks, train.parallel=fsdp (as set)" in main_out.splitlines(), said
    assert other_out == "", said  # rank 1's node prints nothing of the run's
    assert "lmrl: " not in main_err + other_err, said
    for node in nodes:  # and writes nothing where it runs but what the reward function recorded
        assert sorted(p.name for p in node.iterdir() if p.name != "__pycache__") == sorted(
            ["rec.py", *(p.name for p in node.glob("rank-*.json"))]), node.name

    # the run's files, once: one metrics row per step, one final model, each checkpoint with both ranks' parts
    assert [r["step"] for r in _rows(out)] == [0, 1, 2]
    for step in (1, 2):
        saved = out / f"checkpoint-{step}"
        assert sorted(p.name for p in (saved / "state").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        assert (saved / "rng_state_0.pt").is_file() and (saved / "rng_state_1.pt").is_file()
        assert json.loads((saved / "trainer_state.json").read_text())["world_size"] == 2
    assert not list(out.glob(".tmp-*"))  # no half-written checkpoint, no leftover of the ranks' check

    # the same job on one node: 2 processes of one launcher
    one = tmp_path / "one-node"
    one.mkdir()
    (one / "rec.py").write_text(RECORD)
    proc = forked.torchrun("train", *SMALL, "train.output_dir=out", cwd=one, env=_env(), timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _rows(out) == _rows(one / "out")
    assert _files(out) == _files(one / "out")  # the same files (each checkpoint's too), none twice
    from safetensors.torch import load_file

    two_nodes, one_node = load_file(out / "final" / "model.safetensors"), load_file(one / "out" / "final" / "model.safetensors")
    assert two_nodes.keys() == one_node.keys() and all(torch.equal(two_nodes[k], one_node[k]) for k in one_node)
    for shard in ("__0_0.distcp", "__1_0.distcp"):  # each rank's shard of the weights and AdamW moments
        assert (out / "checkpoint-2" / "state" / shard).read_bytes() == (one / "out" / "checkpoint-2" / "state" / shard).read_bytes()


def test_an_output_directory_the_nodes_do_not_share_is_refused_before_a_step(tmp_path):
    """A relative train.output_dir under each node's own working directory is two directories, as a node-local disk
    would be. Before this check rank 1 wrote its checkpoint parts into its own `out/`, and rank 0 sealed checkpoints
    without them (COMPLETE, and no resume could load them). Now every rank stops before the first step, with rank
    0's one line."""
    nodes = _make_nodes(tmp_path)
    ran = _nodes(nodes, *SMALL, "train.output_dir=out")
    said = "\n".join(f"--- node {node.name} (exit {code}):\n{stdout[-2000:]}\n{stderr[-3000:]}"
                     for node, (code, stdout, stderr) in zip(nodes, ran))
    assert all(code != 0 for code, _, _ in ran), said
    lines = [line for _, _, stderr in ran for line in stderr.splitlines() if line.startswith("lmrl: ")]
    assert lines == ["lmrl: error: rank 0: train.output_dir: rank 1 does not see out as rank 0 does (a disk of one "
                     "node, or a relative path under another working directory): every rank writes its part of each "
                     "checkpoint there, so it must be one directory that every node mounts at the same path"], said
    first = [i for i, node in enumerate(nodes) if (node / "out" / ".lmrl.lock").is_file()]  # rank 0's node holds the lock
    assert len(first) == 1 and "lmrl: error: rank 0" in ran[first[0]][2], said
    assert sorted(p.name for p in (nodes[first[0]] / "out").iterdir()) == [".lmrl.lock"]  # nothing written
    other = nodes[1 - first[0]] / "out"
    assert not other.exists() or not any(other.iterdir())
    assert not list(tmp_path.glob("node-*/rank-*.json"))  # no step was taken


def test_one_process_shares_its_directory_and_a_check_a_kill_left_is_removed_quietly(tmp_path):
    from lmrl.checkpoint import ranks_not_sharing, remove_partial

    assert ranks_not_sharing(tmp_path) == []  # no collective, no file
    (tmp_path / ".tmp-ranks-0123abcd").touch()  # a run killed while its ranks looked for this file
    (tmp_path / ".tmp-checkpoint-3-99").mkdir()
    assert remove_partial(tmp_path) == [tmp_path / ".tmp-checkpoint-3-99"]  # (the one a warning names)
    assert not list(tmp_path.iterdir())
