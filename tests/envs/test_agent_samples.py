"""An agent's episode as several training samples: where a request does not extend the tokens sampled so far (a
reasoning model's template cuts the reasoning, the agent compacts or rewrites its context), each model call's tokens
are trained in exactly the context they were sampled in, and baselines are taken over episodes."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from lmrl.agents.programs import AgentEnvironment
from lmrl.experience import compute_advantages, make_experience
from lmrl.models.forward import model_forward_logprobs
from lmrl.models.shipped import SHIPPED_MODELS, load_shipped
from lmrl.rollout.base import Rollout, SamplingParams
from lmrl.rollout.hf import HFGenerator
from lmrl.rollout.multiturn import generate_episodes
from lmrl.rollout.ops import concat_rollouts, select_rollout
from lmrl.rollout.samples import split_samples
from tests.envs import python
from tests.envs.test_agent import AGENT, ROWS


def episodes_of(gen, tok, prompts, mode, log, n=2, max_turns=4, max_new_tokens=24):
    os.environ["AGENT_MODE"], os.environ["AGENT_LOG"] = mode, str(log)
    try:
        return generate_episodes(gen, tok, prompts, ROWS, n, SamplingParams(max_new_tokens=max_new_tokens, seed=0),
                                 AgentEnvironment(f"{python()} {AGENT}", timeout=60), max_turns=max_turns,
                                 max_tokens=128)
    finally:
        del os.environ["AGENT_MODE"], os.environ["AGENT_LOG"]


def calls(log: Path) -> dict[str, list[list[list[int]]]]:
    """Per prompt, each episode's model calls: the token ids the gateway served, call by call."""
    out: dict[str, list] = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        out.setdefault(entry["prompt"], []).append(entry["turns"])
    return out


def assert_trained_as_sampled(model, rollout: Rollout, pad_id: int) -> tuple[Rollout, torch.Tensor]:
    """Each sample as the trainer's forward sees it gives the log-probs its tokens were sampled with (the sync check,
    1e-3): its tokens were sampled after exactly that context."""
    split, episode = split_samples(rollout, pad_id)
    T = split.response_ids.shape[1]
    trainer = model_forward_logprobs(model, split.sequences, split.attention_mask, T, pack=True)
    m = split.response_mask
    assert (trainer[m] - split.logprobs[m]).abs().max().item() < 1e-3
    return split, episode


def test_a_compacting_agent_trains_every_call_token_exact(policy, tmp_path):
    """The third request drops the first tool result: the first two calls close as a sample, the third is one of its
    own after the compacted context; nothing sampled is lost or re-tokenized."""
    gen, tok = policy
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in ROWS]
    episodes = episodes_of(gen, tok, prompts, "compact", tmp_path / "log.jsonl")
    r, served = episodes.rollout, calls(tmp_path / "log.jsonl")
    assert episodes.metrics["agent/failures"] == 0 and episodes.metrics["agent/retokenized_tokens"] == 0
    assert episodes.metrics["agent/samples_per_episode"] == 2
    split, episode = assert_trained_as_sampled(gen.model, r, tok.pad_token_id)
    assert episode.tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and split.prompt_index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    for i in range(len(r.texts)):
        first, second = (split.response_ids[k][split.response_mask[k]] for k in (2 * i, 2 * i + 1))
        turns = [t for t in served[ROWS[i // 2]["prompt"]] if [t[0] + t[1], t[2]] == [first.tolist(), second.tolist()]]
        assert turns  # call by call, the ids served (two episodes of a prompt may share their first calls)
        (at, context), = r.contexts[i]
        assert at == int(r.response_attention[i].sum()) - len(turns[0][2])  # the third call's tokens last
        said = [tok.decode(t, skip_special_tokens=True) for t in turns[0][:2]]  # as the agent's text holds them
        assert tok.decode(context, skip_special_tokens=True) == ROWS[i // 2]["prompt"] + said[0] + said[1]
        assert "=" in tok.decode(split.response_ids[2 * i][split.response_attention[2 * i] & ~split.response_mask[2 * i]])


def test_an_agent_that_rewrites_the_models_text_trains_it_as_sampled_and_counts_it(policy, tmp_path):
    """The agent replaces the model's first turn by text of its own: that turn is trained as sampled, in its own
    sample; the next call's sample is sampled after the agent's version, which is attended, never trained on."""
    gen, tok = policy
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in ROWS]
    episodes = episodes_of(gen, tok, prompts, "edit", tmp_path / "log.jsonl")
    r, served = episodes.rollout, calls(tmp_path / "log.jsonl")
    assert episodes.metrics["agent/retokenized_tokens"] > 0 and episodes.metrics["agent/samples_per_episode"] == 2
    split, _ = assert_trained_as_sampled(gen.model, r, tok.pad_token_id)
    for i in range(len(r.texts)):
        trained = r.response_ids[i][r.response_mask[i]].tolist()
        assert trained in [t[0] + t[1] for t in served[ROWS[i // 2]["prompt"]]]  # both calls, as served
        context = tok.decode(r.contexts[i][0][1])
        assert context.startswith(ROWS[i // 2]["prompt"] + "<calc>1+1</calc>=2")  # the agent's version, attended


def test_with_a_template_that_cuts_reasoning_every_sampled_token_of_both_turns_is_trained(tmp_path):
    """A chat model whose template opens <think> in the generation prompt and writes earlier turns without their
    reasoning (DeepSeek-R1's): the second request never extends the first call's tokens. Before, it was refused with
    400 and every episode failed; now each call is a sample of its own, trained on exactly the ids served."""
    from lmrl.models.prompt_encoding import encode_prompts
    from lmrl.models.tiny import REASONING_TEMPLATE, bpe_chat_tokenizer, tiny_causal_lm

    tok = bpe_chat_tokenizer([r["prompt"] + " =168 <think>the sum</think> is 83" for r in ROWS] * 20, 300,
                             REASONING_TEMPLATE)
    gen = HFGenerator(tiny_causal_lm(tok, hidden_size=32, num_layers=1, seed=0), tok, seed=0)
    prompts = encode_prompts(tok, [[{"role": "user", "content": r["prompt"]}] for r in ROWS], 64, use_chat_template=True)
    episodes = episodes_of(gen, tok, prompts, "chat", tmp_path / "log.jsonl", n=1, max_turns=2, max_new_tokens=12)
    r = episodes.rollout
    assert episodes.metrics["agent/failures"] == 0 and episodes.rewards == [0.5, 0.5]
    assert episodes.metrics["agent/retokenized_tokens"] == 0 and episodes.metrics["agent/samples_per_episode"] == 2
    split, _ = assert_trained_as_sampled(gen.model, r, tok.pad_token_id)
    log = {json.loads(line)["prompt"]: json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()}
    for i, row in enumerate(ROWS):
        turns = log[row["prompt"]]["turns"]
        for j in range(2):  # call by call, the trained ids are the ids served
            assert split.response_ids[2 * i + j][split.response_mask[2 * i + j]].tolist() == turns[j]
        context = tok.decode(split.prompt_ids[2 * i + 1][split.prompt_mask[2 * i + 1]].tolist())
        assert context.startswith(f"<|im_start|>user\n{row['prompt']}<|im_end|>\n<|im_start|>assistant\n")
        assert context.endswith("<|im_start|>assistant\n<think>\n") and "<think>" not in context[:-9]


def test_a_template_that_cuts_an_earlier_turns_reasoning_is_followed_and_unchanged_turns_stay_as_sampled():
    from lmrl.models.tiny import REASONING_TEMPLATE, bpe_chat_tokenizer
    from lmrl.rollout.chat_turns import Reply, render_conversation

    tok = bpe_chat_tokenizer(["hello <think>why</think> yes"] * 5, 300, REASONING_TEMPLATE)
    user, then = {"role": "user", "content": "Q"}, {"role": "user", "content": "go on"}
    reasoned = {"role": "assistant", "content": "why</think>yes"}
    plain = {"role": "assistant", "content": "yes"}
    text, changed = render_conversation(tok, [user, reasoned, then], None,
                                        [Reply(reasoned, "why</think>yes  <|im_end|>", "<|im_end|>")])
    assert "assistant\nyes<|im_end|>" in text and "why" not in text and changed == []  # the template's, not ours
    text, changed = render_conversation(tok, [user, plain, then], None, [Reply(plain, "yes  <|im_end|>", "<|im_end|>")])
    assert "assistant\nyes  <|im_end|>" in text and changed == []  # as sampled (its spacing, not the template's)
    text, changed = render_conversation(tok, [user, {**plain, "content": "no"}, then], None,
                                        [Reply(plain, "yes<|im_end|>", "<|im_end|>")])
    assert "assistant\nno<|im_end|>" in text and changed == [0]  # the agent rewrote it
    tok.chat_template = ("{% for m in messages %}{% if m['content'] is none %}{{ raise_exception('content') }}{% endif %}"
                         "{{ m['content'] }}{% endfor %}")  # strict: it cannot write a reply without content as sent
    empty = {"role": "assistant", "content": None}
    assert render_conversation(tok, [user, empty], None, [Reply(empty, "RAW", "")]) == ("QRAW", [])  # ours, kept


def _rollout(contexts) -> Rollout:
    """Two episodes of one prompt [5, 6]: episode 0 of three samples (responses 7 8 | obs 9, 10 | 11), episode 1 of one."""
    response = torch.tensor([[7, 8, 9, 10, 11], [12, 13, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    attention = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    logprobs = torch.tensor([[-1.0, -2.0, 0.0, -3.0, -4.0], [-5.0, -6.0, 0.0, 0.0, 0.0]])
    return Rollout(torch.tensor([[5, 6], [5, 6]]), torch.ones(2, 2, dtype=torch.bool), response, mask, logprobs,
                   ["ep0", "ep1"], torch.tensor([True, False]), torch.tensor([0, 0]), attention, contexts=contexts)


def test_split_samples_cuts_each_sample_out_of_its_episodes_row_after_its_own_context():
    r = _rollout([[(2, [5, 6, 7, 8, 42]), (4, [5, 43])], []])
    split, episode = split_samples(r, pad_id=0)
    assert episode.tolist() == [0, 0, 0, 1] and split.prompt_index.tolist() == [0, 0, 0, 0]
    assert split.prompt_ids.tolist() == [[0, 0, 0, 5, 6], [5, 6, 7, 8, 42], [0, 0, 0, 5, 43], [0, 0, 0, 5, 6]]
    assert split.response_ids.tolist() == [[7, 8], [9, 10], [11, 0], [12, 13]]
    assert split.response_mask.tolist() == [[True, True], [False, True], [True, False], [True, True]]
    assert split.response_attention.tolist() == [[True, True], [True, True], [True, False], [True, True]]
    assert split.logprobs.tolist() == [[-1, -2], [0, -3], [-4, 0], [-5, -6]]
    assert split.texts == ["ep0", "", "", "ep1"] and split.finished.tolist() == [True, True, True, False]
    assert split_samples(_rollout(None), 0)[1] is None  # every row one sample: the rollout as it is
    # the contexts travel with their rows through dynamic sampling's select and the rounds' concat
    kept = select_rollout(r, torch.tensor([1, 0]))
    assert kept.contexts == [[], r.contexts[0]]
    joined = concat_rollouts([_rollout(None), r], pad_id=0)
    assert joined.contexts == [[], [], *r.contexts] and split_samples(joined, 0)[1].tolist() == [0, 1, 2, 2, 2, 3]


def test_baselines_are_taken_over_episodes_so_an_episode_of_more_samples_does_not_weigh_more():
    mask = torch.ones(4, 2, dtype=torch.bool)
    episode = torch.tensor([0, 0, 0, 1])  # episode 0 (reward 1) is three samples, episode 1 (reward 0) one
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0])
    adv = compute_advantages(scores, mask, 2, advantage="grpo", episode_index=episode).advantages[:, 0]
    # by hand: the group's rewards are [1, 0], mean 0.5, std 0.7071 -> +-0.7071, each sample its episode's
    assert torch.allclose(adv, torch.tensor([0.7071, 0.7071, 0.7071, -0.7071]), atol=1e-4)
    rows = compute_advantages(scores, mask, 4, advantage="grpo").advantages[:, 0]  # the bias it avoids
    assert torch.allclose(rows, torch.tensor([0.5, 0.5, 0.5, -1.5]), atol=1e-4)
    # a sequence-level KL in the reward is the episode's: its samples' KL summed
    kl = torch.tensor([[0.1, 0.1], [0.2, 0.0], [0.0, 0.1], [0.3, 0.3]])
    out = compute_advantages(scores, mask, 2, advantage="reinforce", episode_index=episode, kl=kl, kl_coef=1.0,
                             kl_in="reward", kl_level="sequence").advantages[:, 0]
    assert torch.allclose(out, torch.tensor([0.5, 0.5, 0.5, -0.6]), atol=1e-6)  # 1 - 0.5 and 0 - 0.6


def test_make_experience_trains_each_sample_with_its_episodes_advantage():
    r = _rollout([[(2, [5, 6, 7, 8, 42]), (4, [5, 43])], []])
    exp = make_experience(r, torch.tensor([1.0, 0.0]), advantage="grpo", policy_logprobs=None,
                          loss_mask=torch.tensor([True, False]), info={"reward/x": torch.tensor([3.0, 4.0])})
    assert len(exp) == 4 and exp.episode_index.tolist() == [0, 0, 0, 1]
    assert exp.advantages[:, 0].tolist() == pytest.approx([0.7071, 0.0, 0.7071, 0.0], abs=1e-4)  # 0: a masked token
    assert exp.advantages[1, 1].item() == pytest.approx(0.7071, abs=1e-4)
    assert not exp.response_mask[3].any()  # the episode's loss mask reaches every one of its samples
    assert exp.info["reward/x"].tolist() == [3.0, 3.0, 3.0, 4.0]
    assert exp.per_episode().scores.tolist() == [1.0, 0.0]
    assert int(exp.response_mask.sum()) == int(r.response_mask[0].sum())  # each trained token once


def test_lmrl_train_trains_an_agent_whose_episodes_are_several_samples_and_logs_them_per_episode(tmp_path):
    """Through `lmrl train` (and a resume): the compacting agent's episodes are two samples each, the update runs
    a row per sample, `samples.jsonl` and the scores count episodes."""
    from tests.forked import lmrl

    args = ["train", "model.name_or_path=tiny-calculator", "data.task=calculator", "env.name=agent",
            f"env.command={python()} {AGENT}", "env.timeout=60", "env.max_parallel=4", "env.max_turns=4",
            "rollout.prompts_per_step=1", "rollout.group_size=2", "train.eval_every=0", "train.save_every=1",
            "data.num_eval_prompts=1", f"train.output_dir={tmp_path / 'run'}", "log.console=false",
            "log.samples_every=1", "log.num_samples=8"]
    env = {**os.environ, "AGENT_MODE": "compact", "AGENT_LOG": str(tmp_path / "log.jsonl")}
    out = lmrl(*args, "train.steps=1", cwd=tmp_path, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    out = lmrl(*args, "train.steps=2", "train.resume=auto", cwd=tmp_path, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "env/turns" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["agent/samples_per_episode"] == 2 and r["agent/closed_sample_tokens"] > 0 and r["env/turns"] == 3
        assert r["agent/failures"] == 0 and r["agent/retokenized_tokens"] == 0
        assert math.isfinite(r["loss/policy_avg"]) and math.isfinite(r["objective/scores"])
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4  # 2 episodes a step, one line each (not one per sample)


def test_the_shipped_tiny_reasoner_writes_earlier_turns_without_their_reasoning():
    """`tiny-reasoner` (scripts/make_tiny_model.py --task reasoner) carries the template the example depends on; its
    run through examples/reasoning_agent.py is docs/agents.md's executed example, its numbers benchmarks/."""
    _, tok = load_shipped(SHIPPED_MODELS["tiny-reasoner"])
    turn = {"role": "assistant", "content": "47+85+36</think><calc>47+85+36</calc>"}
    text = tok.apply_chat_template([{"role": "user", "content": "47+85+36="}, turn, {"role": "user", "content": "=168"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == "U:47+85+36=\nA:<calc>47+85+36</calc>\nU:=168\nA:<think>"


class ChatCalculator:
    """The calculator task as a chat environment of lmrl's own: a call's result comes back as a user message."""

    def __call__(self, row):
        return _ChatEpisode(row)


class _ChatEpisode:
    def __init__(self, row):
        self.row, self.called = row, False

    def step(self, text, token_ids):
        from lmrl.envs import Step

        said = text.split("</think>")[-1]
        call = re.search(r"<calc>([^<>]*)</calc>", said)
        if call and not self.called:
            self.called = True
            terms = [t for t in call.group(1).split("+") if t.strip().isdigit()]
            return Step(observation=[{"role": "user", "content": f"={sum(map(int, terms))}"}])
        return Step(done=True, reward=float(said.strip() == self.row["answer"]))


def test_a_chat_environment_of_lmrls_own_follows_a_template_that_cuts_reasoning(tmp_path):
    """The built-in loop, as the gateway: with the tiny-reasoner's template an episode whose model called the tool is
    two samples, the answer sampled after the conversation as the template writes it; without the prompts'
    conversations (plain-text prompts) the observation continues the tokens, as before."""
    from lmrl.models.prompt_encoding import encode_prompts

    model, tok = load_shipped(SHIPPED_MODELS["tiny-reasoner"])
    gen = HFGenerator(model, tok, seed=0)
    chats = [[{"role": "user", "content": r["prompt"]}] for r in ROWS]
    prompts = encode_prompts(tok, chats, 64, use_chat_template=True)
    params = SamplingParams(max_new_tokens=48, stop=["</calc>"], seed=0)
    episodes = generate_episodes(gen, tok, prompts, ROWS, 8, params, ChatCalculator(), max_turns=2, conversations=chats)
    r = episodes.rollout
    called = [i for i in range(len(r.texts)) if r.contexts and r.contexts[i]]
    assert called and episodes.metrics["env/samples_per_episode"] == 1 + len(called) / len(r.texts)
    assert_trained_as_sampled(model, r, tok.pad_token_id)
    for i in called:
        (at, context), = r.contexts[i]
        first = tok.decode(r.response_ids[i, :at])
        assert first.endswith("</calc>") and "</think>" in first  # the call, its reasoning trained on in sample 1
        terms = re.search(r"<calc>([^<>]*)</calc>", first.split("</think>")[-1]).group(1).split("+")
        result = {"role": "user", "content": f"={sum(int(t) for t in terms if t.strip().isdigit())}"}
        written = tok.apply_chat_template([*chats[i // 8], {"role": "assistant", "content": first}, result],
                                          tokenize=False, add_generation_prompt=True)
        assert tok.decode(context) == written and "</think>" not in written  # the template's: the reasoning cut
    before = generate_episodes(gen, tok, prompts, ROWS, 8, params, ChatCalculator(), max_turns=2)
    assert before.rollout.contexts is None and "env/samples_per_episode" not in before.metrics
