"""Tests for lmrl.models.critic: ValueModel (shapes, alignment, separate weights, save/load, gradients) and
PolicyValueHead (a value head reading the policy's own hidden states)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from lmrl.models.critic import HEAD_FILE, PolicyValueHead, ValueModel
from lmrl.models.forward import position_ids_from_mask, response_forward
from lmrl.models.tiny import char_tokenizer, tiny_causal_lm

ARCHS = ["llama", "qwen2"]


@pytest.fixture(params=ARCHS)
def policy_and_tok(request):
    tok = char_tokenizer()
    return tiny_causal_lm(tok, arch=request.param, hidden_size=32), tok


def batch(tok, texts: list[str]):
    """Left-padded [B, S] ids and mask."""
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    s = max(map(len, ids))
    seqs = torch.tensor([[tok.pad_token_id] * (s - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (s - len(x)) + [1] * len(x) for x in ids])
    return seqs, mask


def test_shapes_and_dtype(policy_and_tok):
    policy, tok = policy_and_tok
    critic = ValueModel.from_policy(policy)
    seqs, mask = batch(tok, ["1+2=3", "10+20=30"])
    values = critic(seqs, mask)
    assert values.shape == seqs.shape and values.dtype == torch.float32
    assert critic.response_values(seqs, mask, 2).shape == (2, 2)
    std = critic.value_head.weight.std().item()
    assert abs(std - 1 / math.sqrt(32 + 1)) < 0.06  # 32 samples of N(0, 1/33)
    assert torch.all(critic.value_head.bias == 0)


def test_response_values_read_the_state_before_each_token(policy_and_tok):
    policy, tok = policy_and_tok
    critic = ValueModel.from_policy(policy).eval()
    seqs, mask = batch(tok, ["12+3=15", "4+4=8"])
    t = 3
    with torch.no_grad():
        full = critic(seqs, mask)
        aligned = critic.response_values(seqs, mask, t)
        s = seqs.shape[1]
        torch.testing.assert_close(aligned, full[:, s - t - 1 : s - 1], atol=0, rtol=0)
        # entry j is V(state before response token j): it cannot depend on token j, and entry j+1 does
        changed = seqs.clone()
        changed[:, s - t + 1] = tok.convert_tokens_to_ids("x")
        after = critic.response_values(changed, mask, t)
    torch.testing.assert_close(after[:, :2], aligned[:, :2], atol=1e-6, rtol=0)
    assert (after[:, 2] - aligned[:, 2]).abs().min() > 1e-6


def test_left_padding_does_not_change_values(policy_and_tok):
    policy, tok = policy_and_tok
    critic = ValueModel.from_policy(policy).eval()
    seqs, mask = batch(tok, ["123+456=579", "1=1"])
    with torch.no_grad():
        padded = critic(seqs, mask)[1, -3:]
        alone_ids = torch.tensor([tok("1=1", add_special_tokens=False)["input_ids"]])
        alone = critic(alone_ids, torch.ones_like(alone_ids))[0]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=0)


def test_from_policy_copies_backbone_with_separate_weights(policy_and_tok):
    policy, tok = policy_and_tok
    critic = ValueModel.from_policy(policy)
    seqs, mask = batch(tok, ["7+8=15"])
    pos = position_ids_from_mask(mask)
    with torch.no_grad():
        policy_hidden = policy(seqs, attention_mask=mask, position_ids=pos, output_hidden_states=True)
        critic_hidden = critic.backbone(
            input_ids=seqs, attention_mask=mask, position_ids=pos
        ).last_hidden_state
        torch.testing.assert_close(critic_hidden, policy_hidden.hidden_states[-1], atol=1e-6, rtol=0)
        next(critic.backbone.parameters()).add_(1.0)
    critic_ids = {id(p) for p in critic.parameters()}
    assert all(id(p) not in critic_ids for p in policy.parameters())
    assert not torch.equal(next(critic.backbone.parameters()), next(policy.parameters()))
    assert not hasattr(critic.backbone, "lm_head")


def test_gradients_reach_head_and_backbone(policy_and_tok):
    policy, tok = policy_and_tok
    critic = ValueModel.from_policy(policy).train()
    seqs, mask = batch(tok, ["1+1=2", "9+9=18"])
    critic.response_values(seqs, mask, 2).pow(2).sum().backward()
    assert critic.value_head.weight.grad.abs().sum() > 0
    layer_grads = [p.grad for p in critic.backbone.layers[0].parameters()]
    assert all(g is not None for g in layer_grads)
    assert sum(g.abs().sum() for g in layer_grads) > 0
    assert all(p.grad is None for p in policy.parameters())


def test_save_and_load_round_trip(policy_and_tok, tmp_path):
    policy, tok = policy_and_tok
    critic = ValueModel.from_policy(policy).eval()
    with torch.no_grad():
        critic.value_head.bias.fill_(0.25)  # something a fresh head would not have
    critic.save_pretrained(tmp_path)
    assert (tmp_path / HEAD_FILE).is_file()
    loaded = ValueModel.from_pretrained(tmp_path).eval()
    seqs, mask = batch(tok, ["5+5=10", "2=2"])
    with torch.no_grad():
        torch.testing.assert_close(loaded(seqs, mask), critic(seqs, mask), atol=1e-6, rtol=0)


def test_from_pretrained_causal_lm_path_takes_its_backbone(policy_and_tok, tmp_path):
    policy, tok = policy_and_tok
    policy.save_pretrained(tmp_path)
    critic = ValueModel.from_pretrained(tmp_path, dtype="float32")
    torch.testing.assert_close(
        critic.backbone.embed_tokens.weight, policy.get_decoder().embed_tokens.weight, atol=0, rtol=0
    )
    torch.testing.assert_close(
        critic.backbone.layers[1].mlp.up_proj.weight,
        policy.get_decoder().layers[1].mlp.up_proj.weight,
        atol=0,
        rtol=0,
    )
    assert not hasattr(critic.backbone, "lm_head")


def test_bfloat16_backbone_gives_float32_values(policy_and_tok, tmp_path):
    policy, tok = policy_and_tok
    policy.save_pretrained(tmp_path)
    critic = ValueModel.from_pretrained(tmp_path, dtype="bfloat16")
    assert next(critic.backbone.parameters()).dtype == torch.bfloat16
    assert critic.value_head.weight.dtype == torch.float32
    seqs, mask = batch(tok, ["3+3=6"])
    assert critic(seqs, mask).dtype == torch.float32


def test_missing_path_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError) as info:
        ValueModel.from_pretrained(missing)
    assert str(info.value) == f"critic.name_or_path: cannot load {str(missing)!r}: no such file or directory"


def test_bad_response_length(policy_and_tok):
    policy, tok = policy_and_tok
    critic = ValueModel.from_policy(policy)
    seqs, mask = batch(tok, ["1=1"])
    with pytest.raises(ValueError, match="num_response_tokens: must be in"):
        critic.response_values(seqs, mask, 0)


@pytest.mark.parametrize("share_prompt", [False, True])
def test_a_value_head_on_the_policy_reads_the_hidden_states_the_policy_scores_from(policy_and_tok, share_prompt):
    """PolicyValueHead: the values are the head over the policy's final hidden states at the positions before each
    response token (the critic's alignment), the same from the experience's path (no LM head) and from the
    update's forward (with log-probs); the value loss's gradient reaches the head and the policy's backbone."""
    policy, tok = policy_and_tok
    policy.train()
    head = PolicyValueHead.for_policy(policy)
    assert [p.shape for p in head.parameters()] == [(1, 32), (1,)]
    # rows 0 and 2 share a prompt, so the shared-prompt path runs where asked
    seqs, mask = batch(tok, ["12+3=15", "7+7=14", "12+3=16"])
    t = 3
    expected = policy.model(input_ids=seqs, attention_mask=mask, position_ids=position_ids_from_mask(mask)).last_hidden_state
    expected = head.value_head(expected[:, -(t + 1):-1]).squeeze(-1)
    with torch.no_grad():
        torch.testing.assert_close(head.response_values(policy, seqs, mask, t, share_prompt=share_prompt), expected,
                                   atol=2e-6, rtol=0)
    out = response_forward(policy, seqs, mask, t, hidden=True, share_prompt=share_prompt)
    logp, hidden = out.logprobs, out.hidden
    assert hidden.shape == (3, t, 32)
    torch.testing.assert_close(head(hidden), expected, atol=2e-6, rtol=0)
    torch.testing.assert_close(logp, response_forward(policy, seqs, mask, t, share_prompt=share_prompt).logprobs)
    head(hidden).pow(2).sum().backward()
    assert head.value_head.weight.grad.abs().sum() > 0
    assert sum(p.grad.abs().sum() for p in policy.model.layers[0].parameters()) > 0


def test_a_value_head_on_the_policy_saves_only_its_head(policy_and_tok, tmp_path):
    policy, _ = policy_and_tok
    head = PolicyValueHead.for_policy(policy)
    head.save_pretrained(tmp_path / "critic")
    assert [f.name for f in (tmp_path / "critic").iterdir()] == [HEAD_FILE]
    saved = load_file(tmp_path / "critic" / HEAD_FILE)
    torch.testing.assert_close(saved["weight"], head.value_head.weight.detach())
