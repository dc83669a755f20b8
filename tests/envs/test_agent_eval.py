"""`lmrl eval RUN` of a run whose episodes an agent program or a verifiers environment drives: the environment's
episodes are the greedy evaluation, scored as the run was. The runs' directories are written here as `lmrl train`
records them (its config), and `--model` names the policy, so no training runs first."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import yaml

from tests.envs import python
from tests.envs.test_verifiers import SUMS, chat_addition_model
from tests.forked import lmrl

BATCH_AGENT = Path(__file__).with_name("calc_agent_batch.py")


def run_dir(where: Path, config: dict) -> Path:
    (where / "run").mkdir()
    (where / "run" / "lmrl_config.yaml").write_text(yaml.safe_dump(config))
    return where / "run"


def test_lmrl_eval_of_an_agent_run_runs_its_program_on_the_held_out_prompts_and_scores_its_rewards(tmp_path):
    run = run_dir(tmp_path, {"model": {"name_or_path": "tiny-calculator"}, "data": {"task": "calculator"},
                             "env": {"name": "agent", "command": f"{python()} {BATCH_AGENT}", "agent_mode": "batch",
                                     "max_turns": 2}})
    env = {**os.environ, "AGENT_LOG": str(tmp_path / "agent.jsonl")}
    out = lmrl("eval", str(run), "--model", "tiny-calculator", "--num-prompts", "6", cwd=tmp_path, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    served = [json.loads(line) for line in (tmp_path / "agent.jsonl").read_text().splitlines()]
    assert sorted(e["index"] for e in served) == list(range(6)) and len({e["pid"] for e in served}) == 1

    def right(text):  # the agent's own reward: its last line is the sum
        prompt = text.split("=", 1)[0]
        return text.rsplit("\n", 1)[-1].strip() == str(sum(int(t) for t in prompt.split("+")))

    accuracy = sum(map(right, (e["text"] for e in served))) / 6
    match = re.search(r"^6 prompts of .*'s held-out prompts: accuracy \(greedy\) ([\d.]+)%", out.stdout, re.M)
    assert match, out.stdout
    assert abs(float(match.group(1)) / 100 - accuracy) < 1e-3  # scored by what the program reported


def test_lmrl_eval_of_a_verifiers_run_runs_the_environments_tasks_through_its_rollout_and_rubric(tmp_path):
    model = chat_addition_model(tmp_path)
    run = run_dir(tmp_path, {"model": {"name_or_path": str(model)}, "env": {"name": f"verifiers:{SUMS}"},
                             "rollout": {"max_new_tokens": 6}})
    log = tmp_path / "calls.jsonl"
    out = lmrl("eval", str(run), "--model", str(model), cwd=tmp_path, timeout=240,
               env={**os.environ, "VF_SUMS_LOG": str(log)})
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert re.search(rf"^4 prompts of .*'s environment's tasks \(verifiers:{re.escape(str(SUMS))}\): accuracy \(greedy\) "
                     r"[\d.]+%  mean reward [\d.]+$", out.stdout, re.M), out.stdout
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 4 and all(c["ids"] for c in calls)  # each task one episode, through the gateway
