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


def test_gpu_benchmark_runs_on_a_tiny_qwen2_here():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_vs_trl.py"), "--tiny", "--trainers", "lmrl"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert re.search(r"Qwen2 [\d.]+M parameters \(64 hidden, 2 layers\), float32, on CPU", out), out
    limit = re.search(r"a generation needs >= ([\d.e-]+) s", out)
    assert limit and float(limit.group(1)) > 0, out
    line = re.search(r"lmrl\s+samples/s\s+([\d.]+) \(1.00x lmrl\).*tokens/s, ([\d.]+)x the limit\).*decode: (\w+)", out)
    assert line and float(line.group(1)) > 0 and float(line.group(2)) >= 1 and line.group(3) == "shared_prompt", out


def test_the_bandwidth_floor_counts_weights_once_per_step_and_the_growing_cache():
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_vs_trl import decode_bytes

    # 10 parameters in bf16 over 3 steps: 60 bytes; KV: 2 rows x (2 x 1 layer x 1 head x 4 dims x 2 bytes) = 16
    # bytes per token per row, over caches of 5, 6 and 7 tokens: 2 x 16 x 18 = 576
    assert decode_bytes(10, 2, rows=2, prompt_len=5, new=3, layers=1, kv_heads=1, head_dim=4) == 60 + 576


def test_sandbox_benchmark_runs_and_reports_latency_and_rates():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sandbox.py"), "--programs", "4"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert re.search(r"one at a time: median \d+ ms per program", out), out
    assert len(re.findall(r"\d at once: [\d.]+ programs/s", out)) == 2, out


def test_preset_gains_benchmark_runs_lmrl_train_and_tabulates():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "preset_gains.py"), "--names", "grpo", "--steps", "2",
         "--seeds", "0", "1", "--parallel", "2", "--set", "data.num_eval_prompts=8"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    for seed in (0, 1):
        assert re.search(rf"\| grpo \| {seed} \| [\d.]+% -> [\d.]+% \| [+-][\d.]+ \| 2 \| [\d.]+ \|", out), out
    assert re.search(r"\| grpo \| mean of 2 \| \| [+-][\d.]+ \(min [+-][\d.]+\) \| 2 \| \|", out), out


def _async_benchmark():
    """benchmarks/async.py (`async` is a keyword: loaded from its path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("async_benchmark", ROOT / "benchmarks" / "async.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_async_benchmark_timeline_places_the_generator_as_late_as_the_trainer_allows():
    import pytest

    bench = _async_benchmark()
    rows = [{"step": 1, "time/step": 5.0, "time/elapsed": 9.0},  # warm-up: not drawn
            {"step": 2, "time/elapsed": 10.0, "time/step": 1.0, "time/wait_for_batch": 0.2, "time/experience": 0.1,
             "time/update": 0.7, "time/wait_for_weights": 0.3, "time/generate": 0.5, "eval/accuracy": 0.5},
            {"step": 3, "time/elapsed": 11.5, "time/step": 1.0, "time/wait_for_batch": 0.0, "time/experience": 0.1,
             "time/update": 0.9, "time/wait_for_weights": 0.4, "time/generate": 0.6}]
    trainer, generator = bench.timeline_bars(rows)
    # the trainer's bars end at time/elapsed; the 0.5 s after step 2 is its evaluation
    assert [(kind, step) for _, _, kind, step in trainer] == [
        ("waiting", 2), ("experience", 2), ("update", 2), ("evaluation", 2), ("waiting", 3), ("experience", 3),
        ("update", 3)]
    assert [x for x, *_ in trainer] == pytest.approx([9.0, 9.2, 9.3, 10.0, 10.5, 10.5, 10.6])
    assert [w for _, w, *_ in trainer] == pytest.approx([0.2, 0.1, 0.7, 0.5, 0.0, 0.1, 0.9])
    # back to back, batch 2 (the one the trainer waited for) ending when the trainer received it, at 9.2
    assert [(kind, step) for _, _, kind, step in generator] == [
        ("waiting", 2), ("generating", 2), ("waiting", 3), ("generating", 3)]
    assert [x for x, *_ in generator] == pytest.approx([8.4, 8.7, 9.2, 9.6])
    assert [w for _, w, *_ in generator] == pytest.approx([0.3, 0.5, 0.4, 0.6])


def test_async_benchmark_compares_accuracy_curves_at_common_times():
    import pytest

    bench = _async_benchmark()
    points = [(0.0, 0.2), (2.0, 0.4), (4.0, 0.4)]
    assert bench.interpolate(points, 1.0) == pytest.approx(0.3)
    assert bench.interpolate(points, 3.0) == pytest.approx(0.4)
    assert bench.curve_mean(points, 2.0) == pytest.approx(0.3)
    assert bench.curve_mean(points, 4.0) == pytest.approx(0.35)
