"""The shared-prompt training forward computes transformers' forward: same log-probs, same gradients,
each distinct prompt run once; and it steps aside wherever it would not be exact."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from lmrl.models import shared_prompt
from lmrl.models.forward import model_forward_logprobs, position_ids_from_mask

P, T = 5, 4
# rows 0, 2, 4 share prompt A (2 pads), rows 1, 3 prompt B (no pad), row 5 has its own (1 pad); 0 = padding
PROMPTS = [[0, 0, 7, 8, 9], [4, 5, 6, 7, 8], [0, 0, 7, 8, 9], [4, 5, 6, 7, 8], [0, 0, 7, 8, 9], [0, 11, 12, 13, 14]]


def model_of(arch: str, kv_heads: int = 4, **config):
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_cls, model_cls = classes[arch]
    torch.manual_seed(0)
    cfg = config_cls(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=kv_heads, max_position_embeddings=64, **config)
    return model_cls(cfg).train()


def batch(prompts=PROMPTS, response_padding: bool = True):
    """Left-padded prompts, random responses; with `response_padding`, the last response token of the
    second-to-last row and the last two of the last row are padding (mask 0)."""
    rows = len(prompts)
    responses = torch.randint(3, 40, (rows, T), generator=torch.Generator().manual_seed(1))
    seqs = torch.cat([torch.tensor(prompts), responses], dim=1)
    mask = (seqs != 0).long()
    if response_padding:
        mask[-2, -1] = 0
        mask[-1, -2:] = 0
    return seqs, mask


def logprobs_and_grads(model, seqs, mask, **kw):
    model.zero_grad(set_to_none=True)
    logp, entropy = model_forward_logprobs(model, seqs, mask, T, temperature=0.7, return_entropy=True, **kw)
    (logp * torch.linspace(0.5, 1.5, logp.numel(), device=logp.device).view_as(logp)).sum().backward()
    return logp.detach(), entropy.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(("arch", "kv_heads"), [("llama", 4), ("llama", 2), ("qwen2", 4), ("qwen2", 1), ("qwen3", 2)])
def test_same_logprobs_entropy_and_gradients_as_transformers(arch, kv_heads, device):
    """Llama, Qwen2 (q / k / v biases) and Qwen3 (an RMSNorm of each query and key head), with grouped-query
    attention, left-padded prompts of different lengths, rows of one prompt not adjacent, response padding, a
    temperature."""
    model = model_of(arch, kv_heads).to(device)
    if arch == "qwen3":  # norms that are not the identity, so that skipping them would show
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    seqs, mask = (t.to(device) for t in batch())
    plain = logprobs_and_grads(model, seqs, mask)
    shared = logprobs_and_grads(model, seqs, mask, share_prompt=True)
    valid = mask[:, P:].bool()
    torch.testing.assert_close(shared[0][valid], plain[0][valid], atol=2e-6, rtol=0)
    torch.testing.assert_close(shared[1][valid], plain[1][valid], atol=2e-6, rtol=0)
    # Qwen3's head norms add a backward through each head's root mean square: its gradients, summed over a prompt's
    # rows in another order, round a little further apart (2.4e-6 seen on one thread)
    atol = 5e-6 if arch == "qwen3" else 1e-6
    for got, want in zip(shared[2], plain[2]):
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_eager_attention_models_get_eager_attention(kv_heads, monkeypatch):
    """A model loaded with attn_implementation="eager" (faster than sdpa under bfloat16 autocast on CPU)
    gets explicit matmul + float32 softmax attention, as transformers' eager forward computes it."""
    model = model_of("llama", kv_heads, attn_implementation="eager")
    called = []
    real_sdpa = shared_prompt.F.scaled_dot_product_attention
    seqs, mask = batch()
    plain = logprobs_and_grads(model, seqs, mask)
    monkeypatch.setattr(shared_prompt.F, "scaled_dot_product_attention", lambda *a, **k: called.append(1) or real_sdpa(*a, **k))
    shared = logprobs_and_grads(model, seqs, mask, share_prompt=True)
    assert not called
    valid = mask[:, P:].bool()
    torch.testing.assert_close(shared[0][valid], plain[0][valid], atol=2e-6, rtol=0)
    for got, want in zip(shared[2], plain[2]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_under_bf16_autocast_close_to_transformers(attn):
    """Under bfloat16 autocast (train.autocast_bf16) the log-probs and gradients stay within bfloat16
    rounding of transformers' forward under the same autocast (measured: log-probs equal, gradients
    1-1.5% apart at their largest entry)."""
    model = model_of("qwen2", 2, attn_implementation=attn)
    seqs, mask = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = logprobs_and_grads(model, seqs, mask)
        shared = logprobs_and_grads(model, seqs, mask, share_prompt=True)
    valid = mask[:, P:].bool()
    torch.testing.assert_close(shared[0][valid], plain[0][valid], atol=1e-2, rtol=0)
    for got, want in zip(shared[2], plain[2]):
        assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_each_distinct_prompt_runs_once_and_transformers_forward_is_skipped():
    model = model_of("llama")
    seqs, mask = batch()
    tokens_seen, model_forward = [], []
    model.model.layers[0].mlp.register_forward_hook(lambda mod, inp, out: tokens_seen.append(inp[0].shape[:-1].numel()))
    model.model.register_forward_pre_hook(lambda *a: model_forward.append(True))
    # a hook on the bypassed inner model sends the call to transformers' forward, which must then run
    with torch.no_grad():
        model_forward_logprobs(model, seqs, mask, T, share_prompt=True)
    assert model_forward == [True] and tokens_seen == [6 * (P + T)]
    model.model._forward_pre_hooks.clear()
    tokens_seen.clear()
    with torch.no_grad():
        model_forward_logprobs(model, seqs, mask, T, share_prompt=True)
    assert model_forward == [True]  # not called again
    # 3 distinct prompts once, then the 6 responses without their last token (it scores nothing)
    assert tokens_seen == [3 * P + 6 * (T - 1)]


def test_steps_aside_where_it_would_not_be_exact():
    seqs, mask = batch()
    assert shared_prompt.supports(model_of("llama"))
    assert not shared_prompt.supports(model_of("llama", attention_dropout=0.1))  # dropout in training
    assert shared_prompt.supports(model_of("llama", attention_dropout=0.1).eval())
    assert not shared_prompt.supports(model_of("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0))
    rope = model_of("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert not shared_prompt.supports(rope)
    # no two rows share a prompt: nothing to save, so the caller runs the model
    distinct = [[0, 0, 7, 8, 9], [4, 5, 6, 7, 8], [0, 11, 12, 13, 14]]
    seqs, mask = batch(distinct)
    assert shared_prompt.shared_prompt_logits(model_of("llama"), seqs, mask, position_ids_from_mask(mask), T) is None


def test_same_prompt_tokens_under_different_padding_are_different_prompts():
    """Rows are grouped by their prompt columns (tokens and mask): a left-padded and an unpadded copy of
    the same text sit at other positions, so they are not merged; the log-probs stay those of each row."""
    model = model_of("llama")
    prompts = [[0, 0, 7, 8, 9], [0, 0, 7, 8, 9], [5, 5, 7, 8, 9], [5, 5, 7, 8, 9], [0, 5, 7, 8, 9], [0, 5, 7, 8, 9]]
    seqs, mask = batch(prompts, response_padding=False)
    with torch.no_grad():
        plain = model_forward_logprobs(model, seqs, mask, T)
        shared = model_forward_logprobs(model, seqs, mask, T, share_prompt=True)
    torch.testing.assert_close(shared, plain, atol=2e-6, rtol=0)


def test_a_peft_lora_model_is_looked_through_with_the_same_gradients():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(model_of("qwen2"), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                   lora_dropout=0.0, task_type="CAUSAL_LM"))
    for name, param in model.named_parameters():  # nonzero B matrices, so the adapters change the output
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    seqs, mask = batch()
    scored = []  # positions the LM head sees: T + 1 a row in transformers' forward (logits_to_keep), T when shared
    model.get_base_model().lm_head.register_forward_hook(lambda mod, inp, out: scored.append(inp[0].shape[:-1].numel()))
    plain = logprobs_and_grads(model, seqs, mask)
    shared = logprobs_and_grads(model, seqs, mask, share_prompt=True)
    assert scored == [len(seqs) * (T + 1), len(seqs) * T]
    valid = mask[:, P:].bool()
    torch.testing.assert_close(shared[0][valid], plain[0][valid], atol=2e-6, rtol=0)
    lora_grads = [(got, want) for (name, _), got, want in zip(model.named_parameters(), shared[2], plain[2]) if "lora_" in name]
    assert lora_grads and all(want.abs().sum() > 0 for _, want in lora_grads)
    for got, want in lora_grads:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_critic_values_and_gradients_equal_its_plain_forward(arch, device):
    """PPO's critic (a value head on the policy's Llama / Qwen2 backbone, without an LM head) runs each
    distinct prompt once too: the same values at the response tokens, the same gradients, and the backbone's
    own forward is not called."""
    from lmrl.models.critic import ValueModel

    critic = ValueModel.from_policy(model_of(arch, 2)).to(device).train()
    assert shared_prompt.supports(critic.backbone)
    seqs, mask = (t.to(device) for t in batch())
    valid = mask[:, P:].bool()

    def values_and_grads(**kw):
        critic.zero_grad(set_to_none=True)
        values = critic.response_values(seqs, mask, T, **kw)
        (values[valid] * torch.linspace(0.5, 1.5, int(valid.sum()), device=device)).sum().backward()
        return values.detach(), [p.grad.clone() for p in critic.parameters()]

    plain = values_and_grads()
    calls = []  # (a hook on the stack would itself send the call to its forward: patch the class instead)
    real_forward = type(critic.backbone).forward
    type(critic.backbone).forward = lambda self, *a, **k: calls.append(True) or real_forward(self, *a, **k)
    try:
        shared = values_and_grads(share_prompt=True)
    finally:
        type(critic.backbone).forward = real_forward
    assert not calls
    assert shared[0].shape == (len(seqs), T) and shared[0].dtype == torch.float32
    torch.testing.assert_close(shared[0][valid], plain[0][valid], atol=2e-6, rtol=0)
    for got, want in zip(shared[1], plain[1]):
        # float32 rounding in a sum grows with the tensor's scale (the embedding's gradient reaches ~70 here):
        # an element near 0 of such a tensor differs by a few 1e-6 between two summation orders
        torch.testing.assert_close(got, want, atol=1e-6 + 1e-7 * want.abs().max().item(), rtol=1e-4)


# ------------------------------------------------------------------------ a reward model's pairs
PAIRS = [  # (chosen, rejected): prompts of several lengths, answers that share a first token or not, one a prefix
    ([5, 6, 7, 20, 21], [5, 6, 7, 22]),
    ([8, 9, 30, 31, 32], [8, 9, 30, 33]),  # a common start past the prompt
    ([4, 10, 11, 12, 13, 14, 25], [4, 10, 11, 12, 13, 14, 25, 26]),  # rejected = chosen + one token
    ([5, 6, 7, 20, 21], [5, 6, 7, 24, 21, 9]),  # the same prompt as the first pair
]


def seqcls_of(arch: str, kv_heads: int = 4):
    from transformers import LlamaForSequenceClassification, Qwen2ForSequenceClassification

    causal = model_of(arch, kv_heads, pad_token_id=0)
    cls = {"llama": LlamaForSequenceClassification, "qwen2": Qwen2ForSequenceClassification}[arch]
    torch.manual_seed(1)
    config = copy.deepcopy(causal.config)
    config.num_labels = 1
    model = cls(config).train()
    model.model.load_state_dict(causal.model.state_dict())
    return model


@pytest.mark.parametrize(("arch", "kv_heads"), [("llama", 4), ("llama", 2), ("qwen2", 1)])
def test_pair_rewards_with_a_shared_start_equal_two_whole_forwards(arch, kv_heads):
    from lmrl.rewards.reward_model import pad_right

    model = seqcls_of(arch, kv_heads)
    chosen, rejected = [c for c, _ in PAIRS], [r for _, r in PAIRS]
    weights = torch.linspace(0.5, 1.5, 2 * len(PAIRS))

    def rewards_and_grads(shared: bool):
        model.zero_grad(set_to_none=True)
        if shared:
            out = shared_prompt.shared_prefix_rewards(model, chosen, rejected)
        else:
            ids, mask = pad_right([*chosen, *rejected], 0)
            out = model(input_ids=ids, attention_mask=mask).logits.view(-1)
        (out * weights).sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain, shared = rewards_and_grads(False), rewards_and_grads(True)
    torch.testing.assert_close(shared[0], plain[0], atol=2e-6, rtol=0)
    assert len(shared[1]) == len(plain[1])
    for got, want in zip(shared[1], plain[1]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


def test_pair_rewards_step_aside_where_they_would_not_be_exact():
    model = seqcls_of("llama")
    assert shared_prompt.shared_prefix_rewards(model, [[5, 6]], [[7, 6]]) is None  # no common first token
    assert shared_prompt.shared_prefix_rewards(model_of("llama"), [[5, 6]], [[5, 7]]) is None  # not a classifier
