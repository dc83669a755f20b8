"""The base every config section derives from, and the constrained types its fields are declared with.

A section forbids unknown names, checks a value assigned after it was built (`cfg.train.steps = -3`), refuses a
bool where a number belongs and keeps a path as a string; every error is one line naming the full key.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lmrl.config.messages import one_line
from lmrl.errors import ConfigError

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


# Ranges live in the field types, so that every value is checked on load, before torch is imported, and
# errors name the full key with the value given. No negative or zero value keeps an accidental meaning.
PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
MAX_SEED = 2**32 - 1


def _takes_number(annotation: Any) -> bool:
    """The field holds an int or float (possibly optional, annotated or a tuple of them), not a bool."""
    args = get_args(annotation)
    if annotation in (int, float):
        return True
    if annotation is bool or bool in args:
        return False
    return any(_takes_number(a) for a in args)


class Section(BaseModel):
    """A config section: a typed group of fields, each with a docstring (`lmrl train --help-config`)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)

    # where this section sits in Config ("model.lora"), the start of its assignment errors' keys: Config's
    # module sets it for each section from Config's fields (lmrl.config.schema)
    _key: ClassVar[str] = ""
    # fields `options_for` leaves out although a function takes them (a value the caller passes instead)
    _not_options: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _plain_values(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                # pydantic would read `train.steps=true` as 1: a bool where a number belongs is a mistake
                if field is not None and _takes_number(field.annotation) and _holds_bool(value):
                    raise ValueError(f"{name}: expected a number, got {value!r}")
            # a path may be a pathlib.Path wherever the config takes one; it is kept as a string
            data = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in data.items()}
        return data

    def options_for(self, fn: Callable[..., Any]) -> dict[str, Any]:
        """This section's fields that `fn` takes as keyword arguments of the same names, so that a call reads
        `make_experience(..., **cfg.algorithm.options_for(make_experience))` and no name is listed twice."""
        keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        params = {name for name, p in inspect.signature(fn).parameters.items() if p.kind in keyword}
        return {name: getattr(self, name) for name in type(self).model_fields
                if name in params and name not in self._not_options}

    def __setattr__(self, name: str, value: Any) -> None:
        # `cfg.train.steps = -3` is checked on assignment (validate_assignment): one line naming the full key
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise ConfigError(one_line(e, type(self), prefix=self._key)) from None


def _holds_bool(value: Any) -> bool:
    return isinstance(value, bool) or (isinstance(value, (list, tuple)) and any(isinstance(v, bool) for v in value))
