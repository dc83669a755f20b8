"""Reading a config: a YAML file (a key written twice is refused) and `key=value` overrides parsed as YAML,
merged, then built into a `Config`.

    cfg = load_config("examples/dapo.yaml", ["algorithm.clip_high=0.3", "train.steps=50"])
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from lmrl.config.presets import SHORTHANDS, expand_shorthands, merge
from lmrl.config.schema import Config
from lmrl.errors import ConfigError


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["algorithm.clip_high=0.28", "train.steps=5"]` -> nested dict; values are parsed as YAML."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            hint = f"; write {item}=VALUE (no spaces around =)" if _looks_like_key(item) else ""
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.steps=50{hint}")
        try:
            value = _parse_value(raw)
        except ConfigError as e:
            raise ConfigError(f"override {key.strip()}: {e}") from None
        parts = key.strip().split(".")
        if len(parts) == 1 and parts[0] in SHORTHANDS:
            parts.append(SHORTHANDS[parts[0]])
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p} is not a section")
        node[parts[-1]] = value
    return out


def _parse_value(raw: str) -> Any:
    """YAML, except that numbers YAML 1.1 leaves as strings ("1e-3") become floats."""
    if not raw.strip():
        return None
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"value {raw!r} is not valid YAML ({problem}); quote the whole key=value for the shell, "
                          "e.g. 'reward.functions=[{fn: math}]'") from None
    if isinstance(value, str):
        try:
            return float(value) if value.strip().lower() not in ("nan", "inf", "-inf", "infinity") else value
        except ValueError:
            return value
    return value


def build_config(raw: dict[str, Any]) -> Config:
    """Validate a nested dict (presets fill what it does not set: `Config`)."""
    return Config(**expand_shorthands(raw))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML file (optional), apply `key=value` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_yaml(path)
    raw = merge(expand_shorthands(raw), parse_overrides(overrides or []))
    return build_config(raw)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A config file's mapping of sections; a key written twice is an error (YAML would keep the last)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {str(p)!r} is a directory, expected a YAML file")
    if not p.is_file():
        hint = ""
        if "=" not in str(path) and _looks_like_key(str(path)):
            hint = f"; to set a field write {path}=VALUE (no spaces around =)"
        raise ConfigError(f"config file {str(p)!r} does not exist{hint}")
    try:
        raw = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ConfigError as e:
        raise ConfigError(f"config file {str(p)!r} {e}") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {str(p)!r} is not valid YAML{line}: {problem}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections, not a {type(raw).__name__}")
    return raw


def _looks_like_key(text: str) -> bool:
    """`train.steps` or `algorithm`: what a user meant as an override when they forgot the `=`."""
    section, _, field = text.partition(".")
    model = Config.model_fields.get(section)
    if model is None:
        return False
    return not field or field.split(".")[0] in getattr(model.annotation, "model_fields", {})


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping key given twice, naming both lines."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(f"line {line}: key {key!r} appears twice (first on line {seen[key]}); "
                                  "YAML would silently keep the second")
            seen[key] = line
        return super().construct_mapping(node, deep)
