"""The steps of each attempt's metrics.jsonl for the dashboard, read from where the last read
stopped and thinned as they grow: a job page refreshed every 3 s must not parse a three-week
run's millions of lines each time, nor keep them all.

Past KEEP points a file's points are halved by merging neighbours (the later time and plan,
the higher memory, the mean loss and speed), over and over: a chart draws at most 600 anyway
(svg_chart.py), and a memory peak is never averaged away. The report's own reader
(report.read_metrics_file) still reads every line: it draws samples/s per plan from all of them.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from oomguard.daemon.report import step_point
from oomguard.daemon.report_data import StepPoint
from oomguard.jobs.attempt import METRICS, AttemptFiles

KEEP = 4096
FILES = 256  # files kept, the least recently read forgotten first (each up to KEEP points): a job has a few dozen attempts
CHUNK = 8 << 20  # read at a time (a three-week run's file is hundreds of MiB)


@dataclass
class _File:
    inode: int
    offset: int = 0  # where the next read starts: after the last whole line read
    points: list[StepPoint] = field(default_factory=list)
    skipped: int = 0


class StepCache:
    def __init__(self) -> None:
        self._files: OrderedDict[Path, _File] = OrderedDict()
        self._locks: dict[Path, threading.Lock] = {}
        self._lock = threading.Lock()  # for the two dicts: requests are served from a pool of threads

    def read(self, files: AttemptFiles) -> tuple[list[StepPoint], int]:
        """What report.read_metrics_file says of the attempt's metrics.jsonl, thinned; an
        unfinished last line waits for the next read (counted as skipped while it is last).
        ``files`` opens it as its owner's, never through a link, only a regular file; a read
        stops at the size it had when opened (one file's reader holds only that file's lock)."""
        path = files.path / METRICS
        with self._lock:
            lock = self._locks.setdefault(path, threading.Lock())
        try:
            with files.open(METRICS) as handle, lock:
                status = os.fstat(handle.fileno())
                with self._lock:
                    cached = self._files.get(path)
                    # Another file now (an inode's number is reused at once): read it from its start.
                    if cached is None or cached.inode != status.st_ino or status.st_size < cached.offset:
                        cached = self._files[path] = _File(status.st_ino)
                    self._files.move_to_end(path)
                    while len(self._files) > FILES:
                        forgotten, _ = self._files.popitem(last=False)
                        self._locks.pop(forgotten, None)
                tail = _catch_up(handle, cached, status.st_size)
                unfinished = 1 if tail.strip() and step_point(tail) is None else 0
                return sorted(cached.points, key=lambda p: p.time), cached.skipped + unfinished
        except OSError:
            return [], 0


def _catch_up(file: BinaryIO, cached: _File, size: int) -> bytes:
    """Read the whole lines written since the last read, up to ``size``, CHUNK at a time;
    returns what follows the last whole line (a line being written)."""
    while True:
        file.seek(cached.offset)
        data = file.read(min(CHUNK, size - cached.offset))
        whole = data[: data.rfind(b"\n") + 1]
        if not whole and len(data) == CHUNK:  # a "line" longer than CHUNK: no metrics line is
            cached.offset += len(data)
            cached.skipped += 1
            continue
        for line in whole.splitlines():
            if line.strip():
                point = step_point(line)
                if point is None:
                    cached.skipped += 1
                else:
                    cached.points.append(point)
        cached.offset += len(whole)
        while len(cached.points) > KEEP:
            cached.points = _halved(cached.points)
        if cached.offset + len(data) - len(whole) >= size or not whole:
            return data[len(whole):]


def _halved(points: list[StepPoint]) -> list[StepPoint]:
    merged = [_merge(points[i], points[i + 1]) for i in range(0, len(points) - 1, 2)]
    return merged + points[len(points) - len(points) % 2:] if len(points) % 2 else merged


def _merge(a: StepPoint, b: StepPoint) -> StepPoint:
    return StepPoint(
        step=b.step, time=b.time, plan=b.plan,
        peak_bytes=_higher(a.peak_bytes, b.peak_bytes), capacity_bytes=b.capacity_bytes if b.capacity_bytes is not None else a.capacity_bytes,
        samples_per_s=_mean(a.samples_per_s, b.samples_per_s), reserved_bytes=_higher(a.reserved_bytes, b.reserved_bytes),
        loss=_mean(a.loss, b.loss),
    )


def _higher(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _mean(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else (a + b) / 2
