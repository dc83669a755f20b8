"""Benchmarks still run: the one that reaches into the decoder's internals (a tiny model, one turn) and the scaling one;
and the tables their --record writes (benchmarks/results/) render as the pages show them."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import forked

ROOT = Path(__file__).resolve().parents[1]


def _figures():
    """scripts/figures.py, with benchmarks/ importable as the benchmarks import recording.py."""
    for path in (ROOT / "scripts", ROOT / "benchmarks", ROOT):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    import figures

    return figures


def _bench(name: str, *args: str, env: dict[str, str] | None = None, check: bool = False,
           forked_python: bool = True) -> subprocess.CompletedProcess:
    """`python benchmarks/NAME.py ARGS...` from the checkout, as a forked child (tests/forked.py), the `python` it
    starts (`sys.executable`: `lmrl train`, torchrun's ranks, a server) forked as well unless `forked_python` is
    False; check: it must exit 0."""
    done = forked.script(ROOT / "benchmarks" / f"{name}.py", *args, cwd=ROOT, env=env, timeout=300,
                         forked_python=forked_python)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def _rendered(columns, rows) -> list[str]:
    """The table lines of a result file with these columns (recording.Column) and rows."""
    from dataclasses import asdict

    return _figures().table({"columns": [asdict(c) for c in columns], "rows": rows}).splitlines()


def test_floor_benchmark_runs_and_reports_both_ratios():
    out = _bench("floor", "--hidden", "32", "--layers", "1", "--heads", "2",
                 "--threads", "1", "--rows", "2", "--repeats", "1", check=True).stdout
    assert re.search(r"the update runs at \d+% of the mm rate", out), out
    assert re.search(r"decode .* matmuls only: [\d.]+ s; the matmuls are \d+% of decode time", out), out


def test_sync_check_benchmark_measures_both_checks_against_the_batchs_forward():
    out = _bench("sync_check", "--preset", "shipped", "--rows", "4",
                 "--prompt", "8", "--response", "8", "--repeats", "1", "--threads", "1", check=True).stdout
    assert re.search(r"the shipped model .*: the batch's forward \(4 rows\) [\d.]+ ms; synchronous check [\d.]+ ms "
                     r"\([\d.]+% of it\); probe [\d.]+ ms per side \([\d.]+% of it\)", out), out


def test_scaling_benchmark_runs_three_ways_and_reports_ratios():
    """The benchmark starts `lmrl train` as users do, twice, and a `torchrun` of two ranks: here each a forked child
    (a stand-in `python`, tests/forked.py), which saves about 4 s of imports each."""
    done = _bench("scaling", "--steps", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    ratios = re.findall(r"completions/s\s+([\d.]+)x", out)
    assert len(ratios) == 3 and ratios[0] == "1.00", out
    assert "2 ranks x 1 thread" in out


def test_scaling_memory_benchmark_compares_ddp_with_fsdp():
    """15-25 s on 2 cores, nearly all of it start-up: two `torchrun` launches of two fresh ranks each, under a
    process that measures their peak memory (the kernel's maxrss of its children: forked ranks would not be its)."""
    out = _bench("scaling", "--memory", "--steps", "1",
                 "--hidden", "64", "--layers", "2", check=True, forked_python=False).stdout
    peaks = re.findall(r"train.parallel=(\w+)\s+peak memory per rank\s+([\d.]+) GB\s+([\d.]+)x", out)
    assert [p[0] for p in peaks] == ["ddp", "fsdp"] and peaks[0][2] == "1.00", out
    assert all(float(p[1]) > 0.1 for p in peaks), out  # a real resident set, not a zero from a failed run


def test_gpu_benchmark_runs_on_a_tiny_qwen2_here():
    out = _bench("gpu_vs_trl", "--tiny", "--trainers", "lmrl",
                 "--lmrl-set", "optim.micro_batch_size=4", "train.logprob_chunk_size=null", check=True).stdout
    on = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"  # --tiny takes the GPU where there is one
    assert re.search(rf"Qwen2 [\d.]+M parameters \(64 hidden, 2 layers\), float32, on {re.escape(on)}", out), out
    limit = re.search(r"a generation needs >= ([\d.e-]+) s", out)
    assert limit and float(limit.group(1)) > 0, out
    line = re.search(r"lmrl\s+samples/s\s+([\d.]+) \(1.00x lmrl\).*tokens/s, ([\d.]+)x the limit\).*decode: (\w+)", out)
    decode = "cuda_graph" if torch.cuda.is_available() else "engine"
    assert line and float(line.group(1)) > 0 and float(line.group(2)) >= 1 and line.group(3) == decode, out
    assert re.search(r"rest [\d.]+ s \(experience [\d.]+ \+ update [\d.]+; peak per phase: generate [\d,]+ MB, experience [\d,]+ MB, update [\d,]+ MB\)", out), out  # where lmrl's rest goes
    assert "lmrl's config overrides: optim.micro_batch_size=4 train.logprob_chunk_size=null" in out
    bad = _bench("gpu_vs_trl", "--tiny", "--trainers", "lmrl",
                 "--lmrl-set", "optim.no_such=1")
    assert bad.returncode != 0 and "--lmrl-set optim.no_such=1: lmrl's config has no field optim.no_such" in bad.stderr


def test_gpu_vision_check_runs_a_tiny_qwen2_5_vl_here():
    """scripts/gpu_run.sh's vision part at a tiny size on the CPU: a Qwen2.5-VL (window attention in its tower,
    M-RoPE) through lmrl's Trainer with one image and two of different sizes, the sampler agreeing with the trainer."""
    out = _bench("gpu_vision", "--tiny", "--steps", "2", env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Qwen2.5-VL (tiny)" in out.stdout and out.stdout.count("val/sampler_kl") == 2 and "2 steps in" in out.stdout


def test_the_bandwidth_floor_counts_weights_once_per_step_and_the_growing_cache():
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_vs_trl import decode_bytes

    # 10 parameters in bf16 over 3 steps: 60 bytes; KV: 2 rows x (2 x 1 layer x 1 head x 4 dims x 2 bytes) = 16
    # bytes per token per row, over caches of 5, 6 and 7 tokens: 2 x 16 x 18 = 576
    assert decode_bytes(10, 2, rows=2, prompt_len=5, new=3, layers=1, kv_heads=1, head_dim=4) == 60 + 576


def test_sandbox_benchmark_runs_and_reports_latency_and_rates():
    out = _bench("sandbox", "--programs", "4", check=True, forked_python=False).stdout  # the sandbox's own python
    assert re.search(r"one at a time: median \d+ ms per program", out), out
    assert len(re.findall(r"\d at once: [\d.]+ programs/s", out)) == 2, out


@pytest.mark.parametrize("client, model", [("http", "shipped"), ("http-kept", "30m")])
def test_serve_concurrency_benchmark_prints_its_ratio(client, model):
    out = _bench("serve_concurrency", "--backend", "lmrl",
                 "--k", "4", "--repeats", "1", "--threads", "1", "--client", client, "--model", model,
                 "--max-tokens", "8", check=True).stdout
    assert re.search(r"one request, n=4: +[\d.]+ s", out) and re.search(r"4 concurrent requests, n=1: [\d.]+ s", out), out
    assert re.search(r"^ratio: [\d.]+x$", out, re.M), out


def test_preset_gains_benchmark_runs_lmrl_train_and_tabulates(tmp_path, monkeypatch):
    # the machine's name for the benchmark's process and for the record() below alike, whatever this host is
    monkeypatch.setenv("LMRL_MACHINE", "epyc-avx2")
    env = {**os.environ, "LMRL_RESULTS_DIR": str(tmp_path)}
    args = ["--names", "grpo", "--steps", "2", "--seeds", "0", "1", "--parallel", "2", "--set", "data.num_eval_prompts=8",
            "--record", "gains"]
    out = _bench("preset_gains", *args, env=env, check=True).stdout
    for seed in (0, 1):
        assert re.search(rf"\| grpo \| {seed} \| [\d.]+% -> [\d.]+% \| [+-][\d.]+ \| 2 \| [\d.]+ \|", out), out
    assert re.search(r"\| grpo \| mean of 2 \| \| [+-][\d.]+ \(min [+-][\d.]+\) \| 2 \| \|", out), out

    # --record: the step-matched column; a time-budget run (its table from made-up runs here) fills the others
    result = json.loads((tmp_path / "gains.epyc-avx2.json").read_text())
    assert result["command"] == "python benchmarks/preset_gains.py " + " ".join(args)
    assert [c["key"] for c in result["columns"]] == ["preset", "150_steps_gain"]
    lines = _figures().table(result).splitlines()
    assert lines[0] == "| preset | 2 steps: gain |" and re.fullmatch(r"\| `grpo` \| [+-]\d+\.\d \|", lines[2]), lines

    from recording import record

    from benchmarks.preset_gains import table

    runs = [{"name": "grpo", "seed": s, "start": 0.306, "end": e, "steps": n, "s_per_step": 75 / n}
            for s, e, n in ((0, 0.55, 806), (1, 0.632, 797))]
    runs += [{"name": "ppo", "seed": 0, "error": ["boom"]}]
    budget = argparse.Namespace(names=["grpo", "ppo"], minutes=1.25, steps=None, seeds=[0, 1], parallel=2, set=[])
    columns, rows, note = table(runs, budget)
    assert note == ("Each 75 s run is `lmrl train algorithm=NAME train.max_minutes=1.25 train.seed=S` in its own process, "
                    "2 at a time.")
    monkeypatch.setattr(sys, "argv", ["benchmarks/preset_gains.py", "--seeds", "0", "1"])
    record("gains", columns, rows, note=note, out_dir=tmp_path, merge_on="preset")
    merged = json.loads((tmp_path / "gains.epyc-avx2.json").read_text())
    assert merged["command"] == [result["command"], "python benchmarks/preset_gains.py --seeds 0 1"]
    lines = _figures().table(merged).splitlines()
    assert lines[0] == "| preset | 75 s: gain, seeds 0 / 1 (points) | mean | steps in 75 s | 2 steps: gain | s/step |"
    assert re.fullmatch(r"\| `grpo` \| \+24\.4 / \+32\.6 \| \+28\.5 \| 806 / 797 \| [+-]\d+\.\d \| 0\.09 \|", lines[2]), lines
    assert len(lines) == 3  # ppo failed: no row


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


def test_async_benchmark_records_its_three_tables_from_the_metrics():
    _figures()
    bench = _async_benchmark()

    def metrics(step_s: float, gen: float, wait: float | None = None) -> list[dict]:
        rows = [{"step": 0, "time/elapsed": 0.0, "eval/accuracy": 0.3}]
        for step in range(1, 5):
            rows.append({"step": step, "time/step": step_s, "time/generate": gen, "time/experience": 0.01,
                         "time/update": step_s - gen - 0.01 if wait is None else step_s - 0.01 - wait,
                         "time/elapsed": 1.0 + step * step_s, **({"time/wait_for_batch": wait, "time/wait_for_weights": 0.05}
                                                                   if wait is not None else {}),
                         **({"eval/accuracy": 0.3 + 0.05 * step} if step % 2 == 0 else {})})
        return rows

    runs = {"sync": metrics(0.1, 0.03), "async": metrics(0.08, 0.03, wait=0.001)}
    shipped = bench.shipped_rows(runs)
    assert [r["run"] for r in shipped] == ["`train.async_steps=0`", "`train.async_steps=1`"]
    assert shipped[1]["steps_s_vs_sync"] == 1.25 and shipped[0]["trainer_waited"] is None
    from recording import Column as C

    columns = [C("run", "run"), C("generation", "generation", "{:.3f}{beside}"),
               C("steps_s_vs_sync", "steps/s vs sync", "**{:.2f}x** ({wall_ratio:.2f}x of wall-clock, evaluations and start included)")]
    assert _rendered(columns, shipped)[2:] == [
        "| `train.async_steps=0` | 0.030 | **1.00x** (1.00x of wall-clock, evaluations and start included) |",
        "| `train.async_steps=1` | 0.030 (beside) | **1.25x** (1.06x of wall-clock, evaluations and start included) |"]

    columns, rows = bench.accuracy_table(runs)
    assert _rendered(columns, rows) == ["| seconds | 0.3 | 0.7 | 1.0 | 1.3 |", "|---|---|---|---|---|",
                                        "| sync | 32.8% | 35.5% | 38.2% | 46.0% |", "| async | 32.8% | 35.7% | 38.5% | 50.0% |"]

    results = {"sync2": {"rows": metrics(1.5, 0.5)}, "async": {"rows": metrics(1.7, 1.3, wait=0.002)},
               "trl": {"step": [2.8, 2.8], "generate": [1.1, 1.1]}, "sync1": {"rows": metrics(2.6, 0.9)}}
    rows = bench.informative_rows(results)
    columns = [C("run", "run"), C("x_the_2_core_floor", "x the 2-core floor", "{:.2f}"), C("x_sync", "x sync", "{:.2f}"),
               C("generation", "generation", "{:.3f}{beside}"), C("update", "update", "{:.3f}")]
    assert _rendered(columns, rows)[2:] == [
        "| lmrl sync, 2 threads | 1.15 | 1.00 | 0.500 | 1.000 |",
        "| lmrl `async_steps=1`, automatic 2 + 1 threads | 1.31 | 1.13 | 1.300 (beside) | 1.698 |",
        "| TRL GRPOTrainer, 2 threads | 2.15 | 1.87 | 1.100 | 1.700 |",
        "| lmrl sync, 1 thread | 2.00 | 1.73 | 0.900 | 1.700 |"]


def test_logprobs_benchmark_tabulates_the_cases_both_methods_ran():
    _figures()
    from recording import Column as C

    from benchmarks.logprobs import Result, table_rows

    def result(seconds: float, work: float) -> Result:
        return Result(seconds=seconds, work_mb=work, peak_mb=0.0, base_mb=0.0)

    measured = [(32000, "float32", "fwd", 1024, result(0.73, 1003.0), result(0.23, 37.0)),
                (152064, "float32", "fwd+bwd", 1024, "skipped: needs ~26 GB, 23 GB available", result(2.0, 80.0))]
    rows, left_out = table_rows(measured, from_hidden=False)
    assert left_out == ["V = 152064 float32 fwd+bwd (naive skipped: needs ~26 GB, 23 GB available)"]
    columns = [C("v", "V"), C("logits", "logits"), C("time_chunked_naive", "time chunked / naive",
                                                         "{:.2f} s / {naive_s:.2f} s = {time_ratio:.2f}"),
               C("work_chunked", "work chunked", "{:.0f} MB"), C("ratio", "ratio", "{:.2f}")]
    assert _rendered(columns, rows)[2:] == ["| 32000 | float32 | 0.23 s / 0.73 s = 0.32 | 37 MB | 0.04 |"]
    assert set(table_rows(measured[:1], from_hidden=True)[0][0]) >= {"dtype", "time_fused_naive", "work_fused"}


def test_vs_trl_benchmark_tabulates_means_over_seeds():
    _figures()
    from benchmarks.vs_trl import RunResult, size_label, table_columns, table_row

    def run(trainer: str, step: float, gen: float, reward: float, held_out: float, rss: float) -> RunResult:
        return RunResult(trainer, [1.0, step, step], [reward] * 3, [64.0] * 3, 3.0, 1.0, rss, 0.0, held_out,
                         {"time/generate": gen})

    seeds = [{"lmrl": run("lmrl", 0.5, 0.25, 0.08, 0.10, 760.0), "trl": run("trl", 1.2, 0.5, 0.07, 0.09, 1000.0)},
             {"lmrl": run("lmrl", 0.6, 0.3, 0.06, 0.12, 760.0), "trl": run("trl", 1.2, 0.6, 0.09, 0.11, 1000.0)}]
    assert size_label("256x4", "bf16", "eager") == "hidden 256, 4 layers, bfloat16, eager attention"
    rows = [table_row(size_label("256x4"), seeds)]
    lines = _rendered(table_columns(rows, 20), rows)
    assert lines[0] == ("| model | lmrl s/step (generate + update) | TRL s/step (generate + rest) | samples/s lmrl / TRL (per seed) "
                        "| peak RSS lmrl / TRL | training reward, last 5 steps (lmrl; TRL) | held-out after (lmrl; TRL) |")
    assert lines[2] == ("| hidden 256, 4 layers | 0.55 (0.28 + 0.28) | 1.20 (0.55 + 0.65) | **2.20x** (2.40, 2.00) | 0.76x "
                        "| 0.070 +- 0.014; 0.080 +- 0.014 | 0.110 +- 0.014; 0.100 +- 0.014 |")
    rows = [table_row(size_label("64x2"), seeds[:1])]  # one seed: no spread, no per-seed list
    assert _rendered(table_columns(rows, 4), rows)[2] == (
        "| hidden 64, 2 layers | 0.50 (0.25 + 0.25) | 1.20 (0.50 + 0.70) | **2.40x** | 0.76x | 0.080; 0.070 | 0.100; 0.090 |")


def test_decode_benchmark_labels_its_row_by_the_flags_that_differ():
    _figures()
    import benchmarks.decode_ab as decode

    defaults = {"hidden": 256, "layers": 4, "heads": 4, "threads": 2, "dtype": "float32", "all_sizes": False}
    ratios = [1.5, 1.6, 1.7, 1.8, 1.9]
    args = argparse.Namespace(**{**defaults, "hidden": 64, "layers": 2})
    assert decode.table_row(args, defaults, ratios) == {
        "model": "hidden 64, 2 layers (`--hidden 64 --layers 2`)", "speedup": 1.7, "q1": 1.6, "q3": 1.8}
    args = argparse.Namespace(**{**defaults, "dtype": "bfloat16", "all_sizes": True})
    assert decode.table_row(args, defaults, ratios)["model"] == (
        "hidden 256, 4 layers, bfloat16 sampler (`--dtype bfloat16 --all-sizes`)")
    assert decode.table_row(argparse.Namespace(**defaults), defaults, ratios)["model"] == "hidden 256, 4 layers"


def test_precision_benchmark_tabulates_the_steps_against_float32():
    _figures()
    from recording import Column as C

    from benchmarks.precision import step_rows

    rows = step_rows("256x4", {"fp32": {"step": 0.94}, "autocast": {"step": 0.97}, "bf16": {"step": 0.55}})
    columns = [C("label", ""), C("float32", "float32", "{:.2f} {unit}"), C("bfloat16", "bfloat16", "{:.2f} {unit}"),
               C("ratio", "ratio", "{:.2f}x")]
    assert _rendered(columns, rows)[2:] == [
        "| GRPO step, hidden 256 / 4 layers, `train.autocast_bf16=true` | 0.94 s | 0.97 s | 0.97x |",
        "| same, plus `rollout.dtype=bfloat16` and eager attention | 0.94 s | 0.55 s | 1.71x |"]


def test_calculator_benchmark_rows_read_as_the_agents_page_shows_them():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from calculator import table_row

    results = [{"start": 0.336, "end": 1.0, "seconds": 182.2}, {"start": 0.336, "end": 0.998, "seconds": 206.0}]
    assert table_row("calculator", [0, 1], results) == {
        "task": "`calculator` (with the tool)", "seeds": "0, 1",
        "accuracy": "33.6% -> 100.0%, 99.8% (mean +66.3 points)", "wall": "182, 206 s"}


CPUS = {  # /proc/cpuinfo's model name and flags -> the machine's name in docs/performance.md#machines
    "xeon-amx": ("Intel(R) Xeon(R) Platinum 8480+", {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}),
    "avx512bf16": ("AMD EPYC", {"avx2", "avx512f", "avx512_bf16"}),
    "epyc-avx2": ("AMD EPYC 7B13", {"avx2", "fma"}),
    "unknown": ("Intel(R) Core(TM) i7-4770", {"avx2"}),
}


@pytest.mark.parametrize("machine", list(CPUS))
def test_a_record_names_the_machine_from_its_cpu_or_from_lmrl_machine(tmp_path, monkeypatch, machine):
    """The machine in a result file's name comes from the CPU's features, and LMRL_MACHINE overrides them: the same
    in a benchmark's process and in this one, whatever CPU runs the suite."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import recording

    monkeypatch.delenv("LMRL_MACHINE", raising=False)
    monkeypatch.setattr(recording, "cpu_flags", lambda: CPUS[machine])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["benchmarks/preset_gains.py"])
    rows = [{"preset": "grpo", "gain": 1.0}]
    columns = [recording.Column("preset"), recording.Column("gain")]
    assert recording.record("gains", columns, rows, out_dir=tmp_path).name == f"gains.{machine}.json"
    other = next(name for name in CPUS if name not in (machine, "unknown"))
    monkeypatch.setenv("LMRL_MACHINE", other)
    assert recording.record("gains", columns, rows, out_dir=tmp_path).name == f"gains.{other}.json"


def test_train_rm_vs_trl_pairs_and_table():
    _figures()
    from benchmarks.train_rm_vs_trl import RunResult, Settings, make_pairs, ratio_row, table_columns

    pairs = make_pairs(50, seed=0)
    for p in pairs:
        a, b = map(int, p["prompt"].rstrip("=").split("+"))
        assert p["chosen"] == str(a + b) and p["rejected"] != p["chosen"] and int(p["rejected"]) >= 0
    assert make_pairs(50, seed=0) == pairs and make_pairs(50, seed=1) != pairs
    s = Settings("-", 50, 3, 32, 1e-4, 1, 0)
    runs = [{"lmrl": RunResult("lmrl", [1.0, 1.04, 1.08], [0.7], 1.5), "trl": RunResult("trl", [5.0, 5.08, 5.16], [0.7], 1.2)},
            {"lmrl": RunResult("lmrl", [1.0, 1.05, 1.10], [0.7], 1.5), "trl": RunResult("trl", [9.0, 9.08, 9.16], [0.7], 1.2)}]
    row = ratio_row("shipped", s, runs, {"loss_diff": 0.0, "grad_rel_diff": 6.7e-7})
    assert row["ratio"] == pytest.approx(0.08 / 0.045) and row["per_seed"] == "2.00, 1.60"
    lines = _rendered(table_columns(), [row])
    assert lines[2] == "| shipped | 32 | 711 | 400 | **1.78x** (2.00, 1.60) | 1.5; 1.2 | 0e+00 / 7e-07 |"


def test_vision_benchmarks_lmrl_side_trains_the_tiny_llava_from_chat_rows_with_images(tmp_path):
    """benchmarks/vision_vs_trl.py's lmrl run (TRL is in the bench extra, not here): two steps of the tiny LLaVA
    whose EOS it cannot sample, on the vision task's rows as chat messages with an image part; every completion
    runs to max_new_tokens, the equal work the comparison rests on."""
    from benchmarks import vision_vs_trl as bench

    bench.build_start_model(32, 1, 0, str(tmp_path / "init"))
    s = bench.Settings(init_dir=str(tmp_path / "init"), steps=2, seed=0, threads=1, prompts_per_step=2,
                       group_size=2, max_new_tokens=6, rows=8)
    bench.LENGTHS.clear()
    times = bench.run_lmrl(s, str(tmp_path / "out"))
    assert len(times) == 2 and all(t > 0 for t in times)
    assert len(bench.LENGTHS) == 8 and max(bench.LENGTHS) <= 6 and sum(bench.LENGTHS) > 8  # none ended at EOS early


def test_agent_learning_benchmark_rows_read_as_the_agents_page_shows_them():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from agent_learning import row

    run = {"evals": [(0, 0.336, 0.0), (10, 0.9, 20.0), (40, 1.0, 93.2)], "seconds": 93.2, "per_step": 2.33, "turns": 1.96}
    out = row("built-in", run)
    assert out.pop("gain") == pytest.approx(66.4) and out == {
        "arm": "built-in", "start": 33.6, "end": 100.0, "last_step": 40, "seconds": 93.2, "per_step": 2.33, "turns": 1.96,
        "at_builtin_time": 100.0, "step_at_builtin_time": 40, "at_quarter_time": 90.0, "step_at_quarter_time": 10,
        "trainer_cpu": 0.0, "agent_cpu": 0.0}
    # a slower arm: its accuracy by the built-in arm's 93.2 s of training is that of its last evaluation done by then
    # (step 10), and by a quarter of it (23.3 s) its step-0 one
    slower = row("agent", {**run, "evals": [(0, 0.3, 0.0), (10, 0.8, 60.0), (20, 0.95, 120.0)], "seconds": 150.0}, 93.2)
    assert (slower["at_builtin_time"], slower["step_at_builtin_time"], slower["end"]) == (80.0, 10, 95.0)
    assert (slower["at_quarter_time"], slower["step_at_quarter_time"]) == (30.0, 0)
