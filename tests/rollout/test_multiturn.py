"""Multi-turn rollouts: observations in the sequence but out of the loss, batched turns, budgets."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmrl import algorithms as A
from lmrl.envs import Step
from lmrl.models.forward import model_forward_logprobs
from lmrl.models.tiny import char_tokenizer
from lmrl.rollout import HFGenerator, SamplingParams
from lmrl.rollout.multiturn import generate_episodes
from tests.rollout.test_hf_generator import reference_logprobs, scrambled_model

PROMPTS = ["2+3=", "hello", "what is 7*6?"]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return scrambled_model(tok, "llama", seed=3)


def generator(model, tok):
    # digits end a turn, so that turns of a random model end often (EOS alone almost never comes)
    return HFGenerator(model, tok, eos_token_id=[tok.convert_tokens_to_ids(d) for d in "0123456789"])


class Counted:
    """A generator that records how many rows each generate call had."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.pad_token_id = inner.pad_token_id

    def generate(self, prompts, n, params):
        self.calls.append(len(prompts) * n)
        return self.inner.generate(prompts, n, params)


class Talk:
    """Answers every turn with an observation until `turns` turns were taken; reward 1 per turn."""

    def __init__(self, turns):
        self.turns, self.taken, self.seen = turns, 0, []

    def step(self, text, token_ids):
        self.taken += 1
        self.seen.append((text, list(token_ids)))
        return Step(observation=f" <obs {self.taken}> ", reward=1.0, done=self.taken >= self.turns,
                    info={"tool_calls": 1.0})


def encode(tok):
    return [tok.encode(p) for p in PROMPTS]


PARAMS = SamplingParams(max_new_tokens=12, temperature=1.0, seed=11)


def test_a_one_turn_episode_is_the_single_turn_rollout(model, tok):
    single = generator(model, tok).generate(encode(tok), 2, PARAMS)
    episodes = generate_episodes(generator(model, tok), tok, encode(tok), [{}] * 3, 2, PARAMS,
                                 env=lambda row: Talk(turns=1), max_turns=4)
    multi = episodes.rollout
    for f in dataclasses.fields(single):
        a, b = getattr(single, f.name), getattr(multi, f.name)
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), f.name
    assert multi.response_attention is None and episodes.turns == [1] * 6
    assert episodes.rewards == [1.0] * 6


def test_observations_are_in_the_sequence_but_not_in_the_loss(model, tok):
    episodes = generate_episodes(generator(model, tok), tok, encode(tok), [{}] * 3, 2, PARAMS,
                                 env=lambda row: Talk(turns=3), max_turns=3)
    r = episodes.rollout
    assert r.response_attention is not None
    observed = r.response_attention & ~r.response_mask
    assert observed.any() and not (r.response_mask & ~r.response_attention).any()
    assert (r.logprobs[observed] == 0).all()
    for i in range(len(r.texts)):
        if episodes.turns[i] > 1:  # the first observation's tokens follow the first turn
            obs = tok(" <obs 1> ", add_special_tokens=False)["input_ids"]
            start = int(r.response_mask[i].long().argmin())  # the first position not trained on
            assert r.response_ids[i, start : start + len(obs)].tolist() == obs
            assert " <obs 1> " in r.texts[i]
    assert torch.equal(r.attention_mask[:, r.prompt_ids.shape[1]:], r.response_attention)
    assert episodes.metrics["env/observation_tokens"] > 0 and episodes.metrics["env/tool_calls"] > 1


def test_sampling_logprobs_are_the_trainers_so_the_step_one_ratio_is_one(model, tok):
    episodes = generate_episodes(generator(model, tok), tok, encode(tok), [{}] * 3, 2, PARAMS,
                                 env=lambda row: Talk(turns=3), max_turns=3)
    r = episodes.rollout
    assert max(episodes.turns) == 3
    T = r.response_ids.shape[1]
    logp = model_forward_logprobs(model, r.sequences, r.attention_mask.long(), T, temperature=1.0)
    mask = r.response_mask
    torch.testing.assert_close(logp[mask], r.logprobs[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(reference_logprobs(model, r, 1.0)[mask], r.logprobs[mask], atol=1e-5, rtol=0)
    _, metrics = A.policy_loss(logp, r.logprobs, torch.ones(len(r.texts)), mask)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and metrics["clipfrac"] == 0.0


def test_observation_tokens_get_no_gradient(model, tok):
    episodes = generate_episodes(generator(model, tok), tok, encode(tok), [{}] * 3, 2, PARAMS,
                                 env=lambda row: Talk(turns=3), max_turns=3)
    r = episodes.rollout
    T = r.response_ids.shape[1]
    observed = r.response_attention & ~r.response_mask
    advantages = torch.linspace(-1, 1, len(r.texts))[:, None].expand(-1, T).clone()

    def grads(old, adv):
        model.zero_grad()
        logp = model_forward_logprobs(model, r.sequences, r.attention_mask.long(), T)
        loss, _ = A.policy_loss(logp, old, adv, r.response_mask)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    base = grads(r.logprobs, advantages)
    # change everything the loss could read at observation positions: the gradient does not move
    other_old = r.logprobs.masked_fill(observed, -3.0)
    other_adv = advantages.masked_fill(observed, 100.0)
    assert torch.equal(grads(other_old, other_adv), base)
    assert base.abs().sum() > 0
    # and the log-prob of an observation token has zero gradient from the loss
    model.zero_grad()
    logp = model_forward_logprobs(model, r.sequences, r.attention_mask.long(), T)
    logp.retain_grad()
    A.policy_loss(logp, r.logprobs, advantages, r.response_mask)[0].backward()
    assert (logp.grad[observed] == 0).all() and (logp.grad[r.response_mask] != 0).any()
    model.zero_grad()


def test_every_turn_is_one_batched_call_and_finished_episodes_leave_the_batch(model, tok):
    counted = Counted(generator(model, tok))
    ends = iter([1, 2, 3, 1, 2, 3])  # episode i ends after its step number ends[i]
    episodes = generate_episodes(counted, tok, encode(tok), [{}] * 3, 2, PARAMS,
                                 env=lambda row: Talk(turns=next(ends)), max_turns=5)
    r = episodes.rollout
    # rows whose turn was cut at max_new_tokens end early too: the calls shrink, never grow
    assert counted.calls[0] == 6 and len(counted.calls) <= 3
    assert all(a >= b for a, b in zip(counted.calls, counted.calls[1:]))
    assert sum(counted.calls) == sum(episodes.turns)
    for i, turns in enumerate(episodes.turns):
        assert turns <= [1, 2, 3, 1, 2, 3][i]
        assert turns == [1, 2, 3, 1, 2, 3][i] or not bool(r.finished[i])
    assert episodes.metrics["env/turns"] == pytest.approx(sum(episodes.turns) / 6)


def test_max_turns_and_the_token_budget_bound_each_episode(model, tok):
    capped = generate_episodes(generator(model, tok), tok, encode(tok), [{}] * 3, 2, PARAMS,
                               env=lambda row: Talk(turns=10), max_turns=2)
    assert max(capped.turns) <= 2
    budget = 20
    short = generate_episodes(generator(model, tok), tok, encode(tok), [{}] * 3, 2, PARAMS,
                              env=lambda row: Talk(turns=10), max_turns=10, max_tokens=budget)
    r = short.rollout
    lengths = r.response_attention.sum(1) if r.response_attention is not None else r.response_mask.sum(1)
    assert int(lengths.max()) <= budget
    assert not r.finished.any()  # every episode wanted more turns than the budget allowed


def test_a_step_that_is_not_a_step_is_one_line():
    from lmrl.errors import RunError

    tok = char_tokenizer()
    model = scrambled_model(tok, "llama", seed=3)

    class Bad:
        def step(self, text, ids):
            return {"done": True}

    with pytest.raises(RunError, match=r"^env: episode.step returned a dict, expected an lmrl.envs.Step$"):
        generate_episodes(generator(model, tok), tok, encode(tok), [{}] * 3, 1, PARAMS, env=lambda row: Bad(),
                          max_turns=2)


def test_the_environments_stop_strings_end_turns_too(model, tok):
    seen = []

    class Recording(Counted):
        def generate(self, prompts, n, params):
            seen.append(list(params.stop))
            return super().generate(prompts, n, params)

    class Env:
        stop = ["</calc>", "x"]

        def __call__(self, row):
            return Talk(turns=2)

    params = dataclasses.replace(PARAMS, stop=["x"])
    generate_episodes(Recording(generator(model, tok)), tok, encode(tok), [{}] * 3, 1, params, env=Env(), max_turns=2)
    assert seen and all(stop == ["x", "</calc>"] for stop in seen)
    from lmrl.envs import ToolEnvironment, Tools

    assert ToolEnvironment(Tools([])).stop == ["</tool_call>"]
    assert ToolEnvironment(Tools([]), pattern=r"<(?P<name>c)>(?P<e>.*)</c>").stop == []
