"""One line per invalid value: pydantic's ValidationError shaped as `full.key: what is wrong (got VALUE)`.

Every config error a user sees passes through `one_line`, whether the value came from `Config(...)`, a YAML
file, an override or an assignment (`cfg.train.steps = -3`). A name another framework uses
(`learning_rate=`) is answered from `foreign_names`; an unknown name gets the closest field. `section_at`
finds the section a key names, walking the sections' fields from a root (Config, or one section).
"""

from __future__ import annotations

import difflib
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from lmrl.config.foreign_names import explain_foreign_name

_RANGE_WORDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
                "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}


def one_line(e: ValidationError, root: type[BaseModel], prefix: str = "") -> str:
    """The first validation error as `full.key: what is wrong (got VALUE)`. `root` is the model that raised it:
    Config, or the section a field was assigned in, whose key in Config is `prefix` ("model.lora")."""
    err = e.errors()[0]
    own = [x for x in err["loc"] if not str(x).startswith("function-")]
    # pydantic names a union's member in the location (`list[...]`, `constrained-int`): not a user's key
    own = [x for x in own if isinstance(x, int) or "[" not in str(x) and "-" not in str(x)]
    parts = [*filter(None, prefix.split(".")), *own]
    loc, rel = _key(parts), _key(own)  # the full key, and the same key from `root`
    kind, got = err["type"], err.get("input")
    if kind in ("extra_forbidden", "no_such_attribute"):
        if (foreign := explain_foreign_name(loc, got)) is not None:  # learning_rate=..., beta=..., verl's paths
            return foreign
        section_path, _, key = loc.rpartition(".")
        section = section_at(root, rel.rpartition(".")[0])
        allowed = list(section.model_fields) if section else []
        hint = difflib.get_close_matches(key, allowed, n=1)
        where = section_path or "config"
        suggestion = f"; did you mean {hint[0]!r}?" if hint else f"; allowed: {', '.join(allowed)}"
        return f"{loc}: {where} has no field {key!r}{suggestion}"
    msg = err["msg"].removeprefix("Value error, ")
    if kind in _RANGE_WORDS:
        word, key = _RANGE_WORDS[kind]
        bound = err["ctx"][key]
        bound = int(bound) if float(bound).is_integer() else bound
        return f"{loc}: must be {word} {bound} (got {got!r})"
    if got is None and kind.endswith("_type"):
        return f"{loc}: must be set (got null or an empty value)"
    if kind == "missing" and parts and isinstance(parts[-1], int):
        return f"{loc.rpartition('[')[0]}: too few values (got {got!r})"
    if kind == "too_long":
        return f"{loc}: too many values (got {got!r})"
    if kind == "finite_number":
        return f"{loc}: must be a finite number (got {got!r})"
    if kind in ("int_from_float", "int_parsing", "int_type"):
        return f"{loc}: must be a whole number (got {got!r})"
    if kind in ("float_parsing", "float_type"):
        return f"{loc}: must be a number (got {got!r})"
    if kind == "string_too_short":
        return f"{loc}: must not be empty"
    if kind == "string_pattern_mismatch" and loc == "model.device":
        return f"{loc}: must be auto, cpu, cuda or cuda:N (got {got!r})"
    section = section_at(root, rel)
    first = msg.split(" ", 1)[0].rstrip(":")
    if loc and section is not None and first in section.model_fields:
        return f"{loc}.{msg}"  # a section validator naming its own field
    if kind == "literal_error":
        return f"{loc}: got {got!r}; {msg.lower()}"
    if loc and not kind.startswith("value_error"):
        return f"{loc}: {msg} (got {got!r})"
    if loc and msg.startswith(loc.rpartition(".")[2] + ":"):
        msg = msg.split(":", 1)[1].strip()  # a field validator naming its field: the full key says it
    return f"{loc}: {msg}" if loc else msg


def _key(parts: list[Any]) -> str:
    """["reward", "clip", 1] -> "reward.clip[1]"."""
    return "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in parts).lstrip(".")


def section_type(annotation: Any) -> type[BaseModel] | None:
    """The section class a field holds (`lora: LoraConfig | None` -> LoraConfig); None for a plain value."""
    return next((a for a in (annotation, *get_args(annotation)) if isinstance(a, type) and issubclass(a, BaseModel)),
                None)


def section_at(root: type[BaseModel], path: str) -> type[BaseModel] | None:
    """The section `path` names under `root`: section_at(Config, "model.lora") -> LoraConfig; "" -> root."""
    model = root
    for part in filter(None, path.split(".")):
        field = model.model_fields.get(part)
        found = section_type(field.annotation) if field is not None and field.annotation is not None else None
        if found is None:
            return None
        model = found
    return model
