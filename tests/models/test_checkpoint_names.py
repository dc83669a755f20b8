"""The policy's weights as an engine loads them: under the names and layouts `save_pretrained` writes, not the
fused ones transformers 5 holds in memory (a mixture-of-experts layer's experts in one tensor), and back into a
model of lmrl's own that takes them by those names (`ModelGenerator`, the generator process's copy)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from lmrl.models.tiny import char_tokenizer, tiny_causal_lm
from lmrl.models.weights import CheckpointLayout, export_weights
from lmrl.rollout.server import ModelGenerator

MOE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=16)


def tiny(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    if arch == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**MOE)).eval()
    if arch == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE)).eval()
    return tiny_causal_lm(char_tokenizer(), hidden_size=32, num_layers=2, seed=seed)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "mixtral"])
def test_exported_weights_are_the_checkpoints_names_and_values(tmp_path, arch):
    model = tiny(arch)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    exported = dict(export_weights(model))
    assert exported.keys() == saved.keys()
    for name, tensor in saved.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0)
    if arch == "mixtral":  # in memory: model.layers.0.mlp.experts.gate_up_proj, one tensor of every expert
        assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in exported
        assert not any("gate_up_proj" in name for name in exported)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "mixtral"])
def test_a_model_of_lmrls_own_takes_the_exported_weights_into_its_own_layout(arch):
    """The generator process's copy (`ModelGenerator`), built from the config, takes a trained policy's weights
    by their checkpoint names: every parameter equals the policy's, the fused experts too."""
    policy, copy = tiny(arch, seed=0), tiny(arch, seed=1)
    with torch.no_grad():  # a policy that trained: every expert moved
        for name, p in policy.named_parameters():
            if "experts" in name:
                p.mul_(3.0)
    generator = ModelGenerator(copy, char_tokenizer())
    generator.load_weights(export_weights(policy), version=1)
    for (name, a), b in zip(policy.named_parameters(), copy.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_a_conversion_that_computes_is_refused_rather_than_loaded_wrong(monkeypatch):
    """The index map holds only where the conversion moves elements; one that computes (here: doubles) cannot be
    written back by name, and the layout says so instead of loading other values."""
    import transformers.core_model_loading as loading

    real = loading.revert_weight_conversion
    monkeypatch.setattr(loading, "revert_weight_conversion",
                        lambda model, sd: {n: (t * 2 if "experts" in n else t) for n, t in real(model, sd).items()})
    with pytest.raises(ValueError, match="is not a rearrangement of its weights"):
        CheckpointLayout(tiny("qwen3_moe"))
