"""Peak memory and time of chunked token log-probs vs the naive full log-softmax (CPU).

    python benchmarks/logprobs.py                       # V = 32000 and 152064, float32 and bfloat16, B x T = 8 x 1024
    python benchmarks/logprobs.py --quick               # small sizes, a few seconds
    python benchmarks/logprobs.py --vocab 32000 --dtype bfloat16 --chunk-size 64 256 1024   # tune the chunk size
    python benchmarks/logprobs.py --record              # the table in docs/performance.md (benchmarks/results/logprobs.MACHINE.json)
    python benchmarks/logprobs.py --vocab 32000 --from-hidden 1024 --record   # its hidden-states table (logprobs-from-hidden)

Methods:
    naive    torch.log_softmax(logits.float() / temperature, -1).gather(-1, tokens)   (plain autograd)
    chunked  lmrl.algorithms.token_logprobs(logits, tokens, temperature, chunk_size)  (custom backward)

With --from-hidden H the inputs are the last hidden states [B, T, H] and an LM head [V, H] instead of
logits: naive computes F.linear(hidden, head) and then the above; chunked is
lmrl.algorithms.hidden_logprobs, which never builds the [B, T, V] logits nor their gradient.

Modes: `fwd` (no grad) and `fwd+bwd` (logits require grad; loss = Σ w·logp; backward).

Memory: every case runs alone in a fresh (forked) process, one after the other. "work" is the process's
peak resident set size (getrusage ru_maxrss) minus its resident size right after the inputs were
built: the memory the computation needs beyond its inputs, including the [B, T, V] gradient of the
logits in fwd+bwd mode (which every method must produce). "peak" is the whole process's peak RSS.
A case whose estimated need exceeds the memory available now is skipped, not run.
Time: best of --repeats runs (the first one included; CPU timings are noisy on a shared machine).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Case:
    method: str  # "naive" | "chunked"
    mode: str  # "fwd" | "fwd+bwd"
    vocab: int
    dtype: str
    batch: int
    length: int
    chunk_size: int
    temperature: float
    repeats: int
    threads: int
    hidden: int = 0  # > 0: inputs are hidden states [B, T, hidden] and an LM head [V, hidden]


@dataclass
class Result:
    seconds: float
    work_mb: float
    peak_mb: float
    base_mb: float


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run_case(case: Case) -> Result:
    """Runs in the worker subprocess."""
    import torch

    from lmrl.algorithms.logprobs import hidden_logprobs, token_logprobs

    torch.set_num_threads(case.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, case.dtype)
    # normal_ in place: building the inputs never holds a second copy, so the RSS peak so far
    # equals the RSS now and the measured peak belongs to the computation.
    tokens = torch.randint(0, case.vocab, (case.batch, case.length))
    weights = torch.randn(case.batch, case.length)
    backward = case.mode == "fwd+bwd"
    if case.hidden:
        hidden = torch.empty(case.batch, case.length, case.hidden, dtype=dtype).normal_()
        head = torch.empty(case.vocab, case.hidden, dtype=dtype).normal_(std=case.hidden**-0.5)
        leaves = [hidden.requires_grad_(backward), head.requires_grad_(backward)]
    else:
        logits = torch.empty(case.batch, case.length, case.vocab, dtype=dtype).normal_(std=2.0)
        leaves = [logits.requires_grad_(backward)]

    def naive() -> torch.Tensor:
        z = (torch.nn.functional.linear(hidden, head) if case.hidden else logits).float()
        if case.temperature != 1.0:
            z = z / case.temperature
        return torch.log_softmax(z, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    def chunked() -> torch.Tensor:
        if case.hidden:
            return hidden_logprobs(hidden, head, tokens, case.temperature, case.chunk_size)
        return token_logprobs(logits, tokens, case.temperature, case.chunk_size)

    fn = naive if case.method == "naive" else chunked
    gc.collect()
    base = _rss_mb()
    times = []
    for _ in range(case.repeats):
        for leaf in leaves:
            leaf.grad = None
        start = time.perf_counter()
        if backward:
            (fn() * weights).sum().backward()
        else:
            with torch.no_grad():
                fn()
        times.append(time.perf_counter() - start)
    peak = _maxrss_mb()
    return Result(seconds=min(times), work_mb=peak - base, peak_mb=peak, base_mb=base)


def estimate_gb(case: Case) -> float:
    """A rough upper bound of the memory a case needs (GB), to skip what cannot fit."""
    n = case.batch * case.length * case.vocab
    s = DTYPE_BYTES[case.dtype]
    upcast = 4 if s != 4 else 0
    if case.hidden and case.method != "naive":
        return (2 * (case.batch * case.length + case.vocab) * case.hidden * (s + 4)) / 1e9 + 0.6
    if case.method == "naive":
        extra = 4 + upcast if case.mode == "fwd" else 12 + upcast + s
        if case.hidden:
            extra += s  # the logits themselves are part of the computation
    else:
        extra = 0 if case.mode == "fwd" else s
        extra_chunk = 3 * 4 * case.chunk_size * case.vocab
        return (n * (s + extra) + extra_chunk) / 1e9 + 0.6
    return n * (s + extra) / 1e9 + 0.6


def available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("inf")


def spawn(case: Case) -> Result | str:
    """Runs `case` in a forked child process and returns its result (or why there is none).

    The parent has imported torch but never computed with it, so forking is safe (no OpenMP pool
    yet) and each child starts in well under a second with a fresh peak-RSS counter.
    """
    need, have = estimate_gb(case), available_gb()
    if need > 0.85 * have:
        return f"skipped: needs ~{need:.0f} GB, {have:.0f} GB available"
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_fd)
        code = 0
        try:
            payload = json.dumps(asdict(run_case(case)))
        except BaseException as e:  # report any failure to the parent instead of a traceback
            payload, code = json.dumps({"error": f"{type(e).__name__}: {e}"}), 1
        with os.fdopen(write_fd, "w") as f:
            f.write(payload)
        os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        payload = f.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)} (out of memory?)"
    data = json.loads(payload)
    return f"failed: {data['error']}" if "error" in data else Result(**data)


def _fmt(r: Result | str | None, field: str, unit: str) -> str:
    if not isinstance(r, Result):
        return "-"
    value = getattr(r, field)
    return f"{value:.3f} {unit}" if unit == "s" else f"{value:.0f} {unit}"


def _ratio(a: Result | str | None, b: Result | str | None, field: str) -> str:
    if not (isinstance(a, Result) and isinstance(b, Result)) or getattr(b, field) <= 0:
        return "-"
    return f"{getattr(a, field) / getattr(b, field):.2f}"


def table_rows(measured: list[tuple], from_hidden: bool) -> tuple[list[dict], list[str]]:
    """The result file's rows from `(vocab, dtype, mode, chunk, naive, chunked)` cases (a Result each, or why
    there is none), and the cases left out, where either method did not run."""
    other = "fused" if from_hidden else "chunked"
    rows, left_out = [], []
    for vocab, dtype, mode, chunk, naive, chunked in measured:
        if not (isinstance(naive, Result) and isinstance(chunked, Result)):
            why = "; ".join(f"{name} {r}" for name, r in (("naive", naive), (other, chunked)) if isinstance(r, str))
            left_out.append(f"V = {vocab} {dtype} {mode} ({why})")
            continue
        rows.append({"v": vocab, "dtype" if from_hidden else "logits": dtype, "mode": mode, "chunk": chunk,
                     f"time_{other}_naive": round(chunked.seconds, 4), "naive_s": round(naive.seconds, 4),
                     "time_ratio": round(chunked.seconds / naive.seconds, 4),
                     "work_naive": round(naive.work_mb, 1), f"work_{other}": round(chunked.work_mb, 1),
                     "ratio": round(chunked.work_mb / naive.work_mb, 4) if naive.work_mb > 0 else None})
    return rows, left_out


def record_table(name: str, measured: list[tuple], args, threads: int) -> None:
    from recording import Column, record

    other, dtype = ("fused", "dtype") if args.from_hidden else ("chunked", "logits")
    rows, left_out = table_rows(measured, bool(args.from_hidden))
    columns = [Column("v", "V"), Column(dtype, dtype), Column("mode", "mode"),
               *([Column("chunk", "chunk")] if len(args.chunk_size) > 1 else []),
               Column(f"time_{other}_naive", f"time {other} / naive", "{:.2f} s / {naive_s:.2f} s = {time_ratio:.2f}"),
               Column("work_naive", "work naive", "{:.0f} MB"), Column(f"work_{other}", f"work {other}", "{:.0f} MB"),
               Column("ratio", "ratio", "{:.2f}")]
    shape = f"B x T = {args.batch} x {args.length}, {threads} threads, best of {args.repeats}, each case alone in a fresh process"
    if args.from_hidden:
        note = f"Naive: `F.linear` then the full log-softmax; H = {args.from_hidden}, {shape}."
    else:
        note = (f"{shape}; \"work\" is the memory a computation needs beyond its inputs, including the `[B, T, V]` "
                "gradient of the logits in fwd+bwd, which every method must produce.")
    if left_out:
        note += f" Not in the table: {', '.join(left_out)}."
    record(name, columns, rows, note=note)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 152064])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPE_BYTES))
    p.add_argument("--mode", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--chunk-size", type=int, nargs="+", default=None, help="default: DEFAULT_CHUNK_SIZE")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    p.add_argument("--from-hidden", type=int, default=0, metavar="H",
                   help="start from hidden states of width H and an LM head (hidden_logprobs) instead of logits")
    p.add_argument("--quick", action="store_true", help="B x T = 2 x 128, V = 4096: a smoke run")
    p.add_argument("--record", nargs="?", const="", metavar="NAME",
                   help="write the table to benchmarks/results/NAME.MACHINE.json (default NAME: logprobs, or "
                        "logprobs-from-hidden with --from-hidden)")
    args = p.parse_args(argv)

    # Import (but do not run) torch and lmrl before forking the per-case children.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (recording)
    import torch  # noqa: F401

    from lmrl.algorithms.logprobs import DEFAULT_CHUNK_SIZE

    if args.chunk_size is None:
        args.chunk_size = [DEFAULT_CHUNK_SIZE]
    if args.quick:
        args.vocab, args.batch, args.length, args.chunk_size = [4096], 2, 128, [64]
    threads = args.threads or os.cpu_count() or 1

    inputs = f"hidden states (H = {args.from_hidden}) and an LM head" if args.from_hidden else "logits"
    print(f"inputs: {inputs}; B x T = {args.batch} x {args.length}, temperature {args.temperature}, "
          f"{threads} threads, best of {args.repeats}")
    print("work = peak RSS - RSS after inputs were built (what the computation needs beyond its inputs,")
    print("       incl. the logits gradient in fwd+bwd); peak = process peak RSS; ratio = chunked / naive\n")
    header = "| V | dtype | mode | chunk | naive time | chunked time | time ratio | naive work | chunked work | work ratio | naive peak | chunked peak |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    measured = []
    for vocab in args.vocab:
        for dtype in args.dtype:
            for mode in args.mode:
                base = dict(mode=mode, vocab=vocab, dtype=dtype, batch=args.batch, length=args.length,
                            temperature=args.temperature, repeats=args.repeats, threads=threads,
                            hidden=args.from_hidden)
                naive = spawn(Case(method="naive", chunk_size=0, **base))
                for chunk in args.chunk_size:
                    chunked = spawn(Case(method="chunked", chunk_size=chunk, **base))
                    print(f"| {vocab} | {dtype} | {mode} | {chunk} | {_fmt(naive, 'seconds', 's')} | "
                          f"{_fmt(chunked, 'seconds', 's')} | {_ratio(chunked, naive, 'seconds')} | "
                          f"{_fmt(naive, 'work_mb', 'MB')} | {_fmt(chunked, 'work_mb', 'MB')} | "
                          f"{_ratio(chunked, naive, 'work_mb')} | {_fmt(naive, 'peak_mb', 'MB')} | "
                          f"{_fmt(chunked, 'peak_mb', 'MB')} |", flush=True)
                    for name, r in (("naive", naive), ("chunked", chunked)):
                        if isinstance(r, str):
                            print(f"|   {name}: {r}")
                    measured.append((vocab, dtype, mode, chunk, naive, chunked))
    if args.record is not None:
        record_table(args.record or ("logprobs-from-hidden" if args.from_hidden else "logprobs"), measured, args, threads)


if __name__ == "__main__":
    main()
