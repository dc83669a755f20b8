"""A LoRA run's outputs: the adapter beside the merged final model, its base named as the user named it (so
that peft loads it from where the run was started), and a second run that continues training it."""

from __future__ import annotations

import json

import torch
from peft import AutoPeftModelForCausalLM
from safetensors.torch import load_file

from lmrl import Trainer, load_config
from lmrl.models.tiny import char_tokenizer, tiny_causal_lm

ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]


def digits(prompts, completions, **kw):
    """Varies between a random model's samples: the share of characters that are digits."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def run(name_or_path: str, output_dir: str, *extra: str) -> Trainer:
    cfg = load_config(None, [f"model.name_or_path={name_or_path}", f"train.output_dir={output_dir}", "train.steps=2",
                             "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
                             "optim.lr=1e-2", "log.console=false", "train.eval_every=0", "train.save_every=2", *extra])
    trainer = Trainer(cfg, reward_funcs=[digits], train_dataset=ROWS)
    trainer.train()
    return trainer


def test_a_lora_run_leaves_a_portable_adapter_that_peft_loads_and_a_second_run_continues(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the base is named by a relative path, as users often do
    tokenizer = char_tokenizer()
    tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, seed=0).save_pretrained("base")
    tokenizer.save_pretrained("base")

    run("base", "first", "model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj]}")
    adapter = tmp_path / "first" / "final" / "adapter"
    for directory in (adapter, tmp_path / "first" / "checkpoint-2"):
        assert json.loads((directory / "adapter_config.json").read_text())["base_model_name_or_path"] == "base"
    merged = load_file(tmp_path / "first" / "final" / "model.safetensors")
    peft_model = AutoPeftModelForCausalLM.from_pretrained(str(adapter)).merge_and_unload()
    weights = peft_model.state_dict()
    for name, value in merged.items():  # the adapter, merged by peft, is the final model (tied head not stored)
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-6, msg=name)

    second = run(str(adapter), "second")
    saved = load_file(adapter / "adapter_model.safetensors")
    continued = load_file(tmp_path / "second" / "final" / "adapter" / "adapter_model.safetensors")
    assert saved.keys() == continued.keys() and any("lora_B" in k for k in saved)
    assert any(not torch.equal(saved[k], continued[k]) for k in saved)  # trained on from where the first stopped
    assert second.cfg.model.name_or_path == str(adapter)
    assert json.loads((tmp_path / "second" / "final" / "adapter" / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == "base"  # still the first run's base, not the adapter directory


def test_lora_on_a_mixture_of_experts_trains_every_expert(tmp_path, monkeypatch):
    """transformers 5 holds a Mixtral's experts as two 3-D tensors per layer, not as linear layers, so
    `target_modules: all-linear` could leave them frozen while attention trains. peft wraps them as parameters: the
    saved model's expert tensors move, every expert's slice included, and the router's too."""
    from transformers import MixtralConfig, MixtralForCausalLM

    monkeypatch.chdir(tmp_path)
    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, pad_token_id=tokenizer.pad_token_id,
                                     eos_token_id=tokenizer.eos_token_id)).save_pretrained("moe")
    tokenizer.save_pretrained("moe")
    before = load_file(tmp_path / "moe" / "model.safetensors")
    run("moe", "out", "model.lora={r: 4, alpha: 8}", "optim.lr=5e-2", "train.steps=3")
    after = load_file(tmp_path / "out" / "final" / "model.safetensors")
    assert before.keys() == after.keys()  # saved under the checkpoint's names, one tensor per expert
    experts = [name for name in before if ".experts." in name]
    assert len(experts) == 4 * 3, experts  # w1, w2, w3 of each of the 4 experts
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert set(experts) <= moved, sorted(set(experts) - moved)
    assert "model.layers.0.block_sparse_moe.gate.weight" in moved and "model.embed_tokens.weight" not in moved
