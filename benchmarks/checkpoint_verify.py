"""What verifying a checkpoint costs: the CRC-32 of every file that COMPLETE lists, written when a checkpoint is
sealed and checked before a resume loads one (`lmrl.checkpoint`), against plainly reading the same bytes.

    python benchmarks/checkpoint_verify.py              # 1 GB in four files, in a temporary directory
    python benchmarks/checkpoint_verify.py --gb 4 --dir /mnt/scratch

It writes --gb of random bytes in four files, then times, --repeats times each, alternating:
    read      reading every file in 16 MiB pieces (the peer: what any resume pays to load the bytes)
    verify    `verify_checkpoint`: reading them and computing CRC-32 (a fresh cache key each time)
    seal      `_seal`: what writing a checkpoint adds (CRC-32 and fsync of every file)
both from the page cache ("warm") and, where the kernel allows dropping a file's cached pages
(posix_fadvise DONTNEED after an fsync), from the disk ("cold"). Prints seconds per GB and verify / read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from lmrl import checkpoint as ckpt  # noqa: E402


def drop_cache(root: Path) -> bool:
    dropped = True
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except (OSError, AttributeError):
                dropped = False
            finally:
                os.close(fd)
    return dropped


def read_all(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(16 << 20):
                    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"command: python benchmarks/checkpoint_verify.py --gb {args.gb:g}" + (f" --dir {args.dir}" if args.dir else ""))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp) / "checkpoint-1"
        (root / "state").mkdir(parents=True)
        piece = int(args.gb * (1 << 30) / 4)
        for i in range(4):
            with open(root / "state" / f"__{i}_0.distcp", "wb") as f:
                for _ in range(0, piece, 64 << 20):
                    f.write(os.urandom(min(64 << 20, piece)))
        gb = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 1e9
        files = ckpt._seal(root)
        (root / ckpt.COMPLETE).write_text(json.dumps({"name": root.name, "files": files}))
        for where in ("warm", "cold"):
            times: dict[str, list[float]] = {"read": [], "verify": [], "seal": []}
            for _ in range(args.repeats):
                for name, work in (("read", lambda: read_all(root)),
                                   ("verify", lambda: ckpt._verify(root, json.loads((root / ckpt.COMPLETE).read_text()))),
                                   ("seal", lambda: ckpt._seal(root))):
                    if where == "cold" and not drop_cache(root):
                        print("cold: the kernel would not drop the cache here; skipped")
                        return
                    if where == "warm":
                        read_all(root)
                    start = time.perf_counter()
                    result = work()
                    times[name].append(time.perf_counter() - start)
                    assert name != "verify" or result is None, result
            per = {k: statistics.median(v) / gb for k, v in times.items()}
            print(f"{where}: {gb:.2f} GB; s/GB (median of {args.repeats}): read {per['read']:.3f}, "
                  f"verify {per['verify']:.3f}, seal {per['seal']:.3f}; verify / read = {per['verify'] / per['read']:.2f}x")


if __name__ == "__main__":
    main()
