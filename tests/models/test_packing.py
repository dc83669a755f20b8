"""Packed forwards (`train.packing`): only the real tokens run, each distinct prompt once, and the log-probs,
entropies, values and gradients at every real position are those of transformers' padded forward."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lmrl.models.forward import model_forward_logprobs, trimmed
from tests.models.test_shared_prompt import model_of

P, T = 7, 6
# prompts of 3 to 7 real tokens (0 = padding), three shared; responses of 1 to 6 real tokens
PROMPTS = [[0, 0, 0, 0, 7, 8, 9], [4, 5, 6, 7, 8, 9, 10], [0, 0, 0, 0, 7, 8, 9], [0, 0, 0, 0, 7, 8, 9],
           [0, 0, 11, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10]]
RESPONSE_LENGTHS = [2, 6, 1, 4, 3, 5]


def batch(lengths=RESPONSE_LENGTHS, prompts=PROMPTS, width=T):
    responses = torch.randint(3, 40, (len(prompts), width), generator=torch.Generator().manual_seed(1))
    seqs = torch.cat([torch.tensor(prompts), responses], dim=1)
    mask = (seqs != 0).long()
    for row, n in enumerate(lengths):
        mask[row, P + n:] = 0
        seqs[row, P + n:] = 0
    return seqs, mask


def run(model, seqs, mask, **kw):
    model.zero_grad(set_to_none=True)
    logp, entropy = model_forward_logprobs(model, seqs, mask, seqs.shape[1] - P, temperature=0.7, return_entropy=True,
                                           **kw)
    weights = torch.linspace(0.5, 1.5, logp.numel()).view_as(logp) * mask[:, P:]  # the loss: real tokens only
    (logp * weights).sum().backward()
    return logp.detach(), entropy.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def assert_same(packed, plain, mask, grad_atol=1e-6, ran=None):
    """`ran`: `[B, T]` the positions the packed forward ran (default: the real ones); 0 elsewhere."""
    valid = mask[:, P:].bool()
    ran = valid if ran is None else ran
    torch.testing.assert_close(packed[0][valid], plain[0][valid], atol=2e-6, rtol=0)
    torch.testing.assert_close(packed[1][valid], plain[1][valid], atol=2e-6, rtol=0)
    assert (packed[0][~ran] == 0).all() and (packed[1][~ran] == 0).all()
    for got, want in zip(packed[2], plain[2]):
        torch.testing.assert_close(got, want, atol=grad_atol + 1e-7 * want.abs().max().item(), rtol=1e-4)


@pytest.mark.parametrize(("arch", "kv_heads", "attn"),
                         [("llama", 4, "sdpa"), ("llama", 2, "eager"), ("qwen2", 1, "sdpa"), ("qwen3", 2, "sdpa")])
def test_packed_equals_the_padded_forward(arch, kv_heads, attn):
    """Prompts and completions of different lengths, grouped-query attention (the key heads never repeated),
    Qwen2's biases and Qwen3's head norms, sdpa and eager attention."""
    model = model_of(arch, kv_heads, attn_implementation=attn)
    seqs, mask = batch()
    assert_same(run(model, seqs, mask, share_prompt=True, pack=True), run(model, seqs, mask), mask,
                grad_atol=5e-6 if arch == "qwen3" else 1e-6)


def test_only_real_tokens_run_and_the_lm_head_sees_only_scored_ones():
    model = model_of("llama", 2)
    seqs, mask = batch()
    seen, scored = [], []
    model.model.layers[0].mlp.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape[:-1].numel()))
    model.lm_head.register_forward_hook(lambda mod, inp, out: scored.append(inp[0].shape[:-1].numel()))
    with torch.no_grad():
        model_forward_logprobs(model, seqs, mask, T, share_prompt=True, pack=True)
    prompt_tokens = 3 + 7 + 5  # three distinct prompts, each once, without padding
    # each response but its last token (it scores nothing), never the padding after it
    assert seen == [prompt_tokens + sum(n - 1 for n in RESPONSE_LENGTHS)]
    assert scored == [sum(RESPONSE_LENGTHS)]
    seen.clear()
    with torch.no_grad():  # padded (train.packing=false): every column of every distinct prompt and response
        model_forward_logprobs(model, seqs, mask, T, share_prompt=True)
    assert seen == [3 * P + 6 * (T - 1)]


def test_rows_without_a_shared_prompt_are_packed_too():
    model = model_of("qwen2", 2)
    prompts = [[0, 0, 0, 0, 7, 8, 9], [4, 5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14, 15]]
    seqs, mask = batch([2, 6, 3], prompts)
    assert_same(run(model, seqs, mask, share_prompt=True, pack=True), run(model, seqs, mask), mask)


def test_holes_inside_a_response_are_masked_as_keys_as_the_model_masks_them():
    """A response whose attention mask has a 0 between real tokens: the hole still runs as a query (its
    output scores the next token, in both forwards) and is never attended to."""
    model = model_of("llama", 2)
    seqs, mask = batch()
    mask[1, P + 2] = 0
    plain, packed = run(model, seqs, mask), run(model, seqs, mask, share_prompt=True, pack=True)
    valid = mask[:, P:].bool()
    torch.testing.assert_close(packed[0][valid], plain[0][valid], atol=2e-6, rtol=0)
    for got, want in zip(packed[2], plain[2]):
        torch.testing.assert_close(got, want, atol=1e-6 + 1e-7 * want.abs().max().item(), rtol=1e-4)


def test_under_bf16_autocast_close_to_the_padded_forward():
    model = model_of("qwen2", 2, attn_implementation="eager")
    seqs, mask = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, packed = run(model, seqs, mask), run(model, seqs, mask, share_prompt=True, pack=True)
    valid = mask[:, P:].bool()
    torch.testing.assert_close(packed[0][valid], plain[0][valid], atol=2e-2, rtol=0)
    for got, want in zip(packed[2], plain[2]):
        assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_other_models_run_without_the_columns_no_row_uses():
    """GPT-2 has no module-by-module forward here: packing cuts the batch to the columns some row uses, with the
    same log-probs and gradients."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).train()
    seqs, mask = batch([2, 3, 1, 3, 2, 3], width=T)  # at most 3 of 6 response columns used
    widths = []
    model.transformer.register_forward_pre_hook(lambda mod, args: widths.append(args[0].shape[1]))
    plain, packed = run(model, seqs, mask), run(model, seqs, mask, pack=True)
    assert widths == [P + T, P + 3]  # every prompt column holds a real token of the second row
    assert_same(packed, plain, mask, ran=(torch.arange(T) < 3).expand(len(seqs), -1))


def test_trimmed_keeps_one_response_column_and_the_prompts_last():
    seqs, mask = batch([0, 0, 0, 0, 0, 0])
    _, _, t = trimmed(seqs, mask, T)
    assert t == 1
    prompts = [[0, 0, 0, 0, 7, 8, 9], [0, 0, 0, 5, 6, 8, 9]]
    seqs, mask = batch([2, 1], prompts)
    out, out_mask, t = trimmed(seqs, mask, T)
    assert t == 2 and out.shape == (2, 4 + 2) and out_mask[:, :4].sum() == 7


@pytest.mark.parametrize("shared_head", [False, True])
def test_critic_values_packed_equal_padded(shared_head):
    """PPO's critic: a value model of its own, or a head on the policy's backbone."""
    from lmrl.models.critic import PolicyValueHead, ValueModel

    policy = model_of("llama", 2)
    seqs, mask = batch()
    valid = mask[:, P:].bool()
    critic = PolicyValueHead.for_policy(policy) if shared_head else ValueModel.from_policy(policy).train()
    args = (policy, seqs, mask, T) if shared_head else (seqs, mask, T)
    trained = [*critic.parameters(), *(policy.parameters() if shared_head else [])]

    def values_and_grads(**kw):
        for p in trained:
            p.grad = None
        values = critic.response_values(*args, **kw)
        (values[valid] * torch.linspace(0.5, 1.5, int(valid.sum()))).sum().backward()
        return values.detach(), [p.grad.clone() for p in trained if p.grad is not None]

    plain, packed = values_and_grads(), values_and_grads(share_prompt=True, pack=True)
    torch.testing.assert_close(packed[0][valid], plain[0][valid], atol=2e-6, rtol=0)
    assert (packed[0][~valid] == 0).all() and len(packed[1]) == len(plain[1])
    for got, want in zip(packed[1], plain[1]):
        torch.testing.assert_close(got, want, atol=1e-6 + 1e-7 * want.abs().max().item(), rtol=1e-4)


def test_under_gradient_checkpointing_each_layer_runs_again_in_the_backward():
    """model.gradient_checkpointing: the packed forward keeps each layer's input only and recomputes the layer in the
    backward (the MLP runs twice), with the same log-probs and gradients."""
    model = model_of("llama", 2)
    seqs, mask = batch()
    plain = run(model, seqs, mask, share_prompt=True, pack=True)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    calls = []
    # (a pre-hook: the recomputation stops once it has what the backward needs, inside the MLP)
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    checkpointed = run(model, seqs, mask, share_prompt=True, pack=True)
    assert len(calls) == 2
    assert_same(checkpointed, plain, mask)
    calls.clear()
    with torch.no_grad():  # no backward to recompute for: the layers run once
        model_forward_logprobs(model, seqs, mask, T, share_prompt=True, pack=True)
    assert len(calls) == 1
