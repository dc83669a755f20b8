"""verifiers environments (`env.name=verifiers:MODULE`): the environment's tasks, its own rollout against the
gateway, its rubric; environments the tests write themselves (tests/envs/vf_sums.py), nothing from a hub."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from lmrl.models.shipped import SHIPPED_MODELS

HERE = Path(__file__).parent
SUMS = HERE / "vf_sums.py"


def chat_addition_model(where: Path) -> Path:
    """The shipped tiny-addition model with a chat template that renders messages as their bare text, so that a
    chat harness sends it the sums it was trained on."""
    where = where / "tiny-addition-chat"
    shutil.copytree(SHIPPED_MODELS["tiny-addition"], where)
    config = json.loads((where / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (where / "tokenizer_config.json").write_text(json.dumps(config))
    return where


def tool_calling_model(where: Path) -> Path:
    """A tiny chat model with a tools template (tests/envs/test_gateway_tools.py) that learned, in 150 steps on one
    conversation, to call `add` for "What is 2+3?" its own way and answer "5" after the tool's result."""
    import torch

    from lmrl.models.tiny import bpe_chat_tokenizer, tiny_causal_lm
    from tests.envs.test_gateway_tools import CALL, TOOLS_TEMPLATE
    from tests.envs.vf_tools import TOOLS

    tok = bpe_chat_tokenizer([CALL, "What is 2+3? The sum is 5.", TOOLS_TEMPLATE, str(TOOLS)] * 10, vocab_size=320)
    tok.chat_template = TOOLS_TEMPLATE
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tools=TOOLS,
                                     add_generation_prompt=True, tokenize=False)
    text = (prompt + CALL + "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n5<|im_end|>")
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    torch.manual_seed(0)
    model = tiny_causal_lm(tok, hidden_size=32, num_layers=1, max_position_embeddings=512, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05
    model.save_pretrained(where / "tool-model")
    tok.save_pretrained(where / "tool-model")
    return where / "tool-model"


def test_lmrl_train_runs_a_verifiers_tool_environment_token_exact_asynchronously(tmp_path):
    from tests.forked import lmrl

    model = tool_calling_model(tmp_path)
    out = lmrl("train", f"model.name_or_path={model}", f"env.name=verifiers:{HERE / 'vf_tools.py'}",
               "rollout.prompts_per_step=1", "rollout.group_size=4", "rollout.max_new_tokens=48", "env.max_turns=3",
               "train.steps=2", "train.async_steps=1", f"train.output_dir={tmp_path / 'run'}", "log.console=false",
               cwd=tmp_path, timeout=240)  # asynchronous: the episodes run in the generator process
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "verifiers/called_tool" in r]
    assert len(steps) == 2 and all(r["agent/failures"] == 0 for r in steps)
    assert all(r["agent/retokenized_tokens"] == 0 for r in steps)  # the calls trained on as sampled
    assert max(r["verifiers/called_tool"] for r in steps) > 0 and all("verifiers/exact" in r for r in steps)
    assert max(r["env/observation_tokens"] for r in steps) > 0  # the tool results: new tokens, attended only


def test_lmrl_train_runs_a_verifiers_environment_with_its_rubric_on_the_sampled_tokens(tmp_path):
    from tests.forked import lmrl

    model = chat_addition_model(tmp_path)
    log = tmp_path / "calls.jsonl"
    out = lmrl("train", f"model.name_or_path={model}", f"env.name=verifiers:{SUMS}", "rollout.prompts_per_step=2",
               "rollout.group_size=2", "rollout.max_new_tokens=6", "train.steps=2", "train.eval_every=0",
               "train.threads=1", f"train.output_dir={tmp_path / 'run'}", "log.console=false",
               "log.samples_every=1", cwd=tmp_path, timeout=240, env={**os.environ, "VF_SUMS_LOG": str(log)})
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]  # clients closed in their loop
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "verifiers/exact" in r]
    assert len(steps) == 2 and all(r["agent/failures"] == 0 and r["agent/retokenized_tokens"] == 0 for r in steps)
    assert all(r["verifiers/digits"] > 0 for r in steps)  # the rubric's functions, each a metric
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 8 and all(c["ids"] for c in calls)  # 2 steps x 2 prompts x 2 episodes, one call each


@pytest.fixture(scope="module")
def chat_policy(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmrl.rollout.hf import HFGenerator

    where = chat_addition_model(tmp_path_factory.mktemp("model"))
    tok = AutoTokenizer.from_pretrained(where)
    return HFGenerator(AutoModelForCausalLM.from_pretrained(where).eval(), tok, seed=0), tok


@pytest.mark.parametrize("stream", [False, True])
def test_the_tokens_trained_on_are_the_tokens_the_verifiers_rollout_was_served(chat_policy, tmp_path, monkeypatch,
                                                                              stream):
    from lmrl.agents.verifiers import VerifiersEnvironment, load_verifiers_environment
    from lmrl.models.prompt_encoding import encode_prompts
    from lmrl.rollout.base import SamplingParams
    from lmrl.rollout.multiturn import generate_episodes

    gen, tok = chat_policy
    monkeypatch.setenv("VF_SUMS_LOG", str(tmp_path / "calls.jsonl"))
    if stream:  # the harness streams: verifiers relays the gateway's server-sent events
        monkeypatch.setenv("VF_SUMS_STREAM", "1")
    env = VerifiersEnvironment(load_verifiers_environment(f"verifiers:{SUMS}"))
    rows = env.rows()
    assert [r["prompt"] for r in rows[:1]] == [[{"role": "user", "content": "80+76="}]] and rows[0]["answer"] == "156"
    prompts = encode_prompts(tok, [r["prompt"] for r in rows], 64, use_chat_template=True)
    episodes = generate_episodes(gen, tok, prompts, rows, 2, SamplingParams(max_new_tokens=6), env, max_turns=2)
    served = {}
    for line in (tmp_path / "calls.jsonl").read_text().splitlines():
        served.setdefault(json.loads(line)["prompt"], []).append(json.loads(line)["ids"])
    r = episodes.rollout
    for i, row in enumerate([row for row in rows for _ in range(2)]):
        trained = r.response_ids[i][r.response_mask[i]].tolist()
        assert trained in served[row["prompt"][0]["content"]]  # byte for byte what the harness got
        text = r.texts[i].strip()
        expected = float(text == row["answer"]) + 0.25 * float(text.isdigit())  # the rubric: exact 1, digits 0.25
        assert episodes.rewards[i] == pytest.approx(expected)
    assert episodes.metrics["verifiers/exact"] == pytest.approx(sum(r.texts[i].strip() == row["answer"] for i, row in
                                                                  enumerate([row for row in rows for _ in range(2)])) / 8)


@pytest.mark.parametrize("source, message", [
    (None, "env.name: verifiers environment 'verifiers:no_such_vf_module_xyz': cannot import module "
           "'no_such_vf_module_xyz'"),
    ("import no_such_package_xyz\n", "env.name: verifiers environment 'verifiers:{path}': importing '{path}' failed: "
                                     "ModuleNotFoundError: No module named"),
    ("x = 1\n", "env.name: verifiers environment 'verifiers:{path}': no function 'load_environment' in '{path}'"),
    ("def load_environment():\n    return 3\n", "env.name: verifiers environment 'verifiers:{path}': load_environment() "
                                               "returned a value of type 'int', expected a verifiers Env"),
])
def test_a_verifiers_module_that_does_not_load_is_one_line(tmp_path, source, message):
    from lmrl.agents.verifiers import load_verifiers_environment
    from lmrl.errors import ConfigError

    path = tmp_path / "my_env.py"
    if source is not None:
        path.write_text(source)
    with pytest.raises(ConfigError) as info:
        load_verifiers_environment(f"verifiers:{path}" if source is not None else "verifiers:no_such_vf_module_xyz")
    assert message.format(path=path) in str(info.value) and "\n" not in str(info.value)


def test_without_verifiers_installed_the_run_says_which_extra_to_install(tmp_path):
    from tests.forked import script

    program = tmp_path / "no_verifiers.py"
    program.write_text("import sys\nsys.modules['verifiers'] = None\nsys.modules['verifiers.v1'] = None\n"
                       "from lmrl.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    out = script(program, "train", f"env.name=verifiers:{SUMS}", "train.steps=1", cwd=tmp_path, timeout=120)
    assert out.returncode != 0
    assert "env.name: verifiers environments need the verifiers package: pip install 'lmrl[agents]'" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_verifiers_env_passed_from_python_trains_on_its_tasks_and_reward(tmp_path):
    from lmrl import Config, Trainer
    from lmrl.agents.verifiers import VerifiersEnvironment, load_verifiers_environment

    vf_env = load_verifiers_environment(f"verifiers:{SUMS}")
    cfg = Config(model={"name_or_path": str(chat_addition_model(tmp_path))}, log={"console": False},
                 rollout={"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 6},
                 train={"steps": 1, "threads": 1, "output_dir": str(tmp_path / "run")})
    trainer = Trainer(cfg, env=vf_env)
    assert isinstance(trainer.env, VerifiersEnvironment) and trainer.env.env is vf_env
    assert [r["prompt"][0]["content"] for r in trainer.data.train_rows] == ["80+76=", "28+2=", "12+30=", "47+5="]
    trainer.train()
    [row] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if "verifiers/exact" in line]
    assert row["agent/failures"] == 0 and "reward/env_reward/mean" in row  # its rubric is the run's reward


def test_a_failed_verifiers_episode_is_one_line_or_a_counted_failure(chat_policy, monkeypatch):
    from lmrl.agents.verifiers import VerifiersEnvironment, load_verifiers_environment
    from lmrl.errors import RunError
    from lmrl.models.prompt_encoding import encode_prompts
    from lmrl.rollout.base import SamplingParams
    from lmrl.rollout.multiturn import generate_episodes

    gen, tok = chat_policy
    monkeypatch.setenv("VF_SUMS_BROKEN", "1")
    vf_env = load_verifiers_environment(f"verifiers:{SUMS}")
    rows = VerifiersEnvironment(vf_env).rows()[:1]
    prompts = encode_prompts(tok, [r["prompt"] for r in rows], 64, use_chat_template=True)
    with pytest.raises(RunError, match=r"^env.name: episode 0 \(row 0\) verifiers: .*the harness broke.* \(1 of 1 "
                                       r"episodes failed; reward.on_error=zero counts them and goes on\)$"):
        generate_episodes(gen, tok, prompts, rows, 1, SamplingParams(max_new_tokens=4), VerifiersEnvironment(vf_env), 2)
    episodes = generate_episodes(gen, tok, prompts, rows, 2, SamplingParams(max_new_tokens=4),
                                 VerifiersEnvironment(vf_env, on_error="zero"), 2)
    assert episodes.metrics["agent/failures"] == 2 and episodes.rewards == [0.0, 0.0]
    assert not episodes.rollout.response_mask.any()  # nothing of a failed episode is trained on


def test_the_session_route_takes_only_the_gateways_session_key_and_a_live_session(chat_policy):
    import httpx

    from lmrl.agents.gateway import SESSIONS, Gateway, _Episode, _Segment
    from lmrl.rollout.base import SamplingParams

    gen, tok = chat_policy
    gateway = Gateway(gen, tok)
    try:
        seg = _Segment([5, 6], [0.0, 0.0], False, "47", "47")
        gateway.episodes = {"a": _Episode(0, "key-a", {}, [seg], SamplingParams(max_new_tokens=4), 2, 8)}
        gateway.sessions = {"trace-1": "a", "trace-gone": "b"}
        url = f"{gateway.url}/episodes/{SESSIONS}/v1/lmrl/reward"

        def post(key, session):
            return httpx.post(url, json={"reward": 1.0}, headers={"Authorization": f"Bearer {key}",
                                                                  "X-Session-ID": session}).status_code

        assert post("key-a", "trace-1") == 401  # an episode's own key does not open the session route
        assert post(gateway.session_key, "trace-x") == 404 and post(gateway.session_key, "trace-gone") == 404
        assert gateway.episodes["a"].reward is None
        assert post(gateway.session_key, "trace-1") == 200 and gateway.episodes["a"].reward == 1.0
    finally:
        gateway.shutdown()
