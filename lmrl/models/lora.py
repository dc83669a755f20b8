"""LoRA: new adapters on a policy (`model.lora`), an adapter directory to continue from (`model.name_or_path`
pointing at `final/adapter/` or a LoRA run's checkpoint), and the base model an adapter records."""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

from torch import nn

from lmrl.errors import ModelError


def adapter_base(path: str) -> str | None:
    """The base model a LoRA adapter directory (one holding adapter_config.json: `final/adapter/`, a LoRA
    run's checkpoint) was trained on, as recorded there; None when `path` is not one."""
    config = Path(path) / "adapter_config.json"
    if not config.is_file():
        return None
    try:
        base = json.loads(config.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as e:
        raise ModelError(f"model.name_or_path: cannot read {config}: {e}") from e
    if not isinstance(base, str) or not base:
        raise ModelError(f"model.name_or_path: {config} names no base model (base_model_name_or_path)")
    return base


def portable_adapter_config(directory: Path, base: str) -> None:
    """Record `base` (the model as the user named it: a hub id, a relative path, "tiny-addition") as the
    adapter's base model, instead of the absolute path peft writes."""
    config = directory / "adapter_config.json"
    values = json.loads(config.read_text())
    values["base_model_name_or_path"] = base
    config.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def load_adapter(policy: nn.Module, directory: str) -> nn.Module:
    """`policy` wrapped with the LoRA adapter saved in `directory`, trainable: a run continues from it."""
    try:
        from peft import PeftModel
    except ImportError as e:
        raise ImportError("model.name_or_path: a LoRA adapter needs peft: pip install 'lmrl[peft]'") from e
    try:
        with quiet_peft():
            return PeftModel.from_pretrained(policy, directory, is_trainable=True)
    except Exception as e:  # noqa: BLE001 - one line naming the adapter
        raise ModelError(f"model.name_or_path: cannot load the LoRA adapter {directory}: "
                         f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from e


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """peft reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model: a FutureWarning
    about peft's code, not the user's, on every LoRA run. On a mixture of experts peft 0.21 also says that rank and
    alpha patterns it made itself for the fused `gate_up_proj` matched nothing, while it adapts every expert
    (`tests/test_lora_outputs.py`): two warnings a user can do nothing about."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match any "
                                                  r"targeted module and were ignored: \['[^,]*gate_up_proj'\]\.$",
                                category=RuntimeWarning)
        yield


# a vision-language model's parts that `all-linear` leaves alone: LoRA targets its language model
VISION_MODULES = r".*(vision_tower|visual|vision_model|multi_modal_projector|connector)\..*"


def apply_lora(policy: nn.Module, lora, task_type: str = "CAUSAL_LM") -> nn.Module:
    """`policy` wrapped with new LoRA adapters as `model.lora` (r, alpha, dropout, target modules) sets them.
    `task_type="SEQ_CLS"` (a reward model) also trains the score head in full and saves it with the adapters.
    A vision-language model's `all-linear` adapters go on its language model only (not the vision tower or
    the projector); named target modules are taken as they are."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise ImportError("model.lora needs peft: pip install 'lmrl[peft]'") from e
    vision = getattr(policy.config, "vision_config", None) is not None
    peft_cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=lora.target_modules, task_type=task_type,
                          exclude_modules=VISION_MODULES if vision and lora.target_modules == "all-linear" else None)
    with quiet_peft():
        return get_peft_model(policy, peft_cfg)
