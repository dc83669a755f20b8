"""Asynchronous rollouts (train.async_steps=1) against synchronous training on a 2-core CPU: steps per second,
held-out accuracy against wall-clock time, and how close each comes to the 2-core compute floor.

    python benchmarks/async.py                          # part A (150 steps) then part B (12 steps)
    python benchmarks/async.py --quick                  # A: 20 steps, eval every 10; B: 4 steps: a smoke run
    python benchmarks/async.py --part A --steps 300 --eval-every 50 --seed 1
    python benchmarks/async.py --part B --plot timeline.png   # B only, and the async run's timeline
    python benchmarks/async.py --plot docs/async-timeline.png --record   # the tables of docs/async.md

--record [NAME] writes the run's tables to benchmarks/results/ (default NAME: async): NAME-shipped (part A's
phases), NAME-accuracy (part A's accuracy at common times) and NAME-informative (part B), each NAME-PART.MACHINE.json;
docs/async.md shows all three from one run (--part both).

Every configuration runs in its own subprocess, one after the other (never two at once), with the same seed.

Part A, the shipped task: `lmrl train` with no model arguments (the shipped tiny model and the addition task; its
preset trains with train.threads=1), twice:
    sync       train.async_steps=0: one process, one thread; the second core idles.
    async      train.async_steps=1: the trainer (1 thread, the preset's) and a generator process (1 thread: half the
               cores) that samples and scores batch s+1 while the trainer trains on batch s.
Both with train.steps=N, train.eval_every=E, train.max_minutes=null, log.samples_every=0 (the preset's 500
held-out prompts, greedy exact match), in separate output directories of a temporary directory.
    steps/s    1 / the mean `time/step` of steps 2..N (step 1 is warm-up), and N / the last step's `time/elapsed`
               (wall seconds since the loop began: the evaluations included, and async's step 1, which waits for the
               generator process to start); async / sync for both (goal >= 1.5x). Printed beside them: the most
               that overlapping could give with sync's phase times, its time/step / max(generation, experience +
               update).
    accuracy   `eval/accuracy` of every evaluation row (step 0: the start model, then every E steps) against its
               `time/elapsed`, for both runs; each curve is interpolated linearly at common wall-clock times up to
               the shorter run's last evaluation, and compared there and by its mean over that span. The
               evaluations' own time counts in both runs' clocks. 500 prompts: one evaluation's standard error is
               about 2 points.

Part B, the informative-reward set-up: a Llama with random weights (hidden 256, 4 layers, 4 heads, tied
embeddings: 4.3M parameters) and a byte-level BPE tokenizer of 400 tokens trained here on generated text
(`benchmarks.gpu_vs_trl.bpe_tokenizer`), whose EOS lies outside the model's vocabulary: every completion is
exactly 64 new tokens. 8 prompts x 8 completions per step, the prompts of `gpu_vs_trl.prompts`, scored by
`gpu_vs_trl.hashed_reward` (a score in [0, 1) hashed from the text: no group is all equal, no row is skipped).
The settings are vs_trl.py's equal-settings list: GRPO, clip 0.2, no KL / reference model, one optimizer step per
batch (micro batch 64), per-sequence token mean, AdamW lr 1e-4 constant, weight decay 0, grad-norm clip 1.0,
temperature 1, float32. Five runs:
    lmrl sync,  2 threads    train.threads=2
    lmrl async, auto 2+1     train.async_steps=1, automatic placement (train.threads and generator_threads unset:
                             the trainer takes both cores, the generator process one)
    lmrl async, 1+1          train.async_steps=1, train.threads=1: an even split
    TRL,        2 threads    GRPOTrainer (`gpu_vs_trl.run_trl`, torch.set_num_threads(2)); skipped without TRL
    lmrl sync,  1 thread     train.threads=1: the phase times of one core
    s/step     the mean `time/step` of steps 2..N (TRL: its step time, on_step_begin to on_step_end).
    floor      (generation + update) / 2 on one thread: gen = `time/generate`, update = `time/step` - gen of the
               1-thread run; two cores kept busy with no overhead could do no better. Each run's s/step is printed
               with its ratio to the floor and to lmrl sync with 2 threads (goal: async <= 1.1 x the floor, and
               never slower than sync), and the best a 1 + 1 split can do: max(generation, update) on one thread.

--plot PATH.png draws the async run's two processes on one wall-clock axis, steps 2..12 (part A's run, or part
B's when only B runs), with Pillow, reconstructed from the logged per-step durations. The trainer's bars (waiting
for the batch `time/wait_for_batch`, `time/experience`, `time/update`) end at each step's `time/elapsed`; the gap
after a step with an evaluation is drawn as the evaluation. The generator's bars (waiting for weights
`time/wait_for_weights`, generating `time/generate`, which includes loading the weights) are its logged durations
placed back to back, shifted as late as they can go with no batch ending after the trainer received it (the
tightest batch, usually one the trainer waited for, ends exactly then). Sending a batch is not logged, so the
generator's bars may run a little early.

The machine may be shared with other processes: compare the ratios of one run, and rerun when in doubt.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' too: no bars in the runs' stderr
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from benchmarks.gpu_vs_trl import Settings, bpe_tokenizer, hashed_reward, prompts, run_trl  # noqa: E402
from benchmarks.gpu_vs_trl import _load as load_model  # noqa: E402
from benchmarks.vs_trl import END_TOKEN, SIZES  # noqa: E402

B_RUNS = {  # name: (label, train.threads, train.async_steps); "trl" is TRL's GRPOTrainer with 2 threads
    "sync2": ("lmrl sync, 2 threads", 2, 0),
    "async": ("lmrl async_steps=1, auto 2+1", None, 1),
    "async11": ("lmrl async_steps=1, 1+1", 1, 1),
    "trl": ("TRL GRPOTrainer, 2 threads", 2, 0),
    "sync1": ("lmrl sync, 1 thread", 1, 0),
}
BPE_VOCAB = 400
PAGE_LABELS = {"sync2": "lmrl sync, 2 threads", "async": "lmrl `async_steps=1`, automatic 2 + 1 threads",
               "async11": "lmrl `async_steps=1`, 1 + 1", "trl": "TRL GRPOTrainer, 2 threads", "sync1": "lmrl sync, 1 thread"}


# ------------------------------------------------------------------------------------------------ shared
def machine() -> str:
    model = "?"
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
        model = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name"))
    except (OSError, StopIteration):
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {os.cpu_count()} CPUs ({usable} usable by this process)"


def read_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def steady(rows: list[dict], key: str) -> float:
    """Mean of `key` over steps 2..N (step 1 is warm-up)."""
    values = [r[key] for r in rows if r["step"] >= 2 and r.get(key) is not None]
    return statistics.fmean(values) if values else float("nan")


def show_stderr(name: str, text: str, limit: int = 12) -> None:
    """A run's stderr lines (its warnings, the generator process's included), if it wrote any."""
    lines = [line for line in text.splitlines() if line.strip()]
    if lines:
        print(f"  {name}: stderr ({len(lines)} lines{', the last ' + str(limit) if len(lines) > limit else ''}):")
        for line in lines[-limit:]:
            print(f"    {line}")


# ------------------------------------------------------------------------------------------------ part A
def train_cli(name: str, out: Path, overrides: list[str]) -> list[dict]:
    """`lmrl train` with `overrides` in a subprocess; its metrics rows."""
    cmd = [sys.executable, "-m", "lmrl.cli", "train", *overrides, f"train.output_dir={out}", "log.console=false"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        sys.exit(f"async: {name} failed (exit {proc.returncode}): {shlex.join(cmd[1:])}\n{proc.stderr[-4000:]}")
    print(f"[A] {name}: done in {time.perf_counter() - start:.0f}s ({shlex.join(['python', *cmd[1:]])})", flush=True)
    show_stderr(name, proc.stderr)
    return read_rows(out)


def interpolate(points: list[tuple[float, float]], t: float) -> float:
    """The piecewise-linear curve through `points` (sorted by time) at time `t` within its span."""
    for (t0, y0), (t1, y1) in zip(points, points[1:]):
        if t0 <= t <= t1:
            return y0 if t1 == t0 else y0 + (y1 - y0) * (t - t0) / (t1 - t0)
    return points[-1][1]


def curve_mean(points: list[tuple[float, float]], end: float, n: int = 200) -> float:
    """The curve's mean over [0, end] (trapezoids on n intervals)."""
    ys = [interpolate(points, end * i / n) for i in range(n + 1)]
    return (sum(ys) - (ys[0] + ys[-1]) / 2) / n


def shipped_rows(runs: dict[str, list[dict]]) -> list[dict]:
    """Part A's table in the result file: each run's phases (steps 2..N) and async / sync steps per second."""
    rate = {n: 1 / steady(rows, "time/step") for n, rows in runs.items()}
    last = {n: [r for r in rows if r.get("time/step") is not None][-1] for n, rows in runs.items()}
    wall = {n: last[n]["step"] / last[n]["time/elapsed"] for n in runs}
    out = []
    for k, name in enumerate(("sync", "async")):
        rows = runs[name]
        out.append({"run": f"`train.async_steps={k}`", "s_step": round(steady(rows, "time/step"), 5),
                    "generation": round(steady(rows, "time/generate"), 5), "beside": " (beside)" if k else "",
                    "experience_update": round(steady(rows, "time/experience") + steady(rows, "time/update"), 5),
                    "trainer_waited": round(steady(rows, "time/wait_for_batch"), 5) if k else None,
                    "generator_waited": round(steady(rows, "time/wait_for_weights"), 5) if k else None,
                    "steps_s_vs_sync": round(rate[name] / rate["sync"], 4),
                    "wall_ratio": round(wall[name] / wall["sync"], 4)})
    return out


def accuracy_table(runs: dict[str, list[dict]]) -> tuple[list, list[dict]]:
    """Part A's held-out accuracy at a quarter, half, three quarters and all of the shorter run's span (its last
    evaluation), interpolated: the result file's (columns, rows)."""
    from recording import Column

    curves = {name: [(r["time/elapsed"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
              for name, rows in runs.items()}
    end = min(points[-1][0] for points in curves.values())
    times = [end * frac for frac in (0.25, 0.5, 0.75, 1.0)]
    keys = [f"{t:.1f}".replace(".", "_") for t in times]
    columns = [Column("seconds", "seconds"), *(Column(k, f"{t:.1f}", "{:.1%}") for k, t in zip(keys, times))]
    return columns, [{"seconds": name, **{k: round(interpolate(curves[name], t), 4) for k, t in zip(keys, times)}}
                     for name in ("sync", "async")]


def part_a(args, tmp: Path) -> dict[str, list[dict]]:
    common = [f"train.steps={args.steps_a}", f"train.eval_every={args.eval_every}", "train.max_minutes=null",
              "log.samples_every=0", f"train.seed={args.seed}"]
    print(f"\n== A: the shipped task (`lmrl train`, its preset: 1 thread, 32 prompts x 8, 500 held-out prompts), "
          f"{args.steps_a} steps, evaluation every {args.eval_every}, seed {args.seed}", flush=True)
    runs = {name: train_cli(name, tmp / f"A-{name}", [*common, f"train.async_steps={k}"])
            for name, k in (("sync", 0), ("async", 1))}
    rate, wall = {}, {}
    print("\nseconds (steps 2..N unless said; async: generate is the generator process's, beside the trainer)")
    print(f"{'run':<7}{'s/step':>8}{'steps/s':>9}{'N/elapsed':>11}{'step 1':>8}{'generate':>10}{'experience':>11}"
          f"{'update':>8}{'trainer wait':>14}{'gen wait':>10}{'lag':>5}")
    for name, rows in runs.items():
        steps = [r for r in rows if r.get("time/step") is not None]
        rate[name] = 1 / steady(rows, "time/step")
        wall[name] = steps[-1]["step"] / steps[-1]["time/elapsed"]
        extra = (f"{steady(rows, 'time/wait_for_batch'):>14.4f}{steady(rows, 'time/wait_for_weights'):>10.4f}"
                 f"{steady(rows, 'async/version_lag'):>5.0f}" if name == "async" else "")
        print(f"{name:<7}{steady(rows, 'time/step'):>8.4f}{rate[name]:>9.2f}{wall[name]:>11.2f}"
              f"{steps[0]['time/step']:>8.2f}{steady(rows, 'time/generate'):>10.4f}"
              f"{steady(rows, 'time/experience'):>11.4f}{steady(rows, 'time/update'):>8.4f}{extra}")
    sync = runs["sync"]
    bound = max(steady(sync, "time/generate"), steady(sync, "time/experience") + steady(sync, "time/update"))
    print(f"async / sync steps per second: {rate['async'] / rate['sync']:.2f}x from time/step, "
          f"{wall['async'] / wall['sync']:.2f}x from N / time/elapsed (goal >= 1.5x)")
    print(f"  (with sync's phase times, overlapping generation with experience + update gives at most "
          f"{steady(sync, 'time/step') / bound:.2f}x; async's step 1 includes the generator process's start-up)")

    curves = {name: [(r["time/elapsed"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
              for name, rows in runs.items()}
    evals = {name: {r["step"]: r for r in rows if r.get("eval/accuracy") is not None} for name, rows in runs.items()}
    print("\nheld-out accuracy against wall-clock (time/elapsed, s):")
    print(f"{'step':>6}{'sync s':>9}{'sync acc':>10}{'async s':>9}{'async acc':>11}")
    for step in sorted(set(evals["sync"]) | set(evals["async"])):
        cells = [(f"{e['time/elapsed']:>9.1f}{e['eval/accuracy']:>10.3f}" if (e := evals[n].get(step)) else f"{'-':>9}{'-':>10}")
                 for n in ("sync", "async")]
        print(f"{step:>6}{cells[0]}{cells[1]:>20}")
    end = min(points[-1][0] for points in curves.values())
    print(f"at common wall-clock times (interpolated), up to {end:.1f} s, the shorter run's last evaluation:")
    print(f"{'time s':>8}{'sync acc':>10}{'async acc':>11}")
    for frac in (0.25, 0.5, 0.75, 1.0):
        print(f"{end * frac:>8.1f}{interpolate(curves['sync'], end * frac):>10.3f}{interpolate(curves['async'], end * frac):>11.3f}")
    at_end = {n: interpolate(c, end) for n, c in curves.items()}
    mean = {n: curve_mean(c, end) for n, c in curves.items()}
    verdict = "yes" if at_end["async"] >= at_end["sync"] and mean["async"] >= mean["sync"] else "no"
    print(f"async's accuracy per second at least sync's: {verdict} (at {end:.1f} s: {at_end['async']:.3f} vs "
          f"{at_end['sync']:.3f}; mean over 0..{end:.1f} s: {mean['async']:.3f} vs {mean['sync']:.3f}; one "
          f"evaluation's standard error is about 0.02)")
    return runs


# ------------------------------------------------------------------------------------------------ part B
def build_llama(out_dir: str, seed: int) -> int:
    """The part B model, saved with its tokenizer to `out_dir`; returns its parameter count."""
    from transformers.utils import logging

    from lmrl.models.tiny import tiny_causal_lm

    logging.set_verbosity_error()  # the EOS outside the vocabulary is on purpose
    hidden, layers, heads = SIZES["256x4"]
    tokenizer = bpe_tokenizer(BPE_VOCAB, seed)
    model = tiny_causal_lm(tokenizer, "llama", hidden, layers, heads, seed=seed)
    tokenizer.add_special_tokens({"eos_token": END_TOKEN})  # outside the model's vocabulary: never sampled
    assert tokenizer.eos_token_id >= model.config.vocab_size
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def run_lmrl(s: Settings, threads: int | None, async_steps: int, out: str) -> dict:
    from lmrl import Config, Trainer

    model, tokenizer = load_model(s)
    batch = s.prompts_per_step * s.group_size
    cfg = Config(
        algorithm={"name": "grpo", "kl_coef": 0.0, "clip_low": 0.2, "clip_high": 0.2,
                   "aggregation": "seq-mean-token-mean"},
        rollout={"prompts_per_step": s.prompts_per_step, "group_size": s.group_size,
                 "max_new_tokens": s.max_new_tokens, "temperature": 1.0},
        optim={"lr": s.lr, "weight_decay": 0.0, "max_grad_norm": 1.0, "micro_batch_size": batch},
        model={"name_or_path": s.model_dir, "dtype": s.dtype, "device": s.device},
        data={"num_eval_prompts": 0},
        train={"steps": s.steps, "seed": s.seed, "output_dir": out, "eval_every": 0, "threads": threads,
               "async_steps": async_steps, "max_minutes": None},
        log={"console": False, "samples_every": 0})
    trainer = Trainer(cfg, model=model, tokenizer=tokenizer, reward_funcs=[hashed_reward], train_dataset=prompts(s))
    trainer.train()
    return {"rows": read_rows(Path(out))}


def child(name: str, settings: str, result: str) -> None:
    """Subprocess entry: one part B run; writes its result as JSON."""
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    s = Settings(**json.loads(settings))
    _, threads, async_steps = B_RUNS[name]
    torch.manual_seed(s.seed)
    with tempfile.TemporaryDirectory() as out:
        if name == "trl":
            torch.set_num_threads(threads)
            r = run_trl(s, out) | {"threads": torch.get_num_threads()}
        else:
            r = run_lmrl(s, threads, async_steps, out)
    Path(result).write_text(json.dumps(r))


def run_child(name: str, s: Settings) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "result.json")
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, "--settings",
                               json.dumps(asdict(s)), "--result", str(path)], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"async: part B, {B_RUNS[name][0]} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        print(f"[B] {B_RUNS[name][0]}: done in {time.perf_counter() - start:.0f}s", flush=True)
        show_stderr(B_RUNS[name][0], proc.stderr)
        return json.loads(path.read_text())


def part_b(args, tmp: Path) -> dict[str, dict]:
    """Part B's runs, printed; returns each run's result (lmrl: {"rows": its metrics rows}; TRL: its step and generate
    times)."""
    model_dir = tmp / "B-model"
    params = build_llama(str(model_dir), args.seed)
    s = Settings(str(model_dir), args.steps_b, 8, 8, 64, 1e-4, "float32", "cpu", args.seed)
    print(f"\n== B: the informative-reward set-up: a random {params / 1e6:.1f}M-parameter BPE Llama (256 hidden, 4 "
          f"layers, {BPE_VOCAB}-token BPE), {s.prompts_per_step} prompts x {s.group_size}, exactly "
          f"{s.max_new_tokens} new tokens, hashed reward, GRPO, {s.steps} steps, seed {s.seed}", flush=True)
    try:
        import trl  # noqa: F401

        names = list(B_RUNS)
    except ImportError:
        names = [n for n in B_RUNS if n != "trl"]
        print("[B] TRL GRPOTrainer: skipped (`import trl` fails: pip install 'lmrl[bench]')", flush=True)
    results = {name: run_child(name, s) for name in names}
    if "trl" in results and results["trl"]["threads"] != 2:
        print(f"[B] note: TRL ended with {results['trl']['threads']} torch threads, not 2 (something in it reset them)")

    seconds = {n: (statistics.fmean(r["step"]) if n == "trl" else phases(r["rows"])[0]) for n, r in results.items()}
    _, gen1, update1 = phases(results["sync1"]["rows"])
    floor = (gen1 + update1) / 2
    print(f"\n2-core compute floor = (generation {gen1:.3f} + update {update1:.3f}) / 2 = {floor:.3f} s/step "
          f"(the 1-thread run's phases, steps 2..{s.steps})")
    print(f"seconds, steps 2..{s.steps}; update = time/step - time/generate (async: - time/wait_for_batch, its "
          f"generate being the generator process's)")
    print(f"{'run':<28}{'s/step':>8}{'x floor':>9}{'x sync':>8}{'step 1':>8}{'generate':>10}{'update':>8}"
          f"{'trainer wait':>14}{'gen wait':>10}")
    for name, r in results.items():
        if name == "trl":
            gen = statistics.fmean(r["generate"])
            cells = f"{'-':>8}{gen:>10.3f}{seconds[name] - gen:>8.3f}"
        else:
            rows = r["rows"]
            _, gen, update = phases(rows)
            wait = steady(rows, "time/wait_for_batch")
            cells = f"{rows[0]['time/step']:>8.2f}{gen:>10.3f}"
            cells += (f"{seconds[name] - wait:>8.3f}{wait:>14.3f}{steady(rows, 'time/wait_for_weights'):>10.3f}"
                      if B_RUNS[name][2] else f"{update:>8.3f}")
        print(f"{B_RUNS[name][0]:<28}{seconds[name]:>8.3f}{seconds[name] / floor:>9.2f}"
              f"{seconds[name] / seconds['sync2']:>8.2f}{cells}")
    for name in ("async", "async11"):
        ok_floor, ok_sync = seconds[name] <= 1.1 * floor, seconds[name] <= seconds["sync2"]
        print(f"{B_RUNS[name][0]}: within 10% of the floor: {'yes' if ok_floor else 'no'} ({seconds[name] / floor:.2f}x); "
              f"never slower than sync (2 threads): {'yes' if ok_sync else 'no'} ({seconds[name] / seconds['sync2']:.2f}x)")
    print(f"  (one thread each, async can do no better than max(generation, update) of the 1-thread run = "
          f"{max(gen1, update1):.3f} s/step, {max(gen1, update1) / floor:.2f}x the floor)")
    return results


def phases(rows: list[dict]) -> tuple[float, float, float]:
    """(s/step, generate, the rest) of an lmrl run's metrics rows, steps 2..N."""
    step, gen = steady(rows, "time/step"), steady(rows, "time/generate")
    return step, gen, step - gen


def informative_rows(results: dict[str, dict]) -> list[dict]:
    """Part B's table in the result file, from its runs' results (as `part_b` prints it): s/step against the 2-core
    floor and against sync with 2 threads, and each run's generation and update."""
    _, gen1, update1 = phases(results["sync1"]["rows"])
    floor = (gen1 + update1) / 2
    out = []
    for name, r in results.items():
        if name == "trl":
            step, gen = statistics.fmean(r["step"]), statistics.fmean(r["generate"])
            update = step - gen
        else:
            step, gen, update = phases(r["rows"])
            if B_RUNS[name][2]:  # async: the trainer's step less its wait for the batch
                update = step - steady(r["rows"], "time/wait_for_batch")
        out.append({"run": PAGE_LABELS[name], "s_step": round(step, 5), "x_the_2_core_floor": round(step / floor, 4),
                    "x_sync": round(step / phases(results["sync2"]["rows"])[0], 4), "generation": round(gen, 5),
                    "beside": " (beside)" if B_RUNS[name][2] else "", "update": round(update, 5)})
    return out


def record_tables(prefix: str, runs_a: dict[str, list[dict]] | None, results_b: dict[str, dict] | None, args) -> None:
    """--record: the tables of the parts that ran, as NAME-shipped, NAME-accuracy and NAME-informative."""
    from recording import Column, record

    if runs_a is not None:
        record(f"{prefix}-shipped", [
            Column("run", "run"), Column("s_step", "s/step", "{:.3f}"), Column("generation", "generation", "{:.3f}{beside}"),
            Column("experience_update", "experience + update", "{:.3f}"), Column("trainer_waited", "trainer waited", "{:.3f}"),
            Column("generator_waited", "generator waited", "{:.3f}"),
            Column("steps_s_vs_sync", "steps/s vs sync", "**{:.2f}x** ({wall_ratio:.2f}x of wall-clock, evaluations and start included)"),
        ], shipped_rows(runs_a), note=f"{args.steps_a} steps, held-out evaluation every {args.eval_every}, seed {args.seed}; "
                                      f"seconds: means over steps 2-{args.steps_a}.")
        columns, rows = accuracy_table(runs_a)
        record(f"{prefix}-accuracy", columns, rows,
               note="Held-out accuracy at common wall-clock times (s), interpolated between evaluations.")
    if results_b is not None:
        record(f"{prefix}-informative", [
            Column("run", "run"), Column("s_step", "s/step", "{:.3f}"), Column("x_the_2_core_floor", "x the 2-core floor", "{:.2f}"),
            Column("x_sync", "x sync", "{:.2f}"), Column("generation", "generation", "{:.3f}{beside}"), Column("update", "update", "{:.3f}"),
        ], informative_rows(results_b), note=f"{args.steps_b} steps, seed {args.seed}; seconds: means over steps 2-{args.steps_b}.")
    if args.part != "both":
        print("note: docs/async.md shows the three tables of one run: record them with --part both")


# ------------------------------------------------------------------------------------------------ the plot
WAIT, COLORS = "waiting", {"waiting": (200, 200, 200), "experience": (31, 119, 180), "update": (255, 127, 14),
                           "evaluation": (197, 176, 213), "generating": (44, 160, 44)}


def timeline_bars(rows: list[dict], last: int = 12) -> tuple[list[tuple], list[tuple]]:
    """The trainer's and the generator process's bars, (start s, seconds, kind, step) each, for steps 2..last of an
    async run's metrics rows: placed as the module docstring says."""
    steps = [r for r in rows if r.get("time/step") is not None and 2 <= r["step"] <= last]
    trainer, generator, received, done, t = [], [], [], [], 0.0
    for i, r in enumerate(steps):
        end, wait, step = r["time/elapsed"], r.get("time/wait_for_batch") or 0.0, r["step"]
        start = end - r["time/step"]
        if i and steps[i - 1].get("eval/accuracy") is not None:  # the held-out evaluation after the previous step
            trainer.append((steps[i - 1]["time/elapsed"], start - steps[i - 1]["time/elapsed"], "evaluation", step - 1))
        trainer += [(start, wait, WAIT, step),
                    (end - r["time/update"] - r["time/experience"], r["time/experience"], "experience", step),
                    (end - r["time/update"], r["time/update"], "update", step)]
        received.append(start + wait)
        gw = r.get("time/wait_for_weights") or 0.0
        generator += [(t, gw, WAIT, step), (t + gw, r["time/generate"], "generating", step)]
        t += gw + r["time/generate"]
        done.append(t)
    shift = min(got - end for got, end in zip(received, done))  # as late as it can be: no batch after its receipt
    return trainer, [(x + shift, w, kind, step) for x, w, kind, step in generator]


def plot_timeline(rows: list[dict], path: str, title: str) -> None:
    """Draw `timeline_bars` to a PNG with Pillow: the trainer above, the generator process below, wall-clock seconds
    (time/elapsed) along the bottom."""
    import math

    from PIL import Image, ImageDraw, ImageFont

    trainer, generator = timeline_bars(rows)
    width, height, left, right = 1500, 330, 120, 30
    lanes = {"trainer": (trainer, 90), "generator\nprocess": (generator, 170)}  # bars, the lane's centre (pixels)
    lo = min(x for x, *_ in trainer + generator)
    hi = max(x + w for x, w, *_ in trainer + generator)
    scale = (width - left - right) / (hi - lo)
    px = lambda s: left + (s - lo) * scale  # noqa: E731
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font, small = ImageFont.load_default(size=15), ImageFont.load_default(size=11)
    draw.text((width / 2, 18), title, fill="black", font=font, anchor="mm")
    for label, (bars, y) in lanes.items():
        draw.multiline_text((left - 12, y), label, fill="black", font=font, anchor="rm", align="right")
        for x, w, kind, step in bars:
            box = (px(x), y - 25, max(px(x + w), px(x) + 1), y + 25)
            draw.rectangle(box, fill=COLORS[kind], outline="white")
            if kind not in (WAIT, "evaluation") and box[2] - box[0] > 14:
                draw.text(((box[0] + box[2]) / 2, y), str(step), fill="white", font=small, anchor="mm")
    axis = 215
    draw.line((left, axis, width - right, axis), fill="black")
    tick = 10 ** math.floor(math.log10((hi - lo) / 8))  # about 8 round ticks
    tick *= next(m for m in (1, 2, 5, 10) if (hi - lo) / (tick * m) <= 10)
    for i in range(math.ceil(lo / tick), math.floor(hi / tick) + 1):
        draw.line((px(i * tick), axis, px(i * tick), axis + 5), fill="black")
        draw.text((px(i * tick), axis + 8), f"{i * tick:g}", fill="black", font=small, anchor="mt")
    draw.text((width / 2, axis + 30), "wall-clock seconds since the run began (time/elapsed)", fill="black", font=font,
              anchor="mt")
    x = left
    for kind, label in ((WAIT, "waiting (trainer: for the batch; generator: for weights)"),
                        ("experience", "experience"), ("update", "update"), ("evaluation", "evaluation"),
                        ("generating", "generating")):
        draw.rectangle((x, axis + 70, x + 18, axis + 84), fill=COLORS[kind])
        draw.text((x + 24, axis + 77), label, fill="black", font=font, anchor="lm")
        x += 40 + draw.textlength(label, font=font)
    image.save(path)
    print(f"\ntimeline: steps {trainer[0][3]}..{trainer[-1][3]} of {title} -> {path}")


# ------------------------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["A", "B", "both"], default="both")
    parser.add_argument("--steps", type=int, help="steps of each part run (default: A 150, B 12)")
    parser.add_argument("--eval-every", type=int, default=25, help="part A: held-out evaluation every this many steps")
    parser.add_argument("--quick", action="store_true", help="A: 20 steps, evaluation every 10; B: 4 steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="PATH.png", help="the async run's timeline (part A's, else part B's)")
    parser.add_argument("--record", nargs="?", const="async", metavar="NAME",
                        help="write the tables to benchmarks/results/NAME-{shipped,accuracy,informative}.MACHINE.json")
    parser.add_argument("--child", choices=list(B_RUNS), help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.settings, args.result)
    args.steps_a, args.steps_b = args.steps or 150, args.steps or 12
    if args.quick:
        args.steps_a, args.eval_every, args.steps_b = args.steps or 20, 10, args.steps or 4

    if args.plot:
        try:
            import PIL  # noqa: F401
        except ImportError:
            sys.exit("async: --plot needs Pillow (pip install pillow)")
    import torch

    print(f"command: {shlex.join(['python', 'benchmarks/async.py', *sys.argv[1:]])}")
    print(f"machine: {machine()}; torch {torch.__version__}")
    start = time.perf_counter()
    timelines, runs_a, results_b = {}, None, None
    with tempfile.TemporaryDirectory(prefix="lmrl-async-") as tmp:
        if args.part in ("A", "both"):
            runs_a = part_a(args, Path(tmp))
            timelines["A"] = runs_a["async"]
        if args.part in ("B", "both"):
            results_b = part_b(args, Path(tmp))
            timelines["B"] = results_b["async"]["rows"]
    if args.plot:
        part = "A" if "A" in timelines else "B"
        name = "part A (the shipped task)" if part == "A" else "part B (the 4.3M BPE Llama)"
        plot_timeline(timelines[part], args.plot, f"train.async_steps=1, {name}, seed {args.seed}")
    if args.record:
        record_tables(args.record, runs_a, results_b, args)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
