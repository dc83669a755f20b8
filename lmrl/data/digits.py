"""The vision task's data: "the digit shown plus k", with the digit drawn in a 32x32 image and k in the text, so
the answer needs both (issue 41). Digits come from a 3x5 bitmap written here, not from a font, so an image
is the same bytes whatever Pillow's version; each is scaled, placed and coloured from the row's seed.

Write it out as JSONL + PNG (the format `lmrl train data.path=...` reads, docs/vision.md):

    python -m lmrl.data.digits OUT_DIR [--rows 200] [--seed 0] [--blank]

`--blank` draws every image empty: the control run, which cannot beat chance at the digit.

The same rows, in memory, are the built-in task `data.task=digits` (`lmrl.data.tasks.DigitsTask`, what the
shipped `tiny-vision` trains on) and `data.task=digits-blank` (its blank-image control).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

SIZE = 32
IMAGE_TOKEN = "<image>"
# 3 columns x 5 rows per digit, one string per row
GLYPHS = {
    0: ("###", "#.#", "#.#", "#.#", "###"), 1: (".#.", "##.", ".#.", ".#.", "###"),
    2: ("###", "..#", "###", "#..", "###"), 3: ("###", "..#", ".##", "..#", "###"),
    4: ("#.#", "#.#", "###", "..#", "..#"), 5: ("###", "#..", "###", "..#", "###"),
    6: ("###", "#..", "###", "#.#", "###"), 7: ("###", "..#", ".#.", ".#.", ".#."),
    8: ("###", "#.#", "###", "#.#", "###"), 9: ("###", "#.#", "###", "..#", "###"),
}


def digit_image(digit: int, rng: random.Random, blank: bool = False):
    """A 32x32 RGB image of `digit`: its bitmap scaled 3 to 5 times, at a random place, in a random dark colour on
    a light background (`blank`: the background alone)."""
    from PIL import Image

    background = tuple(rng.randint(200, 255) for _ in range(3))
    ink = tuple(rng.randint(0, 90) for _ in range(3))
    scale = rng.randint(3, 5)
    left, top = rng.randint(0, SIZE - 3 * scale), rng.randint(0, SIZE - 5 * scale)
    image = Image.new("RGB", (SIZE, SIZE), background)
    if blank:
        return image
    pixels = image.load()
    for r, line in enumerate(GLYPHS[digit]):
        for c, cell in enumerate(line):
            if cell == "#":
                for y in range(top + r * scale, top + (r + 1) * scale):
                    for x in range(left + c * scale, left + (c + 1) * scale):
                        pixels[x, y] = ink
    return image


def digit_rows(n: int, seed: int = 0, blank: bool = False) -> list[dict[str, Any]]:
    """`n` rows: a PIL `image` of a digit d, a `prompt` asking for d + k (k from 1 to 9, in the text), and the
    `answer` (d + k as a string), a pure function of (n, seed)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digit, k = rng.randint(0, 9), rng.randint(1, 9)
        rows.append({"prompt": f"{IMAGE_TOKEN}digit+{k}=", "image": digit_image(digit, rng, blank),
                     "answer": str(digit + k)})
    return rows


def write_digits(out: str | Path, n: int, seed: int = 0, blank: bool = False) -> Path:
    """`digit_rows` as `out/data.jsonl` whose `image` fields are paths of PNGs in `out/images/`; returns the
    JSONL's path."""
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, row in enumerate(digit_rows(n, seed, blank)):
        name = f"images/{i:05d}.png"
        row["image"].save(out / name)
        lines.append(json.dumps({**row, "image": name}) + "\n")
    (out / "data.jsonl").write_text("".join(lines))
    return out / "data.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmrl.data.digits", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="directory to write data.jsonl and images/ into")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blank", action="store_true", help="empty images: the control run's data")
    a = parser.parse_args(argv)
    if a.rows < 1:
        parser.error(f"--rows: expected at least 1, got {a.rows}")
    print(write_digits(a.out, a.rows, a.seed, a.blank))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
