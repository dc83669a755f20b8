"""Tests for lmrl.data.pairs: the four row formats, bad rows as one line each, lengths, and the scorer's encoding."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmrl.data.pairs import encode_pairs, load_pairs
from lmrl.errors import DataError
from lmrl.models.tiny import bpe_chat_tokenizer, char_tokenizer
from lmrl.rewards.reward_model import encode_scored

USER = {"role": "user", "content": "What is 2+2?"}


def assistant(text):
    return {"role": "assistant", "content": text}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def chat_tok():
    return bpe_chat_tokenizer(["What is 2+2? It is 4. It is 5. four five"] * 4, vocab_size=300)


def test_explicit_and_implicit_text_prompts(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "2+2=", "chosen": "4", "rejected": "5", "margin": 1.5},
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
        {"chosen": "ab", "rejected": "cd"},
    ])
    pairs = load_pairs(path)
    p0, p1, p2 = pairs.pairs
    assert (p0.prompt, p0.chosen, p0.rejected, p0.margin) == ("2+2=", "4", "5", 1.5)
    # TRL's implicit prompt: the common prefix, the space before the difference staying with the answers
    assert (p1.prompt, p1.chosen, p1.rejected, p1.margin) == ("The sky is", " blue.", " green.", None)
    assert (p2.prompt, p2.chosen, p2.rejected) == ("", "ab", "cd")
    assert p1.where == f"{path} line 2"


def test_explicit_and_implicit_chat_prompts():
    pairs = load_pairs([
        {"prompt": [USER], "chosen": [assistant("4")], "rejected": [assistant("5")]},
        {"prompt": [USER], "chosen": "4", "rejected": "5"},
        {"chosen": [USER, assistant("4")], "rejected": [USER, assistant("5")]},
    ]).pairs
    for p in pairs:
        assert (p.prompt, p.chosen, p.rejected) == ([USER], "4", "5")


def test_json_and_parquet(tmp_path):
    rows = [{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "r", "chosen": "c", "rejected": "d"}]
    (tmp_path / "p.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    for name, where in (("p.json", "item 1"), ("p.parquet", "row 1")):
        pairs = load_pairs(tmp_path / name).pairs
        assert [(p.prompt, p.chosen) for p in pairs] == [("q", "a"), ("r", "c")]
        assert pairs[1].where == f"{tmp_path / name} {where}"


BAD = [
    ({"prompt": "q", "chosen": "a"}, "line 2: missing 'rejected'"),
    ({"prompt": "q", "chosen": "a", "rejected": "a"}, "line 2: chosen == rejected: a pair needs two different"),
    ({"prompt": "q", "chosen": "  ", "rejected": "b"}, "line 2: chosen: the completion is empty"),
    ({"chosen": "same", "rejected": "same more"}, "line 2: chosen: the completion is empty"),
    ({"prompt": "q", "chosen": 3, "rejected": "b"}, "line 2: chosen: expected a string or a list of"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "margin": "big"}, "line 2: margin: expected a finite number"),
    ({"chosen": [USER, assistant("4"), USER], "rejected": [USER, assistant("5")]},
     "line 2: chosen: after the prompt, expected one assistant message, got 2 (assistant, user)"),
    ({"prompt": "q", "chosen": [assistant("4")], "rejected": "5"}, "line 2: prompt is text, so chosen and"),
]


@pytest.mark.parametrize(("row", "expected"), BAD)
def test_each_bad_row_is_one_line(tmp_path, row, expected):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok", "chosen": "a", "rejected": "b"}, row])
    with pytest.raises(DataError) as info:
        load_pairs(path)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"data.path: {path} {expected}"), msg
    assert msg.endswith("fix it, or set data.on_bad_row=skip to leave it out")


def test_skip_leaves_bad_rows_out_and_counts_them(tmp_path):
    rows = [{"prompt": "ok", "chosen": "a", "rejected": "b"}, *(row for row, _ in BAD)]
    pairs = load_pairs(write_jsonl(tmp_path / "p.jsonl", rows), on_bad_row="skip")
    assert len(pairs) == 1 and len(pairs.skipped) == len(BAD)
    with pytest.raises(DataError, match=f"line 2: missing 'rejected' \\({len(BAD) - 1} other bad rows: line 3, "):
        load_pairs(tmp_path / "p.jsonl")
    with pytest.raises(DataError, match="every row is bad"):
        load_pairs(write_jsonl(tmp_path / "q.jsonl", rows[1:]), on_bad_row="skip")


def test_encoding_is_the_scorers(chat_tok):
    text_tok = char_tokenizer()
    for tok, rows in ((text_tok, [{"prompt": "2+2=", "chosen": "4", "rejected": "5"}]),
                      (chat_tok, [{"chosen": [USER, assistant("It is 4.")], "rejected": [USER, assistant("five")]}])):
        pair = load_pairs(rows).pairs[0]
        enc = encode_pairs([pair], tok, max_length=None)
        assert enc.chosen[0] == encode_scored(tok, pair.prompt, pair.chosen)
        assert enc.rejected[0] == encode_scored(tok, pair.prompt, pair.rejected)
    # text: prompt + completion, one token per character for the char tokenizer
    assert encode_scored(text_tok, "2+2=", "4") == text_tok("2+2=4")["input_ids"] and len(enc.chosen[0]) > 0


def test_too_long_pairs():
    tok = char_tokenizer()
    pairs = load_pairs([{"prompt": "0123456789", "chosen": "a", "rejected": "bb"},
                        {"prompt": "q", "chosen": "a", "rejected": "b"}]).pairs
    # pair 0: 10 prompt chars + "bb" = 12 tokens on its longer side
    kept = encode_pairs(pairs, tok, max_length=8, on_too_long="skip")
    assert len(kept) == 1 and kept.too_long == 1 and kept.where == ["dataset index 1"]
    with pytest.raises(DataError, match=r"^data.path: dataset index 0: the pair is 12 tokens, longer than "
                                        r"data.max_length=8; raise data.max_length"):
        encode_pairs(pairs, tok, max_length=8, on_too_long="fail")
    cut = encode_pairs(pairs, tok, max_length=8, on_too_long="truncate")
    assert cut.truncated == 1 and cut.chosen[0] == encode_scored(tok, pairs[0].prompt, "a")[-8:]
    assert tok.decode(cut.rejected[0]) == "456789bb"  # the completion survives, the prompt's start does not
    with pytest.raises(DataError, match="every pair is too long"):
        encode_pairs(pairs, tok, max_length=1, on_too_long="skip")  # "qa": 2 tokens
