"""Loading user code that a config names: `"path/to/file.py:function"` or `"package.module:function"`.

Reward functions (`reward.functions`), tools (`env.tools`) and environments (`env.name`) are all
named this way. Each caller says how its messages call the spec ("reward spec", "tool spec",
"environment") and which built-in names it would also have taken, so that every message is one line
in that caller's words.

Loading a file runs that file, as importing any module does: only load files you trust. Model
outputs, by contrast, are never executed here.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lmrl.errors import ConfigError


def _one_line(e: BaseException) -> str:
    if isinstance(e, SystemExit):
        return f"it called sys.exit({'' if e.code is None else repr(e.code)})"
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= 300 else text[:297] + "..."


def load_function(spec: str, what: str = "reward spec", builtins: Iterable[str] = ()) -> Callable[..., Any]:
    """Load `"path/to/file.py:function"` or `"package.module:function"`.

    Importing runs the file or module; an exception or a sys.exit() there is reported, not
    propagated (KeyboardInterrupt still is).

    Args:
        spec: the spec as the config wrote it.
        what: how messages name it: "reward spec" (as `lmrl.rewards.load_function` says), "tool spec",
            "environment".
        builtins: the built-in names the caller also takes, listed in the message of a spec that is
            neither form (the caller resolves them itself, before calling this).

    Raises:
        ConfigError: a malformed spec, a missing file or module, a file or module that fails to
            import, or a missing / non-callable attribute; the message names the spec.
    """
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        names = sorted(builtins)
        forms = "'path/to/file.py:function' or 'module.sub:function'"
        raise ConfigError(f"{what} {spec!r}: expected {f'a built-in name {names}, ' if names else ''}{forms}")
    if module_part.endswith(".py"):
        path = Path(module_part).expanduser()
        if not path.is_file():
            raise ConfigError(f"{what} {spec!r}: file {str(path)!r} not found")
        # one name per file, whatever it holds (a reward, a tool, an environment)
        module_name = f"lmrl_user_reward_{abs(hash(str(path.resolve())))}"
        file_spec = importlib.util.spec_from_file_location(module_name, path)
        if file_spec is None or file_spec.loader is None:
            raise ConfigError(f"{what} {spec!r}: cannot load {str(path)!r} as a Python module")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[module_name] = module  # so that pickling and dataclasses inside the file work
        try:
            file_spec.loader.exec_module(module)
        except (Exception, SystemExit) as e:
            sys.modules.pop(module_name, None)
            raise ConfigError(f"{what} {spec!r}: importing {str(path)!r} failed: {_one_line(e)}") from e
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as e:
            raise ConfigError(f"{what} {spec!r}: cannot import module {module_part!r}: {_one_line(e)}") from e
        except (Exception, SystemExit) as e:
            raise ConfigError(f"{what} {spec!r}: importing module {module_part!r} failed: {_one_line(e)}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ConfigError(f"{what} {spec!r}: no function {attr!r} in {module_part!r}; callables there: {public}")
    if not callable(fn):
        raise ConfigError(f"{what} {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn
