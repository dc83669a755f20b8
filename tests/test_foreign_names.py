"""Config names of TRL, verl and OpenRLHF stop with one line naming lmrl's field; docs/coming-from-trl.md lists
every one of them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmrl import Config, load_config
from lmrl.config.foreign_names import FLAT_NAMES, VERL_PATHS
from lmrl.config.messages import section_at
from lmrl.errors import ConfigError

DOC = Path(__file__).resolve().parents[1] / "docs" / "coming-from-trl.md"


def _is_lmrl_field(path: str) -> bool:
    section, _, name = path.rpartition(".")
    model = section_at(Config, section)
    return model is not None and name in model.model_fields


@pytest.mark.parametrize("name", list(FLAT_NAMES))
def test_a_flat_foreign_name_names_lmrls_field(name):
    framework, field, _ = FLAT_NAMES[name]
    assert _is_lmrl_field(field), field
    with pytest.raises(ConfigError, match=rf"^{name} is {framework}'s name; lmrl calls it {field}( \(.*\))?$"):
        load_config(None, [f"{name}=1"])
    section = "optim" if name not in Config.model_fields["optim"].annotation.model_fields else "train"
    with pytest.raises(ConfigError, match=rf"^{section}.{name}: {name} is {framework}'s name; lmrl calls it {field}"):
        load_config(None, [f"{section}.{name}=1"])  # inside a section too


@pytest.mark.parametrize("path", list(VERL_PATHS))
def test_a_verl_path_names_lmrls_field(path):
    field, _ = VERL_PATHS[path]
    assert _is_lmrl_field(field), field
    with pytest.raises(ConfigError, match=rf"^{path} is verl's name; lmrl calls it {field}( \(.*\))?$"):
        load_config(None, [f"{path}=1"])


def test_python_and_yaml_get_the_same_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^num_generations is TRL's name; lmrl calls it rollout.group_size$"):
        Config(num_generations=8)
    (tmp_path / "c.yaml").write_text("algorithm:\n  epsilon_high: 0.28\n")
    with pytest.raises(ConfigError, match=r"^algorithm.epsilon_high: epsilon_high is TRL's name; lmrl calls it algorithm.clip_high$"):
        load_config(tmp_path / "c.yaml")


def test_lmrls_own_names_and_typos_are_unchanged():
    assert load_config(None, ["algorithm.kl_target=0.1", "algorithm.kl_coef=0.05"]).algorithm.kl_target == 0.1
    with pytest.raises(ConfigError, match=r"^algorithm.clip_hihg: algorithm has no field 'clip_hihg'; did you mean 'clip_high'\?$"):
        load_config(None, ["algorithm.clip_hihg=0.3"])


def test_the_cli_prints_one_line():
    out = subprocess.run([sys.executable, "-m", "lmrl.cli", "train", "beta=0.04", "--dry-run"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr == "lmrl: error: beta is TRL's name; lmrl calls it algorithm.kl_coef\n"


def test_the_docs_table_lists_every_name():
    text = DOC.read_text()
    for name, (framework, field, _) in FLAT_NAMES.items():
        shown = f"--{name}" if framework == "OpenRLHF" else name
        assert f"| `{shown}` | `{field}` |" in text, name
    for path, (field, _) in VERL_PATHS.items():
        assert f"| `{path}` | `{field}` |" in text, path
