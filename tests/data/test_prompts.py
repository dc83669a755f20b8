"""Tests for lmrl.data.prompts: loading files and lists, errors, and the resumable sampler."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmrl.data import PromptDataset, PromptSampler, load_prompts

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
    assert len(ds) == 2 and ds.name == "<in-memory>"
    assert ds[0] is not ROWS[0]  # rows are copied: the caller's list may change afterwards


def test_file_not_found_names_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ValueError) as info:
        load_prompts(missing)
    assert str(info.value) == f"data.source: file not found: {str(missing)!r}"


def test_unsupported_extension(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("prompt\nhi\n")
    with pytest.raises(
        ValueError, match=r"unsupported extension; use one of \['.jsonl', '.json', '.parquet'\]"
    ):
        load_prompts(path)


def test_empty_dataset(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError) as info:
        load_prompts(path)
    assert str(info.value) == f"dataset {str(path)!r} has no rows"


def test_missing_prompt_column_lists_columns(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "1+1=", "answer": "2"}])
    with pytest.raises(ValueError) as info:
        load_prompts(path)
    msg = str(info.value)
    assert "row 0 has no prompt column 'prompt'" in msg
    assert "columns present: ['question', 'answer']" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("bad", [42, None, {"role": "user"}, [{"role": "user"}], [], ""])
def test_bad_prompt_names_row(bad):
    rows = [{"prompt": "ok"}, {"prompt": "fine"}, {"prompt": bad}]
    with pytest.raises(ValueError, match="row 2"):
        load_prompts(rows)


def test_bad_jsonl_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        load_prompts(path)


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
    with pytest.raises(ValueError, match="file not found"):
        load_prompts(str(tmp_path / "data" / "train"))  # a path, never sent to the hub
    assert len(calls) == 1
