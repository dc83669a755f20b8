"""Tests for lmrl.data.PromptStream: rows read in order as training asks, never held whole, resumable by position."""

from __future__ import annotations

import pytest
from datasets import Dataset

from lmrl.data import PromptStream, is_stream
from lmrl.errors import DataError


class Counting:
    """A re-iterable stream of `n` rows that counts how many rows were read and how often it started over."""

    def __init__(self, n: int, bad: dict[int, dict] | None = None):
        self.n, self.bad, self.read, self.epochs_set = n, bad or {}, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epochs_set.append(epoch)

    def __iter__(self):
        for i in range(self.n):
            self.read += 1
            yield self.bad.get(i, {"prompt": f"{i}+1=", "answer": str(i + 1)})


def prompts(rows):
    return [r["prompt"] for r in rows]


def test_what_counts_as_a_stream():
    assert is_stream(Dataset.from_list([{"prompt": "a"}]).to_iterable_dataset())
    assert is_stream(r for r in [{"prompt": "a"}]) and is_stream(Counting(3))
    assert not any(map(is_stream, ([{"prompt": "a"}], Dataset.from_list([{"prompt": "a"}]), {"prompt": ["a"]}, "a.jsonl")))


def test_rows_come_in_stream_order_and_only_as_far_as_asked():
    source = Counting(10**9)  # a billion rows: holding them whole would never finish
    stream = PromptStream(source)
    assert prompts(stream.peek(4)) == ["0+1=", "1+1=", "2+1=", "3+1="] and source.read == 4
    assert prompts(stream.batch(0, 3)) == ["0+1=", "1+1=", "2+1="]  # peeked rows are not read twice
    assert prompts(stream.batch(2, 3)) == ["6+1=", "7+1=", "8+1="]  # batch 1 is passed over
    assert source.read == 9
    with pytest.raises(ValueError, match="read forward"):
        stream.batch(1, 3)


def test_epochs_follow_each_other_and_tell_the_stream():
    source = Counting(5)
    stream = PromptStream(source)
    assert prompts(stream.batch(0, 4)) == ["0+1=", "1+1=", "2+1=", "3+1="]
    assert prompts(stream.batch(1, 4)) == ["4+1=", "0+1=", "1+1=", "2+1="]  # a batch straddles two epochs
    assert source.epochs_set == [1]


def test_a_resumed_stream_reads_the_rows_the_stopped_one_would_have():
    shuffled = Dataset.from_list([{"prompt": f"{i}+1="} for i in range(10)]).to_iterable_dataset().shuffle(seed=3,
                                                                                                          buffer_size=4)
    whole = PromptStream(shuffled)
    run = [prompts(whole.batch(b, 4)) for b in range(6)]  # 24 rows: two shuffled epochs and a bit
    resumed = PromptStream(Dataset.from_list([{"prompt": f"{i}+1="} for i in range(10)]).to_iterable_dataset()
                           .shuffle(seed=3, buffer_size=4))
    assert [prompts(resumed.batch(b, 4)) for b in range(4, 6)] == run[4:]
    assert sorted(sum(run[:5], [])[:10]) == sorted(f"{i}+1=" for i in range(10))  # an epoch is every row once
    assert sum(run[:2], []) != [f"{i}+1=" for i in range(8)]  # shuffled: not the file order


def test_a_bad_row_is_one_line_naming_its_place_in_the_stream():
    stream = PromptStream(Counting(100, bad={30: {"prompt": "   "}, 31: {"text": "x"}}), name="train_dataset")
    stream.batch(0, 16)
    with pytest.raises(DataError, match=r"^train_dataset row 30: prompt is only whitespace \(1 other bad row: "
                                        r"row 31\); fix them, or set data.on_bad_row=skip to leave them out$"):
        stream.batch(1, 16)


def test_skip_leaves_bad_rows_out_and_counts_them():
    stream = PromptStream(Counting(20, bad={2: {"prompt": ""}, 5: {"prompt": 7}}), on_bad_row="skip")
    assert prompts(stream.batch(0, 4)) == ["0+1=", "1+1=", "3+1=", "4+1="]
    assert prompts(stream.batch(1, 4)) == ["6+1=", "7+1=", "8+1=", "9+1="]
    assert stream.skipped == 2 and stream.first_skipped.where == "train_dataset row 2"


def test_the_rows_rewards_need_and_the_prompt_length_are_checked():
    stream = PromptStream(Counting(8), required_columns={"label": ["exact"]}, name="train_dataset")
    with pytest.raises(DataError, match=r"^train_dataset row 0: .*'label'.*exact"):
        stream.peek(2)
    lengths = PromptStream(Counting(20), prompt_length=lambda ps: [len(p) for p in ps], max_prompt_length=4)
    with pytest.raises(DataError, match=r"^train_dataset row 10: prompt is 5 tokens, longer than rollout.max_prompt_length=4"):
        lengths.batch(0, 12)


def test_a_generator_cannot_start_a_second_epoch():
    stream = PromptStream(({"prompt": f"{i}="} for i in range(5)), name="train_dataset")
    stream.batch(0, 4)
    with pytest.raises(DataError, match=r"^train_dataset: the stream ended after 5 rows and cannot be read again"):
        stream.batch(1, 4)


def test_a_stream_without_good_rows_says_so():
    with pytest.raises(DataError, match=r"^train_dataset: the stream has no rows$"):
        PromptStream(iter([]), name="train_dataset").peek(4)
    with pytest.raises(DataError, match=r"^train_dataset: the stream has no good rows \(3 left out as bad\)$"):
        PromptStream(Counting(3, bad={0: {}, 1: {}, 2: {}}), on_bad_row="skip").batch(0, 2)
