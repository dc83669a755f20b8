"""The generation backend `rollout.backend` names, built from the config: the trainer's (`make_generator`), an
asynchronous run's generator process's (`process_generator`) and what `lmrl serve` runs (`serving_generator`).
lmrl's decode over the live policy, or a generator that holds its own weights (`RemoteGenerator`): a vLLM engine
in this process, a generation server (at rollout.vllm.server_url or started here), or lmrl's decode over a model
of its own. The models it generates with are `lmrl.build`'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmrl.build import Models, load_processor, policy_path
from lmrl.config import Config
from lmrl.models.loading import DTYPES, load_causal_lm, load_tokenizer, resolve_device
from lmrl.rollout import Generator, HFGenerator
from lmrl.rollout.hf import resolve_eos


def make_generator(cfg: Config, models: Models, env: Any, device: torch.device, local: bool = False) -> Generator:
    """The generation backend `rollout.backend` names: lmrl's decode over the live policy (or its sampler copy);
    a vLLM engine in this process; or a generation server, at rollout.vllm.server_url or started here
    (`lmrl.rollout.remote`). The last two hold their own weights (`RemoteGenerator`) and are sized for the
    longest row a rollout can hold, within the model's positions. `local`: lmrl's decode whatever the backend (an
    asynchronous run's evaluation, while its generator process samples with rollout.backend's)."""
    r = cfg.rollout
    if r.backend == "lmrl" or local:
        return HFGenerator(models.sampler or models.policy, models.tokenizer, batch_size=r.batch_size,
                           cuda_graph=r.cuda_graph)
    base = getattr(models.policy, "module", models.policy)
    base = base.get_base_model() if hasattr(base, "peft_config") else base
    return _holding_generator(cfg, base, models.tokenizer, env, device, processor=models.processor)


def process_generator(cfg: Config, skeleton: Any, tokenizer: Any, env: Any, device: torch.device, processor: Any = None):
    """The generator of an asynchronous run's generator process (`lmrl.async_rollouts`), as rollout.backend names
    it, holding its own weights (a `RemoteGenerator`) and given them before its first batch: lmrl's decode over a
    model built from the policy's config, a vLLM engine in that process, or a generation server. `skeleton`: the
    policy's `config`, `generation_config` (its EOS) and `dtype`, without weights; `processor`: a vision-language
    policy's (lmrl's decode then takes the collector's bundles, an engine or a server the images)."""
    if cfg.rollout.backend != "lmrl":
        return _holding_generator(cfg, skeleton, tokenizer, env, device, processor)
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from lmrl.rollout.server import ModelGenerator

    dtype = DTYPES[cfg.rollout.dtype] if cfg.rollout.dtype else skeleton.dtype
    auto = AutoModelForImageTextToText if processor is not None else AutoModelForCausalLM
    with torch.device(device):
        model = auto.from_config(skeleton.config, dtype=dtype)
    model.generation_config = skeleton.generation_config
    return ModelGenerator(model.eval(), tokenizer, seed=cfg.train.seed, batch_size=cfg.rollout.batch_size)


def _holding_generator(cfg: Config, base: Any, tokenizer: Any, env: Any, device: torch.device, processor: Any = None):
    """A vLLM engine in this process, or a generation server (at rollout.vllm.server_url, or started here), for the
    model `base` (its `config` and `generation_config` are read); `processor`: a vision-language model's."""
    r = cfg.rollout
    completion = cfg.completion_budget(multi_turn=env is not None)  # an env object counts, not only env.name
    if r.backend == "vllm":
        return _engine(cfg, base, tokenizer, r.max_prompt_length + completion, device, processor)
    from lmrl.rollout.remote import ServerGenerator

    if r.vllm.server_url is not None:
        server = ServerGenerator(r.vllm.server_url, tokenizer, timeout=r.vllm.timeout, seed=cfg.train.seed,
                                 api_key=os.environ.get(r.vllm.server_api_key_env),
                                 weights_secret=os.environ.get(r.vllm.server_weights_secret_env))
        server.health()  # a server that is not there fails now, in one line, before the first step
        return server
    # a server on this machine, started and stopped with the run: the policy's model and the engine's settings
    model = cfg.model.model_dump(mode="json", include={"dtype", "trust_remote_code"})
    args = [f"model.name_or_path={policy_path(cfg)}", *(f"model.{k}={v}" for k, v in model.items()),
            "rollout.backend=vllm", f"rollout.max_prompt_length={r.max_prompt_length}",
            f"rollout.max_new_tokens={completion}", f"train.seed={cfg.train.seed}",
            *([f"rollout.vllm.max_model_len={r.vllm.max_model_len}"] if r.vllm.max_model_len else []),
            *(f"rollout.vllm.{k}={v}" for k, v in r.vllm.model_dump(mode="json", exclude={"max_model_len", "server_url",
                                                                                       "server_api_key_env",
                                                                                       "server_weights_secret_env"}).items()),
            *([f"rollout.dtype={r.dtype}"] if r.dtype else []),
            "--max-n", "0", "--max-sequences", "0"]  # its only client is this run (a random key): an eval of every row
    return ServerGenerator.start(args, tokenizer, timeout=r.vllm.timeout, seed=cfg.train.seed)


def _engine(cfg: Config, model: nn.Module, tokenizer: Any, longest: int, device: torch.device, processor: Any = None):
    """A vLLM engine for `model`, holding rows of `longest` tokens (rollout.vllm.max_model_len when set), within
    the model's positions; given a vision-language model's `processor`, it takes images."""
    from lmrl.rollout.vllm_engine import VLLMGenerator, refuse_on_this_build

    refuse_on_this_build(model.config, device.type, cfg.rollout.backend)
    v = cfg.rollout.vllm
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None) or longest
    max_model_len = v.max_model_len or min(longest, positions)
    return VLLMGenerator(model.config, tokenizer, dtype=cfg.rollout.dtype or cfg.model.dtype, max_model_len=max_model_len,
                         seed=cfg.train.seed, eos_token_ids=resolve_eos(model, tokenizer, None), device=device.type,
                         gpu_memory_utilization=v.gpu_memory_utilization, cpu_kv_cache_gb=v.cpu_kv_cache_gb,
                         sleep=v.sleep, enforce_eager=v.enforce_eager, processor=processor)


@dataclass
class Served:
    """What `lmrl serve` runs, and the model's sizes its request limits come from (`lmrl.rollout.server.Limits`)."""

    generator: Any
    """Holds the model and takes new weights (`RemoteGenerator`)."""
    tokenizer: Any
    context: int
    """Tokens one row may hold, prompt and completion: the engine's max_model_len, else the model's positions
    (0: the model does not say)."""
    vocab_size: int
    """Rows of the input embedding: a prompt's token ids are below it."""
    push_bytes: int
    """The most bytes a weight push of this model can take: every tensor in float64, and each frame's header."""


def serving_generator(cfg: Config) -> Served:
    """What `lmrl serve` runs: the config's model and a generator that holds it and takes new weights
    (`RemoteGenerator`): a vLLM engine given the model's weights (rollout.backend vllm or vllm-server), or lmrl's
    decode over the model (rollout.backend=lmrl)."""
    from lmrl.models.weights import export_weights
    from lmrl.rollout.wire import MAX_FRAME_HEADER

    m, r = cfg.model, cfg.rollout
    path = policy_path(cfg)
    device = resolve_device(m.device)
    processor = load_processor(cfg)  # a vision-language model's: requests may then carry images
    if processor is not None:
        from lmrl.models.vision import load_vision_model

        model, _ = load_vision_model(path, dtype=DTYPES[m.dtype], processor=processor)
        model, tokenizer = model.to(device), processor.tokenizer
    else:
        tokenizer = load_tokenizer(path, trust_remote_code=m.trust_remote_code)
        model = load_causal_lm(path, dtype=m.dtype, device=device, trust_remote_code=m.trust_remote_code)
    tensors = [*model.parameters(), *model.buffers()]
    push_bytes = sum(8 * t.numel() + 4 + MAX_FRAME_HEADER for t in tensors) + 4
    vocab_size = model.get_input_embeddings().num_embeddings
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None) or 0
    if r.backend == "lmrl":
        from lmrl.rollout.server import ModelGenerator

        return Served(ModelGenerator(model, tokenizer, seed=cfg.train.seed, processor=processor), tokenizer,
                      positions, vocab_size, push_bytes)
    engine = _engine(cfg, model, tokenizer, cfg.longest_sequence, device, processor)
    engine.load_weights(export_weights(model), version=-1)  # its starting weights: no policy version yet
    del model
    context = r.vllm.max_model_len or (min(cfg.longest_sequence, positions) if positions else cfg.longest_sequence)
    return Served(engine, tokenizer, context, vocab_size, push_bytes)


def check_backend(cfg: Config, model_config: Any, device: torch.device) -> None:
    """Before a run builds its generator (in this process, a generator process or a server it starts): refuse a
    model the generation engine rollout.backend names would not compute on the device it would run on."""
    r = cfg.rollout
    if r.backend == "lmrl" or (r.backend == "vllm-server" and r.vllm.server_url is not None):  # (a server elsewhere:
        return  # the sync check holds it to the policy from step 1)
    from lmrl.rollout.vllm_engine import refuse_on_this_build

    engine = cfg.train.generator_device if cfg.asynchronous and r.backend == "vllm" else None
    refuse_on_this_build(model_config, resolve_device(engine).type if engine else device.type, r.backend)


def sampler_of(cfg: Config, policy: nn.Module) -> dict[str, Any]:
    """What samples with a copy of the weights of its own, for the sync check (`lmrl.guards.Guards`): its name as
    the check's line says it (None: the policy samples itself), what to do instead, and whether it and the trainer
    both compute in float32 on the CPU, where a synced copy's log-probs equal the trainer's to ~1e-6."""
    r, m = cfg.rollout, cfg.model
    model_type = getattr(getattr(policy, "config", None), "model_type", "?")
    if r.backend != "lmrl":
        sampler, advice = f"rollout.backend={r.backend}, {model_type}", "use rollout.backend=lmrl for this model"
    elif cfg.asynchronous:
        t = cfg.train
        schedule = f"train.async_steps={t.async_steps}" if t.async_steps else f"train.max_staleness={t.max_staleness}"
        sampler, advice = f"the generator process's copy, {schedule}", "train.async_steps=0, train.max_staleness=null"
    elif r.dtype is not None:
        sampler, advice = f"its rollout.dtype={r.dtype} copy", "leave rollout.dtype unset"
    else:
        return {"sampler": None}
    floats = {r.dtype or m.dtype, m.dtype} == {"float32"} and not cfg.train.autocast_bf16
    on_cpu = resolve_device(m.device).type == "cpu" and (cfg.train.generator_device or "cpu").startswith("cpu")
    return {"sampler": sampler, "sampler_advice": advice, "sampler_exact": floats and on_cpu}
