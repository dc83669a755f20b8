"""Tests for lmrl.models.forward: position ids, the shift of response-token log-probs, padding, logits only for
the response, chunking and bad arguments."""

from __future__ import annotations

import pytest
import torch

from lmrl.models.forward import model_forward_logprobs, position_ids_from_mask
from lmrl.models.tiny import char_tokenizer, tiny_causal_lm
from tests.models.conftest import ARCHS


def left_padded_batch(tok, prompts: list[str], responses: list[str]):
    """Prompt left-padded, response right-padded (mask 0 on response padding), as the generator returns."""
    p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    r_ids = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in responses]
    p_len, t = max(map(len, p_ids)), max(map(len, r_ids))
    seqs, masks = [], []
    for p, r in zip(p_ids, r_ids):
        seqs.append([tok.pad_token_id] * (p_len - len(p)) + p + r + [tok.pad_token_id] * (t - len(r)))
        masks.append([0] * (p_len - len(p)) + [1] * (len(p) + len(r)) + [0] * (t - len(r)))
    return torch.tensor(seqs), torch.tensor(masks), t


def test_position_ids_from_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_full_forward_shift_and_gather(arch, temperature):
    tok = char_tokenizer(pad_is_eos=True)  # pad == eos: nothing may rely on pad_token_id
    model = tiny_causal_lm(tok, arch=arch, hidden_size=32)
    seqs, mask, t = left_padded_batch(tok, ["1+2=", "10+20=", "7="], ["3", "30", "seven"])
    got = model_forward_logprobs(model, seqs, mask, t, temperature=temperature)
    assert got.shape == (3, t) and got.dtype == torch.float32
    with torch.no_grad():
        logits = model(seqs, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    # logits at position s score token s + 1; the response is the last t columns
    full = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    expected = full.gather(-1, seqs[:, 1:, None]).squeeze(-1)[:, -t:]
    torch.testing.assert_close(got.detach(), expected, atol=1e-5, rtol=0)
    # the same thing, one token at a time, naively
    s = seqs.shape[1]
    for b in range(3):
        for j in range(t):
            pos = s - t + j
            naive = torch.log_softmax(logits[b, pos - 1] / temperature, dim=-1)[seqs[b, pos]]
            assert abs(got[b, j].item() - naive.item()) < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padded_logprobs_equal_unpadded(arch):
    """Left padding + cumsum positions give the log-probs of each sequence run alone (as generation)."""
    tok = char_tokenizer()
    model = tiny_causal_lm(tok, arch=arch, hidden_size=32)
    prompts, responses = ["123+4=", "5="], ["127", "5"]
    seqs, mask, t = left_padded_batch(tok, prompts, responses)
    with torch.no_grad():
        batched = model_forward_logprobs(model, seqs, mask, t)
        for b, (p, r) in enumerate(zip(prompts, responses)):
            ids = tok(p + r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            alone = torch.tensor([ids])
            n = len(r) + 1
            single = model_forward_logprobs(model, alone, torch.ones_like(alone), n)
            torch.testing.assert_close(batched[b, :n], single[0], atol=1e-5, rtol=0)


def test_logits_only_for_response(saved):
    """The lm_head sees T + 1 positions, never the prompt's."""
    _, _, model, tok = saved
    seqs, mask, t = left_padded_batch(tok, ["1111111111+2=", "3="], ["1113", "5"])
    seen = []
    handle = model.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape[1]))
    try:
        with torch.no_grad():
            model_forward_logprobs(model, seqs, mask, t)
    finally:
        handle.remove()
    assert seen == [t + 1] and t + 1 < seqs.shape[1]


def test_chunked_logprobs_equal_and_differentiable(saved):
    _, _, model, tok = saved
    seqs, mask, t = left_padded_batch(tok, ["12+3=", "4+4="], ["15", "8"])
    whole = model_forward_logprobs(model, seqs, mask, t)
    chunked = model_forward_logprobs(model, seqs, mask, t, chunk_size=2)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=0)
    whole.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_logprobs_bad_arguments(saved):
    _, _, model, tok = saved
    seqs, mask, t = left_padded_batch(tok, ["1="], ["1"])
    with pytest.raises(ValueError, match="num_response_tokens: must be in"):
        model_forward_logprobs(model, seqs, mask, seqs.shape[1])
    with pytest.raises(ValueError, match="temperature: must be > 0"):
        model_forward_logprobs(model, seqs, mask, t, temperature=0.0)
