"""The Python API as a TRL user writes it: configs built in Python are the CLI's, a model object gets no preset
made for another model, datasets as the `datasets` library gives them, paths as strings."""

from __future__ import annotations

import subprocess
import sys

import pytest
from datasets import Dataset, DatasetDict

from lmrl import Config, Trainer, load_config
from lmrl.config import ALGORITHM_PRESETS, AlgorithmConfig
from lmrl.errors import ConfigError, DataError
from lmrl.models.shipped import SHIPPED_MODEL, load_shipped
from tests.forked import lmrl

ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]


def exact(prompts, completions, answer, **kw):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


@pytest.mark.parametrize("name", list(ALGORITHM_PRESETS))
def test_a_config_built_in_python_is_the_clis(name):
    cli = load_config(None, [f"algorithm={name}"])
    assert Config(algorithm={"name": name}) == cli
    assert Config(algorithm=name) == cli
    assert Config(algorithm=AlgorithmConfig(name=name)) == cli
    assert Config.model_validate({"algorithm": name}) == cli  # pydantic's entry point takes the same steps
    assert Config(algorithm={"name": name, "clip_high": 0.5}).algorithm.clip_high == 0.5  # the user's value wins


def test_a_bad_value_is_one_line_when_set_and_when_assigned(tmp_path):
    with pytest.raises(ConfigError, match=r"^rollout.group_size: must be >= 1 \(got 0\)$"):
        Config(rollout={"group_size": 0})
    cfg = Config(train={"output_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"^rollout.group_size: must be >= 1 \(got 0\)$"):
        cfg.rollout.group_size = 0  # each field on assignment, named by its full key
    with pytest.raises(ConfigError, match=r"^train.stesp: train has no field 'stesp'; did you mean 'steps'\?$"):
        cfg.train.stesp = 3
    cfg.model.lora = {"r": 4}
    with pytest.raises(ConfigError, match=r"^model.lora.r: must be >= 1 \(got -1\)$"):
        cfg.model.lora.r = -1
    assert cfg.rollout.group_size == 8 and cfg.model.lora.r == 4  # a refused value leaves the field as it was
    cfg.rollout.group_size = 1  # a valid number, but not for GRPO: the checks between fields run in Trainer
    with pytest.raises(ConfigError, match=r"^rollout.group_size: must be >= 2 for the grpo advantage \(got 1\)$"):
        Trainer(cfg)


def test_paths_may_be_pathlib_paths(tmp_path):
    cfg = Config(train={"output_dir": tmp_path / "a"}, data={"path": tmp_path / "rows.jsonl"})
    assert cfg.train.output_dir == str(tmp_path / "a") and cfg.data.path == str(tmp_path / "rows.jsonl")
    cfg.train.output_dir = tmp_path / "b"
    assert cfg.train.output_dir == str(tmp_path / "b")
    cli = load_config(None, [f"train.output_dir={tmp_path / 'b'}", f"data.path={tmp_path / 'rows.jsonl'}"])
    assert cli.model_dump() == cfg.model_dump()


def test_a_model_object_gets_no_preset_made_for_the_shipped_model(tmp_path):
    model, tokenizer = load_shipped()
    cfg = Config(train={"output_dir": str(tmp_path), "steps": 3}, log={"console": False})
    assert cfg.train.max_minutes == 4.5 and cfg.optim.lr == 1e-4  # the shipped model's preset
    trainer = Trainer(cfg, model=model, tokenizer=tokenizer, reward_funcs=[exact], train_dataset=ROWS)
    assert trainer.cfg.model.name_or_path == str(SHIPPED_MODEL)  # where transformers loaded it from
    assert trainer.cfg.train.max_minutes is None and trainer.cfg.optim.lr == 1e-6  # the general defaults
    assert trainer.cfg.train.steps == 3 and trainer.cfg.train.output_dir == str(tmp_path)  # the user's values
    labelled = Config(model={"name_or_path": "tiny-addition"}, train={"output_dir": str(tmp_path)})
    kept = Trainer(labelled, model=model, tokenizer=tokenizer, reward_funcs=[exact], train_dataset=ROWS)
    assert kept.cfg.train.max_minutes == 4.5  # the user named the model: its preset is theirs


def test_a_dataset_and_a_dataset_dict_train_and_save_to_a_string_path(tmp_path):
    cfg = Config(train={"steps": 1, "output_dir": str(tmp_path / "run")}, log={"console": False},
                 rollout={"prompts_per_step": 4, "group_size": 4}, data={"num_eval_prompts": 4})
    splits = DatasetDict({"train": Dataset.from_list(ROWS), "test": Dataset.from_list(ROWS[:8])})
    for train, evaluate in [(Dataset.from_list(ROWS), Dataset.from_list(ROWS[:8])), (splits, splits)]:
        trainer = Trainer(cfg.model_copy(update={"train": cfg.train.model_copy(update={"overwrite": True})}),
                          reward_funcs=[exact], train_dataset=train, eval_dataset=evaluate)
        assert trainer.data.train_rows[3] == ROWS[3] and len(trainer.data.eval_rows) == 4
        assert len(trainer.train().history) == 1
    trainer.save(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "model.safetensors").is_file()
    with pytest.raises(DataError, match=r"^train_dataset: a DatasetDict without a 'validation' split \(data.split\); "
                                        r"its splits: train, test$"):
        Trainer(Config(data={"split": "validation"}, train={"output_dir": str(tmp_path / "x")}), reward_funcs=[exact],
                train_dataset=splits)


def test_the_top_level_names_import_without_torch_until_trainer():
    code = ("import sys; from lmrl import Config, load_config; assert 'torch' not in sys.modules; "
            "from lmrl import Trainer; assert 'torch' in sys.modules and Trainer.__name__ == 'Trainer'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("values, says", [
    ({"log": {"tensorboard": True}}, "log.tensorboard: needs the tensorboard package, which is not installed: "
                                     "pip install 'lmrl[tensorboard]'"),
    ({"model": {"lora": {"r": 4}}}, "model.lora: needs the peft package, which is not installed: pip install 'lmrl[peft]'"),
])
def test_a_missing_optional_package_is_refused_with_the_config(monkeypatch, values, says):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("tensorboard", "peft") else real(name, *a))
    with pytest.raises(ConfigError) as raised:
        Config(**values)
    assert str(raised.value) == says


def test_the_run_directory_names_the_reward_and_data_passed_in(tmp_path):
    import yaml

    cfg = Config(train={"steps": 1, "output_dir": str(tmp_path)}, log={"console": False},
                 rollout={"prompts_per_step": 4, "group_size": 4}, data={"num_eval_prompts": 4})
    Trainer(cfg, reward_funcs=[exact], train_dataset=Dataset.from_list(ROWS), eval_dataset=ROWS[:8]).train()
    for saved in (tmp_path / "lmrl_config.yaml", tmp_path / "final" / "lmrl_config.yaml"):
        record = yaml.safe_load(saved.read_text())
        assert record["reward"]["functions"] == [f"{exact.__module__}:exact"]
        assert record["data"]["task"] is None and record["data"]["path"] == "<Dataset passed to Trainer: 40 rows>"
        assert record["data"]["eval_path"] == "<list passed to Trainer: 4 rows used>"


def test_reward_models_and_their_paths_are_reward_funcs_as_in_trl(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    monkeypatch.chdir(tmp_path)
    _, tokenizer = load_shipped()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    LlamaForSequenceClassification(config).save_pretrained("judge")
    tokenizer.save_pretrained("judge")
    model = LlamaForSequenceClassification.from_pretrained("judge")
    cfg = Config(train={"steps": 1, "output_dir": "run"}, log={"console": False}, data={"num_eval_prompts": 0},
                 rollout={"prompts_per_step": 4, "group_size": 4})
    trainer = Trainer(cfg, reward_funcs=["judge", "exact_match"], train_dataset=ROWS)
    assert trainer.data.rewards.names == ["judge", "exact_match"]
    assert trainer.cfg.reward.functions == ["judge", "exact_match"]
    history = trainer.train().history
    assert history[0]["reward/judge/mean"] != 0 and history[0]["reward/judge/none_frac"] == 0  # the model scored
    from_object = Trainer(cfg.model_copy(update={"train": cfg.train.model_copy(update={"output_dir": "run2"})}),
                          reward_funcs=[model], train_dataset=ROWS)
    assert from_object.data.rewards.names == ["judge"] and from_object.cfg.reward.functions == ["judge"]


def test_the_cli_trains_on_a_saved_dataset_and_dataset_dict(tmp_path):
    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    DatasetDict({"train": Dataset.from_list(ROWS), "test": Dataset.from_list(ROWS[:8])}).save_to_disk(str(tmp_path / "two"))
    common = ["reward.functions=[exact_match]", "train.steps=1", "rollout.prompts_per_step=4", "log.console=false",
              "data.num_eval_prompts=4"]
    for saved in ("one", "two"):
        run = lmrl("train", f"data.path={saved}", f"train.output_dir=out-{saved}", *common, cwd=tmp_path, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        assert (tmp_path / f"out-{saved}" / "final" / "model.safetensors").is_file()
    bad = lmrl("train", "data.path=two", "data.split=validation", *common, cwd=tmp_path, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "lmrl: error: data.path: two: a saved DatasetDict without a 'validation' split; its splits: train, test"]


def _stream():
    """ROWS as a shuffled datasets.IterableDataset: read again, in another order, each epoch."""
    from datasets import IterableDataset

    return IterableDataset.from_generator(lambda: iter(ROWS)).shuffle(seed=1, buffer_size=16)


def test_an_iterable_dataset_is_streamed_and_resumes_exactly(tmp_path):
    import torch

    def run(out, steps, stream, resume=None):
        cfg = Config(train={"steps": steps, "output_dir": str(out), "save_every": 1, "resume": resume},
                     log={"console": False}, rollout={"prompts_per_step": 16, "group_size": 4},
                     data={"num_eval_prompts": 4})
        trainer = Trainer(cfg, reward_funcs=[exact], train_dataset=stream, eval_dataset=_stream())
        assert trainer.data.train_rows == [] and trainer.cfg.data.path == "<IterableDataset passed to Trainer: streamed>"
        trainer.train()
        return trainer.policy.state_dict()

    whole = run(tmp_path / "whole", 3, _stream())  # 48 rows: the 40-row stream's 2nd epoch too
    run(tmp_path / "split", 1, _stream())
    resumed = run(tmp_path / "split", 3, _stream(), resume="auto")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_a_bad_row_deep_in_a_stream_stops_the_run_after_a_checkpoint(tmp_path):
    cfg = Config(train={"steps": 4, "output_dir": str(tmp_path), "save_every": 10}, log={"console": False},
                 rollout={"prompts_per_step": 16, "group_size": 4}, data={"num_eval_prompts": 0})
    from datasets import IterableDataset

    stream = IterableDataset.from_generator(lambda: iter([*ROWS, {"prompt": " "}, *ROWS]))  # row 40: step 3's
    trainer = Trainer(cfg, reward_funcs=[exact], train_dataset=stream)  # the first step's rows are fine
    with pytest.raises(DataError) as raised:
        trainer.train()
    assert str(raised.value) == (f"step 3: train_dataset row 40: prompt is only whitespace; fix it, or set "
                                 f"data.on_bad_row=skip to leave it out; {tmp_path}/checkpoint-2 written: add "
                                 "train.resume=auto to continue")
    assert raised.value.exit_code == 1 and (tmp_path / "checkpoint-2").is_dir()
    skipping = Trainer(cfg.model_copy(update={"data": cfg.data.model_copy(update={"on_bad_row": "skip"}),
                                              "train": cfg.train.model_copy(update={"overwrite": True})}),
                       reward_funcs=[exact], train_dataset=stream)
    assert skipping.train().history[-1]["data/skipped_rows"] == 1


def test_the_cli_streams_a_file_with_data_streaming(tmp_path):
    import json

    rows = [*ROWS[:20], {"prompt": " ", "answer": "0"}, *ROWS[20:]]  # row 20 is blank
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["train", "data.path=rows.jsonl", "data.streaming=true",
              "reward.functions=[exact_match]", "train.steps=2", "rollout.prompts_per_step=16", "log.console=false",
              "data.num_eval_prompts=0"]
    failed = lmrl(*common, "train.output_dir=a", cwd=tmp_path, timeout=300)
    assert failed.returncode == 1 and failed.stderr.strip().splitlines() == [
        "lmrl: error: step 2: data.path: rows.jsonl row 20: prompt is only whitespace; fix it, or set "
        "data.on_bad_row=skip to leave it out; a/checkpoint-1 written: add train.resume=auto to continue"]
    skipped = lmrl(*common, "train.output_dir=b", "data.on_bad_row=skip", cwd=tmp_path, timeout=300)
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert "left out a bad row" in skipped.stderr
    last = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["data/skipped_rows"] == 1
