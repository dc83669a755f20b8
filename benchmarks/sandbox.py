"""What running model-written code in the sandbox costs: the latency of one small program, and programs per
second with several at once.

    python benchmarks/sandbox.py                 # 40 programs, one at a time, then 2 and 4 at once

Each program is `print(sum(range(1000)))`: the time is the sandbox's own (a fresh interpreter, namespaces,
mounts, rlimits), not the program's.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from lmrl.sandbox import Sandbox, SandboxLimits

PROGRAM = "print(sum(range(1000)))"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=40)
    args = parser.parse_args()
    sandbox = Sandbox(SandboxLimits(max_parallel=1))
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; isolated={sandbox.isolated} "
          f"(python {sandbox.python}); load average {os.getloadavg()[0]:.1f}")
    times = []
    for _ in range(args.programs):
        t0 = time.perf_counter()
        assert sandbox.run(PROGRAM).stdout == "499500\n"
        times.append(time.perf_counter() - t0)
    print(f"one at a time: median {1000 * statistics.median(times):.0f} ms per program, "
          f"p90 {1000 * sorted(times)[int(0.9 * len(times))]:.0f} ms")
    for parallel in (2, 4):
        pool = Sandbox(SandboxLimits(max_parallel=parallel))
        t0 = time.perf_counter()
        results = pool.run_many([PROGRAM] * args.programs)
        seconds = time.perf_counter() - t0
        assert all(r.ok for r in results)
        print(f"{parallel} at once: {args.programs / seconds:.1f} programs/s")


if __name__ == "__main__":
    main()
