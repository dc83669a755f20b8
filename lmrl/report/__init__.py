"""`lmrl report`: one self-contained HTML page of one or several runs.

The page opens from disk with no server and no network: the plots are inline SVG drawn here
(`lmrl.report.plots`), the styles inline, and it holds no script. It shows, for every run directory
given (their curves overlaid, one colour per run):

- a summary: algorithm, model, steps, held-out accuracy at the start and the end, wall time;
- plots of reward and held-out accuracy, KL, entropy, clip fraction, ratio, response length, loss,
  gradient norm, seconds per phase and throughput, each against step and against wall time;
- the sample tables written during training (`samples.jsonl`), newest first, with a thumbnail of each image a
  sample's prompt showed (read from its path, or from the run's `images/` for an in-memory image);
- the resolved config (`lmrl_config.yaml`).

It reads only what a run writes (`metrics.jsonl`, `samples.jsonl`, `lmrl_config.yaml`, `images/`) and the image
files samples.jsonl names, so it works
on a finished run, an interrupted one, or one still training. Model outputs are untrusted: every
text is HTML-escaped.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lmrl.errors import ConfigError
from lmrl.report.plots import COLORS, DASHES, Series, line_plot

# (title, metric keys): one plot per entry, drawn when some run logged one of its keys
PLOTS: list[tuple[str, list[str]]] = [
    ("reward (train)", ["reward/mean", "objective/scores"]),
    ("held-out accuracy", ["eval/accuracy"]),
    ("held-out reward", ["eval/reward"]),
    ("KL to the reference", ["objective/kl", "kl"]),
    ("entropy (nats per token)", ["policy/entropy_avg"]),
    ("clip fraction", ["policy/clipfrac_avg"]),
    ("importance ratio", ["val/ratio", "val/ratio_max"]),
    ("response length (tokens)", ["val/response_length"]),
    ("policy loss", ["loss/policy_avg"]),
    ("gradient norm", ["policy/grad_norm"]),
    ("seconds per phase", ["time/generate", "time/experience", "time/update"]),
    ("throughput (completions / s)", ["eps"]),
]
MAX_SAMPLE_STEPS = 30  # sample tables shown per run, the newest


@dataclass
class Run:
    """What one run directory holds, as the report reads it."""

    directory: Path
    rows: list[dict[str, Any]]  # metrics.jsonl, one row per step (a step logged twice: its last row)
    samples: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # step -> sample rows
    config_text: str = ""
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.directory.name or str(self.directory)


def read_run(directory: str | Path) -> Run:
    """A run directory's metrics, samples and config.

    Raises:
        ConfigError: the directory does not exist or has no metrics.jsonl (one line naming it).
    """
    d = Path(directory)
    metrics = d / "metrics.jsonl"
    if not d.is_dir():
        raise ConfigError(f"{directory}: no such run directory")
    if not metrics.is_file():
        raise ConfigError(f"{directory}: no metrics.jsonl in it (not a run directory, or a run with log.jsonl=false)")
    by_step: dict[int, dict[str, Any]] = {}
    for row in _jsonl(metrics):
        if isinstance(row.get("step"), int):
            by_step[row["step"]] = row  # a resumed run rewrites its file, but a live one may repeat a step
    samples: dict[int, list[dict[str, Any]]] = {}
    previous = None  # samples.jsonl is appended to: a step written again (after a resume) replaces the old table
    for row in _jsonl(d / "samples.jsonl"):
        step = row.get("step")
        if isinstance(step, int):
            if step != previous:
                samples[step] = []
            samples[step].append(row)
            previous = step
    config_text = (d / "lmrl_config.yaml").read_text() if (d / "lmrl_config.yaml").is_file() else ""
    try:
        config = yaml.safe_load(config_text) or {}
    except yaml.YAMLError:
        config = {}
    return Run(d, [by_step[s] for s in sorted(by_step)], samples, config_text, config if isinstance(config, dict) else {})


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file; a line cut short (a run killed mid-write) is left out."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


def write_report(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Write the report of `run_dirs` to `out` (default: RUN_DIR/report.html for one run, ./report.html for
    several) and return its path. The file is written whole, then renamed into place."""
    runs = [read_run(d) for d in run_dirs]
    path = Path(out) if out is not None else (runs[0].directory / "report.html" if len(runs) == 1 else Path("report.html"))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_report(runs), encoding="utf-8")
    tmp.replace(path)
    return path


def render_report(runs: list[Run]) -> str:
    """The whole HTML page."""
    title = "lmrl report: " + ", ".join(r.name for r in runs)
    body = [f"<h1>{html.escape(title)}</h1>", _summary(runs), _legend(), _plots(runs)]
    for i, run in enumerate(runs):
        body.append(_samples(run, COLORS[i % len(COLORS)]))
    for run in runs:
        body.append(f"<details><summary>resolved config of {html.escape(run.name)}</summary>"
                    f"<pre>{html.escape(run.config_text or '(no lmrl_config.yaml)')}</pre></details>")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_CSS}</style></head><body>{''.join(body)}</body></html>\n")


def _summary(runs: list[Run]) -> str:
    head = "".join(f"<th>{h}</th>" for h in ["run", "algorithm", "model", "steps", "held-out accuracy",
                                              "reward (last 10 steps)", "wall time", "completions / s"])
    lines = []
    for i, r in enumerate(runs):
        evals = [row["eval/accuracy"] for row in r.rows if _number(row.get("eval/accuracy"))]
        steps = [row for row in r.rows if row["step"] > 0]
        rewards = [row["reward/mean"] for row in steps[-10:] if _number(row.get("reward/mean"))]
        eps = [row["eps"] for row in steps if _number(row.get("eps"))]
        elapsed = [row["time/elapsed"] for row in r.rows if _number(row.get("time/elapsed"))]
        cells = [f'<span class="swatch" style="background:{COLORS[i % len(COLORS)]}"></span>{html.escape(r.name)}',
                 html.escape(str(_get(r.config, "algorithm", "name"))), html.escape(str(_get(r.config, "model", "name_or_path"))),
                 str(steps[-1]["step"] if steps else 0),
                 " &rarr; ".join(f"{a:.1%}" for a in (evals[:1] + evals[1:][-1:])) or "&ndash;",
                 f"{sum(rewards) / len(rewards):.3f}" if rewards else "&ndash;",
                 _duration(max(elapsed)) if elapsed else "&ndash;",
                 f"{sum(eps) / len(eps):.1f}" if eps else "&ndash;"]
        lines.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f'<table class="summary"><tr>{head}</tr>{"".join(lines)}</table>'


def _legend() -> str:
    samples = []
    for k, dash in enumerate(DASHES[:3]):
        pattern = f' stroke-dasharray="{dash}"' if dash else ""
        samples.append(f'<svg width="28" height="8"><line x1="0" x2="28" y1="4" y2="4" stroke="#333" stroke-width="2"{pattern}/>'
                       f"</svg> metric {k + 1}")
    return (f'<p class="legend">One colour per run (see the table); where a plot shows several metrics, their lines are '
            f"{', '.join(samples)} in the order its title lists them. Hover a line for its name.</p>")


def _plots(runs: list[Run]) -> str:
    minutes = max((row.get("time/elapsed") or 0 for r in runs for row in r.rows if _number(row.get("time/elapsed"))),
                  default=0) > 300
    unit, scale = ("minutes", 60.0) if minutes else ("seconds", 1.0)
    cells, missing = [], []
    for title, keys in PLOTS:
        logged = [k for k in keys if any(_number(row.get(k)) for r in runs for row in r.rows)]
        if not logged:
            missing.append(title)
            continue
        named = f"{title}: {', '.join(logged)}" if len(logged) > 1 else title
        by_step, by_time = [], []
        for i, run in enumerate(runs):
            color = COLORS[i % len(COLORS)]
            for k, key in enumerate(logged):
                rows = [row for row in run.rows if key in row]
                label = f"{run.name}: {key}"
                dash = DASHES[k % len(DASHES)]
                by_step.append(Series(label, color, dash, [(row["step"], row[key]) for row in rows]))
                by_time.append(Series(label, color, dash, [(row["time/elapsed"] / scale, row[key]) for row in rows
                                                           if _number(row.get("time/elapsed"))]))
        cells.append(f'<div class="pair">{line_plot(named, by_step, "step")}'
                     f'{line_plot(named, by_time, f"wall time ({unit})")}</div>')
    note = (f'<p class="note">Not logged by {"these runs" if len(runs) > 1 else "this run"}: {", ".join(missing)}.</p>'
            if missing else "")
    if not any(row["step"] > 0 for r in runs for row in r.rows):
        note += '<p class="note">No training step is logged yet.</p>'
    return f'<h2>Curves</h2>{note}<div class="plots">{"".join(cells)}</div>'


def _samples(run: Run, color: str) -> str:
    if not run.samples:
        return (f"<h2>Samples of {html.escape(run.name)}</h2><p class=\"note\">No sample tables were written "
                "(log.samples_every=0, or no step reached it yet).</p>")
    steps = sorted(run.samples, reverse=True)
    parts = [f'<h2><span class="swatch" style="background:{color}"></span>Samples of {html.escape(run.name)}</h2>']
    if len(steps) > MAX_SAMPLE_STEPS:
        parts.append(f'<p class="note">The newest {MAX_SAMPLE_STEPS} of {len(steps)} sample tables.</p>')
    for n, step in enumerate(steps[:MAX_SAMPLE_STEPS]):
        rows = run.samples[step]
        extra = [k for k in dict.fromkeys(k for row in rows for k in row)
                 if k not in ("step", "prompt", "completion", "score", "advantage")]
        head = "".join(f"<th>{html.escape(h)}</th>" for h in ["prompt", "completion", "score", "advantage", *extra])
        body = "".join(
            "<tr>" + f"<td>{html.escape(str(row.get('prompt', '')))}</td><td class=\"completion\">"
            f"{html.escape(str(row.get('completion', '')))}</td><td>{_num(row.get('score'), '.3f')}</td>"
            f"<td>{_num(row.get('advantage'), '+.3f')}</td>"
            + "".join(f"<td>{_images(run, row[k]) if k == 'images' else html.escape(str(row.get(k, '')))}</td>"
                      for k in extra) + "</tr>"
            for row in rows)
        parts.append(f"<details{' open' if n == 0 else ''}><summary>step {step}</summary>"
                     f'<table class="samples"><tr>{head}</tr>{body}</table></details>')
    return "".join(parts)


THUMBNAIL = 64  # pixels, the longer side


def _images(run: Run, refs: Any) -> str:
    """A sample's images (samples.jsonl's `images`: paths, or `sha256:HEX` for an image kept in the run's images/
    as HEX.png) as small PNG thumbnails inside the page (data URIs: it stays one file), each titled with its
    name; a name whose image is not here (moved, or never kept) is shown as text."""
    if not isinstance(refs, list):
        return html.escape(str(refs))
    cells = []
    for ref in map(str, refs):
        path = run.directory / "images" / f"{ref[7:]}.png" if ref.startswith("sha256:") else Path(ref)
        if not path.is_absolute():
            path = run.directory / path
        uri = _thumbnail(path)
        cells.append(f'<img class="thumb" src="{uri}" title="{html.escape(ref)}" alt="{html.escape(ref)}">' if uri
                     else html.escape(ref))
    return " ".join(cells)


def _thumbnail(path: Path) -> str | None:
    """`path`'s image shrunk to fit THUMBNAIL pixels, as a `data:image/png;base64,...` URI; None where it cannot
    be read."""
    import base64
    import io

    try:
        from PIL import Image

        with Image.open(path) as image:
            image = image.convert("RGB")
            image.thumbnail((THUMBNAIL, THUMBNAIL))
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
    except (OSError, ImportError, ValueError):
        return None
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _num(v: Any, fmt: str) -> str:
    return format(v, fmt) if _number(v) else "&ndash;"


def _get(cfg: dict[str, Any], section: str, key: str) -> Any:
    value = (cfg.get(section) or {}).get(key) if isinstance(cfg.get(section), dict) else None
    return "?" if value is None else value


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


_CSS = """
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
table { border-collapse: collapse; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
.summary td:nth-child(n+4) { text-align: right; }
.swatch { display: inline-block; width: 12px; height: 12px; margin-right: 6px; vertical-align: -1px; }
.plots { display: flex; flex-wrap: wrap; gap: 6px 18px; }
.pair { display: flex; gap: 4px; }
svg.plot text { font: 11px sans-serif; fill: #444; }
svg.plot text.title { font-size: 12px; font-weight: 600; fill: #222; }
svg.plot .frame { fill: none; stroke: #999; }
svg.plot .grid { stroke: #eee; }
.thumb { width: 64px; height: 64px; image-rendering: pixelated; border: 1px solid #ccc; }
.samples td { max-width: 520px; white-space: pre-wrap; word-break: break-word; font-family: ui-monospace, monospace; font-size: 12px; }
.note, .legend { color: #555; }
pre { background: #f7f7f7; padding: 8px; overflow-x: auto; font-size: 12px; }
summary { cursor: pointer; margin: 6px 0; }
"""
