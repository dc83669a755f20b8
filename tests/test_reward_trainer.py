"""`lmrl train-rm` and `lmrl.RewardTrainer`: a tiny reward model learns a separable preference, scores a text as
`{fn: reward_model, path: DIR}` scores it, trains from the command line, refuses bad rows in one line, and
resumes exactly."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmrl import RewardTrainer
from lmrl.models.tiny import bpe_chat_tokenizer, char_tokenizer, tiny_causal_lm
from lmrl.rewards import reward_set_from_config, score
from tests import forked

ROOT = Path(__file__).resolve().parents[1]


def separable_pairs(n: int, seed: int = 0) -> list[dict]:
    """Prompts of digits; the chosen answer says yes, the rejected one no (a reward model separates them)."""
    rng = random.Random(seed)
    return [{"prompt": f"{rng.randint(0, 999)}?", "chosen": "yes" + "!" * rng.randint(0, 2),
             "rejected": "no" + "." * rng.randint(0, 2)} for _ in range(n)]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny causal LM and the char tokenizer, saved: what a user would start a reward model from."""
    path = tmp_path_factory.mktemp("base")
    tok = char_tokenizer()
    tiny_causal_lm(tok, hidden_size=32, num_layers=2, num_heads=4).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def config(base: Path, out: Path, **train) -> dict:
    return {"model": {"name_or_path": str(base), "device": "cpu"},
            "train": {"output_dir": str(out), "batch_size": 4, "gradient_accumulation_steps": 2, **train},
            "optim": {"lr": 3e-3}, "log": {"console": False}}


def test_pair_accuracy_reaches_one_on_a_separable_set(base, tmp_path):
    cfg = config(base, tmp_path / "rm", epochs=3)
    cfg["data"] = {"eval_fraction": 0.25}
    trainer = RewardTrainer(cfg, train_pairs=separable_pairs(48))
    before = trainer.evaluate()
    result = trainer.train()
    assert len(trainer.train_set) == 36 and len(trainer.eval_set) == 12
    assert result.steps == 3 * 5  # ceil(36 / (4 x 2)) = 5 steps an epoch
    assert before["eval/accuracy"] < 1.0
    assert result.evals[-1]["eval/accuracy"] == 1.0
    assert result.evals[-1]["eval/loss"] < before["eval/loss"] - 0.3
    rows = [json.loads(line) for line in (tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 16))
    assert {"rm/loss", "rm/accuracy", "rm/margin", "rm/chosen", "rm/rejected", "rm/reward_mean",
            "rm/reward_std"} <= set(rows[0])
    stats = json.loads((tmp_path / "rm" / "final" / "reward_stats.json").read_text())
    assert stats["pairs"] == 36 and stats["std"] > 0 and stats["mean"] == pytest.approx(result.stats["mean"])
    # {fn: reward_model, normalize: true} scores (r - mean) / std with the recorded stats
    final = str(tmp_path / "rm" / "final")
    prompts, completions = ["5?", "5?"], ["yes", "no"]
    raw = score(reward_set_from_config([{"fn": "reward_model", "path": final}]), prompts, completions).scores
    normal = score(reward_set_from_config([{"fn": "reward_model", "path": final, "normalize": True}]), prompts,
                   completions).scores
    assert normal.tolist() == pytest.approx(((raw - stats["mean"]) / stats["std"]).tolist(), abs=1e-6)


def chat_pairs(n: int) -> list[dict]:
    rng = random.Random(1)
    out = []
    for _ in range(n):
        user = [{"role": "user", "content": f"Is {rng.randint(0, 99)} fine?"}]
        out.append({"chosen": [*user, {"role": "assistant", "content": "yes it is"}],
                    "rejected": [*user, {"role": "assistant", "content": "no"}]})
    return out


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("kind", ["text", "chat"])
def test_the_trained_model_scores_as_the_reward_function_does(base, tmp_path, kind, padding_side):
    if kind == "text":
        tok, pairs = char_tokenizer(), separable_pairs(12)
        prompts, completions = ["12?", "7?", "300?"], ["yes!", "no..", "maybe"]
        model_path = base
    else:
        tok, pairs = bpe_chat_tokenizer(["Is 12 fine? yes it is no maybe"] * 8, vocab_size=300), chat_pairs(12)
        prompts = [[{"role": "user", "content": "Is 12 fine?"}], [{"role": "user", "content": "Is 7 fine?"}],
                   [{"role": "user", "content": "Anything?"}]]
        completions = ["yes it is", "no", "maybe"]
        model_path = tmp_path / "chat-base"
        tiny_causal_lm(tok, hidden_size=32, num_layers=2, num_heads=4, arch="qwen2").save_pretrained(model_path)
    tok.padding_side = padding_side
    tok.save_pretrained(model_path)
    trainer = RewardTrainer(config(model_path, tmp_path / "rm", steps=3), train_pairs=pairs)
    result = trainer.train()
    inside = trainer.score(prompts, completions)
    fn = reward_set_from_config([{"fn": "reward_model", "path": str(result.output_dir / "final"), "batch_size": 2}])
    outside = score(fn, prompts, completions).scores.tolist()
    assert outside == pytest.approx(inside, abs=1e-5)
    assert len(set(round(s, 4) for s in inside)) == 3  # three different scores: not a constant model
    # and the pairs it trained on are the ids the scorer encodes: the trainer's forward of pair 0 is the scorer's
    chosen, _ = trainer.rewards([trainer.train_set.chosen[0]], [trainer.train_set.rejected[0]])
    p = trainer.pairs.pairs[0]
    assert score(fn, [p.prompt], [p.chosen]).scores.tolist() == pytest.approx([chosen.item()], abs=1e-5)


def run_cli(*args: str, cwd: Path, cpu: bool = False) -> subprocess.CompletedProcess:
    """`lmrl train-rm ARGS`; cpu: the GPUs hidden (ranks with gloo, also on a one-GPU machine)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {})}
    return forked.lmrl("train-rm", *args, cwd=cwd, env=env, timeout=300)


def test_train_rm_end_to_end(base, tmp_path):
    write_jsonl(tmp_path / "pairs.jsonl", separable_pairs(24))
    (tmp_path / "rm.yaml").write_text(f"model:\n  name_or_path: {base}\n  device: cpu\n"
                                      "data:\n  path: pairs.jsonl\n  eval_fraction: 0.25\n"
                                      "train:\n  output_dir: runs/rm\n  epochs: 2\n  batch_size: 6\n"
                                      "optim:\n  lr: 0.003\n")
    done = run_cli("rm.yaml", "log.console=false", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    final = tmp_path / "runs" / "rm" / "final"
    assert {"config.json", "model.safetensors", "tokenizer.json", "reward_stats.json", "COMPLETE"} <= {
        p.name for p in final.iterdir()}
    assert "held-out pair accuracy" in done.stdout and f"model saved to {Path('runs/rm/final')}" in done.stdout
    # a second run into the same directory is refused in one line, before any model loads
    again = run_cli("rm.yaml", cwd=tmp_path)
    assert again.returncode == 2 and again.stderr.strip().count("\n") == 0
    assert again.stderr.startswith("lmrl: error: train.output_dir: runs/rm holds a run")


@pytest.mark.parametrize(("row", "expected"), [
    ({"prompt": "q", "chosen": "a"}, "pairs.jsonl line 3: missing 'rejected'"),
    ({"prompt": "q", "chosen": "a", "rejected": "a"}, "pairs.jsonl line 3: chosen == rejected"),
    ({"prompt": "q", "chosen": "", "rejected": "b"}, "pairs.jsonl line 3: chosen: the completion is empty"),
    ({"prompt": "q" * 40, "chosen": "a", "rejected": "b"},
     "pairs.jsonl line 3: the pair is 41 tokens, longer than data.max_length=32"),
])
def test_each_bad_row_is_one_line(base, tmp_path, row, expected):
    rows = separable_pairs(2)
    write_jsonl(tmp_path / "pairs.jsonl", [*rows, row])
    done = run_cli(f"model.name_or_path={base}", "data.path=pairs.jsonl", "data.max_length=32",
                   "data.on_too_long=fail", "train.output_dir=out", cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lmrl: error: data.path: {expected}"), done.stderr
    assert not (tmp_path / "out" / "final").exists()


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def test_resume_equals_an_uninterrupted_run(base, tmp_path):
    pairs = separable_pairs(40)
    whole = RewardTrainer(config(base, tmp_path / "whole", steps=6), train_pairs=pairs).train()
    # the same run stopped after step 3 (its checkpoint), then resumed in a new trainer
    first = RewardTrainer(config(base, tmp_path / "cut", steps=3, save_every=3), train_pairs=pairs)
    first.train()
    assert (tmp_path / "cut" / "checkpoint-3" / "COMPLETE").is_file()
    import shutil

    shutil.rmtree(tmp_path / "cut" / "final")  # as a run killed after its checkpoint would have left it
    resumed = RewardTrainer(config(base, tmp_path / "cut", steps=6, save_every=3, resume="auto"), train_pairs=pairs)
    result = resumed.train()
    a, b = final_weights(tmp_path / "whole"), final_weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["rm/loss"] for r in result.history] == [r["rm/loss"] for r in whole.history]


def test_lora_trains_adapters_and_the_score_head(base, tmp_path):
    pytest.importorskip("peft")
    cfg = config(base, tmp_path / "rm", steps=4)
    cfg["model"]["lora"] = {"r": 4}
    cfg["optim"]["lr"] = 1e-2
    trainer = RewardTrainer(cfg, train_pairs=separable_pairs(16))
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trained) and any(n.endswith("score.modules_to_save.default.weight") for n in trained)
    assert not any("embed_tokens" in n for n in trained)  # the base stays frozen
    head = next(p for n, p in trainer.model.named_parameters() if "score.modules_to_save" in n).detach().clone()
    result = trainer.train()
    assert result.history[-1]["rm/accuracy"] == 1.0
    final = result.output_dir / "final"
    assert (final / "adapter" / "adapter_model.safetensors").is_file()
    saved = load_file(final / "adapter" / "adapter_model.safetensors")
    assert any("score" in k for k in saved)  # the trained head travels with the adapters
    assert not torch.equal(final_weights(result.output_dir)["score.weight"], head)  # merged: the trained head
    prompts, completions = ["1?", "2?"], ["yes", "no"]
    fn = reward_set_from_config([{"fn": "reward_model", "path": str(final)}])
    assert score(fn, prompts, completions).scores.tolist() == pytest.approx(trainer.score(prompts, completions), abs=1e-5)


def test_two_ranks_train_the_model_one_process_trains(base, tmp_path):
    write_jsonl(tmp_path / "pairs.jsonl", separable_pairs(22))  # 22 pairs, 8 a step: the last step splits 3 + 3
    args = [f"model.name_or_path={base}", "data.path=pairs.jsonl", "train.steps=3", "train.batch_size=2",
            "train.gradient_accumulation_steps=4", "train.save_every=2", "optim.lr=0.003", "log.console=false"]
    one = run_cli(*args, "train.output_dir=one", cwd=tmp_path, cpu=True)  # on one device, to compare to 1e-6
    assert one.returncode == 0, one.stderr
    two = run_cli(*args, "train.output_dir=two", "--nproc", "2", cwd=tmp_path, cpu=True)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    start = load_file(base / "model.safetensors")
    assert max((a[k] - start[k]).abs().max().item() for k in start if k in a) > 1e-3  # the steps moved the weights
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    rows = [[json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in ("one", "two")]
    assert [r["rm/loss"] for r in rows[1]] == pytest.approx([r["rm/loss"] for r in rows[0]], abs=1e-6)
    assert (tmp_path / "two" / "checkpoint-2" / "rng_state_1.pt").is_file()


def test_the_trl_table_names_fields_that_exist():
    from lmrl.config import RewardTrainingConfig
    from lmrl.config.describe import field_rows

    text = (ROOT / "docs" / "coming-from-trl.md").read_text()
    section = text.split("## TRL's RewardTrainer")[1]
    named = [line.split("|")[2].strip().strip("`") for line in section.splitlines()
             if line.startswith("| `") and "`" in line.split("|")[2]]
    fields = {key for key, *_ in field_rows(RewardTrainingConfig)}
    assert len(named) >= 20 and not [n for n in named if n not in fields]


def test_a_saved_model_that_would_pool_otherwise_is_refused(base, tmp_path):
    from lmrl.errors import RunError

    trainer = RewardTrainer(config(base, tmp_path / "rm", steps=1), train_pairs=separable_pairs(8))
    trainer.model.config.pad_token_id = 5  # what a config changed after the trainer set it up would save
    with pytest.raises(RunError, match=r"final: the saved config's pad_token_id is 5, the trainer pooled by 0; "):
        trainer.train()
    assert not (tmp_path / "rm" / "final").exists()  # nothing half-right is left behind


def test_normalize_needs_the_recorded_stats(base):
    with pytest.raises(ValueError, match=r"^reward.functions\[0\]: reward 'reward_model': normalize: .*reward_stats.json not found; it is written by lmrl train-rm"):
        reward_set_from_config([{"fn": "reward_model", "path": str(base), "normalize": True}])


KILL_AT = """
import os, signal, sys
import lmrl.reward_trainer as rt
from lmrl.cli import main

step_of = rt.RewardTrainer.train_step
def train_step(self, step):
    if step == int(os.environ["KILL_AT_STEP"]):  # SIGKILL: as a machine that dies (no handler, no final save)
        os.kill(os.getpid(), getattr(signal, os.environ.get("SIGNAL", "SIGKILL")))
    return step_of(self, step)
rt.RewardTrainer.train_step = train_step
sys.exit(main(["train-rm", *sys.argv[1:]]))
"""


def test_a_killed_run_resumes_to_the_uninterrupted_weights(base, tmp_path):
    write_jsonl(tmp_path / "pairs.jsonl", separable_pairs(40))
    args = [f"model.name_or_path={base}", "data.path=pairs.jsonl", "train.steps=6", "train.save_every=3",
            "train.batch_size=4", "optim.lr=0.003", "log.console=false"]
    whole = run_cli(*args, "train.output_dir=whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "KILL_AT_STEP": "5"}
    killed = forked.forked("main", [KILL_AT, "-c", *args, "train.output_dir=cut"], tmp_path, 300, "kill at 5", env)
    assert killed.returncode == -9 and (tmp_path / "cut" / "checkpoint-3").is_dir()
    assert not (tmp_path / "cut" / "final").exists()
    resumed = run_cli(*args, "train.output_dir=cut", "train.resume=auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    a, b = final_weights(tmp_path / "whole"), final_weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [[json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in ("whole", "cut")]
    assert [r["step"] for r in rows[1]] == list(range(1, 7))  # step 4, logged before the kill, not twice
    assert [r["rm/loss"] for r in rows[1]] == [r["rm/loss"] for r in rows[0]]
    # SIGTERM (a scheduler's stop): step 2 ends, its checkpoint is written, exit 128 + 15; the resume ends the same
    env |= {"KILL_AT_STEP": "2", "SIGNAL": "SIGTERM"}
    stopped = forked.forked("main", [KILL_AT, "-c", *args, "train.output_dir=term"], tmp_path, 300, "term at 2", env)
    assert stopped.returncode == 143, stopped.stderr
    assert stopped.stderr.strip().splitlines()[-1] == (
        "lmrl: error: SIGTERM: stopped after step 2; checkpoint term/checkpoint-2 written; add train.resume=auto to "
        "the same command to continue")
    assert run_cli(*args, "train.output_dir=term", "train.resume=auto", cwd=tmp_path).returncode == 0
    c = final_weights(tmp_path / "term")
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_weights_that_are_not_finite_stop_the_run_in_one_line(base, tmp_path):
    write_jsonl(tmp_path / "pairs.jsonl", separable_pairs(16))
    done = run_cli(f"model.name_or_path={base}", "data.path=pairs.jsonl", "train.steps=4", "train.save_every=1",
                   "train.batch_size=8", "optim.lr=1e30", "optim.max_grad_norm=null", "log.console=false",
                   "train.output_dir=out", cwd=tmp_path)
    assert done.returncode == 1, done.stderr  # the run had started
    assert done.stderr.strip().splitlines() == [
        "lmrl: error: step 1: the weights are not finite after the update (optim.lr=1e+30 too high?); the run stops "
        "(no checkpoint was written)"]
    assert not (tmp_path / "out" / "final").exists() and not (tmp_path / "out" / "checkpoint-1").exists()


def test_held_out_pairs_from_a_file_and_a_bf16_model(base, tmp_path):
    write_jsonl(tmp_path / "held.jsonl", separable_pairs(6, seed=7))
    cfg = config(base, tmp_path / "rm", steps=6)
    cfg["model"]["dtype"] = "bfloat16"
    cfg["data"] = {"eval_path": str(tmp_path / "held.jsonl")}
    trainer = RewardTrainer(cfg, train_pairs=separable_pairs(16))
    assert next(trainer.model.parameters()).dtype == torch.bfloat16 and len(trainer.eval_set) == 6
    assert trainer.eval_set.where[0] == f"{tmp_path / 'held.jsonl'} line 1"
    result = trainer.train()
    assert result.evals[-1]["step"] == 6 and result.evals[-1]["eval/accuracy"] == 1.0
    assert all(math.isfinite(r["rm/loss"]) for r in result.history)


def test_gradient_accumulation_1x8_equals_8x1(base, tmp_path):
    pairs, grads = separable_pairs(16), []
    for batch, accumulate in ((8, 1), (1, 8)):
        cfg = config(base, tmp_path / f"rm-{batch}", steps=1, batch_size=batch, gradient_accumulation_steps=accumulate)
        trainer = RewardTrainer(cfg, train_pairs=pairs)
        model = trainer.model  # the step's gradient, as the optimizer gets it
        trainer.optimizer.register_step_pre_hook(lambda *_, model=model: grads.append(
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        metrics = trainer.train_step(1)
        assert metrics["rm/loss"] > 0.1
    a, b = grads
    assert a.keys() == b.keys() and max(a[k].abs().max().item() for k in a) > 1e-3
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
