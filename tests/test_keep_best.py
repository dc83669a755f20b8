"""train.keep_best: early stopping on the held-out verifier without stopping the run. `best/` holds the model of the
evaluation with the highest eval/accuracy, written only when one beats every earlier one (the starting model's
included), and it is that model: evaluated again, it scores what the run logged for it."""

from __future__ import annotations

import json
from pathlib import Path

from tests.forked import lmrl


def evals_of(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval/accuracy" in r]


def test_best_is_the_best_evaluations_model_and_scores_what_the_run_logged(tmp_path):
    out = tmp_path / "run"
    done = lmrl("train", "train.keep_best=true", "train.steps=20", "train.eval_every=5",
                "data.num_eval_prompts=100",
                f"train.output_dir={out}", "log.console=false", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    evals = evals_of(out)
    assert [r["step"] for r in evals] == [0, 5, 10, 15, 20]
    accuracy = [r["eval/accuracy"] for r in evals]
    assert max(accuracy[1:]) > accuracy[0], accuracy  # the task's own reward and the shipped model's preset: it learns
    best = json.loads((out / "best" / "best.json").read_text())
    first_best = next(r for r in evals if r["eval/accuracy"] == max(accuracy))  # the first of a tie: "beats" is >
    assert best == {"step": first_best["step"], "eval/accuracy": first_best["eval/accuracy"]}
    assert f"; best {best['eval/accuracy']:.1%} at step {best['step']} saved to {out / 'best'}" in done.stdout
    again = lmrl("eval", "--model", str(out / "best"), "--task", "addition", "--num-prompts", "100", cwd=tmp_path,
                 timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"accuracy (greedy) {best['eval/accuracy']:.1%}" in again.stdout
    if best["step"] != 20:  # final/ is the last step's model, not the best one's
        last = lmrl("eval", "--model", str(out / "final"), "--task", "addition", "--num-prompts", "100",
                    cwd=tmp_path, timeout=120)
        assert f"accuracy (greedy) {accuracy[-1]:.1%}" in last.stdout


def test_a_run_that_never_beats_its_start_writes_no_best(tmp_path):
    out = tmp_path / "run"
    (out / "best").mkdir(parents=True)  # an earlier run's: train.overwrite=true removes it with the rest of that run
    (out / "best" / "best.json").write_text('{"step": 5, "eval/accuracy": 0.9}\n')
    # lr 1e-12 changes no greedy answer: every evaluation ties the starting model's, and a tie is not better
    done = lmrl("train", "train.keep_best=true", "train.steps=2", "train.eval_every=1", "optim.lr=1e-12",
                "rollout.prompts_per_step=4", "rollout.group_size=2", "data.num_eval_prompts=20",
                f"train.output_dir={out}", "train.overwrite=true", "log.console=false", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len({r["eval/accuracy"] for r in evals_of(out)}) == 1
    assert not (out / "best").exists() and "saved to" in done.stdout and "; best " not in done.stdout
