"""env.agent_mode=serve: lmrl starts no program; programs that run on their own ask the gateway for episodes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from lmrl.agents.programs import AgentEnvironment
from lmrl.errors import ConfigError, RunError
from lmrl.models.shipped import SHIPPED_MODELS, load_shipped
from lmrl.rollout.base import SamplingParams
from lmrl.rollout.hf import HFGenerator
from lmrl.rollout.multiturn import generate_episodes
from tests.envs import python
from tests.envs.test_agent import IDS_REWARD

PULL_AGENT = Path(__file__).with_name("calc_agent_pull.py")
ROWS = [{"prompt": "47+85+36=", "answer": "168"}, {"prompt": "12+30+41=", "answer": "83"}]


def wait_for(path: Path, seconds: float = 120) -> dict:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.05)
    time.sleep(0.05)  # written whole: it is small
    return json.loads(path.read_text())


def test_lmrl_train_hands_its_episodes_to_programs_that_ask_for_work_and_trains_on_the_tokens_they_were_served(tmp_path):
    from tests.forked import lmrl

    (tmp_path / "ids.py").write_text(IDS_REWARD)
    env = {**os.environ, "AGENT_LOG": str(tmp_path / "agent.jsonl"), "IDS_LOG": str(tmp_path / "ids.jsonl")}
    out = {}
    run = threading.Thread(target=lambda: out.update(result=lmrl(
        "train", "model.name_or_path=tiny-calculator", "data.task=calculator", "env.name=agent",
        "env.agent_mode=serve", "env.timeout=120", "reward.functions=[env,ids.py:ids]", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "train.eval_every=0", "data.num_eval_prompts=0", "train.steps=2",
        f"train.output_dir={tmp_path / 'run'}", "log.console=false", cwd=tmp_path, timeout=240, env=env)))
    run.start()
    work_file = tmp_path / "run" / "agent.json"
    work = wait_for(work_file)
    assert stat.S_IMODE(work_file.stat().st_mode) == 0o600 and work["work_url"].startswith("http://127.0.0.1:")
    programs = [subprocess.Popen([python(), str(PULL_AGENT), str(work_file)], env=env, stderr=subprocess.PIPE)
                for _ in range(2)]  # two programs ask for work at once; each episode goes to one of them
    run.join(300)
    result = out["result"]
    assert result.returncode == 0, result.stderr[-2000:]
    assert "agent programs ask for episodes at POST http://127.0.0.1:" in result.stderr
    for p in programs:  # told that the run is over, they end
        assert p.wait(30) == 0, p.stderr.read().decode()[-2000:]
    served = [json.loads(line) for line in (tmp_path / "agent.jsonl").read_text().splitlines()]
    trained = [json.loads(line) for line in (tmp_path / "ids.jsonl").read_text().splitlines()]
    assert len(served) == 8 and len(trained) == 2  # four episodes a step, each served once
    for step, ids in enumerate(trained):
        by_index = {e["index"]: sum(e["turns"], []) for e in served[4 * step: 4 * step + 4]}
        assert ids == [by_index[i] for i in range(4)]  # byte for byte, episode by episode
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["agent/failures"] for r in rows if "env/turns" in r] == [0.0, 0.0]
    assert not work_file.exists()  # its key is dead with the run


@pytest.fixture(scope="module")
def policy():
    model, tok = load_shipped(SHIPPED_MODELS["tiny-calculator"])
    return HFGenerator(model, tok, seed=0), tok


def episodes_of(policy, env):
    gen, tok = policy
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in ROWS]
    return generate_episodes(gen, tok, prompts, ROWS, 1, SamplingParams(max_new_tokens=8), env, max_turns=2)


def test_work_goes_to_the_run_key_only_and_nobody_asking_is_one_line_never_a_hang(policy, tmp_path):
    other = AgentEnvironment(None, mode="serve", work_file=tmp_path / "other.json")
    other.gateway(*policy)  # a second run's gateway: its key is not this run's
    env = AgentEnvironment(None, timeout=3, mode="serve", work_file=tmp_path / "agent.json", on_error="zero")
    seen = {}

    def hostile():
        work = wait_for(tmp_path / "agent.json")
        post = lambda key, body=b"{}": httpx.post(work["work_url"], content=body, timeout=30,  # noqa: E731
                                                  headers={"Authorization": f"Bearer {key}"} if key else {})
        seen["none"], seen["other run"] = post(None).status_code, post(other.run_key).status_code
        seen["bad json"], seen["bad max"] = post(work["key"], b"{x").status_code, post(work["key"], b'{"max": 0}').status_code
        taken = post(work["key"], b'{"max": 1, "wait": 10}').json()["episodes"]  # still serving: one episode
        seen["taken"] = len(taken)
        seen["episode key"] = post(taken[0]["api_key"]).status_code  # it never reports a reward
        seen["run key at an episode"] = httpx.post(taken[0]["base_url"] + "/lmrl/reward", json={"reward": 1.0},
                                                   headers={"Authorization": f"Bearer {work['key']}"}).status_code

    thread = threading.Thread(target=hostile)
    thread.start()
    episodes = episodes_of(policy, env)
    thread.join(30)
    assert seen == {"none": 401, "other run": 401, "bad json": 400, "bad max": 400, "taken": 1, "episode key": 403,
                    "run key at an episode": 401}
    assert episodes.metrics["agent/failures"] == 2 and episodes.rewards == [0.0, 0.0]
    env.on_error, env.timeout = "fail", 1.0  # the same with nobody asking at all: one line naming the URL and file
    with pytest.raises(RunError, match=r"env.agent_mode=serve: episode 0 \(row 0\) was asked for by no agent program "
                                       r"within env.timeout=1s \(POST http://127.0.0.1:\d+/lmrl/work with the run key in "):
        episodes_of(policy, env)
    env.close(), other.close()


def test_beyond_loopback_the_run_key_is_the_users_and_programs_get_the_url_they_reach(policy, tmp_path, monkeypatch):
    import socket

    monkeypatch.delenv("LMRL_AGENT_KEY", raising=False)
    with pytest.raises(ConfigError, match="env.agent_host: 0.0.0.0: listening beyond loopback needs a run key of yours, "
                                          "in the LMRL_AGENT_KEY environment variable"):
        AgentEnvironment(None, mode="serve", host="0.0.0.0")
    monkeypatch.setenv("LMRL_AGENT_KEY", "a-key-of-mine")
    with socket.socket() as s:  # a free port, so that the URL programs reach can name it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://localhost:{port}"  # as a proxy or the machine's name would be: not the address it listens on
    env = AgentEnvironment(None, timeout=60, mode="serve", host="0.0.0.0", port=port, url=url,
                           work_file=tmp_path / "agent.json")
    seen = []

    def program():
        work = wait_for(tmp_path / "agent.json")
        specs = httpx.post(work["work_url"], json={"max": 2}, headers={"Authorization": "Bearer a-key-of-mine"},
                           timeout=30).json()["episodes"]
        for spec in specs:
            seen.append((work["work_url"], spec["base_url"]))
            auth = {"Authorization": f"Bearer {spec['api_key']}"}
            httpx.post(spec["base_url"] + "/completions", json={"prompt": spec["row"]["prompt"], "max_tokens": 4},
                       headers=auth, timeout=60).raise_for_status()
            httpx.post(spec["base_url"] + "/lmrl/reward", json={"reward": 1.0}, headers=auth, timeout=30)

    thread = threading.Thread(target=program)
    thread.start()
    episodes = episodes_of(policy, env)
    thread.join(60)
    env.close()
    assert episodes.rewards == [1.0, 1.0] and episodes.metrics["agent/failures"] == 0
    assert len(seen) == 2 and all(w == url + "/lmrl/work" and b.startswith(url + "/episodes/") for w, b in seen)


@pytest.mark.parametrize("overrides, message", [
    (["env.name=agent", "env.agent_mode=serve", "env.command=python x.py"],
     "env.command: env.agent_mode=serve starts no program (yours ask for work); drop env.command"),
    (["env.name=agent", "env.command=python x.py", "env.agent_port=8000"],
     "env.agent_host: env.agent_host, env.agent_port and env.agent_url are for env.agent_mode=serve"),
    (["env.name=agent", "env.agent_mode=serve", "env.agent_url=trainer:8000"],
     "env.agent_url: expected http://HOST:PORT or https://HOST:PORT (no path), got 'trainer:8000'"),
])
def test_the_serve_mode_config_is_checked_in_one_line(overrides, message):
    from lmrl.config import load_config

    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value) == message
