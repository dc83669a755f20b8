"""Soak test: a training run with injected faults must lose no sample and end with a clean run's weights.

    python benchmarks/soak.py            # 20 steps: about 45 s on a 2-core CPU
    python benchmarks/soak.py --quick    # 10 steps: about 40 s (start-up dominates)
    python benchmarks/soak.py --steps 40 --seed 1 --keep     # keep the runs' directories and logs

Two runs of `lmrl train` (subprocesses: `python -m lmrl.cli train ...`), the same config and seed: the shipped
tiny model on the addition task, 8 prompts x 8 completions per step, a checkpoint every 2 steps, an evaluation
every 6, reward.on_error=zero, two reward functions:
    flaky    `flaky_digits` below, partial credit per digit; it raises on every 10th distinct batch it is given
             (numbered by first appearance in a ledger file, so a step redone after a kill meets the same fate).
             The fault follows the data, never the clock: the clean run fails on the same batches.
    remote   exact match, asked of an HTTP server started here (stdlib, 127.0.0.1), max_retries=3, backoff 0.05 s.
The two rewards differ on purpose: GRPO's advantages ignore a reward's scale, so with two copies of one reward,
losing either would leave the weights unchanged and the weights check blind to it.
    clean    one process; its server answers every request.
    faulted  its server drops every 5th request, alternately closing the connection unanswered and answering 503;
             once metrics.jsonl (polled) shows step N/3 (3 at least), the trainer is SIGKILLed and rerun with
             train.resume=auto; once the rerun logs step 2N/3, it gets SIGTERM (it must checkpoint and exit with
             143) and is rerun again to finish. Where a signal lands varies by a step or so (it may catch a
             checkpoint half-written); exact resume makes that irrelevant.

What it prints:
    injected       flaky: distinct batches it raised on (training steps / evaluations) and calls made (steps redone
                   after the SIGKILL call it again); dropped requests: the server's count; the signals sent.
    handled        flaky: steps whose final metrics row has reward/flaky/errors=1, in a run that went on;
                   dropped: every step has reward/remote/errors=0 and none_frac=0; SIGKILL / SIGTERM: the next
                   process resumed from the newest complete checkpoint (the rows it logged start right after it),
                   no half-written checkpoint remains, and the last process exited 0.
    samples lost   completions of the steps 1..N missing from or repeated in the final metrics.jsonl, or whose
                   `episode` is not 64 x step. Must be 0.
    equal          every metric of every step equals the clean run's (time, time/*, eps, reward/*/seconds aside),
                   and torch.equal holds for every tensor of final/model.safetensors.
Exits 1 when a sample was lost, a fault was not handled, or the metrics or weights differ from the clean run's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

from lmrl.data.tasks import exact_match_reward  # noqa: E402

PROMPTS, GROUP = 8, 8
BATCH = PROMPTS * GROUP


# ------------------------------------------------------------------------ the faults (reward side)
def flaky_digits(prompts, completions, answer, ledger, every=10, **kwargs):
    """Partial credit: the fraction of the answer's digits the completion has in place (1.0 when exact). Raises on
    every `every`-th distinct batch (prompts and completions) it is given, numbered in order of first appearance
    in a ledger file, so that a step redone after a kill is the same batch with the same fate."""
    digest = hashlib.sha256(json.dumps([prompts, completions]).encode()).hexdigest()[:16]
    numbers: dict[str, int] = {}
    for row in read_jsonl(Path(ledger)):
        numbers.setdefault(row["batch"], row["number"])
    number = numbers.get(digest, len(numbers) + 1)
    failed = number % every == 0
    line = json.dumps({"batch": digest, "number": number, "n": len(completions), "failed": failed}) + "\n"
    with open(ledger, "a") as f:  # one short write() at close: a kill leaves no half line
        f.write(line)
    if failed:
        raise RuntimeError(f"injected failure on batch {number} ({digest})")
    return [sum(x == y for x, y in zip(c.strip(), a)) / max(len(c.strip()), len(a)) for c, a in zip(completions, answer)]


class Scorer(ThreadingHTTPServer):
    """The remote scorer: exact match over HTTP; every `drop_every`-th request (0: none) is dropped."""

    def __init__(self, drop_every: int):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.drop_every, self.requests, self.drops = drop_every, 0, {"closed": 0, "503": 0}
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        s = self.server
        with s.lock:
            s.requests += 1
            drop = s.drop_every and s.requests % s.drop_every == 0
            kind = ("503", "closed")[(s.requests // s.drop_every) % 2] if drop else None
            if kind:
                s.drops[kind] += 1
        if kind == "closed":  # no status line at all: the client sees the connection close
            self.close_connection = True
            return
        if kind == "503":
            self.send_error(503, "injected drop")
            return
        out = json.dumps({"rewards": exact_match_reward(body["prompts"], body["completions"], body["answer"])})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out.encode())

    def log_message(self, *args):  # quiet
        pass


# ------------------------------------------------------------------------------- running the trainer
def read_jsonl(path: Path) -> list[dict]:
    """Complete rows only: a line being written (or cut by SIGKILL) is skipped."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


def complete_checkpoints(out: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if (p / "COMPLETE").is_file())


class Run:
    """One run (output directory) of `lmrl train`, made of one or more processes."""

    def __init__(self, work: Path, name: str, steps: int, seed: int, scorer: Scorer):
        self.out, self.ledger = work / name, work / f"{name}-flaky.jsonl"
        rewards = [{"fn": f"{Path(__file__).resolve()}:flaky_digits", "name": "flaky", "ledger": str(self.ledger)},
                   {"fn": "remote", "url": scorer.url, "max_retries": 3, "backoff": 0.05}]
        self.args = [f"train.steps={steps}", f"train.seed={seed}", "train.save_every=2", "train.eval_every=6",
                     "train.max_minutes=null", f"rollout.prompts_per_step={PROMPTS}", f"rollout.group_size={GROUP}",
                     "data.num_eval_prompts=50", "log.console=false", "reward.on_error=zero",
                     f"reward.functions={json.dumps(rewards)}", f"train.output_dir={self.out}"]
        self.starts: list[float] = []  # launch time of each process
        self.proc: subprocess.Popen | None = None

    def start(self, resume: bool = False) -> None:
        self.starts.append(time.time())
        cmd = [sys.executable, "-m", "lmrl.cli", "train", *self.args, *(["train.resume=auto"] if resume else [])]
        with open(self.log("out"), "w") as so, open(self.log("err"), "w") as se:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=so, stderr=se)

    def log(self, kind: str) -> Path:  # the current process's stdout / stderr
        return self.out.parent / f"{self.out.name}-{len(self.starts)}.{kind}"

    def rows(self) -> list[dict]:
        return read_jsonl(self.out / "metrics.jsonl")

    def wait_for_step(self, step: int) -> int:
        """Poll metrics.jsonl until this process has logged `step`; return the newest step it has logged."""
        while True:
            mine = [r["step"] for r in self.rows() if r["time"] >= self.starts[-1]]
            if mine and max(mine) >= step:
                return max(mine)
            if self.proc.poll() is not None:
                sys.exit(f"soak: the trainer exited ({self.proc.returncode}) before step {step}; see {self.log('err')}")
            time.sleep(0.01)

    def finish(self, expect: int) -> None:
        if (rc := self.proc.wait(timeout=600)) != expect:
            sys.exit(f"soak: the trainer exited with {rc}, expected {expect}:\n{self.log('err').read_text()[-2000:]}")


def span(steps: list[int]) -> str:
    return "none" if not steps else f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])


def same_metrics(a: dict, b: dict) -> bool:
    """Every metric equal, timings aside (time, time/*, eps, reward/*/seconds)."""
    keys = {k for k in a.keys() | b.keys() if not k.startswith(("time", "eps")) and not k.endswith("/seconds")}
    return all(a.get(k) == b.get(k) for k in keys)


# ----------------------------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="10 steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories and logs")
    args = parser.parse_args()
    N = 10 if args.quick else args.steps
    if N < 6:
        parser.error("--steps: at least 6")
    work = Path(tempfile.mkdtemp(prefix="lmrl-soak-"))
    print(f"soak: {N} steps x {BATCH} completions, seed {args.seed}, a checkpoint every 2 steps, in {work}")
    t0 = time.time()
    clean = Run(work, "clean", N, args.seed, Scorer(drop_every=0))
    clean.start()
    clean.finish(0)
    print(f"clean run:   1 process, no faults, {time.time() - t0:.1f} s")

    t1, scorer, notes, ckpt = time.time(), Scorer(drop_every=5), [], []  # ckpt: the checkpoint each rerun resumes
    run = Run(work, "faulted", N, args.seed, scorer)
    run.start()
    seen = run.wait_for_step(max(N // 3, 3))  # checkpoint-2 is complete by then
    run.proc.send_signal(signal.SIGKILL)
    run.finish(-signal.SIGKILL)
    ckpt.append((complete_checkpoints(run.out) or [0])[-1])
    partial = ", ".join(p.name for p in run.out.glob(".tmp-*")) or "none"
    notes.append(f"SIGKILL when it had logged step {seen}: newest complete checkpoint-{ckpt[0]}, half-written: {partial}")
    run.start(resume=True)
    seen = run.wait_for_step(2 * N // 3)
    run.proc.send_signal(signal.SIGTERM)
    run.finish(128 + signal.SIGTERM)
    ckpt.append(complete_checkpoints(run.out)[-1])
    said = "".join(f"\n        {line}" for line in run.log("err").read_text().splitlines() if "SIGTERM" in line)
    notes.append(f"SIGTERM when it had logged step {seen}: exit 143, checkpoint-{ckpt[1]}; its stderr:{said}")
    run.start(resume=True)
    run.finish(0)
    leftover = sorted(p.name for p in run.out.glob(".tmp-*"))
    notes.append(f"exit 0; half-written checkpoints left: {', '.join(leftover) or 'none'}")
    print(f"faulted run: 3 processes, {time.time() - t1:.1f} s")

    # --- what the final metrics.jsonl says
    rows = [r for r in run.rows() if r["step"] > 0]
    by_step, logged = {r["step"]: r for r in rows}, [r["step"] for r in rows]
    lost = sum(BATCH for s in range(1, N + 1) if logged.count(s) != 1 or by_step[s]["episode"] != s * BATCH)
    owner = {r["step"]: sum(r["time"] >= t for t in run.starts) for r in rows}  # the process that logged it
    kept = [sorted(s for s, o in owner.items() if o == p) for p in (1, 2, 3)]
    resumed = [bool(kept[i + 1]) and kept[i + 1][0] == ckpt[i] + 1 for i in (0, 1)]  # rows start after the checkpoint
    for p in (1, 2, 3):
        head = f"resumed from checkpoint-{ckpt[p - 2]}, " if p > 1 else ""
        print(f"  process {p}: {head}steps {span(kept[p - 1])} kept; {notes[p - 1]}")
    calls = read_jsonl(run.ledger)
    failing = {(c["batch"], c["n"]) for c in calls if c["failed"]}
    failing_train = sum(n == BATCH for _, n in failing)
    same_failures = failing == {(c["batch"], c["n"]) for c in read_jsonl(clean.ledger) if c["failed"]}
    flaky_steps = [s for s in range(1, N + 1) if by_step.get(s, {}).get("reward/flaky/errors") == 1]
    remote_ok = all(by_step.get(s, {}).get("reward/remote/errors") == 0 and by_step[s]["reward/remote/none_frac"] == 0
                    for s in range(1, N + 1))
    drops = sum(scorer.drops.values())
    clean_rows, final_rows = ({r["step"]: r for r in x.rows()} for x in (clean, run))
    metrics_equal = clean_rows.keys() == final_rows.keys() and all(same_metrics(clean_rows[s], final_rows[s]) for s in clean_rows)
    import torch
    from safetensors.torch import load_file

    a, b = (load_file(x.out / "final" / "model.safetensors") for x in (clean, run))
    weights_equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    print(f"\nsteps completed: {len(set(logged))} / {N}")
    print(f"faults injected:\n  flaky reward      {len(failing)} of {len({c['batch'] for c in calls})} distinct batches "
          f"raised (in training steps: {failing_train}, in evaluations: {len(failing) - failing_train}; "
          f"{len(calls)} calls), the same batches as in the clean run: {same_failures}")
    print(f"  dropped requests  {drops} of {scorer.requests} requests ({scorer.drops['closed']} closed unanswered, "
          f"{scorer.drops['503']} answered 503)\n  SIGKILL           1\n  SIGTERM           1")
    print(f"faults handled:\n  flaky reward      {len(flaky_steps)}: reward/flaky/errors=1 logged at steps "
          f"{', '.join(map(str, flaky_steps)) or 'none'}, and the run went on")
    print(f"  dropped requests  {drops if remote_ok else 0}: reward/remote/errors=0 and none_frac=0 at every step: {remote_ok}")
    print(f"  SIGKILL           {int(resumed[0] and not leftover)}: resumed from checkpoint-{ckpt[0]}, "
          "no half-written checkpoint left, finished")
    print(f"  SIGTERM           {int(resumed[1])}: exit 143 after checkpoint-{ckpt[1]}, resumed from it, finished")
    print(f"samples lost: {lost}")
    print(f"metrics equal to the clean run's (timings aside): {metrics_equal}")
    print(f"weights equal: {weights_equal} ({len(a)} tensors of final/model.safetensors, torch.equal)")
    print(f"total {time.time() - t0:.1f} s" + (f"; kept {work}" if args.keep else ""))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    handled = len(flaky_steps) == failing_train and same_failures and remote_ok and all(resumed) and not leftover
    return 0 if lost == 0 and handled and metrics_equal and weights_equal else 1


if __name__ == "__main__":
    sys.exit(main())
