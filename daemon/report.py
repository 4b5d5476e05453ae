"""The picture behind `oomguard report JOB`: device memory over time per attempt against the
cap, with the OOMs and the rungs taken marked, and the samples/s each plan reached.

Two halves: `load_report` (here) turns the store's rows (job, attempts, events) and the attempt
directories (metrics.jsonl, outcome.json, heartbeat.json) into a `ReportData` of plain frozen
values (report_data.py), and `draw_report` (report_plot.py) draws that with matplotlib
(imported there, Agg backend, so the CLI starts fast and needs no display). Whatever is missing
or half written (a running attempt, one that died before its first step, a truncated last
metrics line) is drawn as far as it goes and named in the figure.

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

import json
import math
import re
import statistics
from pathlib import Path
from collections.abc import Callable
from typing import Any

from oomguard.daemon.store_rows import AttemptRow, EventRow, JobRow
from oomguard.daemon.owner_numbers import owner_float, owner_int
from oomguard.daemon.report_data import AttemptSeries, OomKind, OomMarker, PlanRate, ReportData, RungMarker, StepPoint
from oomguard.daemon.text import shorten
from oomguard.jobs.attempt import HEARTBEAT, METRICS, OUTCOME, AttemptFiles
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.units import format_bytes
from oomguard.strategies.errors import ReportError
from oomguard.strategies.step_up_history import BACK, UP

# An attempt's metrics.jsonl as its steps and the count of lines that did not parse.
MetricsReader = Callable[[AttemptFiles], tuple[list[StepPoint], int]]


def load_report(
    job: JobRow, attempts: list[AttemptRow], events: list[EventRow],
    files_of: Callable[[AttemptRow], AttemptFiles] | None = None, read_metrics: MetricsReader | None = None,
) -> ReportData:
    """What the figure draws, from Store.job(), Store.attempts() and Store.events() rows.
    ``files_of``: how an attempt's folder is opened (as named, by default: the CLI reads as its
    user; the dashboard, as root, opens it as its owner's without following a link).
    ``read_metrics``: how its metrics.jsonl is read (every line, by default; the dashboard's
    reader keeps what it read and thins a long run)."""
    if not attempts:
        raise ReportError(
            f"job {job.id} ({job.name}) has no attempts yet (it is {job.state}): nothing to draw. "
            f"Run `oomguard report {job.id}` again once its first attempt has started; "
            "`oomguard status` shows where it is."
        )
    rows = sorted(attempts, key=lambda a: a.number)
    series: list[AttemptSeries] = []
    ooms: list[OomMarker] = []
    rungs: list[RungMarker] = []
    recovered: dict[int, int] = {}  # attempt number -> runner recoveries found in its files
    for row in rows:
        with (files_of or _as_named)(row) as files:
            attempt, outcome, recoveries = _load_attempt(row, files, read_metrics or read_metrics_file)
        series.append(attempt)
        ooms.extend(_oom_markers(attempt, outcome, recoveries))
        rungs.extend(_runner_rungs(attempt, recoveries))
        recovered[attempt.number] = len(recoveries)
    rungs.extend(_event_rungs(series, events, recovered))
    rungs.sort(key=lambda r: r.time)
    ooms.sort(key=lambda o: o.time)
    origin = min([a.started_at for a in series] + [a.points[0].time for a in series if a.points])
    return ReportData(
        job_id=job.id,
        name=job.name,
        owner=job.owner or "?",
        state=job.state or "?",
        result=job.result,
        origin=origin,
        attempts=tuple(series),
        ooms=tuple(ooms),
        rungs=tuple(rungs),
        rates=_rates(series),
    )


def _as_named(row: AttemptRow) -> AttemptFiles:
    return AttemptFiles(Path(row.directory))


def _load_attempt(
    row: AttemptRow, files: AttemptFiles, read_metrics: MetricsReader,
) -> tuple[AttemptSeries, dict[str, Any] | None, list[dict[str, Any]]]:
    directory = Path(row.directory)
    points, skipped = read_metrics(files)
    outcome = _dict_or_none(row.outcome_dict()) or _dict_or_none(files.read_json(OUTCOME))
    heartbeat = _dict_or_none(files.read_json(HEARTBEAT)) or {}
    recoveries = (outcome or {}).get("recoveries") or heartbeat.get("recoveries") or []
    recoveries = [r for r in recoveries if isinstance(r, dict)]
    kind = row.outcome_kind or (outcome or {}).get("kind")
    started = float(row.started_at)
    ended = row.ended_at
    if ended is not None:
        end = float(ended)
    else:
        # Not collected by the daemon (yet): its last sign of life.
        alive = [started] + [p.time for p in points[-1:]]
        written = files.mtime(OUTCOME)
        if outcome is not None and written is not None:
            alive.append(written)
        end = max(alive)
    note = None
    if not points:
        if files.problem is not None or not directory.is_dir():
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
        number=row.number,
        plan=_plan_text(row.plan_json),
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


def read_metrics_file(files: AttemptFiles) -> tuple[list[StepPoint], int]:
    """The steps of the attempt's metrics.jsonl; lines that do not parse (a truncated last
    line of a running or killed attempt) are counted and skipped."""
    try:
        with files.open(METRICS) as handle:
            text = handle.read().decode(errors="replace")
    except OSError:
        return [], 0
    points: list[StepPoint] = []
    skipped = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        point = step_point(line)
        if point is None:
            skipped += 1
        else:
            points.append(point)
    points.sort(key=lambda p: p.time)
    return points, skipped


def step_point(line: str | bytes) -> StepPoint | None:
    """One metrics.jsonl line as a StepPoint; None for one that does not parse (the job's
    owner writes the file: anything)."""
    try:
        record = json.loads(line)
        return StepPoint(
            step=int(record["step"]),
            time=float(record["time"]),
            plan=str(record.get("plan") or "?"),
            peak_bytes=owner_int(record.get("peak_bytes")),
            capacity_bytes=owner_int(record.get("capacity_bytes")),
            samples_per_s=owner_float(record.get("samples_per_s")),
            reserved_bytes=owner_int(record.get("reserved_bytes")),
            loss=owner_float(record.get("loss")),
        )
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError):  # OverflowError: a 400-digit time
        return None


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
    # The records of an OOM the runner lived through (a step up's is none; its failure's is).
    in_process = [r for r in recoveries if not str(r.get("reason", "")).startswith("probe") and r.get("direction") != UP]
    if failed:
        probe_count = max(0, len(failed) - len(in_process))
        for index, measurement in enumerate(failed):
            step = owner_int(measurement.get("step")) or 0
            kind: OomKind = "probe" if index < probe_count else "in-process"
            time = attempt.started_at if kind == "probe" else _time_of_step(attempt, step)
            cap = owner_int(measurement.get("capacity")) or _cap_at(attempt, time)
            wanted = owner_int(measurement.get("peak_bytes"))
            plan = _plan_text(measurement.get("plan"))
            label = f"{kind} OOM @{step} [{plan}]" + (f" wanted {format_bytes(wanted)}" if wanted else "")
            markers.append(OomMarker(attempt.number, time, cap, step, kind, label))
    else:
        # No measurements (a runner that did not write them): each in-process rung was an OOM.
        for recovery in in_process:
            step = owner_int(recovery.get("step")) or 0
            time = _time_of_step(attempt, step)
            markers.append(OomMarker(attempt.number, time, _cap_at(attempt, time), step, "in-process", f"in-process OOM @{step}"))
    if attempt.outcome_kind == "oom":
        step = outcome.get("step")
        step = int(step) if isinstance(step, int) else (attempt.points[-1].step if attempt.points else 0)
        cap = _cap_at(attempt, attempt.end) or owner_int(memory.get("total"))
        if cap is None and owner_int(memory.get("allocated")) is not None:
            cap = int(memory["allocated"]) + (owner_int(memory.get("requested")) or 0)
        phase = outcome.get("phase")
        label = f"OOM @{step}" + (f" {phase}" if phase else "")
        if owner_int(memory.get("requested")):
            label += f", +{format_bytes(int(memory['requested']))}"
        markers.append(OomMarker(attempt.number, attempt.end, cap, step, "ended", label))
    return markers


def _runner_rungs(attempt: AttemptSeries, recoveries: list[dict[str, Any]]) -> list[RungMarker]:
    markers = []
    for recovery in recoveries:
        step = owner_int(recovery.get("step")) or 0
        probe = str(recovery.get("reason", "")).startswith("probe")
        time = attempt.started_at if probe else _time_of_step(attempt, step)
        bucket = recovery.get("bucket")
        if isinstance(bucket, list) and len(bucket) == 2:
            # One aspect-ratio bucket's slices shrank; the plan stayed (numbers only: the job's file).
            width, height, micro = owner_int(bucket[0]), owner_int(bucket[1]), owner_int(recovery.get("bucket_micro_batch"))
            markers.append(RungMarker(time, attempt.number, "runner", f"bucket {width}x{height}: micro-batch {micro}", _why(recovery)))
            continue
        to = _plan_text(recovery.get("to"))
        # A step back up (jobs/step_ups.py) and its failure read as what they are on the plot.
        how = "probe" if probe else {UP: "stepped up", BACK: "step up failed"}.get(str(recovery.get("direction")), "in-process")
        markers.append(RungMarker(time, attempt.number, "runner", f"{how} -> [{to}]", _why(recovery)))
    return markers


def _why(recovery: dict[str, Any]) -> str:
    """A runner's change of plan in words: the OOM it answered (when one did), then the reason."""
    return ": ".join(str(recovery[key]) for key in ("oom", "reason") if isinstance(recovery.get(key), str) and recovery[key])


RUNNER_EVENT = re.compile(r"in the runner: \[(?P<old>[^\]]*)\] -> \[(?P<new>[^\]]*)\]")


def _event_rungs(series: list[AttemptSeries], events: list[EventRow], recovered: dict[int, int]) -> list[RungMarker]:
    """Rungs from the escalated events: by their code and figures, or (an event recorded before
    events had codes) by their message."""
    markers: list[RungMarker] = []
    runner_events: dict[int | None, list[EventRow]] = {}
    for event in events:
        if event.kind != "escalated" or event.at is None:
            continue
        at = float(event.at)
        message = str(event.message or "")
        before = [a for a in series if a.started_at <= at]
        attempt = before[-1].number if before else None
        if event.code == "in_runner" or (event.code is None and "in the runner" in message):
            runner_events.setdefault(attempt, []).append(event)
            continue
        # "rung micro_batch: <reason>": name the rung and the plan the next attempt ran.
        if isinstance(event.data.get("rung"), str):
            rung = f"rung {event.data['rung']}"
        else:
            rung = message.split(":", 1)[0].strip() if message.startswith("rung ") else message
        after = [a for a in series if a.started_at >= at]
        label = shorten(rung, 28) + (f" -> [{after[0].plan}]" if after else "")
        markers.append(RungMarker(at, attempt, "daemon", label, message))
    # The runner's recoveries reach the store as events too; draw only those no file holds.
    for attempt, found in runner_events.items():
        for event in found[recovered.get(attempt, 0) if attempt is not None else 0 :]:
            match = RUNNER_EVENT.search(str(event.message or ""))
            if isinstance(event.data.get("to"), str):
                label = f"in-process -> [{event.data['to']}]"
            else:
                label = f"in-process -> [{match['new']}]" if match else shorten(str(event.message or "rung"), 40)
            markers.append(RungMarker(float(event.at), attempt, "runner", label, str(event.message or "")))
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


def _dict_or_none(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None
