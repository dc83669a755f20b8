"""examples/rlhf/make_pairs.py, the first stage of the RLHF loop, as a user runs it: pairs from the shipped model's own
samples, the task's verifier deciding which side is right, the held-out sums never used."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from lmrl.data.tasks import get_task
from tests import forked

ROOT = Path(__file__).resolve().parents[1]


def make_pairs(tmp_path: Path, *args: str) -> tuple[list[dict], str]:
    out = tmp_path / "pairs.jsonl"
    done = forked.script(ROOT / "examples" / "rlhf" / "make_pairs.py", "--out", str(out), "--prompts", "24",
                         "--samples", "6", *args, cwd=tmp_path, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in out.read_text().splitlines()], done.stderr


def test_pairs_from_the_models_own_samples_judged_by_the_verifier(tmp_path):
    task = get_task("addition")
    answers = {r["prompt"]: r["answer"] for r in task.train_prompts()[:24]}
    held_out = {r["prompt"] for r in task.eval_prompts()}
    pairs, said = make_pairs(tmp_path)
    assert 0 < len(pairs) <= 24 and len({p["prompt"] for p in pairs}) == len(pairs)  # one per prompt
    for p in pairs:
        assert p["prompt"] in answers and p["prompt"] not in held_out
        assert p["chosen"] == answers[p["prompt"]]  # a right sample, or the reference: the verifier's right answer
        assert p["rejected"] != answers[p["prompt"]] and p["rejected"]
    assert f"tiny-addition: {len(pairs)} pairs from 24 prompts x 6 samples" in said
    every, _ = make_pairs(tmp_path, "--every-wrong", "--append", str(tmp_path / "pairs.jsonl"))
    assert every[: len(pairs)] == pairs  # the earlier round's pairs first
    new = every[len(pairs):]
    assert len(new) > len(pairs) and {p["prompt"] for p in new} == {p["prompt"] for p in pairs}
    assert len({(p["prompt"], p["rejected"]) for p in new}) == len(new)  # each distinct wrong sample once


def test_the_loop_script_runs_a_round_at_a_toy_scale(tmp_path):
    """examples/rlhf/loop.sh as the docs run it (pairs, a reward model, GRPO against it, the verifier choosing the next
    round's policy), on 32 prompts and 3 steps: the documented numbers come from this script at full scale. The
    script runs in bash as a reader runs it; its `python` and `lmrl` commands are tests/forked.py's stand-ins, each
    command a forked child (4 s of imports saved on each of five), the table after it as well."""
    out = tmp_path / "rlhf"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PATH": f"{forked.stand_in()}{os.pathsep}{os.environ['PATH']}",
           "PROMPTS": "32", "RM_EPOCHS": "1", "STEPS": "3", "EVAL_PROMPTS": "40"}
    done = subprocess.run(["bash", str(ROOT / "examples" / "rlhf" / "loop.sh"), str(out), "1"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    pairs = [json.loads(line) for line in (out / "pairs-1.jsonl").read_text().splitlines()]
    assert pairs and {p["prompt"] for p in pairs} <= {r["prompt"] for r in get_task("addition").train_prompts()[:32]}
    assert (out / "rm-1" / "final" / "reward_stats.json").is_file()
    evals = [r for r in map(json.loads, (out / "grpo-1" / "metrics.jsonl").read_text().splitlines()) if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3] and all("eval/learned_reward" in r for r in evals)
    before, after = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    kept = out / "grpo-1" / "final" if after > before else "tiny-addition"  # the verifier decides
    assert done.stdout.strip().splitlines()[-1] == (f"round 1: held-out accuracy {before} -> {after}; "
                                                     f"the next round starts from {kept}")
    assert (out / "grpo-1" / "best").is_dir() == (after > before)  # train.keep_best: the better of two evaluations
    # benchmarks/rlhf_loop.py reads the table of the docs' figure from these directories
    table = forked.script(ROOT / "benchmarks" / "rlhf_loop.py", str(out), "--further", "20", cwd=tmp_path, timeout=120,
                          env=env)
    assert table.returncode == 0, table.stderr
    rm_accuracy = [r for r in map(json.loads, (out / "rm-1" / "metrics.jsonl").read_text().splitlines())
                   if "eval/accuracy" in r][-1]["eval/accuracy"]
    *lines, summary = table.stdout.splitlines()
    assert summary.startswith(f"1 round: held-out accuracy {before:.1%} -> {max(before, after):.1%} (+")
    assert re.search(r"; on 20 further sums \d+\.\d% -> \d+\.\d%$", summary), summary
    further = lines[0].rsplit(" | ", 1)[1]  # the round's policy on 20 sums in neither split
    assert re.fullmatch(r"\d+\.\d%", further) and round(float(further[:-1]) * 20 / 100, 6).is_integer()
    lines = [lines[0].rsplit(" | ", 1)[0]]
    assert lines == [
        f"round 1 | {len(pairs):,} pairs: every distinct wrong sample of the shipped model ({rm_accuracy:.1%}) | "
        f"3 steps, KL 0.05, from the shipped model | {before:.1%} -> {after:.1%} | {after:.1%} (3) | "
        + ("step 3" if evals[-1].get("guard/reward_hacking") == 1.0 else "none")]
