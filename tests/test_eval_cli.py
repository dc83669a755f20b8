"""`lmrl eval` as a user runs it: a plain file with reward functions, a file with splits, a run directory; an empty
selection is one line saying why. The first case runs in a process of its own (forked from one that has imported
lmrl: tests/forked.py), the rest through `lmrl.cli.main` in this process (the same code, without starting Python
each time)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict

from tests.forked import lmrl as lmrl_process

ROWS = [{"prompt": f"{a}+{a + 1}=", "answer": str(2 * a + 1)} for a in range(10, 22)]
REWARDS = '''
def one(completions, **kwargs):          # TRL's signature: every completion scores 1
    return [1.0 for _ in completions]

def quarter(prompts, completions, answer, **kwargs):
    return [0.25 for _ in completions]

def minus(completions, **kwargs):
    return [-1.0 for _ in completions]
'''


def lmrl(*args: str, cwd: Path, real: bool = False) -> subprocess.CompletedProcess:
    if real:
        return lmrl_process(*args, cwd=cwd, timeout=300)
    from lmrl.cli import main

    out, err, before = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.fixture()
def files(tmp_path: Path) -> Path:
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "rw.py").write_text(REWARDS)
    (tmp_path / "empty.jsonl").write_text("")
    return tmp_path


def _numbers(line: str) -> tuple[int, float, float, float | None]:
    m = re.fullmatch(r"(\d+) prompts of .*: accuracy \(greedy\) ([\d.]+)%  mean reward (-?[\d.]+)"
                     r"(?:  pass@\d+ \(T=[\d.]+\) ([\d.]+)%)?", line)
    assert m, line
    return int(m[1]), float(m[2]), float(m[3]), None if m[4] is None else float(m[4])


def test_eval_data_on_a_plain_jsonl_with_reward_functions(files):
    out = lmrl("eval", "--data", "heldout.jsonl", "--reward", "rw.py:one", "--k", "2", cwd=files, real=True)
    assert out.returncode == 0, out.stderr
    assert _numbers(out.stdout.strip()) == (len(ROWS), 100.0, 1.0, 100.0)
    out = lmrl("eval", "--data", "heldout.jsonl", "--reward", "rw.py:quarter", "--num-prompts", "5", cwd=files)
    assert _numbers(out.stdout.strip()) == (5, 100.0, 0.25, None)  # accuracy: scores > 0
    out = lmrl("eval", "--data", "heldout.jsonl", "--reward", "rw.py:minus", "--reward", "rw.py:quarter", cwd=files)
    assert _numbers(out.stdout.strip()) == (len(ROWS), 0.0, -0.75, None)  # several functions: the weighted sum


def test_eval_data_exact_match_is_the_models_accuracy(files):
    # the shipped model answers some sums right and some wrong: exact_match's accuracy lies strictly between
    out = lmrl("eval", "--data", "heldout.jsonl", "--reward", "exact_match", cwd=files)
    n, acc, reward, _ = _numbers(out.stdout.strip())
    assert n == len(ROWS) and 0 < acc < 100 and reward == pytest.approx(acc / 100, abs=1e-3)


def test_eval_data_with_splits(files):
    DatasetDict({"train": Dataset.from_list(ROWS), "heldout": Dataset.from_list(ROWS[:3])}).save_to_disk(files / "saved")
    out = lmrl("eval", "--data", "saved", "--split", "heldout", "--reward", "rw.py:one", cwd=files)
    assert out.returncode == 0, out.stderr
    assert _numbers(out.stdout.strip())[0] == 3
    out = lmrl("eval", "--data", "saved", "--reward", "rw.py:one", cwd=files)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "without a 'test' split; its splits: train, heldout" in out.stderr


def test_an_empty_selection_is_one_line_saying_why(files):
    cases = {
        ("eval", "--data", "empty.jsonl", "--reward", "rw.py:one"): "lmrl: error: data.path: empty.jsonl has no rows",
        ("eval", "--data", "heldout.jsonl"): "lmrl: error: --reward: evaluating --data needs a reward function, "
                                             "e.g. --reward exact_match or --reward rewards.py:my_reward",
        ("eval", "nowhere"): "lmrl: error: nowhere: not a run directory (no lmrl_config.yaml in it)",
    }
    for args, line in cases.items():
        out = lmrl(*args, cwd=files)
        assert (out.returncode, out.stderr) == (2, line + "\n"), args


def test_eval_a_run_directory(files):
    quick = ["train.steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2", "log.console=false"]
    assert lmrl("train", *quick, "train.output_dir=runs/task", cwd=files).returncode == 0
    out = lmrl("eval", "runs/task", "--num-prompts", "7", cwd=files)  # the task's held-out prompts and reward
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("7 prompts of runs/task's held-out prompts: ")
    out = lmrl("eval", "runs/task", "--data", "heldout.jsonl", "--reward", "rw.py:quarter", cwd=files)
    assert _numbers(out.stdout.strip())[:3] == (len(ROWS), 100.0, 0.25)

    # a run on a file without held-out prompts, scored by a function from a file
    assert lmrl("train", *quick, "train.output_dir=runs/file", "data.path=heldout.jsonl",
                "reward.functions=[rw.py:one]", cwd=files).returncode == 0
    out = lmrl("eval", "runs/file", cwd=files)
    assert (out.returncode, out.stderr) == (2, "lmrl: error: runs/file's held-out prompts: nothing to evaluate: it has "
                                               "no held-out prompts (data.eval_path is unset); evaluate a file with --data FILE\n")
    out = lmrl("eval", "runs/file", "--data", "heldout.jsonl", cwd=files)  # the run's own reward function
    assert _numbers(out.stdout.strip())[:3] == (len(ROWS), 100.0, 1.0)


def test_evaluate_from_python_without_held_out_prompts_is_one_line(tmp_path):
    from lmrl import Config, Trainer
    from lmrl.errors import DataError

    trainer = Trainer(Config(train={"output_dir": str(tmp_path)}), train_dataset=ROWS,
                      reward_funcs=[lambda completions, **kw: [1.0] * len(completions)])
    with pytest.raises(DataError, match=r"^evaluate: no held-out prompts \(give eval_dataset, data.eval_path or a task"):
        trainer.evaluate()


def test_eval_a_run_that_had_reward_recipes(files):
    labelled = [{**r, "data_source": "one" if i % 2 else "minus"} for i, r in enumerate(ROWS)]
    (files / "labelled.jsonl").write_text("".join(json.dumps(r) + "\n" for r in labelled))
    assert lmrl("train", "train.steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2", "log.console=false",
                "train.output_dir=runs/mixed", "data.path=labelled.jsonl",
                "reward.recipes={one: [rw.py:one], minus: [rw.py:minus]}", cwd=files).returncode == 0
    out = lmrl("eval", "runs/mixed", "--data", "labelled.jsonl", cwd=files)  # the run's own recipes
    assert out.returncode == 0, out.stderr
    assert _numbers(out.stdout.strip())[:3] == (len(ROWS), 50.0, 0.0)  # half score 1, half -1
    out = lmrl("eval", "runs/mixed", "--data", "labelled.jsonl", "--reward", "rw.py:quarter", cwd=files)
    assert out.returncode == 0, out.stderr  # --reward replaces the recipes
    assert _numbers(out.stdout.strip())[:3] == (len(ROWS), 100.0, 0.25)
