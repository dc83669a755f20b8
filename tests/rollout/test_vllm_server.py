"""The generation server (`lmrl serve`, rollout.backend=vllm-server) as real processes: the plain `openai` client
drives the live policy and its traces train through `train_on_scored`; a run pushes its weights to the server
every step; a dead server is one line; a server the run started goes when the run goes, even by SIGKILL."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoTokenizer

from lmrl import Trainer
from lmrl.config import load_config
from lmrl.errors import RunError
from lmrl.models.tiny import bpe_chat_tokenizer, tiny_causal_lm
from lmrl.rollout import HFGenerator, SamplingParams
from lmrl.rollout.remote import ServerGenerator
from tests import forked

if not (sys.platform == "linux" and platform.machine() == "x86_64"):  # where make test installs vLLM's CPU build
    pytest.skip("vLLM's CPU build is made for x86-64 Linux only", allow_module_level=True)
if torch.cuda.is_available() and importlib.util.find_spec("vllm") is None:  # a GPU machine given lmrl's wheels only
    pytest.skip("vLLM's CUDA build is not installed on this GPU machine", allow_module_level=True)

import openai  # noqa: E402 - vLLM brings it: after the skips above

QUESTIONS = [f"What is {a} + {b}?" for a in range(6) for b in range(6)]


def last_digit(prompts, completions, **kw):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # chat completions are messages
    return [float(any(ch.isdigit() for ch in t)) - 0.5 * (len(t) > 8) for t in texts]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A Qwen2 chat model with random weights and a ChatML BPE tokenizer, saved as a directory."""
    out = tmp_path_factory.mktemp("chat") / "model"
    tok = bpe_chat_tokenizer([f"{q} The answer is {i}." for i, q in enumerate(QUESTIONS)] * 4, vocab_size=320)
    tiny_causal_lm(tok, arch="qwen2", hidden_size=64, num_layers=2, num_heads=2, seed=3).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(chat_model):
    tok = AutoTokenizer.from_pretrained(chat_model)
    generator = ServerGenerator.start([f"model.name_or_path={chat_model}", "rollout.max_new_tokens=16",
                                       "rollout.max_prompt_length=64"], tok, timeout=120)
    yield generator
    generator.close()


def chat_run(tmp_path, chat_model, *overrides):
    cfg = load_config(None, [f"model.name_or_path={chat_model}", "train.steps=3", "rollout.prompts_per_step=4",
                             "rollout.group_size=4", "rollout.max_new_tokens=8", "rollout.max_prompt_length=64",
                             "optim.lr=1e-3", f"train.output_dir={tmp_path}", "log.console=false", "train.eval_every=0",
                             "train.max_minutes=null", *overrides])
    rows = [{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS]
    return Trainer(cfg, reward_funcs=[last_digit], train_dataset=rows, eval_dataset=rows[:4])


def test_the_openai_client_drives_the_server_and_its_traces_train(server, chat_model, tmp_path):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, timeout=60)
    assert [m.id for m in client.models.list().data] == [str(chat_model)]
    # completions: greedy text equal to lmrl's own decode of the same model
    done = client.completions.create(model="m", prompt=["What is 2 + 3?", "What is 4 + 1?"], max_tokens=8,
                                     temperature=0, logprobs=1)
    trainer = chat_run(tmp_path / "run", chat_model)  # lmrl's decode: the policy itself
    tok = trainer.tokenizer
    own = HFGenerator(trainer.policy, tok).generate([tok("What is 2 + 3?")["input_ids"], tok("What is 4 + 1?")["input_ids"]],
                                                    1, SamplingParams(max_new_tokens=8, temperature=0.0))
    assert [c.text for c in done.choices] == own.texts
    assert done.choices[0].logprobs.token_logprobs == pytest.approx(own.logprobs[0, :len(done.choices[0].logprobs.tokens)].tolist(), abs=1e-4)
    assert done.usage.completion_tokens == int(own.lengths.sum())
    # an agent's chat traces, sampled by the server, scored elsewhere, trained on here
    records = []
    for i, question in enumerate(QUESTIONS[:4]):
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}], n=4,
                                              max_tokens=8, temperature=1.0, seed=i, logprobs=True)
        assert len(chat.choices) == 4 and all(c.message.role == "assistant" for c in chat.choices)
        for c in chat.choices:
            records.append({"prompt": [{"role": "user", "content": question}], "completion": c.message.content,
                            "reward": float(len(c.message.content) % 3), "group_id": i,
                            "finished": c.finish_reason == "stop"})
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    metrics = trainer.train_on_scored(records)
    assert torch.isfinite(torch.tensor(metrics["loss/policy_avg"]))
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))


def test_a_run_pushes_its_weights_to_the_server_every_step(server, chat_model, tmp_path, monkeypatch):
    monkeypatch.setenv("LMRL_API_KEY", server.api_key)  # a server the run did not start: its key by environment
    monkeypatch.setenv("LMRL_WEIGHTS_SECRET", server.weights_secret)
    trainer = chat_run(tmp_path, chat_model, "rollout.backend=vllm-server", f"rollout.vllm.server_url={server.url}")
    history = trainer.train().history
    assert [h["val/sampler_kl"] for h in history] == pytest.approx([0] * 3, abs=2e-5)
    assert all(h["time/weight_sync"] > 0 for h in history)
    # the server holds the trained policy: its greedy completions are the policy's own
    rows = trainer.data.eval_rows[:4]
    served, _ = trainer.generate_and_score(rows, 1, temperature=0.0)
    assert server.health()["version"] == 3
    tok = trainer.tokenizer
    prompts = served.prompt_ids.tolist()
    own = HFGenerator(trainer.policy, tok).generate([[t for t, m in zip(p, mask) if m] for p, mask in
                                                     zip(prompts, served.prompt_mask.tolist())], 1,
                                                    SamplingParams(max_new_tokens=8, temperature=0.0))
    assert served.texts == own.texts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_server_is_one_line(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RunError, match=rf"^rollout.vllm.server_url: no answer from {url} \(ConnectionRefusedError"):
        ServerGenerator(url, bpe_chat_tokenizer(["a b"], vocab_size=270)).generate([[1]], 1, SamplingParams())
    out = forked.lmrl("train", "rollout.backend=vllm-server", f"rollout.vllm.server_url={url}",
                      f"train.output_dir={tmp_path}", "train.steps=2", cwd=tmp_path, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]  # refused before training: nothing written
    errors = [line for line in out.stderr.splitlines() if line.startswith("lmrl: error:")]
    assert len(errors) == 1 and f"rollout.vllm.server_url: no answer from {url} (ConnectionRefusedError" in errors[0]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_server_that_dies_mid_run_stops_the_run_after_a_checkpoint(chat_model, tmp_path, monkeypatch):
    tok = AutoTokenizer.from_pretrained(chat_model)
    own = ServerGenerator.start([f"model.name_or_path={chat_model}", "rollout.max_prompt_length=64"], tok, timeout=120)
    monkeypatch.setenv("LMRL_API_KEY", own.api_key)
    monkeypatch.setenv("LMRL_WEIGHTS_SECRET", own.weights_secret)

    def kill_at_step_3(prompts, completions, trainer_state, **kw):
        if trainer_state.global_step == 2:  # scoring step 3: the server goes away before the next sync
            own.process.kill()
            own.process.wait()
        return last_digit(prompts, completions)

    cfg = load_config(None, [f"model.name_or_path={chat_model}", "train.steps=5", "rollout.prompts_per_step=4",
                             "rollout.group_size=4", "rollout.max_new_tokens=8", "rollout.max_prompt_length=64",
                             f"train.output_dir={tmp_path}", "log.console=false", "train.eval_every=0",
                             "rollout.backend=vllm-server", f"rollout.vllm.server_url={own.url}"])
    rows = [{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS]
    trainer = Trainer(cfg, reward_funcs=[kill_at_step_3], train_dataset=rows)
    with pytest.raises(RunError, match=rf"^step 4: rollout.vllm.server_url: the weight sync to {own.url} failed"):
        trainer.train()
    assert (tmp_path / "checkpoint-3").is_dir()  # the last good step, resumable
    own.close()


def servers_of(seed: int) -> list[int]:
    """Pids of the generation servers a run with train.seed=`seed` started."""
    out = subprocess.run(["pgrep", "-f", f"lmrl.cli serve .*train.seed={seed} "], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_the_server_a_run_started_goes_with_the_run_even_on_sigkill(tmp_path):
    """A run that started its own vLLM server, killed with SIGKILL, leaves no server behind. The run is a real
    process forked from the suite's zygote (the SIGKILL reaches it as it would reach `lmrl train`); the server it
    starts is a fresh interpreter, as the run starts it, with a vLLM engine on the CPU."""
    seed = 700 + os.getpid() % 1000
    run = forked.start("train", "rollout.backend=vllm-server", "train.steps=2000", f"train.seed={seed}",
                       f"train.output_dir={tmp_path / 'out'}", "train.eval_every=0", "train.max_minutes=null",
                       cwd=tmp_path, output=tmp_path / "run")
    metrics = tmp_path / "out" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert run.poll() is None, "the run ended early"
        time.sleep(0.2)
    assert json.loads(metrics.read_text().splitlines()[-1])["step"] >= 2  # it trained through the server
    assert servers_of(seed), "no server was started"
    run.send_signal(signal.SIGKILL)
    run.wait()
    deadline = time.monotonic() + 60
    while servers_of(seed) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not servers_of(seed), "the server outlived its run"
