"""The picture behind `oomguard report JOB`: device memory over time per attempt against the
cap, with the OOMs and the rungs taken marked, and the samples/s each plan reached.

Two halves: `load_report` turns the store's rows (job, attempts, events) and the attempt
directories (metrics.jsonl, outcome.json, heartbeat.json) into a `ReportData` of plain frozen
values, and `draw_report` draws that with matplotlib (imported there, Agg backend, so the CLI
starts fast and needs no display). Whatever is missing or half written (a running attempt, one
that died before its first step, a truncated last metrics line) is drawn as far as it goes
and named in the figure.

Where the marks go:
- an attempt that ended with an OOM: a red X at its end time, at the cap it ran against;
- OOMs the runner survived (in the probe, or recovered in the process): from the outcome's
  failed measurements, a red X at the time of the last metrics step the attempt had completed
  when it ran out (a probe's at the attempt's start);
- rungs: the daemon's "escalated" events at their time, and the runner's own recoveries
  (outcome.json, or heartbeat.json while it runs) at the time of their step, each once (the
  daemon also reports a runner's recoveries as "escalated ... in the runner" events; those
  are used only for recoveries no file holds).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from oomguard.daemon.text import escape, shorten
from oomguard.jobs.attempt import HEARTBEAT, METRICS, OUTCOME, read_json
from oomguard.strategies.outcome import Outcome, format_bytes
from oomguard.strategies.plan import Plan

# The figure's size: 14 x 9 inches at 100 dpi.
WIDTH_PX, HEIGHT_PX, DPI = 1400, 900, 100

OomKind = Literal["ended", "in-process", "probe"]
RungSource = Literal["daemon", "runner"]


class ReportError(Exception):
    """Nothing to draw (e.g. the job has no attempts yet)."""


@dataclass(frozen=True)
class StepPoint:
    """One line of metrics.jsonl: an optimizer step completed."""

    step: int
    time: float
    plan: str
    peak_bytes: int | None = None
    capacity_bytes: int | None = None
    samples_per_s: float | None = None


@dataclass(frozen=True)
class AttemptSeries:
    number: int
    plan: str  # the plan it started under (Plan.short())
    started_at: float
    ended_at: float | None  # None: still running (or not collected yet)
    end: float  # where its span ends in the figure: ended_at, else its last sign of life
    outcome_kind: str | None
    points: tuple[StepPoint, ...] = ()
    skipped_lines: int = 0  # metrics lines that could not be read (a truncated last line)
    note: str | None = None  # why there is nothing (or little) to draw for it
    error: str | None = None  # what a failed attempt died of (a crash: its exception line)

    @property
    def plans(self) -> tuple[str, ...]:
        """The plans it ran, in order (a probe or an in-process rung may change it)."""
        seen: list[str] = []
        for point in self.points:
            if not seen or seen[-1] != point.plan:
                seen.append(point.plan)
        return tuple(seen) or (self.plan,)

    @property
    def label(self) -> str:
        text = f"attempt {self.number} [{' -> '.join(self.plans)}]"
        if self.outcome_kind:
            text += f" {self.outcome_kind}"
        elif self.ended_at is None:
            text += " running"
        return text


@dataclass(frozen=True)
class OomMarker:
    attempt: int
    time: float
    bytes: int | None  # where on the memory axis: the cap it ran against, when known
    step: int
    kind: OomKind
    label: str


@dataclass(frozen=True)
class RungMarker:
    time: float
    attempt: int | None  # the attempt it happened in (runner) or after (daemon)
    source: RungSource
    label: str


@dataclass(frozen=True)
class PlanRate:
    plan: str
    median_samples_per_s: float
    steps: int
    attempts: tuple[int, ...]
    samples_per_s: tuple[float, ...] = ()  # every step's, in order


@dataclass(frozen=True)
class ReportData:
    job_id: int
    name: str
    owner: str
    state: str
    result: str | None
    origin: float  # time zero of the figure: when the first attempt started
    attempts: tuple[AttemptSeries, ...]
    ooms: tuple[OomMarker, ...]
    rungs: tuple[RungMarker, ...]
    rates: tuple[PlanRate, ...]

    @property
    def title(self) -> str:
        return f"job {self.job_id} '{self.name}'  ·  {self.owner}  ·  {self.state}"

    @property
    def notes(self) -> tuple[str, ...]:
        notes = []
        for a in self.attempts:
            notes += [f"attempt {a.number}: {a.note}"] if a.note else []
            notes += [f"attempt {a.number} {a.outcome_kind}: {a.error}"] if a.error else []
        return tuple(notes)


# Loading ------------------------------------------------------------------------------------


def load_report(job: dict[str, Any], attempts: list[dict[str, Any]], events: list[dict[str, Any]]) -> ReportData:
    """What the figure draws, from Store.job(), Store.attempts() and Store.events() rows."""
    if not attempts:
        raise ReportError(
            f"job {job['id']} ({job['name']}) has no attempts yet (it is {job['state']}): nothing to draw. "
            f"Run `oomguard report {job['id']}` again once its first attempt has started; "
            "`oomguard status` shows where it is."
        )
    rows = sorted(attempts, key=lambda a: a["number"])
    series: list[AttemptSeries] = []
    ooms: list[OomMarker] = []
    rungs: list[RungMarker] = []
    recovered: dict[int, int] = {}  # attempt number -> runner recoveries found in its files
    for row in rows:
        attempt, outcome, recoveries = _load_attempt(row)
        series.append(attempt)
        ooms.extend(_oom_markers(attempt, outcome, recoveries))
        rungs.extend(_runner_rungs(attempt, recoveries))
        recovered[attempt.number] = len(recoveries)
    rungs.extend(_event_rungs(series, events, recovered))
    rungs.sort(key=lambda r: r.time)
    ooms.sort(key=lambda o: o.time)
    origin = min([a.started_at for a in series] + [a.points[0].time for a in series if a.points])
    return ReportData(
        job_id=int(job["id"]),
        name=str(job["name"]),
        owner=str(job.get("owner") or "?"),
        state=str(job.get("state") or "?"),
        result=job.get("result"),
        origin=origin,
        attempts=tuple(series),
        ooms=tuple(ooms),
        rungs=tuple(rungs),
        rates=_rates(series),
    )


def _load_attempt(row: dict[str, Any]) -> tuple[AttemptSeries, dict[str, Any] | None, list[dict[str, Any]]]:
    directory = Path(row["directory"])
    points, skipped = _read_metrics(directory / METRICS)
    outcome = _json_object(row.get("outcome")) or _dict_or_none(read_json(directory / OUTCOME))
    heartbeat = _dict_or_none(read_json(directory / HEARTBEAT)) or {}
    recoveries = (outcome or {}).get("recoveries") or heartbeat.get("recoveries") or []
    recoveries = [r for r in recoveries if isinstance(r, dict)]
    kind = row.get("outcome_kind") or (outcome or {}).get("kind")
    started = float(row["started_at"])
    ended = row.get("ended_at")
    if ended is not None:
        end = float(ended)
    else:
        # Not collected by the daemon (yet): its last sign of life.
        alive = [started] + [p.time for p in points[-1:]]
        outcome_file = directory / OUTCOME
        if outcome is not None and outcome_file.exists():
            alive.append(outcome_file.stat().st_mtime)
        end = max(alive)
    note = None
    if not points:
        if not directory.is_dir():
            note = f"no metrics: its directory {directory} is gone"
        elif kind:
            step = (outcome or {}).get("step")
            at = f" (step {step})" if step is not None else ""
            note = f"no metrics: it ended ({kind}{at}) before its first step"
        elif ended is not None:
            note = "no metrics: it ended before its first step"
        else:
            note = "no metrics yet: it has not finished a step"
    elif all(p.peak_bytes is None for p in points):
        note = "no memory figures in its metrics (no GPU and no emulated cap?)"
    if skipped:
        what = f"{skipped} unreadable metrics line{'s' if skipped > 1 else ''} skipped"
        note = f"{note}; {what}" if note else what
    attempt = AttemptSeries(
        error=_error_of(kind, outcome),
        number=int(row["number"]),
        plan=_plan_text(row.get("plan")),
        started_at=started,
        ended_at=float(ended) if ended is not None else None,
        end=end,
        outcome_kind=kind,
        points=tuple(points),
        skipped_lines=skipped,
        note=note,
    )
    return attempt, outcome, recoveries


def _error_of(kind: str | None, outcome: dict[str, Any] | None) -> str | None:
    """What an attempt that failed (not of device memory, which the OOM marks show) died of."""
    if kind not in ("crashed", "host_oom", "diverged") or not outcome:
        return None
    try:
        return shorten(Outcome.from_dict(outcome).summary, 160) or None
    except (TypeError, ValueError, AttributeError):  # an outcome of the wrong shape: nothing to quote
        return None


def _read_metrics(path: Path) -> tuple[list[StepPoint], int]:
    """The steps of metrics.jsonl; lines that do not parse (a truncated last line of a
    running or killed attempt) are counted and skipped."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return [], 0
    points: list[StepPoint] = []
    skipped = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            point = StepPoint(
                step=int(record["step"]),
                time=float(record["time"]),
                plan=str(record.get("plan") or "?"),
                peak_bytes=_int_or_none(record.get("peak_bytes")),
                capacity_bytes=_int_or_none(record.get("capacity_bytes")),
                samples_per_s=_float_or_none(record.get("samples_per_s")),
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            skipped += 1
            continue
        points.append(point)
    points.sort(key=lambda p: p.time)
    return points, skipped


def _time_of_step(attempt: AttemptSeries, step: int) -> float:
    """When the attempt was at `step` (steps completed): the time of the last metrics line
    at or before it, else the attempt's start (a probe, or a failure in its first step)."""
    before = [p.time for p in attempt.points if p.step <= step]
    return max(before) if before else attempt.started_at


def _cap_at(attempt: AttemptSeries, time: float) -> int | None:
    caps = [p.capacity_bytes for p in attempt.points if p.capacity_bytes is not None and p.time <= time]
    if caps:
        return caps[-1]
    later = [p.capacity_bytes for p in attempt.points if p.capacity_bytes is not None]
    return later[0] if later else None


def _oom_markers(attempt: AttemptSeries, outcome: dict[str, Any] | None, recoveries: list[dict[str, Any]]) -> list[OomMarker]:
    markers: list[OomMarker] = []
    outcome = outcome or {}
    memory = outcome.get("memory") if isinstance(outcome.get("memory"), dict) else {}
    # OOMs the runner lived through: its failed measurements, in order (probe first, then
    # in-process ones; the last one is the attempt's own end when it ended out of memory).
    failed = [m for m in outcome.get("measurements") or [] if isinstance(m, dict) and not m.get("fits", True)]
    if attempt.outcome_kind == "oom" and failed:
        failed = failed[:-1]
    in_process = [r for r in recoveries if not str(r.get("reason", "")).startswith("probe")]
    if failed:
        probe_count = max(0, len(failed) - len(in_process))
        for index, measurement in enumerate(failed):
            step = _int_or_none(measurement.get("step")) or 0
            kind: OomKind = "probe" if index < probe_count else "in-process"
            time = attempt.started_at if kind == "probe" else _time_of_step(attempt, step)
            cap = _int_or_none(measurement.get("capacity")) or _cap_at(attempt, time)
            wanted = _int_or_none(measurement.get("peak_bytes"))
            plan = _plan_text(measurement.get("plan"))
            label = f"{kind} OOM @{step} [{plan}]" + (f" wanted {format_bytes(wanted)}" if wanted else "")
            markers.append(OomMarker(attempt.number, time, cap, step, kind, label))
    else:
        # No measurements (a runner that did not write them): each in-process rung was an OOM.
        for recovery in in_process:
            step = _int_or_none(recovery.get("step")) or 0
            time = _time_of_step(attempt, step)
            markers.append(OomMarker(attempt.number, time, _cap_at(attempt, time), step, "in-process", f"in-process OOM @{step}"))
    if attempt.outcome_kind == "oom":
        step = outcome.get("step")
        step = int(step) if isinstance(step, int) else (attempt.points[-1].step if attempt.points else 0)
        cap = _cap_at(attempt, attempt.end) or _int_or_none(memory.get("total"))
        if cap is None and _int_or_none(memory.get("allocated")) is not None:
            cap = int(memory["allocated"]) + (_int_or_none(memory.get("requested")) or 0)
        phase = outcome.get("phase")
        label = f"OOM @{step}" + (f" {phase}" if phase else "")
        if _int_or_none(memory.get("requested")):
            label += f", +{format_bytes(int(memory['requested']))}"
        markers.append(OomMarker(attempt.number, attempt.end, cap, step, "ended", label))
    return markers


def _runner_rungs(attempt: AttemptSeries, recoveries: list[dict[str, Any]]) -> list[RungMarker]:
    markers = []
    for recovery in recoveries:
        step = _int_or_none(recovery.get("step")) or 0
        probe = str(recovery.get("reason", "")).startswith("probe")
        time = attempt.started_at if probe else _time_of_step(attempt, step)
        to = _plan_text(recovery.get("to"))
        markers.append(RungMarker(time, attempt.number, "runner", f"{'probe' if probe else 'in-process'} -> [{to}]"))
    return markers


RUNNER_EVENT = re.compile(r"in the runner: \[(?P<old>[^\]]*)\] -> \[(?P<new>[^\]]*)\]")


def _event_rungs(series: list[AttemptSeries], events: list[dict[str, Any]], recovered: dict[int, int]) -> list[RungMarker]:
    markers: list[RungMarker] = []
    runner_events: dict[int | None, list[dict[str, Any]]] = {}
    for event in events:
        if event.get("kind") != "escalated" or event.get("at") is None:
            continue
        at = float(event["at"])
        message = str(event.get("message") or "")
        before = [a for a in series if a.started_at <= at]
        attempt = before[-1].number if before else None
        if "in the runner" in message:
            runner_events.setdefault(attempt, []).append(event)
            continue
        # "rung micro_batch: <reason>": name the rung and the plan the next attempt ran.
        rung = message.split(":", 1)[0].strip() if message.startswith("rung ") else message
        after = [a for a in series if a.started_at >= at]
        label = shorten(rung, 28) + (f" -> [{after[0].plan}]" if after else "")
        markers.append(RungMarker(at, attempt, "daemon", label))
    # The runner's recoveries reach the store as events too; draw only those no file holds.
    for attempt, found in runner_events.items():
        for event in found[recovered.get(attempt, 0) if attempt is not None else 0 :]:
            match = RUNNER_EVENT.search(str(event.get("message") or ""))
            label = f"in-process -> [{match['new']}]" if match else shorten(str(event.get("message") or "rung"), 40)
            markers.append(RungMarker(float(event["at"]), attempt, "runner", label))
    return markers


def _rates(series: list[AttemptSeries]) -> tuple[PlanRate, ...]:
    """Median samples/s per plan, over every step run under it, in the order plans first ran."""
    by_plan: dict[str, tuple[list[float], list[int]]] = {}
    for attempt in series:
        for point in attempt.points:
            if point.samples_per_s is None or not math.isfinite(point.samples_per_s):
                continue
            rates, numbers = by_plan.setdefault(point.plan, ([], []))
            rates.append(point.samples_per_s)
            if attempt.number not in numbers:
                numbers.append(attempt.number)
    return tuple(PlanRate(plan, statistics.median(rates), len(rates), tuple(numbers), tuple(rates)) for plan, (rates, numbers) in by_plan.items())


def _plan_text(value: Any) -> str:
    """Plan.short() of a plan given as a dict or its JSON text; '?' when it cannot be read."""
    try:
        data = json.loads(value) if isinstance(value, str) else value
        return Plan.from_dict(data).short()
    except (TypeError, ValueError, AttributeError):
        return "?"


def _json_object(text: Any) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        return _dict_or_none(json.loads(text))
    except (TypeError, ValueError):
        return None


def _dict_or_none(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


def _float_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# Drawing ------------------------------------------------------------------------------------


def _time_unit(span_s: float) -> tuple[str, float]:
    if span_s < 180:
        return "s", 1.0
    if span_s < 3 * 3600:
        return "min", 60.0
    if span_s < 3 * 86400:
        return "h", 3600.0
    return "days", 86400.0


def _memory_unit(largest: float) -> tuple[str, float]:
    if largest >= 2**30:
        return "GiB", float(2**30)
    if largest >= 2**20:
        return "MiB", float(2**20)
    return "KiB", float(2**10)


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
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.text import Text
    from matplotlib.transforms import blended_transform_factory

    out = Path(out)
    ends = [a.end for a in data.attempts] + [p.time for a in data.attempts for p in a.points]
    ends += [o.time for o in data.ooms] + [r.time for r in data.rungs]
    span = max(ends) - data.origin if ends else 0.0
    time_name, time_div = _time_unit(span)

    def x(t: float) -> float:
        return (t - data.origin) / time_div

    values = [v for a in data.attempts for p in a.points for v in (p.peak_bytes, p.capacity_bytes) if v is not None]
    values += [o.bytes for o in data.ooms if o.bytes is not None]
    mem_name, mem_div = _memory_unit(max(values) if values else 0)

    fig = Figure(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, gridspec_kw={"height_ratios": [3, 1.4]})
    fig.suptitle(data.title, fontsize=14, fontweight="bold")
    if data.result:
        top.set_title(shorten(data.result, 160), fontsize=9, color="dimgray")
    colors = [f"C{i}" for i in range(10)]
    band = blended_transform_factory(top.transData, top.transAxes)
    handles: list[Any] = []

    # Memory per attempt, its span, and the cap it ran against.
    cap_drawn = False
    for index, attempt in enumerate(data.attempts):
        color = colors[index % len(colors)]
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

    top.set_ylim(bottom=0, top=(max(values) / mem_div * 1.4) if values else 1.0)
    right = x(max(ends)) * 1.02 if ends and x(max(ends)) > 0 else 1.0
    top.set_xlim(0.0, right)

    # Rungs: dashed verticals, labelled in the headroom above the cap (rows are chosen once the
    # layout is known, so that labels do not cover each other).
    rung_labels = []
    for rung in data.rungs:
        style = {"color": "dimgray", "ls": "--", "lw": 1.1} if rung.source == "daemon" else {"color": "slategray", "ls": ":", "lw": 1.4}
        where = x(rung.time)
        top.axvline(where, **style, zorder=1)
        rung_labels.append(top.annotate(
            rung.label, (where, 0.985), xycoords=band, xytext=(3, 0), textcoords="offset points", ha="left", va="top", fontsize=8,
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": style["color"], "lw": 0.6, "alpha": 0.85}, zorder=6,
        ))
    if any(r.source == "daemon" for r in data.rungs):
        handles.append(Line2D([], [], color="dimgray", ls="--", lw=1.1, label="rung taken by the daemon (new attempt)"))
    if any(r.source == "runner" for r in data.rungs):
        handles.append(Line2D([], [], color="slategray", ls=":", lw=1.4, label="rung taken inside the runner (probe, in-process)"))

    # OOMs: red X at the cap; labels of marks at the same moment are joined.
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

    top.set_ylabel(f"peak memory per step ({mem_name})")
    started = dt.datetime.fromtimestamp(data.origin).strftime("%Y-%m-%d %H:%M:%S")
    top.set_xlabel(f"time since the first attempt started ({time_name}); 0 = {started}")
    top.grid(True, alpha=0.3)
    top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8.5, frameon=False)
    if data.notes:
        top.text(0.005, 0.015, "\n".join(data.notes), transform=top.transAxes, ha="left", va="bottom", fontsize=8.5,
                 color="black", bbox={"boxstyle": "round,pad=0.3", "fc": "lightyellow", "ec": "goldenrod", "alpha": 0.9}, zorder=9)

    # Samples/s per plan.
    if data.rates:
        first_attempt = {a.number: colors[i % len(colors)] for i, a in enumerate(data.attempts)}
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

    # Every text of the figure (titles, labels, the legend), escaped but for its own lines.
    for text in fig.findobj(Text):
        text.set_text(escape(text.get_text(), keep="\n"))

    # Labels into rows where they neither cover one another nor leave the panel.
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    taken: list[Any] = []
    _spread(rung_labels, [((dx, -15.0 * row), ha) for row in range(6) for dx, ha in ((3.0, "left"), (-3.0, "right"))], top, renderer, taken)
    _spread(oom_labels, [((dx, -12.0 - 13.0 * row), ha) for row in range(5) for dx, ha in ((8.0, "left"), (-8.0, "right"))], top, renderer, taken)

    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(temporary, format="png", dpi=DPI)
        temporary.replace(out)
    finally:
        temporary.unlink(missing_ok=True)
    return out


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
