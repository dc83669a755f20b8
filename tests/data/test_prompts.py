"""Tests for lmrl.data.prompts: loading files and lists, errors, and the resumable sampler."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmrl.data import BadRow, CheckedRows, PromptDataset, PromptSampler, check_rows, load_prompts
from lmrl.errors import DataError

ROWS = [
    {"prompt": "1+2=", "answer": "3"},
    {"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4", "level": 2},
    {"prompt": "10+5=", "answer": "15"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# --- loading --------------------------------------------------------------------------------------


def test_jsonl_keeps_rows_and_columns(tmp_path):
    ds = load_prompts(write_jsonl(tmp_path / "p.jsonl", ROWS))
    assert len(ds) == 3
    assert ds[1] == ROWS[1]
    assert ds.columns == ["prompt", "answer", "level"]
    assert ds.prompts == [r["prompt"] for r in ROWS]
    assert ds[0:2] == ROWS[:2]


def test_parquet_file(tmp_path):
    rows = [{"question": "what is 3+4?", "answer": "7"}, {"question": "5+6?", "answer": "11"}]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    ds = load_prompts(str(path), prompt_column="question")
    assert [ds[i] for i in range(2)] == rows
    assert ds.columns == ["question", "answer"]


def test_parquet_with_chat_prompts(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}]
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert load_prompts(path)[0] == rows[0]


def test_json_list_and_column_table(tmp_path):
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    assert load_prompts(tmp_path / "rows.json")[2] == ROWS[2]
    (tmp_path / "table.json").write_text(json.dumps({"prompt": ["a", "b"], "answer": ["1", "2"]}))
    assert list(load_prompts(tmp_path / "table.json")) == [
        {"prompt": "a", "answer": "1"},
        {"prompt": "b", "answer": "2"},
    ]


def test_in_memory_list_and_max_rows():
    ds = load_prompts(ROWS, max_rows=2)
    assert len(ds) == 2 and ds.name == "dataset"
    assert ds[0] is not ROWS[0]  # rows are copied: the caller's list may change afterwards


def test_file_not_found_names_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError) as info:
        load_prompts(missing)
    assert str(info.value) == f"data.path: {missing}: file not found"
    with pytest.raises(DataError, match=r"^data.eval_path: .*nope.jsonl: file not found$"):
        load_prompts(missing, field="data.eval_path")


def test_directory_is_named(tmp_path):
    with pytest.raises(DataError) as info:
        load_prompts(tmp_path)
    assert str(info.value) == (f"data.path: {tmp_path}: is a directory, expected a .jsonl/.json/.parquet file or a "
                               "dataset saved with datasets' save_to_disk")


def test_unsupported_extension(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("prompt\nhi\n")
    with pytest.raises(DataError) as info:
        load_prompts(path)
    assert str(info.value) == f"data.path: {path}: unsupported extension '.csv', expected a .jsonl/.json/.parquet file"


def test_empty_dataset(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(DataError) as info:
        load_prompts(path)
    assert str(info.value) == f"data.path: {path} has no rows"
    with pytest.raises(DataError, match="^train_dataset has no rows$"):
        check_rows([], field="train_dataset")


def test_missing_prompt_column_lists_columns(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "1+1=", "answer": "2"}])
    with pytest.raises(DataError) as info:
        load_prompts(path)
    assert str(info.value) == (
        f"data.path: {path} line 1: no prompt column 'prompt'; columns present: ['question', 'answer'] "
        "(set data.prompt_column); every row is bad, so there is nothing to train on"
    )


@pytest.mark.parametrize(
    "bad, problem",
    [
        (42, "prompt must be a string or a list of {'role', 'content'} messages, got int"),
        (None, "prompt must be a string or a list of {'role', 'content'} messages, got NoneType"),
        ({"role": "user"}, "prompt must be a string or a list of {'role', 'content'} messages, got dict"),
        ([{"role": "user"}], "prompt message 0 has no 'content'"),
        ([{"content": "hi"}], "prompt message 0 has no 'role'"),
        (["hi"], "prompt message 0 is a str, not a {'role', 'content'} object"),
        ([], "prompt is an empty list of messages"),
        ("", "prompt is empty"),
        (" \n\t", "prompt is only whitespace"),
        ([{"role": "user", "content": "hi"}, {"role": 1, "content": "x"}], "prompt message 1: role must be a non-empty string, got 1"),
        ([{"role": " ", "content": "hi"}], "prompt message 0: role must be a non-empty string, got ' '"),
        ([{"role": "user", "content": None}], "prompt message 0: content must be a string, got NoneType"),
        (
            [{"role": "system", "content": ""}, {"role": "user", "content": "  "}],
            "prompt messages have no content (every one is empty or whitespace)",
        ),
    ],
)
def test_bad_prompt_names_index_and_problem(bad, problem):
    rows = [{"prompt": "ok"}, {"prompt": "fine"}, {"prompt": bad}]
    with pytest.raises(DataError) as info:
        load_prompts(rows)
    assert str(info.value) == (
        f"dataset index 2: {problem}; fix it, or set data.on_bad_row=skip to leave it out"
    )
    with pytest.raises(DataError, match=r"^train_dataset index 2: "):
        PromptDataset(rows, name="train_dataset")


def test_chat_prompt_with_some_blank_messages_is_fine():
    prompt = [{"role": "system", "content": ""}, {"role": "user", "content": "2+2?"}]
    assert check_rows([{"prompt": prompt}]).rows == [{"prompt": prompt}]


def test_bad_jsonl_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": \n')
    with pytest.raises(DataError) as info:
        load_prompts(path)
    assert str(info.value) == f"data.path: {path} line 3: not valid JSON (Expecting value)"


def test_bad_json_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n{"prompt": "a"},\n{"prompt" "b"}]')
    with pytest.raises(DataError, match=r"bad.json line 3: not valid JSON \(Expecting ':' delimiter\)$"):
        load_prompts(path)
    path.write_text("42")
    with pytest.raises(DataError, match=r"bad.json: expected a list of objects .* got int$"):
        load_prompts(path)
    path.write_text('{"prompt": ["a", "b"], "answer": ["1"]}')
    with pytest.raises(DataError, match=r"bad.json: columns have different lengths \[1, 2\]$"):
        load_prompts(path)


def test_non_object_lines_are_bad_rows(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n[1, 2]\n"text"\n{"prompt": "b"}\n')
    with pytest.raises(DataError) as info:
        load_prompts(path)
    assert str(info.value) == (
        f"data.path: {path} line 2: row is a list, not an object of columns (1 other bad row: line 3); "
        "fix them, or set data.on_bad_row=skip to leave them out"
    )
    assert load_prompts(path, on_bad_row="skip").prompts == ["a", "b"]


# --- where rows came from, and checking every row ---------------------------------------------------


def test_where_names_file_lines_items_and_rows(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('\n{"prompt": "a"}\n\n\n{"prompt": "b"}\n')
    ds = load_prompts(path)
    assert [ds.where(i) for i in range(len(ds))] == [f"{path} line 2", f"{path} line 5"]
    assert ds.rows == [{"prompt": "a"}, {"prompt": "b"}]  # rows themselves carry no location

    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    assert load_prompts(tmp_path / "rows.json").where(2) == f"{tmp_path / 'rows.json'} item 2"
    (tmp_path / "table.json").write_text(json.dumps({"prompt": ["a", "b"]}))
    assert load_prompts(tmp_path / "table.json").where(1) == f"{tmp_path / 'table.json'} row 1"
    pq.write_table(pa.Table.from_pylist(ROWS[::2]), tmp_path / "p.parquet")
    assert load_prompts(tmp_path / "p.parquet").where(1) == f"{tmp_path / 'p.parquet'} row 1"
    assert load_prompts(ROWS).where(1) == "dataset index 1"
    assert load_prompts(ROWS, field="train_dataset").where(1) == "train_dataset index 1"
    assert PromptDataset(ROWS).where(-1) == "dataset index 2"


def long_file(tmp_path, bad_lines, n=640, make_bad=lambda i: {"prompt": "x" * 812, "answer": str(i)}):
    """A JSONL file of `n` good rows but at the (1-based) `bad_lines`; prompt length = characters."""
    rows = [make_bad(i) if i in bad_lines else {"prompt": f"p{i}", "answer": str(i)} for i in range(1, n + 1)]
    return write_jsonl(tmp_path / "train.jsonl", rows)


def char_length(prompts):
    return [len(p) for p in prompts]


def test_long_prompt_at_line_600_is_named_with_the_others_counted(tmp_path, monkeypatch):
    path = long_file(tmp_path, {12, 40, 77, 600})
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as info:
        load_prompts("train.jsonl", prompt_length=char_length, max_prompt_length=512)
    assert str(info.value) == (
        "data.path: train.jsonl line 12: prompt is 812 tokens, longer than rollout.max_prompt_length=512 "
        "(3 other bad rows: line 40, line 77, line 600); fix them, or set data.on_bad_row=skip to leave them out"
    )
    ds = load_prompts(path, prompt_length=char_length, max_prompt_length=812)
    assert len(ds) == 640


def test_only_line_600_bad_and_more_than_three_others(tmp_path):
    path = long_file(tmp_path, {600})
    with pytest.raises(DataError, match=r"train.jsonl line 600: prompt is 812 tokens, .*=512; fix it, or set"):
        load_prompts(path, prompt_length=char_length, max_prompt_length=512)
    path = long_file(tmp_path, {5, 6, 7, 8, 9, 600})
    with pytest.raises(DataError, match=r"line 5: .* \(5 other bad rows: line 6, line 7, line 8, \.\.\.\); fix them"):
        load_prompts(path, prompt_length=char_length, max_prompt_length=512)


def test_skip_mode_keeps_good_rows_and_lists_bad_ones(tmp_path):
    path = long_file(tmp_path, {12, 600})
    (tmp_path / "train.jsonl").write_text(
        path.read_text().replace('"p40"', '"  "').replace('"answer": "77"', '"answer": null'), encoding="utf-8"
    )
    ds = load_prompts(
        path, on_bad_row="skip", prompt_length=char_length, max_prompt_length=512, required_columns={"answer": ["math"]}
    )
    assert len(ds) == 636
    assert [r["answer"] for r in ds[10:13]] == ["11", "13", "14"]
    assert ds.where(11) == f"{path} line 13"
    assert ds.skipped == [
        BadRow(f"{path} line 12", "prompt is 812 tokens, longer than rollout.max_prompt_length=512"),
        BadRow(f"{path} line 40", "prompt is only whitespace"),
        BadRow(f"{path} line 77", "column 'answer' (needed by reward 'math') is None"),
        BadRow(f"{path} line 600", "prompt is 812 tokens, longer than rollout.max_prompt_length=512"),
    ]
    assert load_prompts(path, max_rows=30, on_bad_row="skip", prompt_length=char_length, max_prompt_length=512).skipped == [
        BadRow(f"{path} line 12", "prompt is 812 tokens, longer than rollout.max_prompt_length=512"),
    ]


def test_skip_mode_on_in_memory_rows():
    rows = [{"prompt": "a"}, {"prompt": ""}, {"prompt": "b"}, "c"]
    checked = check_rows(rows, on_bad_row="skip", field="eval_dataset")
    assert checked.rows == [rows[0], rows[2]]
    assert checked.rows[0] is rows[0]
    assert checked.where == ["eval_dataset index 0", "eval_dataset index 2"]
    assert checked.skipped == [
        BadRow("eval_dataset index 1", "prompt is empty"),
        BadRow("eval_dataset index 3", "row is a str, not an object of columns"),
    ]
    assert check_rows(rows[:1], on_bad_row="skip") == CheckedRows([rows[0]], ["dataset index 0"], [])


def test_skip_mode_with_every_row_bad_still_raises(tmp_path):
    with pytest.raises(DataError) as info:
        check_rows([{"prompt": " "}, {"prompt": ""}], on_bad_row="skip", field="train_dataset")
    assert str(info.value) == (
        "train_dataset index 0: prompt is only whitespace (1 other bad row: index 1); "
        "every row is bad, so there is nothing to train on"
    )
    path = write_jsonl(tmp_path / "p.jsonl", [{"q": 1}, {"q": 2}])
    with pytest.raises(DataError, match=r"^data.path: .*p.jsonl line 1: no prompt column .*line 2\); every row is bad"):
        load_prompts(path, on_bad_row="skip")


def test_required_columns_missing_or_none_name_the_reward():
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b"}, {"prompt": "c", "answer": None}]
    with pytest.raises(DataError) as info:
        check_rows(rows, required_columns={"answer": ["math", "format"]}, field="train_dataset")
    assert str(info.value) == (
        "train_dataset index 1: column 'answer' (needed by rewards 'math', 'format') is missing "
        "(1 other bad row: index 2); fix them, or set data.on_bad_row=skip to leave them out"
    )
    checked = check_rows(rows, required_columns={"answer": ["math"]}, on_bad_row="skip")
    assert checked.skipped[1] == BadRow("dataset index 2", "column 'answer' (needed by reward 'math') is None")
    assert check_rows(rows[:1], required_columns={"answer": ["math"], "prompt": []}).rows == rows[:1]


def test_prompt_length_is_called_in_batches_on_good_prompts_only():
    calls = []

    def lengths(prompts):
        calls.append(len(prompts))
        return [len(p) if isinstance(p, str) else 100 for p in prompts]

    rows = [{"prompt": f"p{i}"} for i in range(2500)] + [{"prompt": ""}, {"prompt": [{"role": "u", "content": "c"}]}]
    checked = check_rows(rows, prompt_length=lengths, max_prompt_length=99, on_bad_row="skip")
    assert calls == [1024, 1024, 453]
    assert [b.where for b in checked.skipped] == ["dataset index 2500", "dataset index 2501"]
    assert checked.skipped[1].problem == "prompt is 100 tokens, longer than rollout.max_prompt_length=99"


def test_check_rows_argument_errors():
    with pytest.raises(ValueError, match="on_bad_row: must be one of fail, skip, got 'drop'"):
        check_rows(ROWS, on_bad_row="drop")
    with pytest.raises(ValueError, match="max_prompt_length: needed"):
        check_rows(ROWS, prompt_length=char_length)
    with pytest.raises(ValueError, match="prompt_length: returned 1 lengths for 3 prompts"):
        check_rows(ROWS, prompt_length=lambda ps: [1], max_prompt_length=5)
    with pytest.raises(ValueError, match="where: 1 locations for 3 rows"):
        check_rows(ROWS, where=["x"])


def test_check_rows_of_a_dataset_uses_its_locations(tmp_path):
    ds = load_prompts(write_jsonl(tmp_path / "p.jsonl", ROWS), field="data.eval_path")
    with pytest.raises(DataError) as info:
        check_rows(ds, field="data.eval_path", prompt_length=lambda ps: [9] * len(ps), max_prompt_length=8)
    assert str(info.value).startswith(f"data.eval_path: {tmp_path / 'p.jsonl'} line 1: prompt is 9 tokens")
    assert "(2 other bad rows: line 2, line 3)" in str(info.value)


def test_messages_are_one_line(tmp_path):
    rows = [{"prompt": [{"role": "a\nb", "content": "x"}]}, {"prompt": "ok", "b\nad": 1}, {"b\nad": 1}]
    with pytest.raises(DataError) as info:
        check_rows(rows, field="train_dataset")
    assert "\n" not in str(info.value)


def test_importing_prompts_does_not_import_torch():
    code = "import lmrl.data.prompts, sys; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --- sampler --------------------------------------------------------------------------------------


def test_same_seed_and_step_give_same_indices():
    a, b = PromptSampler(10, seed=3), PromptSampler(10, seed=3)
    assert [a.indices(s, 4) for s in range(6)] == [b.indices(s, 4) for s in range(6)]
    assert PromptSampler(10, seed=4).epoch_order(0) != a.epoch_order(0)
    assert a.epoch_order(1) != a.epoch_order(0)


def test_seeds_do_not_share_epochs():
    # with a naive seed + epoch, seed 1 / epoch 0 would equal seed 0 / epoch 1
    assert PromptSampler(20, seed=1).epoch_order(0) != PromptSampler(20, seed=0).epoch_order(1)


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 40), batch_size=st.integers(1, 16), seed=st.integers(0, 2**31), epochs=st.integers(1, 3)
)
def test_epochs_cover_every_index_once(n, batch_size, seed, epochs):
    sampler = PromptSampler(n, seed=seed)
    steps = -(-epochs * n // batch_size)  # enough batches to pass `epochs` epochs
    stream = list(itertools.chain.from_iterable(sampler.indices(s, batch_size) for s in range(steps)))
    assert all(len(sampler.indices(s, batch_size)) == batch_size for s in range(3))
    for e in range(epochs):
        epoch = stream[e * n : (e + 1) * n]
        assert Counter(epoch) == Counter(range(n))
        assert epoch == sampler.epoch_order(e)


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 30), batch_size=st.integers(1, 8), seed=st.integers(0, 1000), start=st.integers(0, 20)
)
def test_resume_continues_the_same_stream(n, batch_size, seed, start):
    ds = PromptDataset([{"prompt": f"p{i}"} for i in range(n)])
    fresh = list(itertools.islice(ds.batches(batch_size, seed), start + 3))
    resumed = list(itertools.islice(ds.batches(batch_size, seed, start_step=start), 3))
    assert resumed == fresh[start:]
    assert ds.batch(start, batch_size, seed) == fresh[start]
    sampler = PromptSampler(n, seed=seed)
    assert sampler.indices_at(start * batch_size, batch_size) == sampler.indices(start, batch_size)


def test_batch_straddles_epochs_and_no_shuffle_keeps_order():
    sampler = PromptSampler(5, seed=0, shuffle=False)
    assert [sampler.indices(s, 2) for s in range(4)] == [[0, 1], [2, 3], [4, 0], [1, 2]]
    assert sampler.epoch_of(2, 2) == 0 and sampler.epoch_of(3, 2) == 1


def test_sampler_bad_arguments():
    with pytest.raises(ValueError, match="n: the sampler needs at least one row"):
        PromptSampler(0)
    with pytest.raises(ValueError, match="batch_size: must be >= 1"):
        PromptSampler(3).indices(0, 0)
    with pytest.raises(ValueError, match="seed: must be >= 0"):
        PromptSampler(3, seed=-1)


def test_hub_name_goes_to_datasets_and_local_looking_names_do_not(monkeypatch, tmp_path):
    calls = []

    def fake_hub(name, split, subset):
        calls.append((name, split, subset))
        return [{"question": "q", "answer": "a"}]

    monkeypatch.setattr("lmrl.data.prompts._read_hub", fake_hub)
    ds = load_prompts("openai/gsm8k", split="test", subset="main", prompt_column="question")
    assert calls == [("openai/gsm8k", "test", "main")]
    assert ds.name == "openai/gsm8k:test"
    with pytest.raises(DataError, match="file not found"):
        load_prompts(str(tmp_path / "data" / "train"))  # a path, never sent to the hub
    assert len(calls) == 1
