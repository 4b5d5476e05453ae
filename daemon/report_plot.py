"""How `oomguard report JOB` draws a ReportData (report_data.py, loaded by report.py) as a
1400 x 900 PNG with matplotlib (imported in the functions that draw, Agg backend: the CLI
starts fast and needs no display). Two panels: peak memory per step against the cap for each
attempt, with the rungs and OOMs marked (top); samples/s per plan (bottom)."""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomguard.daemon.report_data import ReportData
from oomguard.daemon.text import escape, shorten
from oomguard.strategies.units import duration_axis_unit, size_axis_unit

# The figure's size: 14 x 9 inches at 100 dpi.
WIDTH_PX, HEIGHT_PX, DPI = 1400, 900, 100
# Each attempt's colour (matplotlib's default cycle), in turn.
COLORS = tuple(f"C{i}" for i in range(10))


@dataclass(frozen=True)
class _Scales:
    """The axes of the memory panel: time since the first attempt started, in a unit fit for
    the job's span, and bytes in a unit fit for the largest figure."""

    origin: float
    ends: tuple[float, ...]  # every moment drawn
    time_name: str
    time_div: float
    values: tuple[int, ...]  # every memory figure drawn
    mem_name: str
    mem_div: float

    @classmethod
    def of(cls, data: ReportData) -> _Scales:
        ends = [a.end for a in data.attempts] + [p.time for a in data.attempts for p in a.points]
        ends += [o.time for o in data.ooms] + [r.time for r in data.rungs]
        span = max(ends) - data.origin if ends else 0.0
        time_name, time_div = duration_axis_unit(span)
        values = [v for a in data.attempts for p in a.points for v in (p.peak_bytes, p.capacity_bytes) if v is not None]
        values += [o.bytes for o in data.ooms if o.bytes is not None]
        mem_name, mem_div = size_axis_unit(max(values) if values else 0)
        return cls(data.origin, tuple(ends), time_name, time_div, tuple(values), mem_name, mem_div)

    def x(self, t: float) -> float:
        return (t - self.origin) / self.time_div


def draw_report(data: ReportData, out: Path) -> Path:
    """Draw `data` as a 1400 x 900 PNG at `out` (written whole or not at all); return `out`.
    Its text is drawn as written: never as TeX math (a "$" in a runner's message is a dollar,
    and a malformed formula cannot make the drawing fail), with control characters escaped."""
    import matplotlib

    with matplotlib.rc_context({"text.parse_math": False}):
        return _draw_report(data, out)


def _draw_report(data: ReportData, out: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.transforms import blended_transform_factory

    out = Path(out)
    scales = _Scales.of(data)
    fig = Figure(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, gridspec_kw={"height_ratios": [3, 1.4]})
    fig.suptitle(data.title, fontsize=14, fontweight="bold")
    if data.result:
        top.set_title(shorten(data.result, 160), fontsize=9, color="dimgray")
    # x in data coordinates, y as a fraction of the panel's height: marks at a fixed height.
    band = blended_transform_factory(top.transData, top.transAxes)
    handles: list[Any] = []
    _draw_memory(top, band, data, scales, handles)
    rung_labels = _draw_rungs(top, band, data, scales, handles)
    oom_labels = _draw_ooms(top, band, data, scales, handles)
    _label_memory_panel(top, data, scales, handles)
    _draw_rates(bottom, data)
    _escape_texts(fig)
    _place_labels(fig, top, rung_labels, oom_labels)
    _save(fig, out)
    return out


def _draw_memory(top: Any, band: Any, data: ReportData, scales: _Scales, handles: list[Any]) -> None:
    """Memory per attempt, its span, and the cap it ran against; sets the panel's limits."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    x, mem_div = scales.x, scales.mem_div
    cap_drawn = False
    for index, attempt in enumerate(data.attempts):
        color = COLORS[index % len(COLORS)]
        top.axvspan(x(attempt.started_at), x(max(attempt.end, attempt.started_at)), color=color, alpha=0.07, lw=0)
        memory = [p for p in attempt.points if p.peak_bytes is not None]
        if memory:
            (line,) = top.plot(
                [x(p.time) for p in memory], [p.peak_bytes / mem_div for p in memory],
                color=color, lw=1.6, marker="." if len(memory) < 200 else None, ms=4, label=attempt.label,
            )
            handles.append(line)
        else:
            handles.append(Patch(color=color, alpha=0.35, label=f"{attempt.label} (no memory figures)" if attempt.points else f"{attempt.label} (no metrics)"))
            middle = x((attempt.started_at + max(attempt.end, attempt.started_at)) / 2)
            top.text(middle, 0.5, f"attempt {attempt.number}\nno metrics" if not attempt.points else f"attempt {attempt.number}\nno memory figures",
                     transform=band, ha="center", va="center", fontsize=9, color=color, fontweight="bold")
        capped = [p for p in attempt.points if p.capacity_bytes is not None]
        if capped:
            xs = [x(attempt.started_at)] + [x(p.time) for p in capped] + [x(max(attempt.end, capped[-1].time))]
            ys = [capped[0].capacity_bytes] + [p.capacity_bytes for p in capped] + [capped[-1].capacity_bytes]
            top.step(xs, [y / mem_div for y in ys], where="pre", color="black", lw=1.3, label="_cap")
            cap_drawn = True
    if cap_drawn:
        handles.append(Line2D([], [], color="black", lw=1.3, label="cap (device memory limit)"))

    top.set_ylim(bottom=0, top=(max(scales.values) / mem_div * 1.4) if scales.values else 1.0)
    ends = scales.ends
    right = x(max(ends)) * 1.02 if ends and x(max(ends)) > 0 else 1.0
    top.set_xlim(0.0, right)


def _draw_rungs(top: Any, band: Any, data: ReportData, scales: _Scales, handles: list[Any]) -> list[Any]:
    """Rungs: dashed verticals, labelled in the headroom above the cap (rows are chosen once the
    layout is known, so that labels do not cover each other: _place_labels). Returns the labels."""
    from matplotlib.lines import Line2D

    rung_labels = []
    for rung in data.rungs:
        style = {"color": "dimgray", "ls": "--", "lw": 1.1} if rung.source == "daemon" else {"color": "slategray", "ls": ":", "lw": 1.4}
        where = scales.x(rung.time)
        top.axvline(where, **style, zorder=1)
        rung_labels.append(top.annotate(
            rung.label, (where, 0.985), xycoords=band, xytext=(3, 0), textcoords="offset points", ha="left", va="top", fontsize=8,
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": style["color"], "lw": 0.6, "alpha": 0.85}, zorder=6,
        ))
    if any(r.source == "daemon" for r in data.rungs):
        handles.append(Line2D([], [], color="dimgray", ls="--", lw=1.1, label="rung taken by the daemon (new attempt)"))
    if any(r.source == "runner" for r in data.rungs):
        handles.append(Line2D([], [], color="slategray", ls=":", lw=1.4, label="rung taken inside the runner (probe, in-process)"))
    return rung_labels


def _draw_ooms(top: Any, band: Any, data: ReportData, scales: _Scales, handles: list[Any]) -> list[Any]:
    """OOMs: red X at the cap; labels of marks at the same moment are joined. Returns the labels."""
    from matplotlib.lines import Line2D

    x, mem_div = scales.x, scales.mem_div
    placed = [o for o in data.ooms if o.bytes is not None]
    unplaced = [o for o in data.ooms if o.bytes is None]
    if placed:
        top.scatter([x(o.time) for o in placed], [o.bytes / mem_div for o in placed], marker="X", s=140, color="red",
                    edgecolors="darkred", linewidths=0.8, zorder=7)
    for o in unplaced:
        top.scatter([x(o.time)], [0.75], marker="X", s=140, color="red", edgecolors="darkred", transform=band, zorder=7)
    groups: dict[tuple[float, float | None], list[str]] = {}
    for o in data.ooms:
        groups.setdefault((round(x(o.time), 6), o.bytes), []).append(o.label)
    oom_labels = []
    for (gx, gy), labels in groups.items():
        text = labels[0] if len(labels) == 1 else f"{len(labels)} OOMs: " + "; ".join(labels[:2]) + ("; …" if len(labels) > 2 else "")
        point, coords = ((gx, 0.75), band) if gy is None else ((gx, gy / mem_div), "data")
        oom_labels.append(top.annotate(
            text, point, xycoords=coords, xytext=(8, -12), textcoords="offset points", ha="left", va="top", fontsize=8, color="darkred",
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8}, zorder=8,
        ))
    if data.ooms:
        handles.append(Line2D([], [], color="red", marker="X", ls="none", ms=10, markeredgecolor="darkred", label="out of memory"))
    return oom_labels


def _label_memory_panel(top: Any, data: ReportData, scales: _Scales, handles: list[Any]) -> None:
    """The memory panel's axis labels, grid, legend, and the notes on what is missing."""
    top.set_ylabel(f"peak memory per step ({scales.mem_name})")
    started = dt.datetime.fromtimestamp(data.origin).strftime("%Y-%m-%d %H:%M:%S")
    top.set_xlabel(f"time since the first attempt started ({scales.time_name}); 0 = {started}")
    top.grid(True, alpha=0.3)
    top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8.5, frameon=False)
    if data.notes:
        top.text(0.005, 0.015, "\n".join(data.notes), transform=top.transAxes, ha="left", va="bottom", fontsize=8.5,
                 color="black", bbox={"boxstyle": "round,pad=0.3", "fc": "lightyellow", "ec": "goldenrod", "alpha": 0.9}, zorder=9)


def _draw_rates(bottom: Any, data: ReportData) -> None:
    """Samples/s per plan: a bar at the median, a dot per step."""
    if data.rates:
        first_attempt = {a.number: COLORS[i % len(COLORS)] for i, a in enumerate(data.attempts)}
        positions = list(range(len(data.rates)))[::-1]
        medians = [r.median_samples_per_s for r in data.rates]
        bottom.barh(positions, medians, color=[first_attempt.get(r.attempts[0], "gray") for r in data.rates], height=0.6, alpha=0.55)
        # Every step's rate as a dot on its plan's bar: the spread behind the median.
        for pos, rate in zip(positions, data.rates):
            shown = rate.samples_per_s[:: max(1, len(rate.samples_per_s) // 300)]  # a long job: every n-th step
            offsets = [0.22 * (2 * (i % 7) / 6 - 1) if len(shown) > 1 else 0.0 for i in range(len(shown))]
            bottom.scatter(shown, [pos + o for o in offsets], s=8, color="black", alpha=max(0.08, min(0.6, 40 / len(shown))), lw=0, zorder=3)
        largest = max(max(r.samples_per_s, default=0.0) for r in data.rates)
        bottom.set_yticks(positions, [shorten(r.plan, 40) for r in data.rates], fontsize=9)
        for pos, rate in zip(positions, data.rates):
            where = ", ".join(str(n) for n in rate.attempts)
            bottom.text(max(rate.samples_per_s, default=rate.median_samples_per_s) + largest * 0.015, pos,
                        f"{rate.median_samples_per_s:.3g} samples/s  ({rate.steps} step{'s' if rate.steps != 1 else ''}, attempt{'s' if len(rate.attempts) > 1 else ''} {where})",
                        va="center", fontsize=8.5)
        bottom.set_xlim(0, largest * 1.55 if largest > 0 else 1.0)
        bottom.set_ylim(-0.6, len(data.rates) - 0.4)
        bottom.grid(True, axis="x", alpha=0.3)
    else:
        bottom.set_yticks([])
        bottom.text(0.5, 0.5, "no samples/s measured yet (no attempt finished a step)", transform=bottom.transAxes, ha="center", va="center", fontsize=10)
    bottom.set_xlabel("samples/s: bar = median over the steps run under each plan, dots = single steps")
    bottom.set_title("throughput per plan", fontsize=10, loc="left")


def _escape_texts(fig: Any) -> None:
    """Every text of the figure (titles, labels, the legend), escaped but for its own lines."""
    from matplotlib.text import Text

    for text in fig.findobj(Text):
        text.set_text(escape(text.get_text(), keep="\n"))


def _place_labels(fig: Any, top: Any, rung_labels: list[Any], oom_labels: list[Any]) -> None:
    """Labels into rows where they neither cover one another nor leave the panel."""
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    taken: list[Any] = []
    _spread(rung_labels, [((dx, -15.0 * row), ha) for row in range(6) for dx, ha in ((3.0, "left"), (-3.0, "right"))], top, renderer, taken)
    _spread(oom_labels, [((dx, -12.0 - 13.0 * row), ha) for row in range(5) for dx, ha in ((8.0, "left"), (-8.0, "right"))], top, renderer, taken)


def _save(fig: Any, out: Path) -> None:
    """The PNG at `out`, written whole or not at all (a temporary file renamed into place)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(temporary, format="png", dpi=DPI)
        temporary.replace(out)
    finally:
        temporary.unlink(missing_ok=True)


def _spread(labels: list[Any], candidates: list[tuple[tuple[float, float], str]], ax: Any, renderer: Any, taken: list[Any]) -> None:
    """Give each annotation the first (offset, alignment) that keeps it inside `ax` and off
    the labels placed before it (`taken`, which it joins); the first one inside when none is free."""
    frame = ax.get_window_extent(renderer)
    for label in labels:
        fallback = None
        for offset, ha in candidates:
            label.set_position(offset)
            label.set_horizontalalignment(ha)
            box = label.get_window_extent(renderer).padded(3)
            if box.x0 < frame.x0 or box.x1 > frame.x1:
                continue
            fallback = fallback or (offset, ha)
            if not any(box.overlaps(other) for other in taken):
                break
        else:
            offset, ha = fallback or candidates[0]
            label.set_position(offset)
            label.set_horizontalalignment(ha)
        taken.append(label.get_window_extent(renderer).padded(3))
