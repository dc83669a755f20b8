"""Line plots as inline SVG: no plotting library, no script, nothing fetched when the page opens.

One function, `line_plot`, draws several series (one colour per run, one dash pattern per metric of a
plot) on shared axes with round-number ticks. Values that are missing or not finite break a line
instead of bending it to zero.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

WIDTH, HEIGHT = 440, 210
LEFT, RIGHT, TOP, BOTTOM = 56, 12, 26, 36  # margins around the plotting area, in px

# one colour per run (saturated, so that a screenshot shows them); a report with more runs cycles
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
DASHES = ["", "6 3", "2 3", "8 3 2 3"]  # one per metric of a plot: solid, dashed, dotted, dash-dot


@dataclass
class Series:
    """One line: its label (the legend's text and the hover title), colour, dash pattern, and points."""

    label: str
    color: str
    dash: str
    points: list[tuple[float, float | None]]  # (x, y); y None = no value at x (the line breaks)


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round numbers (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi == lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step + 1e-9) * step
    ticks = [round(first, 12)]
    while ticks[-1] < hi - step * 1e-9:  # the last tick is at or above hi
        ticks.append(round(first + len(ticks) * step, 12))
    return ticks


def _fmt(v: float) -> str:
    """A tick label: short, no trailing zeros, scientific notation for very large or small values."""
    if v == 0:
        return "0"
    if abs(v) >= 1e5 or abs(v) < 1e-3:
        return f"{v:.1e}"
    return f"{v:.4g}"


def _finite(y: float | None) -> bool:
    return y is not None and math.isfinite(y)


def line_plot(title: str, series: Sequence[Series], x_label: str) -> str:
    """An `<svg>` element: the series on shared axes, titled, with round-number ticks on both axes.

    A plot with no finite value says so instead of drawing empty axes.
    """
    xs = [x for s in series for x, y in s.points if _finite(y) and math.isfinite(x)]
    ys = [y for s in series for _, y in s.points if _finite(y)]
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" width="{WIDTH}" height="{HEIGHT}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{html.escape(title)}">'
            f'<text x="{WIDTH / 2}" y="16" text-anchor="middle" class="title">{html.escape(title)}</text>')
    if not ys:
        return head + f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" class="empty">no values</text></svg>'
    xt, yt = nice_ticks(min(xs), max(xs)), nice_ticks(min(ys), max(ys))
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]
    pw, ph = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / ((x1 - x0) or 1) * pw

    def py(y: float) -> float:
        return TOP + ph - (y - y0) / ((y1 - y0) or 1) * ph

    parts = [head, f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" class="frame"/>']
    for t in yt:
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}" class="grid"/>'
                     f'<text x="{LEFT - 5}" y="{py(t) + 4:.1f}" text-anchor="end" class="tick">{_fmt(t)}</text>')
    for t in xt:
        parts.append(f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{TOP}" y2="{TOP + ph}" class="grid"/>'
                     f'<text x="{px(t):.1f}" y="{TOP + ph + 15}" text-anchor="middle" class="tick">{_fmt(t)}</text>')
    parts.append(f'<text x="{LEFT + pw / 2}" y="{HEIGHT - 4}" text-anchor="middle" class="axis">{html.escape(x_label)}</text>')
    for s in series:
        parts.append(_draw(s, px, py))
    return "".join(parts) + "</svg>"


def _draw(s: Series, px, py) -> str:
    """One series: a path broken where values are missing, and a dot for a point with no neighbour."""
    runs: list[list[tuple[float, float]]] = [[]]
    for x, y in s.points:
        if _finite(y) and math.isfinite(x):
            runs[-1].append((px(x), py(y)))
        elif runs[-1]:
            runs.append([])
    d = " ".join("M" + " L".join(f"{x:.1f} {y:.1f}" for x, y in run) for run in runs if len(run) > 1)
    dots = "".join(f'<circle cx="{run[0][0]:.1f}" cy="{run[0][1]:.1f}" r="2.5" fill="{s.color}"/>'
                   for run in runs if len(run) == 1)
    dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
    line = f'<path d="{d}" fill="none" stroke="{s.color}" stroke-width="2"{dash}/>' if d else ""
    return f'<g class="series"><title>{html.escape(s.label)}</title>{line}{dots}</g>'
