"""The chat example end to end: a Qwen2-architecture model with random weights, a BPE tokenizer trained locally
with a ChatML template, a conversational dataset, the math and format rewards (examples/chat_qwen2.yaml)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from lmrl import Trainer, load_config
from lmrl.models.prompt_encoding import encode_prompts
from tests.forked import lmrl

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location("make_chat_model", ROOT / "scripts" / "make_chat_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path_factory.mktemp("chat") / "demo"
    module.build(out, train_rows=60, test_rows=8)
    return out


def test_the_model_and_tokenizer_are_built_here(built):
    assert AutoConfig.from_pretrained(built / "model").model_type == "qwen2"
    tok = AutoTokenizer.from_pretrained(built / "model")
    assert len(tok) > 256 + 3  # byte alphabet + ChatML specials + learned merges
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    row = json.loads((built / "train.jsonl").read_text().splitlines()[0])
    text = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    question = row["prompt"][1]["content"]
    assert tok.decode(tok(question)["input_ids"]) == question and len(tok(question)["input_ids"]) < len(question)


def test_the_example_config_trains_a_few_steps(built, tmp_path):
    over = [f"model.name_or_path={built / 'model'}", f"data.path={built / 'train.jsonl'}",
            f"data.eval_path={built / 'test.jsonl'}", f"train.output_dir={tmp_path / 'run'}", "train.steps=2",
            "train.eval_every=2", "data.num_eval_prompts=4", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "rollout.max_new_tokens=8", "log.samples_every=1"]
    out = lmrl("train", str(ROOT / "examples" / "chat_qwen2.yaml"), *over, cwd=Path.cwd(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["reward/math/errors"] == 0 and r["reward/format/errors"] == 0 for r in steps)
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in steps[-1]
    sample = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert sample["prompt"].startswith("system: Think in <think>")  # the messages, as the table shows them
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file() and (tmp_path / "run" / "report.html").is_file()
    assert AutoTokenizer.from_pretrained(tmp_path / "run" / "final").chat_template  # the template travels with the model


def test_rewards_get_chat_prompts_and_message_list_completions(built, tmp_path):
    seen = []

    def spy(prompts, completions, answer, **kwargs):
        seen.append((prompts[0], completions[0]))
        return [0.0] * len(completions)

    cfg = load_config(ROOT / "examples" / "chat_qwen2.yaml", [
        f"model.name_or_path={built / 'model'}", f"data.path={built / 'train.jsonl'}", "data.num_eval_prompts=0",
        f"train.output_dir={tmp_path}", "train.steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_new_tokens=6", "log.console=false"])
    trainer = Trainer(cfg, reward_funcs=[spy])
    trainer.train()
    prompt, completion = seen[0]
    assert [m["role"] for m in prompt] == ["system", "user"]
    assert isinstance(completion, list) and len(completion) == 1 and completion[0]["role"] == "assistant"
    assert isinstance(completion[0]["content"], str)
    ids = encode_prompts(trainer.tokenizer, [prompt], cfg.rollout.max_prompt_length)[0]  # what the policy was given
    text = trainer.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
