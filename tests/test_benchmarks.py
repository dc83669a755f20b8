"""Benchmarks still run: the one that reaches into the decoder's internals (a tiny model, one turn) and the scaling one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_floor_benchmark_runs_and_reports_both_ratios():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "floor.py"), "--hidden", "32", "--layers", "1", "--heads", "2",
         "--threads", "1", "--rows", "2", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    assert re.search(r"the update runs at \d+% of the mm rate", out), out
    assert re.search(r"decode .* matmuls only: [\d.]+ s; the matmuls are \d+% of decode time", out), out


def test_scaling_benchmark_runs_three_ways_and_reports_ratios():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scaling.py"), "--steps", "2"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    ratios = re.findall(r"completions/s\s+([\d.]+)x", out)
    assert len(ratios) == 3 and ratios[0] == "1.00", out
    assert "2 ranks x 1 thread" in out


def test_scaling_memory_benchmark_compares_ddp_with_fsdp():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scaling.py"), "--memory", "--steps", "1",
                          "--hidden", "64", "--layers", "2"], capture_output=True, text=True, timeout=300, check=True).stdout
    peaks = re.findall(r"train.parallel=(\w+)\s+peak memory per rank\s+([\d.]+) GB\s+([\d.]+)x", out)
    assert [p[0] for p in peaks] == ["ddp", "fsdp"] and peaks[0][2] == "1.00", out
    assert all(float(p[1]) > 0.1 for p in peaks), out  # a real resident set, not a zero from a failed run


def test_preset_gains_benchmark_runs_lmrl_train_and_tabulates():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "preset_gains.py"), "--names", "grpo", "--steps", "2",
         "--parallel", "1", "--set", "data.num_eval_prompts=8"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    assert re.search(r"\| grpo \| [\d.]+% -> [\d.]+% \| [+-][\d.]+ \| 2 \| [\d.]+ \|", out), out
