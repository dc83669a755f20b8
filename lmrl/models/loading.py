"""Loading Hugging Face causal LMs and tokenizers, and the frozen reference model. Prompt encoding is
`lmrl.models.prompt_encoding`; the training forward (response-token log-probs) `lmrl.models.forward`.
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any

import torch
from torch import nn

from lmrl.errors import ConfigError, ModelError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("cpu", "cuda", "auto")


def _looks_local(name_or_path: str) -> bool:
    """True if `name_or_path` is meant as a local path rather than a hub id ("org/name").

    Checked before calling transformers so that a mistyped local path fails at once with a clear
    message instead of being sent to the hub (which retries for ~30 s without a network).
    """
    return (
        os.path.exists(name_or_path)
        or name_or_path.startswith(("/", ".", "~"))
        or "\\" in name_or_path
        or name_or_path.count("/") > 1
    )


def _check_exists(name_or_path: str | os.PathLike, config_key: str, what: str) -> str:
    path = os.fspath(name_or_path)
    if _looks_local(path) and not os.path.exists(os.path.expanduser(path)):
        raise ModelError(f"{config_key}: cannot load {what}{path!r}: no such file or directory")
    local = os.path.expanduser(path)
    needs = ("tokenizer_config.json", "tokenizer.json", "config.json") if what else ("config.json",)
    if os.path.isdir(local) and not any(os.path.isfile(os.path.join(local, name)) for name in needs):
        raise ModelError(f"{config_key}: cannot load {what}{path!r}: the directory holds no {' or '.join(needs)}, so it "
                         "is not one written by save_pretrained")
    return os.path.expanduser(path) if _looks_local(path) else path


def quiet_progress_bars():
    """transformers draws a progress bar per load and save: none in the middle of the console or of stderr."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def off():
        was = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            if was:
                hf_logging.enable_progress_bar()

    return off()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_tokenizer(
    name_or_path: str | os.PathLike,
    padding_side: str = "left",
    trust_remote_code: bool = False,
    config_key: str = "model.name_or_path",
):
    """Load a tokenizer with `AutoTokenizer`, padded on the left for generation.

    If the tokenizer has no pad token, the pad token becomes the EOS token. That is safe in lmrl
    because no mask is ever derived from `pad_token_id`: the generator returns explicit attention
    and response masks (see the module docstring).

    Args:
        name_or_path: a local directory or a hub id.
        padding_side: "left" (generation, lmrl's batches) or "right".
        trust_remote_code: passed to transformers; only for repositories you trust.
        config_key: the configuration key named in error messages.

    Raises:
        ValueError: the path does not exist or cannot be loaded, or the tokenizer has neither a pad
            nor an EOS token.
    """
    from transformers import AutoTokenizer

    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side: must be 'left' or 'right', got {padding_side!r}")
    path = _check_exists(name_or_path, config_key, "tokenizer ")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:  # transformers raises both, often over several lines
        raise ModelError(f"{config_key}: cannot load tokenizer {path!r}: {_first_line(err)}") from err
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(f"{config_key}: tokenizer {path!r} has neither a pad token nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    return tokenizer


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device for `device`: "auto" is cuda when available, else cpu; "cuda" without a GPU fails."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise ConfigError(f"model.device: must be one of {list(DEVICES)} (or 'cuda:N'), got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"model.device: {device!r} asked for, but this machine has no CUDA device; "
                          "use model.device=cpu (or auto)")
    return torch.device(device)


def load_causal_lm(
    name_or_path: str | os.PathLike,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    gradient_checkpointing: bool = False,
    config_key: str = "model.name_or_path",
) -> nn.Module:
    """Load a causal LM with `AutoModelForCausalLM` from a local directory or a hub id.

    Args:
        name_or_path: a local directory (e.g. one written by `save_pretrained`) or a hub id.
        dtype: "auto" (the checkpoint's own dtype, as transformers does), "float32", "bfloat16"
            or "float16".
        device: "cpu", "cuda" (or "cuda:N"), or "auto" (cuda when available).
        trust_remote_code: passed to transformers; only for repositories you trust.
        attn_implementation: e.g. "sdpa", "eager", "flash_attention_2"; None lets transformers choose.
        gradient_checkpointing: recompute activations in the backward pass (less memory, ~30% more
            compute); also turns the KV cache off, which checkpointing cannot use.
        config_key: the configuration key named in error messages.

    Returns:
        The model, on `device`, in train mode only if gradient checkpointing is on (eval otherwise;
        the trainer switches modes itself).

    Raises:
        ValueError: unknown dtype or device, or "<config_key>: cannot load 'X': <reason>" when the
            path does not exist or transformers cannot load it.
    """
    from transformers import AutoModelForCausalLM

    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"model.dtype: must be one of {['auto', *DTYPES]}, got {dtype!r}")
    target = resolve_device(device)
    path = _check_exists(name_or_path, config_key, "")
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    # transformers >= 4.56 takes `dtype=` (`torch_dtype=` is deprecated, and gone in 5.x).
    kwargs["dtype"] = "auto" if dtype == "auto" else DTYPES[dtype]
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        with quiet_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:  # transformers raises both, often over several lines
        why = _not_a_causal_lm(path, err, trust_remote_code) or _first_line(err)
        raise ModelError(f"{config_key}: cannot load {path!r}: {why}") from err
    model.to(target)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    else:
        model.eval()
    return model


CAUSAL_LMS = "decoder-only causal LMs (Llama, Qwen, Mistral, Gemma, GPT-2, ...: docs/supported-models.md)"


def _not_a_causal_lm(path: str, err: BaseException, trust_remote_code: bool) -> str | None:
    """Why transformers has no causal-LM class for the model at `path` (an encoder-decoder such as T5, an encoder
    such as a classifier's), in words a user can act on; None when `err` is about something else."""
    if "Unrecognized configuration class" not in str(err):
        return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    kind = "an encoder-decoder" if getattr(config, "is_encoder_decoder", False) else "not a causal LM"
    classes = f" ({', '.join(config.architectures)})" if getattr(config, "architectures", None) else ""
    return f"it is a {config.model_type} model{classes}, {kind}, which lmrl cannot train: lmrl trains {CAUSAL_LMS}"


@torch.no_grad()
def check_causal(model: nn.Module, config_key: str = "model.name_or_path") -> None:
    """Refuse a model whose logits at a position change with the tokens after it. An encoder loads as a causal LM
    (BERT's `BertLMHeadModel` when its config lacks `is_decoder`) and then trains, samples and scores with every
    position seeing the whole sequence: the log-probs of a completion's tokens are conditioned on the tokens
    after them, and nothing fails. Two sequences that share their first half, each on its own: a causal model's
    logits on the shared half are the same (to the bit, on the same shapes); an encoder's are not."""
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    ids[1, :4] = ids[0, :4]
    ids[1, 4:] = (ids[0, 4:] + 1) % vocab
    device = next(model.parameters()).device
    training = model.training
    model.eval()
    try:
        first, second = (model(input_ids=row[None].to(device), use_cache=False).logits[0, :4].float() for row in ids)
    finally:
        model.train(training)
    gap, scale = (first - second).abs().max().item(), first.abs().max().item()
    if gap > 1e-4 * (1 + scale):  # (non-finite logits are the weights' check's to name)
        kind = getattr(model.config, "model_type", type(model).__name__)
        decoder = ("; a model trained as a decoder says so in its config.json (is_decoder: true)"
                   if getattr(model.config, "is_decoder", None) is False else "")
        raise ModelError(f"{config_key}: the {kind} model ({type(model).__name__}) is not a causal LM: its logits at "
                         f"a position change with the tokens after it (by {gap:.3g}), so every log-prob would see the "
                         f"completion it scores; lmrl trains {CAUSAL_LMS}{decoder}")


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute activations in the backward pass (non-reentrant: works with inputs that need no grad
    and with DDP/FSDP). transformers 5.x renamed the method (the old name warns); 4.x has only the old one."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()


def reference_model(policy: nn.Module) -> nn.Module:
    """A frozen copy of the policy: the reference of the KL penalty.

    A deep copy (separate weights, same dtype and device), in eval mode (no dropout), with
    `requires_grad=False` on every parameter so that it never enters an optimizer or the autograd
    graph. It costs one more copy of the weights; a LoRA run needs none (its reference is the policy's
    own base model with its adapters disabled, `Trainer._reference`).
    """
    ref = copy.deepcopy(policy)
    ref.eval()
    ref.requires_grad_(False)
    return ref


# a PreTrainedModel's config's dropout rates before `disable_dropout` zeroed them, kept for saving (`dropout_as_loaded`)
AS_LOADED = "_lmrl_dropout_as_loaded"


def _is_rate(name: str, value: Any) -> bool:
    """A dropout rate by its name (dropout, attention_dropout, attn_pdrop, layerdrop, ...) that is not 0."""
    return "drop" in name.lower() and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def disable_dropout(model: nn.Module) -> None:
    """Dropout off in `model`'s train-mode forward, which then computes what its eval-mode forward does (the
    sampler's and the reference's distribution).

    Three places hold a rate: every dropout module's `p` (TRL's `disable_dropout_in_model` stops here); the rates
    modules copied from the config when they were built (Llama's `attention_dropout`, OPT's `dropout` and
    `layerdrop`); and the config itself, which some models read at forward time (Falcon, GPT-J, GPT-Neo,
    Persimmon). All three go to 0. The config's rates as loaded stay on each model that holds the config, so
    that a saved model keeps them (`dropout_as_loaded`). A peft LoRA layer's dropout is left: the user set it.
    """
    from transformers import PreTrainedConfig

    modules = [(name, m) for name, m in model.named_modules() if "lora_dropout" not in name.split(".")]
    configs = {id(c): c for _, m in modules if isinstance(c := getattr(m, "config", None), PreTrainedConfig)}
    loaded = {i: {k: v for k, v in vars(c).items() if _is_rate(k, v)} for i, c in configs.items()}
    for _, module in modules:
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if _is_rate(name, value):
                setattr(module, name, 0.0)
        # on every model holding the config, for a copy of one may be saved too (a critic's backbone)
        if (rates := loaded.get(id(getattr(module, "config", None)))) and hasattr(module, "save_pretrained"):
            setattr(module, AS_LOADED, {**rates, **getattr(module, AS_LOADED, {})})
    for i, config in configs.items():
        for name in loaded[i]:
            setattr(config, name, 0.0)


@contextlib.contextmanager
def dropout_as_loaded(*models: nn.Module | None):
    """The configs of `models` hold the dropout rates they were loaded with while the body runs (saving them),
    the zeros `disable_dropout` set again after."""
    undo = []
    for model in models:
        for module in model.modules() if model is not None else ():
            for name, value in getattr(module, AS_LOADED, {}).items():
                undo.append((module.config, name, getattr(module.config, name)))
                setattr(module.config, name, value)
    try:
        yield
    finally:
        for config, name, value in reversed(undo):
            setattr(config, name, value)
