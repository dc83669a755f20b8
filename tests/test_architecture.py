"""The package's structure is a contract, checked here (docs/architecture.md explains it):

- the layers in pyproject.toml's [tool.importlinter]: a module imports only from the layers under its own;
- no import cycle between any two modules of lmrl;
- no function over 80 lines of code (docstrings, comments and blank lines aside);
- the loop stays readable in one sitting: lmrl/trainer.py within 350 lines, no config module over 600;
- a step's data flows one way: collecting it enters each stage (prompts, encoding, generation, scoring,
  shaping) once, in that order, never coming back to a stage it left.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lmrl"
MAX_FUNCTION_LINES = 80


def _code_lines(node: ast.AST, lines: list[str]) -> int:
    """Lines of code in a function: its docstring, blank lines and comment-only lines not counted."""
    body = node.body
    skip: set[int] = set()
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
            body[0].value.value, str):
        skip = set(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for i in range(node.lineno, node.end_lineno + 1)
               if i not in skip and lines[i - 1].strip() and not lines[i - 1].strip().startswith("#"))


def test_the_layers_hold():
    """import-linter's contracts (pyproject.toml): the layers, and lmrl.algorithms importing nothing of lmrl."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe is not None, "lint-imports (import-linter) is not installed: pip install -e '.[dev]'"
    out = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_no_import_cycle():
    """No two modules of lmrl import each other, directly or through others (function-level imports included)."""
    import grimp

    graph = grimp.build_graph("lmrl", include_external_packages=False)
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    cycles = [c for c in _strongly_connected(edges) if len(c) > 1]
    assert cycles == [], f"import cycles: {cycles}"


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(sorted(component))
    return out


def test_strongly_connected_finds_a_cycle():
    """The cycle check can fail: a three-module loop and a self-standing module."""
    found = _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert sorted(map(tuple, found)) == [("a", "b", "c"), ("d",)]


def test_no_function_over_80_lines_of_code():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _code_lines(node, lines)
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert long == []


def test_code_lines_leave_out_the_docstring_and_comments():
    source = 'def f(x):\n    """Doc.\n\n    More."""\n    # why\n\n    y = x + 1\n    return y\n'
    node = ast.parse(source).body[0]
    assert _code_lines(node, source.splitlines()) == 3


def test_the_loop_and_the_config_stay_small():
    assert len((PACKAGE / "trainer.py").read_text().splitlines()) <= 350
    assert not (PACKAGE / "config.py").exists() and (PACKAGE / "config" / "__init__.py").is_file()
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PACKAGE / "config").glob("*.py")}
    assert max(sizes.values()) <= 600, sizes


# the stages of collecting a step's data, in the order a step passes them (modules, or packages for a group)
STAGES = ("lmrl.data", "lmrl.models.prompt_encoding", "lmrl.rollout", "lmrl.rewards", "lmrl.rewards.shaping")
# not stages: the Rollout record and its operations (any stage may use them), and the layers under every stage
RECORDS = ("lmrl.rollout.base", "lmrl.rollout.ops")


def _stage(module: str) -> str | None:
    """The stage a module belongs to: the longest prefix in STAGES (None: not a stage, e.g. distributed)."""
    found = [s for s in STAGES if module == s or module.startswith(s + ".")]
    return max(found, key=len) if found and module not in RECORDS else None


@pytest.mark.parametrize("overrides", [[], ["model=tiny-calculator", "rollout.max_new_tokens=8"], ["algorithm=dapo"]],
                         ids=["single-turn", "multi-turn", "dynamic-sampling"])
def test_collecting_a_step_passes_each_stage_once(tmp_path, overrides):
    """The calls the collector makes into lmrl, traced while it collects one step: the stages come in order,
    each entered once, and none is entered again after a later one (DAPO repeats the whole sequence per round,
    so a round is what is checked there)."""
    from lmrl.config import load_config
    from lmrl.trainer import Trainer

    cfg = load_config(None, ["train.steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
                             "data.num_eval_prompts=2", "log.console=false", f"train.output_dir={tmp_path}",
                             "algorithm.max_sampling_rounds=1", *overrides])
    trainer = Trainer(cfg)
    seen: list[str] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        caller = frame.f_back
        if caller is None or caller.f_globals.get("__name__") != "lmrl.collect":
            return
        stage = _stage(frame.f_globals.get("__name__", ""))
        if stage is not None and (not seen or seen[-1] != stage):
            seen.append(stage)

    sys.setprofile(profile)
    try:
        trainer.collect(1)
    finally:
        sys.setprofile(None)
    assert seen == [s for s in STAGES if s in seen], seen  # in order, each once
    assert {"lmrl.data", "lmrl.rollout", "lmrl.rewards", "lmrl.rewards.shaping"} <= set(seen), seen
