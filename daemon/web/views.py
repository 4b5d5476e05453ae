"""What each dashboard page shows, as plain values, read for one viewer: the queue (status's
rows, daemon/queue_rows.py, paged like `status --page` so 10,000 jobs cost what 50 do), the GPUs
(as `oomguard gpus` shows them), and one job (its record as `show --json` has it, with the
charts of `oomguard report`'s data: memory against the cap and the loss over time, the OOMs,
rungs and attempts marked)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oomguard.daemon.cli.state import FilesOf, heartbeat_of, job_record, jobs_on_gpus
from oomguard.daemon.queue_rows import QueueRow, jobs_listed, page_count, queue_row
from oomguard.daemon.report import MetricsReader, load_report
from oomguard.daemon.report_data import ReportData
from oomguard.daemon.store import Store
from oomguard.daemon import processes
from oomguard.daemon.attempts import files_of, owner_uid
from oomguard.daemon.store_rows import AttemptRow, GpuSampleRow, JobRow
from oomguard.daemon.web.svg_chart import Line, Mark, chart_svg
from oomguard.daemon.web.viewer import Viewer
from oomguard.strategies.errors import ReportError
from oomguard.strategies.units import format_bytes


@dataclass(frozen=True)
class QueueEntry:
    row: QueueRow
    readable: bool  # the viewer may open its page (and sees its progress)


@dataclass(frozen=True)
class QueuePage:
    entries: tuple[QueueEntry, ...]
    counts: dict[str, int]
    page: int | None  # None: at a glance (running, the head of the queue, the last ended)
    pages: int
    total: int


@dataclass(frozen=True)
class GpuEntry:
    sample: GpuSampleRow
    jobs: tuple[str, ...]  # "3 alice-a (alice)" for each oomguard job on it
    whose: dict[int, str]  # pid -> the oomguard job it is a process of ("3 alice-a"); others are neighbours


@dataclass(frozen=True)
class RungEntry:
    number: int  # as marked on the charts
    at: float
    text: str
    reason: str


@dataclass(frozen=True)
class JobPage:
    record: dict[str, Any]
    row: QueueRow
    memory_svg: str | None
    loss_svg: str | None
    rungs: tuple[RungEntry, ...]
    chart_note: str | None  # why there are no charts (no attempt yet)


def queue_page(store: Store, viewer: Viewer, page: int | None) -> QueuePage:
    counts = store.job_counts()
    total = sum(counts.values())
    pages = page_count(total)
    jobs = jobs_listed(store, page)
    newest = store.newest_attempts([job.id for job in jobs])
    entries = []
    for job in jobs:
        readable = viewer.may_read(job)
        found = newest.get(job.id)
        attempt = found.attempt if found else None
        # The server (root) reads a job's files as its owner's, never through a link the owner
        # planted, and shows their progress only to who may read them.
        heartbeat = heartbeat_of(attempt, owned(store)) if readable else None
        entries.append(QueueEntry(queue_row(job, attempt, found.count if found else 0, heartbeat), readable))
    return QueuePage(tuple(entries), counts, page, pages, total)


def gpu_page(store: Store) -> tuple[GpuEntry, ...]:
    attempts = store.running_attempts()
    jobs_on, whose = jobs_on_gpus(store, attempts), _job_processes(store, attempts)
    return tuple(GpuEntry(sample, tuple(jobs_on.get(sample.gpu, ())), whose) for sample in store.latest_gpu_samples())


def _job_processes(store: Store, attempts: list[AttemptRow]) -> dict[int, str]:
    """pid -> the job whose running attempt it belongs to: below the attempt's shim, or carrying
    its mark as its owner (anyone may put the mark in their own process; that does not make it
    the job's)."""
    found: dict[int, str] = {}
    for attempt in attempts:
        job = store.job(attempt.job_id)
        pids = processes.marked_with(attempt.directory, owner_uid(job))
        if attempt.pid is not None:
            pids |= processes.descendants(attempt.pid)
        found.update(dict.fromkeys(pids, f"job {job.id} {job.name}"))
    return found


def job_page(store: Store, job: JobRow, read_metrics: MetricsReader) -> JobPage:
    """Only for a viewer who may read the job (the caller checks)."""
    record = job_record(store, job, owned(store))
    found = store.newest_attempts([job.id]).get(job.id)
    row = queue_row(job, found.attempt if found else None, found.count if found else 0, record["heartbeat"])
    try:
        report = load_report(job, store.attempts(job.id), store.events(job.id), owned(store), read_metrics)
    except ReportError as error:
        return JobPage(record, row, None, None, (), str(error))
    rungs = tuple(RungEntry(i, rung.time, rung.label, rung.reason) for i, rung in enumerate(report.rungs, start=1))
    marks = _marks(report, rungs)
    memory = chart_svg("device memory held against the cap", _memory_lines(report), marks, format_bytes)
    loss = chart_svg("loss", _loss_lines(report), marks, _loss_text, y_from_zero=False)
    return JobPage(record, row, memory, loss, rungs, None)


def owned(store: Store) -> FilesOf:
    """An attempt's folder opened as its owner's (daemon/attempts.py files_of)."""
    return lambda attempt: files_of(store, attempt)


def _memory_lines(report: ReportData) -> list[Line]:
    lines = []
    for attempt in report.attempts:
        held = tuple((p.time - report.origin, float(p.held_bytes)) for p in attempt.points if p.held_bytes is not None)
        cap = tuple((p.time - report.origin, float(p.capacity_bytes)) for p in attempt.points if p.capacity_bytes is not None)
        lines.append(Line(f"attempt {attempt.number}: held", held, "held"))
        lines.append(Line(f"attempt {attempt.number}: cap", cap, "cap", steps=True))
    return lines


def _loss_lines(report: ReportData) -> list[Line]:
    return [
        Line(f"attempt {a.number}: loss", tuple((p.time - report.origin, p.loss) for p in a.points if p.loss is not None), "loss", "mean")
        for a in report.attempts
    ]


def _marks(report: ReportData, rungs: tuple[RungEntry, ...]) -> list[Mark]:
    marks = [Mark(a.started_at - report.origin, f"attempt {a.number} started [{a.plan}]", "attempt") for a in report.attempts]
    marks += [Mark(o.time - report.origin, o.label, "oom") for o in report.ooms]
    marks += [Mark(r.at - report.origin, r.text, "rung", r.number) for r in rungs]
    return marks


def _loss_text(value: float) -> str:
    return f"{value:.3g}"
