"""A line chart over time as SVG markup, drawn on the server: lines (each its own polyline, so an
attempt's line does not run across the gap to the next) and vertical marks (OOMs, rungs,
attempts) with their text as a tooltip. Every text is escaped here; nothing is fetched.

A line of a weeks-long job has millions of steps; each is cut to at most MAX_POINTS, keeping
each bin's highest value (a memory peak must not vanish in a mean) or its mean (a loss)."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from oomguard.daemon.text import escape
from oomguard.strategies.units import format_duration_short

MAX_POINTS = 600
WIDTH, HEIGHT = 880, 230
LEFT, RIGHT, TOP, BOTTOM = 70, 12, 26, 30  # margins for the axes' labels and the title


@dataclass(frozen=True)
class Line:
    label: str
    points: tuple[tuple[float, float], ...]  # (seconds since the chart's origin, value)
    css: str  # its class in dashboard.css: "held", "cap", "loss", ...
    reduce: Literal["max", "mean"] = "max"
    steps: bool = False  # a value that holds until the next point (a cap), not a slope between them


@dataclass(frozen=True)
class Mark:
    x: float  # seconds since the chart's origin
    label: str
    css: str  # "oom", "rung" or "attempt"
    number: int | None = None  # shown above the mark; the page lists what each number was


def chart_svg(title: str, lines: Sequence[Line], marks: Sequence[Mark], y_text: Callable[[float], str], *, y_from_zero: bool = True) -> str:
    finite = [
        Line(line.label, tuple(p for p in line.points if math.isfinite(p[0]) and math.isfinite(p[1])), line.css, line.reduce, line.steps)
        for line in lines
    ]
    drawn = [Line(line.label, _thin(line.points, line.reduce), line.css, line.reduce, line.steps) for line in finite if line.points]
    xs = [x for line in drawn for x, _ in line.points] + [m.x for m in marks if math.isfinite(m.x)]
    ys = [y for line in drawn for _, y in line.points]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{_text(title)}">',
        f'<text class="title" x="{LEFT}" y="16">{_text(title)}</text>',
    ]
    if not ys:
        parts.append(f'<text class="empty" x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">no steps recorded yet</text></svg>')
        return "".join(parts)
    x_max = max(max(xs), 1.0)
    y_min = 0.0 if y_from_zero else min(ys)
    y_max = max(ys)
    if y_max <= y_min:
        y_max = y_min + (abs(y_min) or 1.0)
    y_max += (y_max - y_min) * 0.05

    def px(x: float) -> float:
        return LEFT + (WIDTH - LEFT - RIGHT) * x / x_max

    def py(y: float) -> float:
        return HEIGHT - BOTTOM - (HEIGHT - TOP - BOTTOM) * (y - y_min) / (y_max - y_min)

    parts.append(f'<rect class="plot" x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" height="{HEIGHT - TOP - BOTTOM}"/>')
    for i in range(5):
        y = y_min + (y_max - y_min) * i / 4
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{py(y):.1f}" y2="{py(y):.1f}"/>')
        parts.append(f'<text class="tick" x="{LEFT - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{_text(y_text(y) if y else "0")}</text>')
    for i in range(6):
        x = x_max * i / 5
        parts.append(f'<text class="tick" x="{px(x):.1f}" y="{HEIGHT - 10}" text-anchor="middle">{_text(format_duration_short(x))}</text>')
    for line in drawn:
        points = _as_steps(line.points) if line.steps else line.points
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        parts.append(f'<polyline class="line {_text(line.css)}" points="{coords}"><title>{_text(line.label)}</title></polyline>')
    for mark in marks:
        if not math.isfinite(mark.x):
            continue
        x = px(mark.x)
        parts.append(
            f'<g class="mark {_text(mark.css)}"><title>{_text(mark.label)}</title>'
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{HEIGHT - BOTTOM}"/>'
            + (f'<text x="{x + 2:.1f}" y="{TOP + 10}">{mark.number}</text>' if mark.number is not None else "")
            + "</g>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _thin(points: tuple[tuple[float, float], ...], reduce: Literal["max", "mean"]) -> tuple[tuple[float, float], ...]:
    """At most MAX_POINTS points: consecutive points binned, each bin's last time with its
    highest (or mean) value."""
    if len(points) <= MAX_POINTS:
        return points
    size = math.ceil(len(points) / MAX_POINTS)
    thinned = []
    for start in range(0, len(points), size):
        chunk = points[start:start + size]
        values = [y for _, y in chunk]
        thinned.append((chunk[-1][0], max(values) if reduce == "max" else sum(values) / len(values)))
    return tuple(thinned)


def _as_steps(points: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
    """Each value held until the next point's time, then the jump."""
    stepped = list(points[:1])
    for (_, before), (x, y) in zip(points, points[1:]):
        stepped += [(x, before), (x, y)]
    return tuple(stepped)


def _text(value: str) -> str:
    """Text a job's owner may have written, inert in SVG: control characters escaped, then XML."""
    return html.escape(escape(str(value)), quote=True)
