"""MkDocs hooks (mkdocs.yml): the site's pages that are generated, never written by hand, so they cannot go stale.

    index.md             README.md, its links to docs/ made relative to the site
    config-reference.md  every config field from the schema (`lmrl.config.describe.field_rows`: the same rows
                         `lmrl train --help-config` prints) and what each preset sets
    api.md               the public modules' docstrings (mkdocstrings)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # lmrl from this checkout

API = {  # module or object -> what the page says about it
    "lmrl.trainer.Trainer": "The trainer (`lmrl.Trainer`): `Trainer(cfg, ...)`, `train()`, `evaluate()`, `save()`, `train_on_scored()`.",
    "lmrl.trainer.TrainResult": "What `train()` returns.",
    "lmrl.config.Config": "The whole config: one section per concern.",
    "lmrl.config.load_config": "A config from YAML and `key=value` overrides, as the CLI reads it.",
    "lmrl.algorithms": "The pure functions of the algorithms: advantages, KL estimators, losses.",
    "lmrl.rewards": "Reward functions, their runner and shaping.",
    "lmrl.envs": "Multi-turn environments and tools.",
    "lmrl.rollout": "Generators: lmrl's decode, vLLM, a generation server.",
    "lmrl.sandbox": "Running model-written code with limits.",
    "lmrl.scored": "Training on completions sampled and scored elsewhere.",
    "lmrl.errors": "The errors lmrl raises, each printed as one line by the CLI.",
}


def readme_page() -> str:
    """README.md as the site's front page: links into docs/ point at the site's pages, links to other files of
    the repository (examples/, benchmarks/) become their text (the site holds docs/ only)."""
    text = re.sub(r"\]\(docs/([^)]+)\)", r"](\1)", (ROOT / "README.md").read_text())

    def link(m: re.Match) -> str:
        label, target = m.group(1), m.group(2)
        if re.match(r"https?://|#|[\w.-]+\.(md|png)(#|$)", target):
            return m.group(0)
        return f"`{label}`" if label == target else label  # [examples/x.yaml](examples/x.yaml) -> `examples/x.yaml`

    return re.sub(r"\[([^\]]+)\]\(([^)]+)\)", link, text)


def config_reference() -> str:
    from lmrl.config.describe import field_rows, preset_lines

    out = ["# Config reference", "",
           "Every field of the config, generated from the schema's own docstrings (`lmrl/config/`): the same text "
           "`lmrl train --help-config` prints. Set a field on the command line as `section.field=value`, in YAML "
           "under its section, or in Python as `Config(section={...})`.", ""]
    section = None
    for key, default, choices, doc in field_rows():
        top = key.split(".")[0]
        if top != section:
            section = top
            out += [f"## {top}", "", "| field | default | meaning |", "| --- | --- | --- |"]
        allowed = f" One of: {', '.join(f'`{c}`' for c in choices)}." if choices else ""
        meaning = " ".join(line.strip() for line in doc.splitlines()).replace("|", "\\|")
        out.append(f"| `{key}` | `{default!r}` | {meaning}{allowed} |")
    out += ["", "## Presets", "", "`algorithm.name=NAME` (or `algorithm=NAME`) fills these fields unless you set them; a "
            "shipped model's name fills its own:", ""]
    out += [f"- `{line.split(': ', 1)[0]}`: {line.split(': ', 1)[1]}" for line in preset_lines()]
    return "\n".join(out) + "\n"


def api_page() -> str:
    out = ["# Python API", "", "Generated from the public modules' docstrings. [From Python](python.md) shows them in use.", ""]
    for name, what in API.items():
        out += [f"## `{name}`", "", what, "", f"::: {name}", "    options:", "      show_root_heading: false", ""]
    return "\n".join(out)


def on_files(files, config):
    for name, content in (("index.md", readme_page()), ("config-reference.md", config_reference()),
                          ("api.md", api_page())):
        files.append(File.generated(config, name, content=content))
    return files
