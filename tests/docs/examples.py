"""The documentation's examples, read and run as a reader would (issue 30): every fenced block of README.md and
docs/*.md, page by page, in one fresh working directory per page.

    bash     each command runs (`bash -c`, the checkout's .venv/bin first on PATH); `lmrl train` is made small:
             BUDGET's keys at most their value (a documented `train.steps=500` runs 2 steps), SHAPE's where the
             command does not set them. A command that matches NOT_RUN is not run: the list says why and which
             test covers it instead.
    console  a transcript: each `$ command` runs exactly as written, and every line shown under it must be a line
             of what it printed (a quoted error line is compared with the real one).
    python   runs as a script; `lmrl.Trainer` is made small the same way. `<!-- docs: continue -->` before the fence
             appends the block to the page's previous python script.
    pycon    an interactive session (`>>>`), run by doctest: what each line shows, an exception's one line
             included, must be what Python prints.
    yaml     loads as an lmrl config (`lmrl.load_config`): every key and value must be valid. `<!-- docs: file
             NAME -->` before the fence also writes it into the working directory as NAME.
    json     parses (one document, or one per line); `docs: file NAME` writes it as NAME too.
    text     output or a listing: not run.

`<!-- docs: given NAME ... -->` anywhere on a page creates files from GIVEN first (a tiny model directory,
prompt files, a reward module). `<!-- docs: skip REASON -->` before a fence leaves that block out; REASON is one
of SKIP_REASONS, and `skipped_blocks()` lists every such block (the closing note and tests/docs count them).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from tests.forked import forked

ROOT = Path(__file__).resolve().parents[2]
LANGUAGES = {"bash", "console", "python", "pycon", "yaml", "json", "text"}
SKIP_REASONS = {"gpu": "needs a GPU", "network": "needs the network", "minutes": "takes minutes",
                "server": "a server that runs until stopped", "nodes": "needs several machines"}
# a documented run, made small: BUDGET's keys at most these values, SHAPE's where the run does not set them
BUDGET = {"train.steps": 2, "data.num_eval_prompts": 4, "rollout.max_new_tokens": 32}
SHAPE = {"rollout.prompts_per_step": 4, "rollout.group_size": 2, "train.eval_every": 0}
EVAL_PROMPTS = 8
# commands of bash blocks that are not run here, and why (each names what runs it instead)
NOT_RUN = [
    (r"^make (demo|test|setup)\b", "sets up .venv and runs the demo or the suite: CI runs `make test` on a clean clone"),
    (r"^make docs", "builds the site: tests/docs/test_site.py builds it (strict) and opens it in Chromium"),
    (r"^(python3? -m )?pip (install|download)\b", "needs the package index"),
    (r"^lmrl serve\b", "a server that runs until stopped: tests/rollout/test_vllm_server.py starts one"),
    (r"rollout\.backend=vllm", "starts a vLLM engine, minutes on a CPU: tests/rollout/test_vllm_engine.py"),
    (r"^torchrun\b.*--nnodes\b", "one launcher per node: tests/test_multinode.py starts two on one machine"),
    (r"^torchrun\b|--nproc\b", "two or more processes: tests/test_distributed.py runs torchrun with 2 ranks"),
    (r"^git\b", "changes the checkout"),
    (r"^(\.venv/bin/)?pytest\b", "the suite itself"),
    (r"scripts/(make_tiny_model|gpu_wheels|gpu_run)", "minutes, the network or a GPU machine"),
    (r"scripts/same_metrics\.py", "minutes: tests/test_same_metrics.py runs it on a small scale"),
]
GIVEN_FILES = {
    "big.jsonl": "".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                         for a in range(10, 60) for b in range(10, 30)),
    "prompts.jsonl": "".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                             for a in range(10, 30) for b in range(10, 20)),
    "heldout.jsonl": "".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                             for a in range(30, 35) for b in range(20, 24)),
    "rw.py": ("def exact(prompts, completions, answer, **kwargs):\n"
              "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n"),
}
MAKE = {  # directories, made by a script given the path
    # a Hugging Face model: a tiny Llama and its tokenizer, as `save_pretrained` writes them
    "my-model": """
import sys
from lmrl.models.tiny import char_tokenizer, tiny_causal_lm
tok = char_tokenizer()
tiny_causal_lm(tok).save_pretrained(sys.argv[1])
tok.save_pretrained(sys.argv[1])
""",
    # a DatasetDict on disk with train and validation splits
    "saved_dataset": """
import sys
from datasets import Dataset, DatasetDict
rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 20) for b in range(10, 14)]
DatasetDict({"train": Dataset.from_list(rows[:30]), "validation": Dataset.from_list(rows[30:])}).save_to_disk(sys.argv[1])
""",
}
# before every python block: the Trainer made small (BUDGET, SHAPE)
PYTHON_PRELUDE = """
import lmrl as _lmrl, lmrl.trainer as _trainer
_init = _trainer.Trainer.__init__
def _tiny(self, cfg, **kw):
    cfg = cfg.model_copy(deep=True)
    for key, value in {budget!r}.items():
        section, name = key.split(".")
        now = getattr(getattr(cfg, section), name)
        setattr(getattr(cfg, section), name, value if now is None else min(now, value))
    for key, value in {shape!r}.items():
        section, name = key.split(".")
        if name not in getattr(cfg, section).model_fields_set:
            setattr(getattr(cfg, section), name, value)
    _init(self, cfg, **kw)
_trainer.Trainer.__init__ = _lmrl.Trainer.__init__ = _tiny
del _tiny
"""


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    text: str
    skip: str | None = None  # a SKIP_REASONS key
    file: str | None = None  # `docs: file NAME`
    continues: bool = False  # `docs: continue`

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@dataclass
class Page:
    path: Path
    blocks: list[Block] = field(default_factory=list)
    given: list[str] = field(default_factory=list)


class DocError(AssertionError):
    """A documented example that does not do what the page says: names the page and line."""


_DIRECTIVE = re.compile(r"<!--\s*docs:\s*(\w+)\s*(.*?)\s*-->")


def pages() -> list[Path]:
    """README.md and docs/*.md (not the hidden pages a test writes there for a while)."""
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if not p.name.startswith("."))]


def parse(path: Path) -> Page:
    """A page's fenced blocks, with the directives that apply to them."""
    page, pending, lines = Page(path), {}, path.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        for kind, arg in _DIRECTIVE.findall(line):
            if kind == "given":
                page.given += arg.split()
            elif kind in ("skip", "file", "continue"):
                pending[kind] = arg
            else:
                raise DocError(f"{path.relative_to(ROOT)}:{i + 1}: unknown directive 'docs: {kind}'")
        fence = re.match(r"^(`{3,})(.*)$", line)
        if not fence:
            i += 1
            continue
        language, start, body = fence.group(2).strip(), i + 1, []
        i += 1
        while i < len(lines) and not lines[i].startswith(fence.group(1)):
            body.append(lines[i])
            i += 1
        block = Block(path, start, language, "\n".join(body) + "\n", pending.get("skip"), pending.get("file"),
                      "continue" in pending)
        where = block.where
        if language not in LANGUAGES:
            raise DocError(f"{where}: a fenced block needs a language, one of {', '.join(sorted(LANGUAGES))} "
                           f"(got {language!r})")
        if block.skip is not None and block.skip not in SKIP_REASONS:
            raise DocError(f"{where}: 'docs: skip {block.skip}': the reason is one of {', '.join(SKIP_REASONS)}")
        page.blocks.append(block)
        pending = {}
        i += 1
    return page


def skipped_blocks() -> list[tuple[str, str]]:
    """(where, reason) of every block a `docs: skip` leaves out."""
    return [(b.where, SKIP_REASONS[b.skip]) for p in pages() for b in parse(p).blocks if b.skip]


def commands(text: str) -> list[tuple[int, str]]:
    """A bash block's commands with their line offsets: comments and blank lines out, `\\` lines joined."""
    out, joined, first = [], "", 0
    for n, raw in enumerate(text.splitlines()):
        line = raw.strip()
        if not joined:
            first = n
        if not joined and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            joined += line[:-1] + " "
            continue
        out.append((first, _strip_comment(joined + line)))
        joined = ""
    return out


def _strip_comment(command: str) -> str:
    """The command without a trailing `# comment` (a `#` after a space, outside quotes)."""
    quote = None
    for i, ch in enumerate(command):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or command[i - 1].isspace()):
            return command[:i].rstrip()
    return command.rstrip()


def not_run(command: str) -> str | None:
    """Why a command is not run here (NOT_RUN), or None."""
    for pattern, why in NOT_RUN:
        if re.search(pattern, command):
            return why
    return None


def _subcommand(words: list[str]) -> str | None:
    for i, word in enumerate(words[:-1]):
        if word == "lmrl" or (word == "-m" and words[i + 1] == "lmrl"):
            rest = words[i + 1:] if word == "lmrl" else words[i + 2:]
            return rest[0] if rest else None
    return None


def tiny(command: str) -> str:
    """`lmrl train ...` (or `python -m lmrl train ...`) made small: BUDGET's keys at most their values, SHAPE's
    where the command does not set them (appended overrides win over the command's own and its YAML's);
    `lmrl eval` on EVAL_PROMPTS prompts unless it says how many."""
    words = shlex.split(command)
    sub = _subcommand(words)
    if any(w in ("--help-config", "--help", "-h", "--dry-run") for w in words):
        return command
    if sub == "eval":
        return command if "--num-prompts" in words else f"{command} --num-prompts {EVAL_PROMPTS}"
    if sub != "train":
        return command
    given = dict(w.split("=", 1) for w in words if "=" in w)
    small = {k: min(v, int(given[k])) if given.get(k, "").isdigit() else v for k, v in BUDGET.items()}
    small |= {k: v for k, v in SHAPE.items() if k not in given}
    return command + "".join(f" {k}={v}" for k, v in small.items())


def environment() -> dict[str, str]:
    venv = ROOT / ".venv" / "bin"
    path = os.pathsep.join(p for p in (str(venv) if venv.exists() else "", str(Path(sys.executable).parent),
                                       os.environ.get("PATH", "")) if p)
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PATH": path, "PYTHONPATH": python_path, "LMRL_TRACEBACK": ""}


def shell(command: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """`command` as bash runs it in `cwd`: `lmrl` and `python` resolve through PATH (the checkout's .venv first,
    else this interpreter's folder). A plain `lmrl ...` (no shell syntax outside quotes) runs in a process forked
    from this one, which has imported lmrl already: the same `lmrl.cli.main`, its own process, cwd, environment,
    output and exit code, without the interpreter's 3 s of start-up (a page runs dozens)."""
    unquoted = re.sub(r"'[^']*'|\"[^\"$`\\]*\"", "", command)  # what bash reads as syntax is outside quotes
    words = shlex.split(command) if not re.search(r"[|&;<>$`(){}*?~]", unquoted) else []
    if words[:1] == ["lmrl"]:
        return forked("cli", words[1:], cwd, timeout, command, environment())
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=environment(), capture_output=True, text=True,
                          timeout=timeout)


def make_given(names: list[str], cwd: Path, where: str) -> None:
    for name in names:
        if name in GIVEN_FILES:
            (cwd / name).write_text(GIVEN_FILES[name])
        elif name in MAKE:
            done = forked("main", [MAKE[name], "-c", str(cwd / name)], cwd, 120, f"docs: given {name}", environment())
            if done.returncode != 0:
                raise DocError(f"{where}: 'docs: given {name}' failed:\n{done.stderr[-2000:]}")
        else:
            raise DocError(f"{where}: 'docs: given {name}': known are {', '.join([*GIVEN_FILES, *MAKE])}")


def run_page(path: Path, cwd: Path) -> dict[str, int]:
    """Every block of a page, in order, in `cwd`. Raises DocError naming the block's line; returns the counts of
    blocks run, by language, and of commands not run."""
    page = parse(path)
    (cwd / "examples").symlink_to(ROOT / "examples")  # a reader runs the pages' commands in the checkout
    make_given(page.given, cwd, str(path.relative_to(ROOT)))
    counts: dict[str, int] = {}
    script = ""
    for block in page.blocks:
        if block.skip or block.language == "text":
            continue
        counts[block.language] = counts.get(block.language, 0) + 1
        if block.language == "python":
            script = (script if block.continues else "") + block.text
            _python(block, script, cwd)
        elif block.language == "bash":
            for offset, command in commands(block.text):
                if not_run(command):
                    counts["commands not run"] = counts.get("commands not run", 0) + 1
                    continue
                done = shell(tiny(command), cwd)
                if done.returncode != 0:
                    raise DocError(f"{block.page.relative_to(ROOT)}:{block.line + 1 + offset}: `{command}` exited "
                                   f"{done.returncode}:\n{(done.stdout + done.stderr)[-2000:]}")
        elif block.language == "console":
            _transcript(block, cwd)
        elif block.language == "pycon":
            _doctest(block, cwd)
        elif block.language == "yaml":
            _yaml(block, cwd)
        elif block.language == "json":
            _json(block)
            if block.file:
                (cwd / block.file).write_text(block.text)
    return counts


def _python(block: Block, script: str, cwd: Path) -> None:
    source = PYTHON_PRELUDE.format(budget=BUDGET, shape=SHAPE) + script
    done = forked("main", [source, block.where], cwd, 240, block.where, environment())
    if done.returncode != 0:
        raise DocError(f"{block.where}: the python block failed:\n{done.stderr[-2000:]}")


DOCTEST = """
import doctest, sys
test = doctest.DocTestParser().get_doctest(sys.stdin.read(), {}, sys.argv[1], sys.argv[1], 0)
runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
runner.run(test)
sys.exit(1 if runner.failures else 0)
"""


def _doctest(block: Block, cwd: Path) -> None:
    done = forked("main", [DOCTEST, "<doctest>", block.where], cwd, 240, block.where, environment(), stdin=block.text)
    if done.returncode != 0:
        raise DocError(f"{block.where}: the session does not print what the page shows:\n{done.stdout[-2500:]}"
                       f"{done.stderr[-1000:]}")


def _transcript(block: Block, cwd: Path) -> None:
    """`$ command` lines run; the lines under each must be lines of what it printed."""
    steps: list[tuple[int, str, list[str]]] = []
    for n, line in enumerate(block.text.splitlines()):
        if line.startswith("$ "):
            steps.append((n, line[2:], []))
        elif steps and line.strip():
            steps[-1][2].append(line.rstrip())
        elif line.strip():
            raise DocError(f"{block.page.relative_to(ROOT)}:{block.line + 1 + n}: a console block starts with `$ `")
    for n, command, expected in steps:
        done = shell(command, cwd)
        printed = {line.rstrip() for line in (done.stdout + done.stderr).splitlines()}
        for line in expected:
            if line not in printed:
                raise DocError(f"{block.page.relative_to(ROOT)}:{block.line + 1 + n}: `{command}` did not print "
                               f"{line!r}; it printed:\n{(done.stdout + done.stderr)[-2000:]}")


def _yaml(block: Block, cwd: Path) -> None:
    import yaml

    from lmrl.config import load_config
    from lmrl.errors import ConfigError

    try:
        data = yaml.safe_load(block.text)
    except yaml.YAMLError as e:
        raise DocError(f"{block.where}: not YAML: {e}") from None
    target = cwd / (block.file or ".docs-block.yaml")
    target.write_text(block.text)
    if not isinstance(data, dict):
        raise DocError(f"{block.where}: a YAML block is an lmrl config (a mapping of sections)")
    try:
        load_config(str(target), [])
    except ConfigError as e:
        raise DocError(f"{block.where}: {e}") from None
    finally:
        if block.file is None:
            target.unlink()


def _json(block: Block) -> None:
    try:
        json.loads(block.text)
    except json.JSONDecodeError:
        for n, line in enumerate(block.text.splitlines()):
            try:
                if line.strip():
                    json.loads(line)
            except json.JSONDecodeError as e:
                raise DocError(f"{block.page.relative_to(ROOT)}:{block.line + 1 + n}: not JSON: {e}") from None


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")
