"""Training on CUDA, checked on a CPU: every stage of a step under `tests/fakecuda.py`'s fake device.

The first run on a GPU found that training on CUDA did not work at all (rewards scored on the CPU met the
rollout's CUDA tensors, a CUDA index went into a CPU tensor, an asynchronous batch stayed on the generator's
device); on a CPU every tensor is on one device, so none of it could fail here. Under `fake_cuda()` the policy
lives on "cuda" and a CPU tensor meeting it fails as CUDA fails. The first tests check the fake device against
CUDA's rules; the rest run each stage a GPU step goes through: collect (generate, score), experience
(reference and old forwards, KL, advantages, critic values), update (minibatch order, micro-batches, the
optimizer), evaluation, scored rollouts from a file, checkpoints and the asynchronous hand-over.
"""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch

from lmrl.config import Config
from lmrl.trainer import Trainer

from .fakecuda import CudaTensor, DeviceMismatch, fake_cuda
from .test_trainer import make_trainer

# no CUDA graph on the fake device: the decoder falls back to its eager fixed-shape step, as on a broken driver
pytestmark = pytest.mark.filterwarnings("ignore:CUDA graph capture failed")

# ------------------------------------------------------------------------------ the fake device keeps CUDA's rules


# (what to do with x on "cuda" and c on the CPU, does CUDA raise): the rules the fake device keeps. On a machine with a
# GPU the same table runs against real CUDA, so a rule that is not CUDA's fails there.
RULES = {
    "x + c": (lambda x, c: x + c, True),
    "x + c.sum() (a 0-dim CPU tensor is a scalar)": (lambda x, c: x + c.sum(), False),
    "where(x > 0, c.sum(), c.sum())": (lambda x, c: torch.where(x > 0, c.sum(), c.sum()), False),
    "masked_fill(x > 0, c.sum())": (lambda x, c: x.masked_fill(x > 0, c.sum()), False),
    "stack([x.sum(), c.sum()])": (lambda x, c: torch.stack([x.sum(), c.sum()]), True),
    "cat([x, c])": (lambda x, c: torch.cat([x, c]), True),
    "x @ c": (lambda x, c: x @ c, True),
    "x[argsort(c)] (CPU indices)": (lambda x, c: x[torch.argsort(c)], False),
    "c[argsort(x)] (CUDA indices into a CPU tensor)": (lambda x, c: c[torch.argsort(x)], True),
    "x[c > 0] (a CPU mask)": (lambda x, c: x[c > 0], False),
    "c[x > 0] (a CUDA mask on a CPU tensor)": (lambda x, c: c[x > 0], True),
    "x[:2] = c[:2] (copied)": (lambda x, c: x.__setitem__(slice(0, 2), c[:2]), False),
    "x[argsort(c)] = c (put from the CPU)": (lambda x, c: x.__setitem__(torch.argsort(c), c), True),
    "index_select(x, 0, argsort(c))": (lambda x, c: torch.index_select(x, 0, torch.argsort(c)), True),
    "gather(x, 0, argsort(c))": (lambda x, c: torch.gather(x, 0, torch.argsort(c)), True),
    "x.copy_(c)": (lambda x, c: x.copy_(c), False),
    "c.to(x) + x": (lambda x, c: c.to(x) + x, False),
    "multinomial(x, generator=CPU)": (lambda x, c: torch.multinomial(x.abs() + 1, 1, generator=torch.Generator()), True),
    "x.numpy()": (lambda x, c: x.numpy(), True),
}
RULE_DEVICES = ["fake", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("where", RULE_DEVICES)
@pytest.mark.parametrize("case", list(RULES))
def test_the_fake_device_keeps_cudas_rules(case, where):
    fn, raises = RULES[case]
    with fake_cuda() if where == "fake" else contextlib.nullcontext():
        x, c = torch.arange(1.0, 5.0, device="cuda"), torch.tensor([4.0, 1.0, 3.0, 2.0])
        if raises:
            with pytest.raises((RuntimeError, TypeError)):
                fn(x, c)
        else:
            fn(x, c)


def test_a_tensor_on_the_fake_device_says_cuda_and_the_line_says_where():
    with fake_cuda():
        x = torch.ones(3, device="cuda")
        assert isinstance(x, CudaTensor) and x.device == torch.device("cuda", 0) and x.is_cuda
        with pytest.raises(DeviceMismatch, match=r"cuda:0 and cpu.*\(fake CUDA: in add\)"):
            x + torch.ones(3)
        with pytest.raises(DeviceMismatch, match="indices should be either on cpu or on the same device"):
            torch.arange(3)[torch.argsort(x)]


def test_what_cuda_allows_passes_and_keeps_its_device():
    with fake_cuda():
        x = torch.ones(3, device="cuda")
        assert (x * torch.tensor(2.0)).device.type == "cuda"
        assert x[torch.tensor([2, 0])].tolist() == [1.0, 1.0]
        assert torch.zeros_like(x).is_cuda and x.new_zeros(2).is_cuda and x.sum().is_cuda
        moved = x.cpu()
        assert type(moved) is torch.Tensor and moved.device.type == "cpu"
        moved += 1  # a move copies: the CUDA tensor is unchanged
        assert x.tolist() == [1.0, 1.0, 1.0] and x.sum().item() == 3.0
        assert torch.ones(2).to(x).is_cuda and torch.ones(2).to(x.device, torch.float64).dtype == torch.float64
        rng = torch.Generator(device="cuda").manual_seed(0)
        assert torch.multinomial(x[None], 2, generator=rng).is_cuda


def test_a_model_moved_to_cuda_trains_there():
    torch.manual_seed(0)
    with fake_cuda():
        model = torch.nn.Linear(3, 2).to("cuda")
        assert all(isinstance(p, torch.nn.Parameter) and p.is_cuda for p in model.parameters())
        before = model.weight.detach().cpu()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        model(torch.ones(4, 3, device="cuda")).square().sum().backward()
        assert model.weight.grad.is_cuda
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        assert not torch.equal(before, model.weight.detach().cpu())
        with pytest.raises(DeviceMismatch):
            model(torch.ones(4, 3))


# ------------------------------------------------------------------------------ a step's stages on "cuda"


def _finite(row: dict) -> bool:
    return all(math.isfinite(v) for k, v in row.items() if isinstance(v, float) and not k.startswith("time/"))


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "dapo", "remax", "gspo", "sapo"])
def test_a_step_on_cuda_collects_scores_updates_and_evaluates(tmp_path, algorithm):
    """Generation, rewards, the reference / old / critic forwards, advantages, two minibatches of two micro-batches,
    the optimizer and an evaluation, all with the policy on "cuda"."""
    with fake_cuda():
        trainer = make_trainer(tmp_path, f"algorithm={algorithm}", "algorithm.kl_coef=0.05", "train.steps=1",
                               "train.eval_every=1", "algorithm.num_minibatches=2", "optim.micro_batch_size=4", device="cuda")
        assert all(p.is_cuda for p in trainer.policy.parameters())
        before = [p.detach().cpu() for p in trainer.policy.parameters()]
        history = trainer.train().history
    assert len(history) == 1 and _finite(history[0])
    assert "eval/accuracy" in history[0]
    assert any(not torch.equal(a, b.detach().cpu()) for a, b in zip(before, trainer.policy.parameters()))


def test_scored_rollouts_from_a_file_train_on_cuda(tmp_path):
    rows = [{"prompt": f"{i}+{i}=", "completion": str(2 * i), "reward": float(i % 2), "group_id": i // 2}
            for i in range(8)]
    with fake_cuda():
        trainer = make_trainer(tmp_path, device="cuda")
        metrics = trainer.train_on_scored(rows)
    assert _finite(metrics) and "loss/policy_avg" in metrics


def test_a_checkpoint_saved_on_cuda_resumes_on_cuda(tmp_path):
    """The optimizer's state and the generators' states go to disk from "cuda" and come back there."""
    with fake_cuda():
        make_trainer(tmp_path, "train.steps=1", "train.save_every=1", device="cuda").train()
        resumed = make_trainer(tmp_path, "train.steps=2", "train.save_every=1", "train.resume=true", device="cuda")
        history = resumed.train().history
        state = [t for s in resumed.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        assert state and all(t.is_cuda for t in state)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2] and _finite(history[-1])


def test_a_checkpoint_saved_on_the_cpu_resumes_on_cuda_with_the_samplers_own_stream(tmp_path, capsys, monkeypatch):
    """A run moved from a CPU machine to a GPU: lmrl's decode draws each call's seed from a generator on the host
    (each row's numbers then come from a hash on the device, `lmrl.engine.sampling`), so the sampler's saved state
    is restored as it is on CUDA too, with no line about it. model.device=auto (the default) is cpu there and cuda
    here."""
    with monkeypatch.context() as cpu_machine:  # also where the suite runs on a GPU machine
        cpu_machine.setattr(torch.cuda, "is_available", lambda: False)
        make_trainer(tmp_path, "train.steps=1", "train.save_every=1", "log.console=true").train()
    checkpoint = next(tmp_path.rglob("checkpoint-1"))
    saved = torch.load(checkpoint / "rng_state_0.pt", weights_only=True)["generators"]["sampler"]
    with fake_cuda():
        resumed = make_trainer(tmp_path, "train.steps=1", "train.resume=true", "log.console=true")
        assert resumed.policy.device.type == "cuda" and resumed.generator._rng.device.type == "cpu"
        resumed.lifecycle.load_checkpoint(checkpoint)
        assert torch.equal(resumed.generator._rng.get_state(), saved)
        resumed = make_trainer(tmp_path, "train.steps=2", "train.resume=true", "log.console=true")
        history = resumed.train().history
    assert _finite(history[-1])
    out = capsys.readouterr()
    assert "random state was saved on" not in out.out + out.err


def test_an_asynchronous_batch_from_a_cpu_generator_trains_on_cuda(tmp_path):
    """The generator process samples on the CPU (train.generator_device=cpu) while the trainer is on "cuda": each
    batch is handed over across devices, as with a generator on a GPU of its own."""
    cfg = Config(rollout={"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 6}, data={"num_eval_prompts": 4},
                 model={"device": "cuda"}, algorithm={"num_minibatches": 2},
                 train={"steps": 2, "eval_every": 0, "async_steps": 1, "generator_device": "cpu",
                        "output_dir": str(tmp_path)},
                 log={"console": False, "samples_every": 0})
    with fake_cuda():
        trainer = Trainer(cfg)
        history = trainer.train().history
    assert [r["async/policy_version"] for r in history] == [0, 0]
    assert all(_finite(r) for r in history)


@pytest.fixture
def two_rank_world(tmp_path):
    """A World that takes its statistics across ranks (`distributed`), over a one-process gloo group: each sum is
    the tensor itself, and every collective's placement runs as on several ranks."""
    import torch.distributed as dist

    from lmrl.distributed import World

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield World(rank=0, size=2)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("advantage", ["gpg", "grpo_batch_std"])
def test_statistics_across_ranks_are_taken_on_cuda(two_rank_world, advantage):
    """The estimators whose statistics span every rank's rows (GPG's informative share, the batch std) and the
    clip-filter weights, with the scores on "cuda"."""
    from lmrl.experience import _sequence_advantages, clip_filter_weights

    with fake_cuda():
        scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0], device="cuda")
        adv = _sequence_advantages(advantage, scores, 4, two_rank_world, None, 1)
        weights = clip_filter_weights(scores, 4, 2.0, two_rank_world)
        assert adv.is_cuda and weights.is_cuda
    assert torch.isfinite(adv).all() and torch.isfinite(weights).all()


def test_multi_turn_episodes_train_on_cuda(tmp_path):
    """Episodes of several turns (an environment's observations between the model's turns, the per-token masks of
    whole episodes) with PPO's critic and two passes, the policy on "cuda"."""
    from lmrl.models.tiny import char_tokenizer, tiny_causal_lm

    from .envs.test_training import ROWS, CountDigits, config

    tok = char_tokenizer()
    with fake_cuda():
        trainer = Trainer(config(tmp_path, "model.device=cuda"), model=tiny_causal_lm(tok, hidden_size=32, num_layers=1),
                          tokenizer=tok, train_dataset=ROWS, env=CountDigits)
        history = trainer.train().history
    assert history[-1]["env/turns"] > 1 and _finite(history[-1])


def test_a_mixture_of_experts_copy_on_cuda_takes_weights_pushed_from_the_cpu():
    """The generator process's copy on a GPU takes the policy's weights from shared (CPU) memory under checkpoint
    names: the fused experts are written through an index map, across devices."""
    from lmrl.models.tiny import char_tokenizer
    from lmrl.models.weights import export_weights
    from lmrl.rollout.server import ModelGenerator

    from .models.test_checkpoint_names import tiny

    policy = tiny("qwen3_moe", seed=0)
    pushed = [(name, t.clone()) for name, t in export_weights(policy)]  # on the CPU, as the snapshot is
    with fake_cuda():
        copy = tiny("qwen3_moe", seed=1).to("cuda")
        ModelGenerator(copy, char_tokenizer()).load_weights(pushed, version=1)
        same = [torch.equal(a, b.cpu()) for a, b in zip(policy.parameters(), copy.parameters(), strict=True)]
    assert all(same)


def test_an_agent_programs_episodes_train_on_cuda(tmp_path):
    """env.name=agent: a program written elsewhere asks the gateway for its turns; the episodes come back as token
    lists (built on the CPU) and must train with the policy on "cuda" (the third GPU run's failure)."""
    from .envs import python
    from .envs.test_agent import AGENT

    cfg = Config(model={"name_or_path": "tiny-calculator", "device": "cuda"}, data={"task": "calculator", "num_eval_prompts": 0},
                 env={"name": "agent", "command": f"{python()} {AGENT}", "timeout": 60, "max_parallel": 4},
                 rollout={"prompts_per_step": 2, "group_size": 2},
                 train={"steps": 1, "eval_every": 0, "output_dir": str(tmp_path)}, log={"console": False})
    with fake_cuda():
        history = Trainer(cfg).train().history
    assert history[-1]["env/turns"] > 1 and history[-1]["agent/failures"] == 0 and _finite(history[-1])


def test_a_run_through_a_generation_server_trains_on_cuda(tmp_path, monkeypatch):
    """rollout.backend=vllm-server against `lmrl serve` in its own process (on the CPU): the rollouts come back as
    token lists, built on the CPU, and train with the policy on "cuda"; the policy's weights go the other way."""
    from .rollout.test_server_security import SECRET, serve

    monkeypatch.setenv("LMRL_WEIGHTS_SECRET", SECRET)  # the server's, and what the run sends
    process, url = serve("rollout.max_new_tokens=8")
    try:
        cfg = Config(model={"device": "cuda"}, rollout={"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8,
                                                        "backend": "vllm-server", "vllm": {"server_url": url}},
                     train={"steps": 2, "eval_every": 0, "output_dir": str(tmp_path)}, log={"console": False})
        with fake_cuda():
            history = Trainer(cfg).train().history
    finally:
        process.terminate()
        process.wait(30)
    assert len(history) == 2 and all(_finite(r) for r in history)
    assert all(abs(r["val/sampler_logprob_diff"]) < 1e-4 for r in history)  # the server sampled with the pushed weights
