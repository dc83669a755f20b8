"""export_weights: what a generator holding its own copy of the policy loads."""

from __future__ import annotations

import pytest
import torch

from lmrl.models.tiny import char_tokenizer, tiny_causal_lm
from lmrl.models.weights import export_weights

peft = pytest.importorskip("peft")


def test_a_lora_policy_exports_merged_weights_under_the_checkpoint_names_from_outside_or_inside():
    torch.manual_seed(0)
    model = tiny_causal_lm(char_tokenizer())
    plain = {name: t.clone() for name, t in export_weights(model)}
    policy = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    outside = dict(export_weights(policy))
    inside = dict(export_weights(model))  # the model peft injected its layers into, as a trainer may hold it
    assert outside.keys() == inside.keys() == plain.keys()
    merged = policy.merge_and_unload()
    for name, tensor in merged.state_dict().items():
        if name in plain:
            torch.testing.assert_close(outside[name], tensor)
            torch.testing.assert_close(inside[name], tensor)
    changed = [n for n in plain if not torch.equal(outside[n], plain[n])]
    assert changed and all("q_proj" in n or "v_proj" in n for n in changed)
