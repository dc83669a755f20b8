"""`lmrl report`: the page of real runs (written by `train` itself, at the end and when a signal stops the run),
several runs overlaid, untrusted text escaped, nothing fetched; rendered in headless Chromium, whose screenshot
must show the runs' line colours inside the plots."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from lmrl import Config, Trainer
from lmrl.cli import main
from lmrl.errors import Interrupted
from lmrl.report import PLOTS, read_run, render_report, write_report
from lmrl.report.plots import COLORS, nice_ticks

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 30) for b in range(10, 14)]


def exact(completions, answer, log_extra, **kwargs):
    log_extra("gold", answer)
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def _train(out: Path, steps: int = 6, **algorithm) -> None:
    cfg = Config(algorithm=algorithm or "grpo", train={"steps": steps, "output_dir": str(out), "eval_every": 3},
                 log={"console": False, "samples_every": 2, "num_samples": 3},
                 rollout={"prompts_per_step": 4, "group_size": 4}, data={"num_eval_prompts": 8})
    Trainer(cfg, reward_funcs=[exact], train_dataset=ROWS, eval_dataset=ROWS[:8]).train()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("runs")
    _train(root / "grpo")
    _train(root / "rloo", name="rloo")
    return root / "grpo", root / "rloo"


def test_train_writes_the_report_of_its_run(runs):
    page = (runs[0] / "report.html").read_text()
    run = read_run(runs[0])
    assert [r["step"] for r in run.rows] == list(range(7)) and sorted(run.samples) == [2, 4, 6]
    assert page.count('<svg xmlns="http://www.w3.org/2000/svg" class="plot"') >= 2 * 10  # vs step and vs wall time
    for title in ("reward (train)", "held-out accuracy", "entropy (nats per token)", "clip fraction", "importance ratio",
                  "response length (tokens)", "seconds per phase", "throughput (completions / s)"):
        assert page.count(f'aria-label="{title}') == 2, title
    assert "<th>gold</th>" in page  # the reward function's log_extra column
    assert "grpo" in page and "algorithm:" in page  # the resolved config
    # the KL plot is there only for a run with a KL term: this GRPO run (kl_coef 0) says so instead
    assert "Not logged by this run: KL to the reference." in page


def test_several_runs_overlay_and_nothing_is_fetched(runs, tmp_path, capsys):
    out = tmp_path / "both.html"
    assert main(["report", str(runs[0]), str(runs[1]), "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out} (open it in a browser: it needs no server and no network)\n"
    page = out.read_text()
    step_plot = re.search(r'<svg[^>]*aria-label="held-out accuracy".*?</svg>', page).group(0)
    assert f'stroke="{COLORS[0]}"' in step_plot and f'stroke="{COLORS[1]}"' in step_plot  # both runs in one plot
    assert "KL to the reference" in page and "Not logged" not in page  # RLOO's KL is drawn
    assert not re.search(r"<script|<link|<img|<iframe|src=|url\(|@import", page)
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", page)


def test_untrusted_text_is_escaped(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 0, "reward/mean": 1.0, "time/elapsed": 1}) + "\n"
                                            + '{"step": 2, "rew')  # a line cut short by a kill: left out
    (tmp_path / "samples.jsonl").write_text(json.dumps({"step": 1, "prompt": "<b>p</b>", "completion": "<script>x()</script>",
                                                        "score": 1.0, "advantage": 0.5, "note": "<i>"}) + "\n")
    page = render_report([read_run(tmp_path)])
    assert "<script" not in page and "&lt;script&gt;x()&lt;/script&gt;" in page and "&lt;b&gt;p&lt;/b&gt;" in page
    assert "<td>&lt;i&gt;</td>" in page


def test_a_bad_run_directory_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == f"lmrl: error: {tmp_path / 'nowhere'}: no such run directory\n"
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl in it" in capsys.readouterr().err


@pytest.mark.parametrize("lo, hi", [(0.306, 0.468), (0, 17.3), (-0.2, 0.41), (1, 1), (3e-6, 9e-6), (-5, -5), (0, 1e6)])
def test_ticks_are_round_even_and_cover_the_values(lo, hi):
    ticks = nice_ticks(lo, hi)
    assert ticks[0] <= lo and ticks[-1] >= hi and 2 <= len(ticks) <= 7
    steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:])}
    assert len({round(s / max(steps), 6) for s in steps}) == 1  # evenly spaced
    mantissa = float(f"{max(steps):e}".split("e")[0])
    assert mantissa in (1.0, 2.0, 5.0)


def test_a_signal_stops_the_run_and_its_report_is_written(tmp_path):
    calls = []

    def stop_at_third(completions, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # the trainer's handler: stop after a checkpoint
        return [0.0] * len(completions)

    cfg = Config(train={"steps": 50, "output_dir": str(tmp_path)}, log={"console": False},
                 rollout={"prompts_per_step": 2, "group_size": 2}, data={"num_eval_prompts": 0})
    with pytest.raises(Interrupted):
        Trainer(cfg, reward_funcs=[stop_at_third], train_dataset=ROWS).train()
    assert (tmp_path / "report.html").is_file()
    logged = [r["step"] for r in read_run(tmp_path).rows]
    assert 1 <= len(logged) < 50 and f"<td>{logged[-1]}</td>" in (tmp_path / "report.html").read_text()


# ------------------------------------------------------------------------------------------- in Chromium

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _png_pixels(path: Path) -> tuple[int, int, list[bytes], int]:
    """(width, height, rows of pixel bytes, bytes per pixel) of an 8-bit, non-interlaced RGB(A) PNG: what
    Chromium writes."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            chunks.append(body)
        pos += 12 + length
    width, height, depth, color_type, _, _, interlace = header
    assert depth == 8 and color_type in (2, 6) and interlace == 0, header
    bpp = 3 if color_type == 2 else 4
    raw, stride, rows, prev = zlib.decompress(b"".join(chunks)), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):  # undo the PNG row filter
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, rows, bpp


def _chromium(args: list[str], profile: Path) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--hide-scrollbars"]
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian: apt-get install chromium; make test tries)")
def test_the_report_draws_in_chromium(runs, tmp_path):
    page = write_report(list(runs), tmp_path / "both.html")
    shot = tmp_path / "shot.png"
    out = _chromium([f"--screenshot={shot}", "--window-size=1000,1400", page.as_uri()], tmp_path / "profile")
    assert shot.is_file(), out.stderr[-2000:]
    width, height, rows, bpp = _png_pixels(shot)
    assert (width, height) == (1000, 1400)

    def count(color: str, box: tuple[int, int, int, int]) -> int:
        target = bytes.fromhex(color[1:])
        x0, y0, x1, y1 = box
        n = 0
        for y in range(y0, y1):
            row = rows[y]
            for x in range(x0, x1):
                px = row[x * bpp:x * bpp + 3]
                n += all(abs(p - t) <= 40 for p, t in zip(px, target))
        return n

    # below the summary table and the legend, the plots: each run's colour drawn there as lines, many pixels of it
    plots = (0, 300, width, height)
    assert count(COLORS[0], plots) > 500 and count(COLORS[1], plots) > 500
    assert count("#ffffff", plots) > 0.5 * width * (height - 300)  # a page, not a solid fill
    dom = _chromium(["--dump-dom", page.as_uri()], tmp_path / "profile2").stdout
    drawn = re.findall(r'<path d="M[^"]+" fill="none" stroke="(#[0-9a-f]{6})"', dom)
    assert set(drawn) == {COLORS[0], COLORS[1]} and len(drawn) >= 2 * len(PLOTS)
