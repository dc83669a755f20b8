"""The shipped vision model (`tiny-vision`) and its built-in task (`data.task=digits`): the task's rows carry their
images in memory, the model loads as any vision-language model does, reads the digit (blank images cost it most of
its accuracy), and `lmrl train model.name_or_path=tiny-vision` with nothing else runs the task."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from lmrl.data.tasks import exact_match_reward, get_task
from lmrl.models.shipped import SHIPPED_MODELS
from tests import forked

ROOT = Path(__file__).resolve().parents[2]


def test_the_digits_task_carries_images_in_memory():
    from PIL import Image

    task = get_task("digits", num_train=50, num_eval=20)
    train, held_out = task.train_prompts(), task.eval_prompts()
    assert len(train) == 50 and len(held_out) == 20
    for row in train + held_out:
        assert isinstance(row["image"], Image.Image) and row["image"].size == (32, 32)
        k = int(row["prompt"].removeprefix("<image>digit+").removesuffix("="))
        assert 1 <= k <= 9 and k <= int(row["answer"]) <= k + 9
    # held out: drawings the training split does not have
    assert not {r["image"].tobytes() for r in held_out} & {r["image"].tobytes() for r in train}
    assert task.reward_funcs[0] is exact_match_reward and task.max_new_tokens == 3
    # the control: the same prompts and answers, each image one colour
    blank = get_task("digits-blank", num_train=50, num_eval=20)
    assert [(r["prompt"], r["answer"]) for r in blank.train_prompts()] == [(r["prompt"], r["answer"]) for r in train]
    assert all(len(r["image"].getcolors()) == 1 for r in blank.eval_prompts())
    # rows are copies: a caller changing one does not change the task
    train[0]["answer"] = "x"
    assert task.train_prompts()[0]["answer"] != "x"


def test_the_shipped_vision_model_reads_the_digit():
    """Loads with AutoModelForImageTextToText and AutoProcessor; answers a minority of held-out drawings greedily,
    as shipped (room for RL), and far fewer when the images are blank."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_tiny_vision import evaluate_vision

    from lmrl.models.vision import load_vision_model

    model, processor = load_vision_model(str(SHIPPED_MODELS["tiny-vision"]))
    assert processor.image_token == "<image>"
    shown = evaluate_vision(model, processor, get_task("digits").eval_prompts()[:150])["accuracy"]
    blank = evaluate_vision(model, processor, get_task("digits-blank").eval_prompts()[:150])["accuracy"]
    assert 0.12 <= shown <= 0.45, shown
    assert blank <= shown - 0.08, (shown, blank)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-vision") / "run"
    args = ["model.name_or_path=tiny-vision", "train.steps=2", "train.eval_every=2", "data.num_eval_prompts=16",
            "rollout.prompts_per_step=4", "log.samples_every=2", "train.max_minutes=null", f"train.output_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = forked.lmrl("train", *args, env=env, cwd=out.parent, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def test_lmrl_train_with_tiny_vision_runs_the_digits_task(run):
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [(h["step"], h["eval/accuracy"]) for h in history if "eval/accuracy" in h]
    assert [s for s, _ in evals] == [0, 2] and all(0.0 <= a <= 1.0 for _, a in evals)
    assert len([h for h in history if "loss" in h]) == 2
    config = (run / "lmrl_config.yaml").read_text()
    assert "task: digits" in config  # the model's preset chose the task
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"].startswith("<image>digit+") for s in samples)
    assert all(len(s["images"]) == 1 and s["images"][0].startswith("sha256:") for s in samples)


def test_lmrl_eval_with_tiny_vision_and_with_the_trained_run(run):
    """`lmrl eval --model tiny-vision` evaluates the model's own task (digits), and a run directory its run's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for args, source in ((["--model", "tiny-vision", "--num-prompts", "12", "--k", "2"], "12 prompts of task digits"),
                         ([str(run), "--num-prompts", "12"], f"12 prompts of {run}'s held-out prompts")):
        proc = forked.lmrl("eval", *args, env=env, cwd=run.parent, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        line = proc.stdout.strip().splitlines()[-1]
        assert line.startswith(source + ": accuracy (greedy) "), line
        accuracy = float(line.split("accuracy (greedy) ")[1].split("%")[0])
        assert 0.0 <= accuracy <= 100.0


def test_the_report_shows_each_samples_image_as_a_thumbnail(run):
    """The run keeps its in-memory images in images/ (named by samples.jsonl's sha256), and report.html embeds
    them as PNG data URIs, each titled with its name."""
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    names = {s["images"][0] for s in samples}
    assert {f"sha256:{p.stem}" for p in (run / "images").glob("*.png")} == names
    page = (run / "report.html").read_text()
    assert all(f'title="{name}"' in page for name in names)
    assert page.count('<img class="thumb" src="data:image/png;base64,') == len(samples)


def test_the_report_reads_image_paths_and_names_a_missing_image(tmp_path):
    from PIL import Image

    from lmrl.report import read_run, render_report

    Image.new("RGB", (32, 32), (200, 30, 30)).save(tmp_path / "red.png")
    rows = [{"step": 1, "prompt": "<image>?", "completion": "a", "score": 1.0, "advantage": 0.5,
             "images": [str(tmp_path / "red.png"), "sha256:0123456789abcdef"]}]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "metrics.jsonl").write_text("")
    page = render_report([read_run(tmp_path)])
    assert page.count("data:image/png;base64,") == 1 and f'title="{tmp_path / "red.png"}"' in page
    assert "sha256:0123456789abcdef" in page  # not kept here: its name, as text
