"""RewardModelScorer with a tiny LlamaForSequenceClassification and the char tokenizer."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from lmrl.models.tiny import char_tokenizer
from lmrl.rewards import RewardModelScorer, resolve_reward, score

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
)


def tiny_reward_model(tokenizer, num_labels=1, pad=True):
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id if pad else None,
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).eval()
    with torch.no_grad():  # a zero-initialised head would score everything 0: make scores distinct
        model.score.weight.normal_(0, 1.0)
    return model


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_reward_model(tok)


def manual_score(model, tok, text):
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        return model(input_ids=ids).logits[0, 0].item()


PROMPTS = ["What is 2+2? ", "Name a colour: ", "Q: ", "Say hi. "]
COMPLETIONS = ["4", "a rather long answer: blue", "x", "hi there!"]


def test_scores_match_unbatched_forward(model, tok):
    scorer = RewardModelScorer(model, tok, batch_size=3)
    out = scorer(PROMPTS, COMPLETIONS)
    assert len(out) == 4 and all(isinstance(v, float) for v in out)
    expected = [manual_score(model, tok, p + c) for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    assert out == pytest.approx(expected, abs=1e-5)
    assert len(set(round(v, 4) for v in out)) == 4  # not a constant


def test_batch_size_does_not_change_scores(model, tok):
    one = RewardModelScorer(model, tok, batch_size=1)(PROMPTS, COMPLETIONS)
    four = RewardModelScorer(model, tok, batch_size=4)(PROMPTS, COMPLETIONS)
    assert one == pytest.approx(four, abs=1e-5)


def test_no_grad_and_model_untouched(model, tok):
    before = [p.clone() for p in model.parameters()]
    out = RewardModelScorer(model, tok)(PROMPTS[:1], COMPLETIONS[:1])
    assert isinstance(out[0], float)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_max_length_keeps_the_end(model, tok):
    scorer = RewardModelScorer(model, tok, max_length=5)
    out = scorer(["a long prompt "], ["answer"])
    assert out[0] == pytest.approx(manual_score(model, tok, "nswer"), abs=1e-5)


def test_chat_template_prompts(model):
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    scorer = RewardModelScorer(model, tok)
    prompt = [{"role": "user", "content": "hi"}]
    text, special = scorer.render(prompt, "hello")
    assert text == "<user>hi\n<assistant>hello\n" and special is False
    out = scorer([prompt], ["hello"])
    assert out[0] == pytest.approx(manual_score(model, tok, text), abs=1e-5)


def test_errors(tok, model):
    with pytest.raises(ValueError, match="chat-message prompts need a tokenizer with a chat_template"):
        RewardModelScorer(model, tok)([[{"role": "user", "content": "hi"}]], ["x"])
    with pytest.raises(ValueError, match="pad_token_id is None"):
        RewardModelScorer(tiny_reward_model(tok, pad=False), tok)
    with pytest.raises(ValueError, match="needs num_labels=1, got 2"):
        RewardModelScorer(tiny_reward_model(tok, num_labels=2), tok)


def test_through_score_and_registry(tmp_path, model, tok):
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    fn = resolve_reward("reward_model", path=str(tmp_path), batch_size=2)
    out = score([fn], PROMPTS, COMPLETIONS)
    expected = [manual_score(model, tok, p + c) for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    assert out.scores.tolist() == pytest.approx(expected, abs=1e-5)
    assert "reward/reward_model/mean" in out.metrics
