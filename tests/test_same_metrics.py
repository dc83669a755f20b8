"""scripts/same_metrics.py compares two sets of runs value by value, timings aside."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "same_metrics.py"


def _runs(root: Path, value: float = 0.5, seconds: float = 0.1) -> Path:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from same_metrics import RUNS
    finally:
        sys.path.pop(0)
    for name in RUNS:
        (root / name).mkdir(parents=True)
        rows = [{"step": s, "time": 1000.0 + s + seconds, "time/step": seconds, "eps": 1 / seconds,
                 "reward/exact/seconds": seconds, "reward/mean": value if (name, s) == ("dapo", 2) else 0.5}
                for s in (1, 2, 3)]
        (root / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _compare(a: Path, b: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "compare", str(a), str(b)], capture_output=True, text=True,
                          timeout=60)


def test_runs_that_differ_only_in_timings_are_the_same(tmp_path):
    out = _compare(_runs(tmp_path / "a"), _runs(tmp_path / "b", seconds=0.2))
    assert out.returncode == 0, out.stdout
    assert out.stdout.count("SAME") == out.stdout.count("\n")


def test_one_value_apart_is_named_with_its_step_and_metric(tmp_path):
    out = _compare(_runs(tmp_path / "a"), _runs(tmp_path / "b", value=0.25))
    assert out.returncode == 1
    assert "dapo: DIFFERENT (1): step 2 reward/mean: 0.5 vs 0.25" in out.stdout
    assert "grpo: SAME" in out.stdout
