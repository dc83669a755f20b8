"""The config in words: every field with its default and docstring (`lmrl train --help-config`), the resolved
config one line per section (what a run and `--dry-run` print), as YAML (a run's `lmrl_config.yaml`), and the
valid values that would quietly waste a run.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel

from lmrl.config.algorithm import AlgorithmConfig
from lmrl.config.messages import section_type
from lmrl.config.presets import ALGORITHM_PRESETS, MODEL_PRESETS, REWARD_PRESETS
from lmrl.config.schema import Config


def config_warnings(cfg: Config) -> list[str]:
    """Values that are valid but quietly waste a run: one line each, printed when a run starts."""
    out = []
    o, a = cfg.optim, cfg.algorithm
    updates = cfg.train.steps * a.num_iterations * a.num_minibatches
    if o.warmup_steps > updates:
        out.append(f"optim.warmup_steps={o.warmup_steps} is longer than the run's {updates} optimizer steps: the "
                   f"learning rate never reaches optim.lr (it ends at {updates / o.warmup_steps:.0%} of it)")
    return out


def config_to_yaml(cfg: Config) -> str:
    """The resolved config as YAML: what a run saves as `lmrl_config.yaml`."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def config_summary(cfg: Config) -> str:
    """The resolved config, one line per section: `algorithm: name=grpo advantage=grpo ...`."""
    lines = []
    for section, values in cfg.model_dump(mode="json").items():
        # a string with a line break (env.response_format) is shown as a literal, so each section stays one line
        lines.append(f"{section}: " + " ".join(f"{k}={v!r}" if isinstance(v, str) and "\n" in v else f"{k}={v}"
                                               for k, v in values.items()))
    return "\n".join(lines)


def field_rows(root: type[BaseModel] | None = None) -> list[tuple[str, Any, list[Any], str]]:
    """(key, default, allowed values, docstring) of every field, nested ones after their parent (`model.lora.r`),
    in the schema's order: what `--help-config` and the documentation's config reference both print. `root`: the
    config whose fields these are (default `Config`; `RewardTrainingConfig` for `lmrl train-rm`)."""
    rows: list[tuple[str, Any, list[Any], str]] = []

    def section(model: type[BaseModel], prefix: str) -> None:
        for name, f in model.model_fields.items():
            key = f"{prefix}.{name}"
            rows.append((key, f.default, _choices(f.annotation), f.description or ""))
            nested = section_type(f.annotation)
            if nested is not None:
                section(nested, key)

    for name, f in (root or Config).model_fields.items():
        section(f.annotation, name)
    return rows


def preset_lines() -> list[str]:
    """What each preset sets: `NAME: field=value, ...` for the algorithms, then the shipped models'."""
    lines = []
    for name, preset in ALGORITHM_PRESETS.items():
        changed = {k: v for k, v in preset.items() if AlgorithmConfig.model_fields[k].default != v}
        extra = [f"reward.{k}={f:g} x rollout.max_new_tokens" for k, f in REWARD_PRESETS.get(name, {}).items()]
        lines.append(f"{name}: " + (", ".join([*(f"{k}={v}" for k, v in changed.items()), *extra]) or "the defaults"))
    for model, sections in MODEL_PRESETS.items():
        fields = [f"{s}.{k}={str(v).lower() if isinstance(v, bool) else v}" for s, values in sections.items()
                  for k, v in values.items()]
        lines.append(f"model.name_or_path={model}: {', '.join(fields)}")
    return lines


def describe_fields(root: type[BaseModel] | None = None) -> str:
    """Every field (nested ones too: `model.lora.r`) with its default, its allowed values and its docstring,
    then what each preset changes: for `lmrl train --help-config`."""
    lines: list[str] = []
    section = None
    for key, default, choices, doc in field_rows(root):
        if key.split(".")[0] != section:
            section = key.split(".")[0]
            lines.append(f"{section}:")
        lines.append(f"  {key} = {default!r}" + (f"   (one of: {', '.join(map(str, choices))})" if choices else ""))
        lines.extend(f"      {line.strip()}" for line in doc.splitlines())
    if root is not None:  # presets are the policy config's
        return "\n".join(lines)
    lines.append("presets (algorithm.name=NAME fills these fields unless you set them):")
    lines.extend(f"  {line}" for line in preset_lines())
    return "\n".join(lines)


def _choices(annotation: Any) -> list[Any]:
    """The values a Literal field (possibly optional or annotated) allows; [] for other fields."""
    if getattr(annotation, "__origin__", None) is Literal:
        return list(get_args(annotation))
    return [c for a in get_args(annotation) for c in _choices(a)]
