"""The vision task's data (`lmrl.data.digits`): written out by its command as JSONL + PNG that lmrl's row checks
read, the same bytes on every run, and the digit really in the image (the blank control has none)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from lmrl.data.digits import GLYPHS, digit_image, digit_rows

ROOT = Path(__file__).resolve().parents[2]


def _command(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "lmrl.data.digits", str(out), "--rows", "12", *extra],
                          capture_output=True, text=True, env=env, timeout=60)


def _digests(out: Path) -> list[str]:
    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((out / "images").glob("*.png"))]


def test_the_command_writes_rows_lmrl_reads(tmp_path):
    from lmrl.data.images import ImageInputs
    from lmrl.data.prompts import load_prompts

    run = _command(tmp_path / "a")
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in (tmp_path / "a" / "data.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and len(_digests(tmp_path / "a")) == 12
    for row in rows:
        k = int(row["prompt"].split("+")[1].rstrip("="))
        assert row["prompt"].startswith("<image>") and 0 <= int(row["answer"]) - k <= 9  # the digit shown
    loaded = load_prompts(str(tmp_path / "a" / "data.jsonl"), images=ImageInputs(image_token="<image>"))
    assert len(loaded) == 12 and all(os.path.isabs(r["image"]) for r in loaded)
    assert _command(tmp_path / "b").returncode == 0
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")  # the same bytes every time
    assert _command(tmp_path / "c", "--seed", "1").returncode == 0 and _digests(tmp_path / "c") != _digests(tmp_path / "a")
    bad = _command(tmp_path / "d", "--rows", "0")
    assert bad.returncode == 2 and "--rows: expected at least 1, got 0" in bad.stderr


def _red(image) -> bytes:
    return image.tobytes()[0::3]


def test_the_digit_is_in_the_image_and_not_in_the_blank_control():
    import random

    for digit in GLYPHS:
        inked = sum(line.count("#") for line in GLYPHS[digit])
        red = _red(digit_image(digit, random.Random(digit)))
        dark = sum(1 for v in red if v <= 90)  # ink is dark, the background light
        assert dark in {inked * s * s for s in (3, 4, 5)} and dark + sum(1 for v in red if v >= 200) == 32 * 32
    assert all(v >= 200 for row in digit_rows(5, blank=True) for v in _red(row["image"]))
    assert [r["answer"] for r in digit_rows(5)] == [r["answer"] for r in digit_rows(5, blank=True)]
