"""env.name=agent: episodes driven by a program written elsewhere through the recording gateway, token-exact."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from lmrl.agents.programs import AgentEnvironment
from lmrl.errors import RunError
from lmrl.rollout.base import SamplingParams
from lmrl.rollout.hf import HFGenerator
from lmrl.rollout.multiturn import generate_episodes
from tests.envs import python

AGENT = Path(__file__).with_name("calc_agent.py")
ROWS = [{"prompt": "47+85+36=", "answer": "168"}, {"prompt": "12+30+41=", "answer": "83"}]


def run(policy, tmp_path, mode="ok", on_error="fail", timeout=60.0, n=2, temperature=1.0):
    gen, tok = policy
    os.environ["AGENT_MODE"], os.environ["AGENT_LOG"] = mode, str(tmp_path / "log.jsonl")
    try:
        env = AgentEnvironment(f"{python()} {AGENT}", timeout=timeout, on_error=on_error)
        prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in ROWS]
        params = SamplingParams(max_new_tokens=24, temperature=temperature, stop=[], seed=0)
        return generate_episodes(gen, tok, prompts, ROWS, n, params, env, max_turns=4, max_tokens=96)
    finally:
        del os.environ["AGENT_MODE"], os.environ["AGENT_LOG"]


def test_the_tokens_trained_on_are_the_tokens_the_agent_was_sampled_after_a_tool_result_too(policy, tmp_path):
    episodes = run(policy, tmp_path)
    log = {}
    for line in (tmp_path / "log.jsonl").read_text().splitlines():
        entry = json.loads(line)
        log.setdefault(entry["prompt"], []).append(entry)
    r = episodes.rollout
    assert episodes.metrics["agent/failures"] == 0 and episodes.metrics["agent/retokenized_tokens"] == 0
    assert r.response_attention is not None  # the tool results are attended, not trained on
    for i in range(len(r.texts)):
        trained = r.response_ids[i][r.response_mask[i]].tolist()
        candidates = [sum(e["turns"], []) for e in log[ROWS[i // 2]["prompt"]]]
        assert trained in candidates  # byte for byte: the sampled ids, nothing re-tokenized
        assert episodes.turns[i] == 2 and r.texts[i] in [e["text"][len(ROWS[i // 2]["prompt"]):]
                                                          for e in log[ROWS[i // 2]["prompt"]]]
        observed = r.response_ids[i][r.response_attention[i] & ~r.response_mask[i]].tolist()
        assert observed and (r.logprobs[i][~r.response_mask[i]] == 0).all()
    assert all(x in (0.0, 1.0) for x in episodes.rewards)


@pytest.mark.parametrize("mode, message", [
    ("crash", "exited with status 1: agent: something broke"),
    ("noreward", "exited without reporting a reward"),
    ("nan", "reported a reward of NaN, not a finite number"),
    ("hang", "ran past env.timeout=1s and was killed"),
])
def test_a_failing_agent_is_one_line_or_a_counted_failure_never_a_hang(policy, tmp_path, mode, message):
    timeout = 1.0 if mode == "hang" else 60.0  # the others end on their own (in seconds; more on a loaded machine)
    with pytest.raises(RunError, match="episode 0 .*" + message.replace("(", r"\(")):
        run(policy, tmp_path, mode=mode, timeout=timeout, n=1)
    episodes = run(policy, tmp_path, mode=mode, on_error="zero", timeout=timeout, n=1)
    assert episodes.metrics["agent/failures"] == 2 and episodes.rewards == [0.0, 0.0]
    assert not episodes.rollout.response_mask.any()  # nothing of a failed episode is trained on


def test_programs_that_mostly_start_up_are_told_once_of_the_modes_that_start_one_for_many(policy, tmp_path, capfd):
    """A program per episode that spends most of its run before its first request (here it sleeps 0.8 s first) gets
    one line, once per run, naming env.agent_mode=batch / persistent; one that works after its episode does not."""
    gen, tok = policy
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in ROWS]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, stop=[], seed=0)
    told = "starting, before its first request; env.agent_mode=batch or persistent runs one program for many episodes"
    for mode, lines in (("slow-start", 1), ("slow-end", 0)):
        os.environ["AGENT_MODE"] = mode
        try:
            env = AgentEnvironment(f"{python()} {AGENT}", timeout=60)
            for _ in range(2 if lines else 1):  # two calls, one line
                os.environ["AGENT_CALLED"] = str(time.monotonic())  # slow-end's start-up: lmrl's, however loaded
                generate_episodes(gen, tok, prompts, ROWS, 1, params, env, max_turns=4, max_tokens=96)
        finally:
            del os.environ["AGENT_MODE"]
            os.environ.pop("AGENT_CALLED", None)  # (not set if the environment failed to start)
        assert capfd.readouterr().err.count(told) == lines, mode


@pytest.mark.parametrize(("overrides", "cores", "picked"), [([], 2, 4), ([], 64, 32), (["env.max_parallel=3"], 2, 3),
                                                            (["env.agent_mode=batch"], 2, 32)])
def test_the_programs_at_once_default_to_two_per_core_and_the_run_says_so(overrides, cores, picked, monkeypatch):
    from lmrl.build import max_parallel
    from lmrl.config import load_config

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    cfg = load_config(None, ["env.name=agent", "env.command=python agent.py", *overrides])
    number, note = max_parallel(cfg)
    assert number == picked
    if overrides:
        assert note is None
    else:
        assert note == (f"env.max_parallel={picked}: agent programs at once, two per core of the {cores} this process "
                        "may use (set env.max_parallel to choose)")


def test_a_command_that_cannot_start_is_one_line(policy, tmp_path):
    gen, tok = policy
    env = AgentEnvironment("no-such-agent-program --x")
    with pytest.raises(RunError, match="env.command: cannot start 'no-such-agent-program'"):
        generate_episodes(gen, tok, [[5, 6]], ROWS[:1], 1, SamplingParams(max_new_tokens=4), env, max_turns=2)


def test_a_key_reaches_only_its_own_episode(policy):
    import httpx

    from lmrl.agents.gateway import Gateway, _Episode, _Segment

    gen, tok = policy
    gateway = Gateway(gen, tok)
    try:
        seg = lambda: _Segment([5, 6], [0.0, 0.0], False, "47", "47")  # noqa: E731
        gateway.episodes = {"a": _Episode(0, "key-a", ROWS[0], [seg()], SamplingParams(max_new_tokens=4), 2, 8),
                            "b": _Episode(1, "key-b", ROWS[0], [seg()], SamplingParams(max_new_tokens=4), 2, 8)}
        post = lambda eid, key, body: httpx.post(f"{gateway.episode_url(eid)}/lmrl/reward", json=body,  # noqa: E731
                                                 headers={"Authorization": f"Bearer {key}"} if key else {})
        assert post("a", "key-b", {"reward": 1.0}).status_code == 403
        assert post("a", None, {"reward": 1.0}).status_code == 401
        assert post("a", "key-x", {"reward": 1.0}).status_code == 401
        assert gateway.episodes["a"].reward is None  # none of them reached it
        answer = post("a", "key-a", {"reward": 1.0})
        assert answer.status_code == 200 and gateway.episodes["a"].reward == 1.0 and gateway.episodes["b"].reward is None
        assert httpx.post(f"{gateway.url}/v1/completions", json={}).status_code == 404  # no episode, no policy
    finally:
        gateway.shutdown()


def test_a_tool_result_after_the_last_model_turn_is_not_in_the_batch(policy):
    """The agent's last text was refused a turn (its budget): it conditions nothing trained on, so the batch is as
    wide as the episodes' model turns and the tool results between them, as the built-in environment's budget cut."""
    from lmrl.agents.gateway import _Episode, _Segment

    gen, _ = policy
    prompt = _Segment([5, 6], [0.0, 0.0], False, "47", "47")
    turn = lambda ids: _Segment(ids, [-0.5] * len(ids), True, "t", "t")  # noqa: E731
    result = lambda ids: _Segment(ids, [0.0] * len(ids), False, "=9\n", "=9\n")  # noqa: E731
    cut = _Episode(0, "a", ROWS[0], [prompt, turn([7, 8]), result([9] * 30)], SamplingParams(), 2, 8, reward=0.0)
    whole = _Episode(1, "b", ROWS[0], [prompt, turn([7]), result([9, 9]), turn([8, 2])], SamplingParams(), 2, 8, reward=1.0)
    r = AgentEnvironment("true")._episodes([cut, whole], [[5, 6]], 2, gen).rollout
    assert r.response_ids.shape[1] == 5  # not the 32 of the refused tool result
    assert r.response_ids[0, :2].tolist() == [7, 8] and not r.response_attention[0, 2:].any()
    assert r.response_ids[1].tolist() == [7, 9, 9, 8, 2] and r.response_mask[1].tolist() == [True, False, False, True, True]
    assert r.texts[0] == "t=9\n"  # what the episode showed stays in its text


def test_lmrl_train_runs_on_an_agent_written_elsewhere_and_resumes(tmp_path):
    """10 s on 2 cores: each of the 7 episodes of the two runs (training and held-out) is a fresh program that
    imports the official `openai` client (0.5 s), as an agent written elsewhere does."""
    from tests.forked import lmrl

    args = ["train", "model.name_or_path=tiny-calculator", "data.task=calculator", "env.name=agent",
            f"env.command={python()} {AGENT}", "env.timeout=60", "env.max_parallel=4",
            "rollout.prompts_per_step=1", "rollout.group_size=2", "train.eval_every=0", "train.save_every=1",
            "data.num_eval_prompts=1", f"train.output_dir={tmp_path / 'run'}", "log.console=false"]  # 2 + 1 programs a run
    out = lmrl(*args, "train.steps=1", cwd=tmp_path, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "env/turns" in r]
    assert len(steps) == 1 and all(r["agent/failures"] == 0 and r["env/turns"] == 2 for r in steps)
    assert all(r["agent/retokenized_tokens"] == 0 and r["env/observation_tokens"] > 0 for r in steps)
    out = lmrl(*args, "train.steps=2", "train.resume=auto", cwd=tmp_path, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "env/turns" in r] == [1, 2]  # step 2 came from the checkpoint of step 1
    assert [r for r in rows if "env/turns" in r][-1]["agent/failures"] == 0


@pytest.mark.parametrize("overrides, message", [
    (["env.name=agent"], 'env.command: the "agent" environment needs env.command, e.g. env.command="python my_agent.py"'),
    (["env.command=python x.py"], "env.command: env.command is for env.name=agent"),
    (["env.agent_mode=batch"], "env.agent_mode: env.agent_mode is for env.name=agent"),
])
def test_the_agent_environment_config_is_checked_in_one_line(overrides, message):
    from lmrl.config import load_config
    from lmrl.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value) == message


@pytest.mark.parametrize("mode", ["chat", "chat-stop"])
def test_a_chat_agent_on_a_bpe_tokenizer_trains_on_exactly_the_sampled_tokens(tmp_path, mode):
    """chat-stop: the turns end at a stop string, which the content leaves out and the agent adds back."""
    from lmrl.models.prompt_encoding import encode_prompts
    from lmrl.models.tiny import bpe_chat_tokenizer, tiny_causal_lm

    tok = bpe_chat_tokenizer([r["prompt"] + " =168 the sum is 83" for r in ROWS] * 20, vocab_size=300)
    gen = HFGenerator(tiny_causal_lm(tok, hidden_size=32, num_layers=1, seed=0), tok, seed=0)
    prompts = encode_prompts(tok, [[{"role": "user", "content": r["prompt"]}] for r in ROWS], 64, use_chat_template=True)
    os.environ["AGENT_MODE"], os.environ["AGENT_LOG"] = mode, str(tmp_path / "log.jsonl")
    try:
        episodes = generate_episodes(gen, tok, prompts, ROWS, 1, SamplingParams(max_new_tokens=12, seed=0),
                                     AgentEnvironment(f"{python()} {AGENT}", timeout=60), max_turns=2,
                                     max_tokens=96)
    finally:
        del os.environ["AGENT_MODE"], os.environ["AGENT_LOG"]
    log = {json.loads(line)["prompt"]: json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()}
    r = episodes.rollout
    naive = 0  # what re-tokenizing the text the agent saw would have trained on instead
    for i, row in enumerate(ROWS):
        trained = r.response_ids[i][r.response_mask[i]].tolist()
        assert trained == sum(log[row["prompt"]]["turns"], [])
        for turn in log[row["prompt"]]["turns"]:
            naive += tok(tok.decode(turn, skip_special_tokens=True), add_special_tokens=False)["input_ids"] != turn
    assert naive > 0  # the case that matters: this tokenizer does not give back the sampled ids
    assert episodes.metrics["agent/retokenized_tokens"] == 0 and episodes.rewards == [0.5, 0.5]
    assert (sum(entry["stopped"] for entry in log.values()) > 0) == (mode == "chat-stop")


def test_the_gateway_samples_under_the_autocast_of_the_trainers_thread(policy, tmp_path):
    import torch

    gen, tok = policy
    seen = []

    class Recording:  # the policy's decode, noting the autocast each call of the gateway's batcher runs under
        pad_token_id = gen.pad_token_id

        def generate(self, prompts, n, params):
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            return gen.generate(prompts, n, params)

    with torch.autocast("cpu", dtype=torch.bfloat16):  # what the trainer's rollouts run under with train.autocast_bf16
        run((Recording(), tok), tmp_path, n=1)
    assert seen and set(seen) == {(True, torch.bfloat16)}  # every call, the first turns of both rows shared or not


BATCH_AGENT = Path(__file__).with_name("calc_agent_batch.py")


def run_batch(policy, tmp_path, mode="ok", on_error="zero", n=2, agent_mode="batch"):
    gen, tok = policy
    os.environ["AGENT_MODE"], os.environ["AGENT_LOG"] = mode, str(tmp_path / "log.jsonl")
    try:
        env = AgentEnvironment(f"{python()} {BATCH_AGENT}", timeout=60, on_error=on_error, mode=agent_mode)
        prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in ROWS]
        params = SamplingParams(max_new_tokens=24, temperature=1.0, stop=[], seed=0)
        out = generate_episodes(gen, tok, prompts, ROWS, n, params, env, max_turns=4, max_tokens=96)
        if agent_mode == "persistent":  # the same program takes a second batch
            out = (out, generate_episodes(gen, tok, prompts, ROWS, n, params, env, max_turns=4, max_tokens=96),
                   env._program.pid)
            env.close()
        return out
    finally:
        del os.environ["AGENT_MODE"], os.environ["AGENT_LOG"]


def test_a_batch_program_runs_every_episode_of_a_call_and_trains_on_exactly_the_sampled_tokens(policy, tmp_path):
    episodes = run_batch(policy, tmp_path)
    log = {e["index"]: e for e in map(json.loads, (tmp_path / "log.jsonl").read_text().splitlines())}
    r = episodes.rollout
    assert sorted(log) == [0, 1, 2, 3] and episodes.metrics["agent/failures"] == 0  # one program, four episodes
    for i in range(4):
        assert r.response_ids[i][r.response_mask[i]].tolist() == sum(log[i]["turns"], [])  # token-exact
        assert r.texts[i] == log[i]["text"][len(ROWS[i // 2]["prompt"]):] and episodes.turns[i] == 2
    assert episodes.rewards == [float(log[i]["text"].rsplit("\n", 1)[-1].strip() == ROWS[i // 2]["answer"])
                                for i in range(4)]


def test_a_batch_programs_failures_fail_the_episodes_it_left_without_a_reward(policy, tmp_path):
    episodes = run_batch(policy, tmp_path, mode="crash")
    assert episodes.metrics["agent/failures"] == 3 and not episodes.rollout.response_mask[1:].any()
    with pytest.raises(RunError, match=r"episode 1 \(row 0\) the batch's program exited with status 1: agent: "
                                       "something broke"):
        run_batch(policy, tmp_path, mode="crash", on_error="fail")
    episodes = run_batch(policy, tmp_path, mode="steal")  # another episode's key reports nothing
    assert episodes.metrics["agent/failures"] == 4 and episodes.rewards == [0.0] * 4


# a reward function that notes the ids the trainer trains on (in $IDS_LOG), and adds nothing
IDS_REWARD = ("import json, os\n\n\ndef ids(completions, completion_ids, **_):\n"
              "    with open(os.environ['IDS_LOG'], 'a') as f:\n"
              "        f.write(json.dumps(completion_ids) + '\\n')\n"
              "    return [0.0] * len(completions)\n")


@pytest.mark.parametrize("agent_mode, programs", [("batch", 2), ("persistent", 1)])
def test_lmrl_train_runs_a_batch_agent_once_per_step_or_run_and_trains_on_the_tokens_it_was_served(tmp_path, agent_mode,
                                                                                                  programs):
    from tests.forked import lmrl

    (tmp_path / "ids.py").write_text(IDS_REWARD)
    env = {**os.environ, "AGENT_LOG": str(tmp_path / "agent.jsonl"), "IDS_LOG": str(tmp_path / "ids.jsonl")}
    out = lmrl("train", "model.name_or_path=tiny-calculator", "data.task=calculator", "env.name=agent",
               f"env.command={python()} {BATCH_AGENT}", f"env.agent_mode={agent_mode}", "env.timeout=120",
               "reward.functions=[env,ids.py:ids]", "rollout.prompts_per_step=2", "rollout.group_size=2",
               "train.eval_every=0", "data.num_eval_prompts=0", "train.steps=2", f"train.output_dir={tmp_path / 'run'}",
               "log.console=false",
               cwd=tmp_path, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    served = [json.loads(line) for line in (tmp_path / "agent.jsonl").read_text().splitlines()]
    trained = [json.loads(line) for line in (tmp_path / "ids.jsonl").read_text().splitlines()]
    assert len(served) == 8 and len(trained) == 2  # four episodes a step
    assert len({e["pid"] for e in served}) == programs  # a program per step, or one for the run
    for step, ids in enumerate(trained):
        by_index = {e["index"]: sum(e["turns"], []) for e in served[4 * step: 4 * step + 4]}
        assert ids == [by_index[i] for i in range(4)]  # byte for byte, episode by episode
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["agent/failures"] for r in rows if "env/turns" in r] == [0.0, 0.0]


def test_a_persistent_program_takes_batch_after_batch_on_its_stdin_and_ends_with_the_run(policy, tmp_path):
    first, second, pid = run_batch(policy, tmp_path, agent_mode="persistent")
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert len(log) == 8 and first.metrics["agent/failures"] == second.metrics["agent/failures"] == 0
    for episodes, served in ((first, log[:4]), (second, log[4:])):
        by_index = {e["index"]: sum(e["turns"], []) for e in served}
        r = episodes.rollout
        assert [r.response_ids[i][r.response_mask[i]].tolist() for i in range(4)] == [by_index[i] for i in range(4)]
    with pytest.raises(ProcessLookupError):  # it ended at the end of its stdin
        os.kill(pid, 0)
    first, second, _ = run_batch(policy, tmp_path, mode="crash", agent_mode="persistent")
    assert first.metrics["agent/failures"] == 3 and second.metrics["agent/failures"] == 3  # started again, crashed again


@pytest.mark.parametrize("mode", ["ok", "no-stop-back"])
def test_text_leaves_the_stop_string_out_and_either_way_back_trains_the_sampled_tokens(policy, tmp_path, mode):
    """As the OpenAI API defines it, a completion's text has no stop string; an agent that puts `</calc>` back (as
    calc_agent.py does) and one that does not both train exactly the tokens they were served, nothing re-tokenized.
    Greedy: the gateway's sampling is unseeded, and the shipped model's greedy turn closes its call every time."""
    episodes = run(policy, tmp_path, mode=mode, temperature=0.0)
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert episodes.metrics["agent/failures"] == 0 and episodes.metrics["agent/retokenized_tokens"] == 0
    r = episodes.rollout
    served = [sum(e["turns"], []) for e in log]
    for i in range(len(r.texts)):
        assert r.response_ids[i][r.response_mask[i]].tolist() in served
    # the turns that closed a call: the text the agent got ended before `</calc>`, which the rollout's text keeps
    closed = [i for i in range(len(r.texts)) if "</calc>" in r.texts[i]]
    assert closed, "no episode closed a call: the check would be empty"
    texts = [e["text"] for e in log]
    assert any("</calc>" in t for t in texts) == (mode == "ok")
