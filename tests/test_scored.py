"""Bring-your-own rollouts: scored completions from a JSONL file become an aligned Experience."""

from __future__ import annotations

import json

import pytest
import torch

from lmrl import algorithms as A
from lmrl.config import load_config
from lmrl.models.forward import model_forward_logprobs
from lmrl.models.tiny import char_tokenizer, tiny_causal_lm
from lmrl.scored import experience_from_records, load_scored_rollouts

ROWS = [
    {"prompt": "1+1=", "completion": "2", "reward": 1.0, "group_id": "a", "old_logprobs": [-0.5, -0.1]},
    {"prompt": "7+5=", "completion": "11", "reward": 0.0, "group_id": "b", "old_logprobs": [-1.0, -2.0, -0.2]},
    {"prompt": "1+1=", "completion": "3", "reward": 0.0, "group_id": "a", "old_logprobs": [-2.0, -0.3]},
    {"prompt": "7+5=", "completion": "12", "reward": 1.0, "group_id": "b", "old_logprobs": [-0.4, -0.6, -0.1]},
    {"prompt": "7+5=", "completion": "12", "reward": 1.0, "group_id": "b", "old_logprobs": [-0.4, -0.6, -0.1]},
    {"prompt": "9+9=", "completion": "1", "reward": 0.0, "group_id": "c", "finished": False, "old_logprobs": [-3.0]},
]


def write(tmp_path, rows):
    path = tmp_path / "traces.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_alignment_groups_and_logprobs(tmp_path):
    tok = char_tokenizer()
    exp = experience_from_records(load_scored_rollouts(write(tmp_path, ROWS)), tok, load_config().algorithm)
    assert exp.response_mask.sum(1).tolist() == [2, 3, 2, 3, 3, 1]  # completion tokens + EOS when finished
    T = exp.num_response_tokens
    assert tok.decode(exp.sequences[1, -T:][exp.response_mask[1]]) == "11" + tok.eos_token
    assert exp.sequences[5, -T] == tok.convert_tokens_to_ids("1") and not exp.response_mask[5, 1:].any()
    torch.testing.assert_close(exp.old_logprobs[1, :3], torch.tensor([-1.0, -2.0, -0.2]))
    assert exp.group_index.tolist() == [0, 1, 0, 1, 1, 2]
    # unequal groups, by id: a = {1, 0}, b = {0, 1, 1}, c = {0} (a group of one has advantage 0)
    want = A.group_advantages(torch.tensor([1.0, 0, 0, 1, 1, 0]), torch.tensor([0, 1, 0, 1, 1, 2]))
    torch.testing.assert_close(exp.advantages[:, 0], want)
    assert exp.advantages[5, 0] == 0 and exp.advantages[0, 0] > 0 > exp.advantages[2, 0]


def test_missing_old_logprobs_are_computed_by_the_policy(tmp_path):
    tok = char_tokenizer()
    model = tiny_causal_lm(tok, hidden_size=32, num_layers=1)
    rows = [{k: v for k, v in r.items() if k != "old_logprobs"} for r in ROWS]
    with pytest.raises(ValueError, match="no old_logprobs"):
        experience_from_records(rows, tok, load_config().algorithm)
    exp = experience_from_records(rows, tok, load_config().algorithm,
                                  policy_logprobs=lambda s, a, T: (model_forward_logprobs(model, s, a, T), None))
    direct = model_forward_logprobs(model, exp.sequences, exp.attention_mask, exp.num_response_tokens)
    torch.testing.assert_close(exp.old_logprobs, torch.where(exp.response_mask, direct, torch.zeros(())))


@pytest.mark.parametrize("row, message", [
    ({"prompt": "1+1=", "completion": "2", "group_id": 0}, "row 0 lacks reward"),
    ({"prompt": "1+1=", "completion": "2", "reward": "high", "group_id": 0}, "reward must be a number"),
])
def test_bad_rows_name_the_row_and_field(tmp_path, row, message):
    with pytest.raises(ValueError, match=message):
        load_scored_rollouts(write(tmp_path, [row]))


def test_wrong_logprob_count_and_critic_estimators():
    tok = char_tokenizer()
    bad = [dict(ROWS[0], old_logprobs=[-0.5])]
    with pytest.raises(ValueError, match="row 0 has 1 old_logprobs for 2 trainable completion tokens"):
        experience_from_records(bad, tok, load_config().algorithm)
    with pytest.raises(ValueError, match="needs a critic"):
        experience_from_records(ROWS, tok, load_config(None, ["algorithm=ppo"]).algorithm)


def scored_trainer(tmp_path):
    """A Trainer on a tiny model, to update on rollouts scored elsewhere: (trainer, model, tokenizer)."""
    from lmrl.trainer import Trainer

    tok = char_tokenizer()
    model = tiny_causal_lm(tok, hidden_size=32, num_layers=1)
    cfg = load_config(None, [f"train.output_dir={tmp_path}", "log.console=false", "optim.lr=1e-2"])
    trainer = Trainer(cfg, model=model, tokenizer=tok, reward_funcs=[lambda p, c, **k: [0.0] * len(c)],
                      train_dataset=[{"prompt": "1+1="}])
    return trainer, model, tok


def test_trainer_updates_on_scored_traces(tmp_path):
    trainer, model, tok = scored_trainer(tmp_path)
    before = [p.detach().clone() for p in model.parameters()]
    rows = [{k: v for k, v in r.items() if k != "old_logprobs"} for r in ROWS]
    metrics = trainer.train_on_scored(rows)
    assert metrics["val/ratio"] == pytest.approx(1.0, abs=1e-5)  # old log-probs were the policy's own
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


TRACE = [
    {"prompt": "12+3+4=", "group_id": "q", "reward": 1.0, "completion": [
        {"text": "add(12,3)", "trainable": True},
        {"text": "->15;", "trainable": False},
        {"role": "assistant", "content": "19"}]},
    {"prompt": "12+3+4=", "group_id": "q", "reward": 0.0, "completion": [
        {"text": "add(1,3)", "role": "assistant"},
        {"text": "->4;", "role": "tool"},
        {"text": "8"}]},
]


def test_multi_turn_traces_train_only_the_trainable_segments(tmp_path):
    tok = char_tokenizer()
    exp = experience_from_records(load_scored_rollouts(write(tmp_path, TRACE)), tok, load_config().algorithm,
                                  policy_logprobs=lambda s, a, T: (torch.zeros(s.shape[0], T), None))
    T = exp.num_response_tokens
    response = exp.sequences[0, -T:]
    assert tok.decode(response[exp.attention_mask[0, -T:].bool()]) == "add(12,3)->15;19" + tok.eos_token
    assert tok.decode(response[exp.response_mask[0]]) == "add(12,3)19" + tok.eos_token
    assert tok.decode(exp.sequences[1, -T:][exp.response_mask[1]]) == "add(1,3)8" + tok.eos_token
    assert exp.info["length"].tolist() == [12, 10]  # trainable tokens, EOS included
    assert exp.advantages[0, 0] > 0 > exp.advantages[1, 0]
    assert (exp.advantages[~exp.response_mask] == 0).all()


def test_trace_old_logprobs_are_one_per_trainable_token_and_observations_get_no_gradient():
    tok = char_tokenizer()
    model = tiny_causal_lm(tok, hidden_size=32, num_layers=1)
    row = dict(TRACE[0], old_logprobs=[-0.5] * 12)
    exp = experience_from_records([row, TRACE[1]], tok, load_config().algorithm,
                                  policy_logprobs=lambda s, a, T: (model_forward_logprobs(model, s, a, T), None))
    assert (exp.old_logprobs[0][exp.response_mask[0]] == -0.5).all()
    assert (exp.old_logprobs[~exp.response_mask] == 0).all()
    logp = model_forward_logprobs(model, exp.sequences, exp.attention_mask, exp.num_response_tokens)
    logp.retain_grad()
    A.policy_loss(logp, exp.old_logprobs, exp.advantages, exp.response_mask)[0].backward()
    observed = exp.attention_mask[:, -exp.num_response_tokens:].bool() & ~exp.response_mask
    assert observed.sum() == 5 + 4 and (logp.grad[observed] == 0).all() and (logp.grad[exp.response_mask] != 0).any()
    with pytest.raises(ValueError, match=r"row 0 has 2 old_logprobs for 12 trainable completion tokens"):
        experience_from_records([dict(row, old_logprobs=[-1.0, -1.0])], tok, load_config().algorithm)


@pytest.mark.parametrize("completion, message", [
    ([], "row 0: completion must be a string or a non-empty list of segments"),
    (["text"], r"row 0: completion\[0\] must be a \{'text', 'trainable'\} object, got str"),
    ([{"trainable": True}], r"row 0: completion\[0\] needs a string 'text'"),
    ([{"text": "x", "trainable": "yes"}], r"row 0: completion\[0\].trainable must be true or false"),
    ([{"text": "x", "trainable": False}], "row 0 has no trainable completion token"),
])
def test_bad_traces_name_the_row_and_segment(tmp_path, completion, message):
    row = {"prompt": "1+1=", "completion": completion, "reward": 1.0, "group_id": 0, "finished": False}
    with pytest.raises(ValueError, match=message):
        experience_from_records(load_scored_rollouts(write(tmp_path, [row])), char_tokenizer(), load_config().algorithm)


def test_trainer_updates_on_multi_turn_traces(tmp_path):
    trainer, model, tok = scored_trainer(tmp_path)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = trainer.train_on_scored(TRACE)
    assert metrics["val/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_batch_std_advantage_by_group_id():
    from lmrl.scored import BY_GROUP_ID

    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0])
    groups = torch.tensor([7, 7, 3, 3, 9])  # the lone sample of group 9 gets 0
    want = torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0]) / (r.std() + 1e-8)
    torch.testing.assert_close(BY_GROUP_ID["grpo_batch_std"](r, groups), want)


def test_tapeagents_knobs_on_scored_rollouts():
    tok = char_tokenizer()
    raw = experience_from_records(ROWS, tok, load_config(None, ["algorithm.use_advantages=false"]).algorithm)
    torch.testing.assert_close(raw.advantages[:, 0], torch.tensor([1.0, 0, 0, 1, 1, 0]))
    relu = experience_from_records(ROWS, tok, load_config(None, ["algorithm.relu_log_p_weights=true"]).algorithm)
    plain = experience_from_records(ROWS, tok, load_config().algorithm)
    torch.testing.assert_close(relu.advantages, plain.advantages.clamp(min=0))
    assert (plain.advantages < 0).any()
