"""The command line: help with examples, config errors as one line before any model loads, example configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmrl.cli import main

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.yaml"))


def test_help_shows_examples(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "lmrl train" in out and "examples:" in out


def test_help_config_lists_every_section(capsys):
    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    for key in ("algorithm.clip_high", "rollout.group_size", "optim.lr", "reward.functions"):
        assert key in out
    lines = out.splitlines()
    assert "  model.lora.r = 16" in lines  # nested fields
    assert "  train.parallel = 'auto'   (one of: auto, ddp, fsdp)" in lines  # allowed values
    assert "  rloo: advantage=rloo, aggregation=token-mean, kl_coef=0.05, kl_in=reward, kl_estimator=k1, " \
           "kl_level=sequence" in lines  # what each preset changes
    assert any(line.startswith("  model.name_or_path=tiny-addition: rollout.prompts_per_step=32") for line in lines)


def test_bad_override_is_one_line_and_exit_2(capsys, monkeypatch):
    import lmrl.trainer

    monkeypatch.setattr(lmrl.trainer, "Trainer", None)  # proves nothing past validation runs
    assert main(["train", "algorithm.clip_hihg=0.3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "lmrl: error: algorithm.clip_hihg: algorithm has no field 'clip_hihg'; did you mean 'clip_high'?"


def test_missing_config_file(capsys):
    assert main(["train", "nope.yaml"]) == 2
    assert "config file 'nope.yaml' does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_configs_validate(path, capsys):
    assert main(["train", str(path), "--dry-run"]) == 0
    assert "resolved config:" in capsys.readouterr().out


def test_examples_cover_every_algorithm():
    from lmrl.config import ALGORITHM_PRESETS, load_config

    names = {load_config(p).algorithm.name for p in EXAMPLES}
    assert names >= set(ALGORITHM_PRESETS) - {"reinforce_pp_baseline"}


@pytest.mark.parametrize("fast", [True, False])
def test_bf16_on_a_slow_cpu_is_one_warning_line_before_any_model_loads(capsys, monkeypatch, fast):
    import lmrl.build

    monkeypatch.setattr(lmrl.build, "cpu_has_fast_bf16", lambda: fast)
    assert main(["train", "train.autocast_bf16=true", "model.device=cpu", "--dry-run"]) == 0  # a GPU machine too
    err = capsys.readouterr().err
    if fast:
        assert "warning" not in err
    else:
        assert err.count("\n") == 1 and err.startswith("lmrl: warning: train.autocast_bf16=true: this CPU has no native")


@pytest.mark.parametrize("how", ["--traceback", "LMRL_TRACEBACK=1"])
def test_the_full_traceback_is_one_flag_or_variable_away(how, capsys, monkeypatch):
    monkeypatch.delenv("LMRL_TRACEBACK", raising=False)
    args = ["train", "train.steps=-3"]
    if how == "--traceback":
        args.append(how)
    else:
        monkeypatch.setenv("LMRL_TRACEBACK", "1")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert err.splitlines()[-1] == "lmrl: error: train.steps: must be >= 1 (got -3)"
    monkeypatch.setenv("LMRL_TRACEBACK", "0")  # 0 and unset both mean off
    assert main(["train", "train.steps=-3"]) == 2
    assert capsys.readouterr().err == "lmrl: error: train.steps: must be >= 1 (got -3)\n"


def test_python_dash_m_lmrl_is_the_lmrl_command(tmp_path):
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-m", "lmrl", "train", "--dry-run", "train.steps=3"], capture_output=True,
                        text=True, timeout=120, cwd=tmp_path)
    assert ok.returncode == 0 and "train: steps=3" in ok.stdout, ok.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-m", "lmrl", "train", "train.steps=-3"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip() == "lmrl: error: train.steps: must be >= 1 (got -3)"


def test_version(capsys):
    import lmrl

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"lmrl {lmrl.__version__}\n"
