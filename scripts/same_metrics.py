"""Does a change leave training exactly as it was? Runs a set of seeded `lmrl train` runs and compares their
metrics.jsonl, step by step and value by value, with another checkout's.

    python scripts/same_metrics.py run runs/before            # on the old commit (git stash / worktree)
    python scripts/same_metrics.py run runs/after             # on the new one
    python scripts/same_metrics.py compare runs/before runs/after

Timings (time/*, eps, reward/*/seconds, env/tool_seconds) are left out of the comparison; every other value must be equal,
bit for bit. Two runs at a time, about 3 minutes on 2 cores. A restructuring must print SAME for every run;
a change of numerics shows where the runs part, at which step and in which metric.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SHIPPED = Path(__file__).resolve().parents[1] / "lmrl" / "assets" / "tiny-addition"
# name -> overrides: the default loop with checkpoints, each family of algorithm, and the paths that differ
RUNS = {
    "grpo": ["train.steps=200", "train.save_every=100"],
    "ppo": ["algorithm=ppo", "train.steps=100"],  # the value head on the policy
    "ppo_critic": ["algorithm=ppo", f"model.critic_name_or_path={SHIPPED}", "train.steps=40"],
    "dapo": ["algorithm=dapo", "train.steps=60"],  # dynamic sampling
    "remax": ["algorithm=remax", "train.steps=40"],  # greedy baselines
    "calc": ["model=tiny-calculator", "train.steps=40"],  # multi-turn episodes with a tool
    "minib": ["algorithm.num_minibatches=2", "algorithm.num_iterations=2", "algorithm.kl_coef=0.02", "train.steps=40"],
    "bf16": ["rollout.dtype=bfloat16", "train.steps=20"],  # a sampler copy and its importance weights
    "rloo": ["algorithm=rloo", "reward.normalize=true", "train.steps=40"],
    "gspo": ["algorithm=gspo", "algorithm.entropy_coef=0.001", "train.steps=40"],
}


def _timing(key: str) -> bool:
    return key.startswith("time") or key.endswith("seconds") or key == "eps"


def run(out: Path, names: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)

    def one(name: str) -> int:
        cmd = [sys.executable, "-m", "lmrl.cli", "train", f"train.output_dir={out / name}", "train.max_minutes=30",
               "log.console=false", "train.overwrite=true", *RUNS[name]]
        with (out / f"{name}.log").open("w") as log:
            code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
        print(f"{name}: exit {code}", flush=True)
        return code

    with ThreadPoolExecutor(2) as pool:
        return max(pool.map(one, names))


def compare(a: Path, b: Path) -> int:
    bad = 0
    for name in RUNS:
        fa, fb = a / name / "metrics.jsonl", b / name / "metrics.jsonl"
        if not (fa.is_file() and fb.is_file()):
            print(f"{name}: missing ({fa if not fa.is_file() else fb})")
            bad += 1
            continue
        ra, rb = ([json.loads(line) for line in f.read_text().splitlines()] for f in (fa, fb))
        diffs = [f"{len(ra)} rows vs {len(rb)}"] if len(ra) != len(rb) else []
        for x, y in zip(ra, rb):
            kx, ky = ({k for k in r if not _timing(k)} for r in (x, y))
            if kx != ky:
                diffs.append(f"step {x['step']}: metrics {sorted(kx ^ ky)} in one run only")
            diffs += [f"step {x['step']} {k}: {x[k]} vs {y[k]}" for k in sorted(kx & ky)
                      if x[k] != y[k] and not (isinstance(x[k], float) and isinstance(y[k], float)
                                                and math.isnan(x[k]) and math.isnan(y[k]))]
        print(f"{name}: " + ("SAME" if not diffs else f"DIFFERENT ({len(diffs)}): " + "; ".join(diffs[:3])))
        bad += bool(diffs)
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the set into DIR")
    r.add_argument("dir", type=Path)
    r.add_argument("--names", nargs="+", choices=list(RUNS), default=list(RUNS))
    c = sub.add_parser("compare", help="compare two directories the run command wrote")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = p.parse_args()
    return run(args.dir, args.names) if args.cmd == "run" else compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
