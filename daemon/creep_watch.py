"""Creep, reported while an attempt runs: every few seconds the daemon reads the end of each
running attempt's step timeline (metrics.jsonl, written by the built-in runner and by a command
job's bootstrap alike) and, the first time its step peaks creep up (strategies/creep.py), adds a
"creep" event with the step range and the rate, notified like a stall: long before the OOM it
would end in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from oomguard.daemon.clock import Clock
from oomguard.daemon.events import Events, log_error
from oomguard.daemon.store import Store
from oomguard.daemon.store_rows import AttemptRow
from oomguard.jobs.attempt import METRICS, AttemptFiles
from oomguard.jobs.script_report import step_records
from oomguard.strategies.creep import Creep, find_creep

# How often one attempt's timeline is looked at (read only when it has changed), and how much of its end (about
# 300 bytes a step: the last ~3,500 steps).
CHECK_SECONDS = 2.0
TAIL_BYTES = 1 << 20


def timeline(records: list[dict[str, Any]]) -> tuple[list[tuple[int, int]], int | None]:
    """The (step, peak) points of the records' last plan, from where that plan began, and the
    capacity the last step had."""
    points: list[tuple[int, int]] = []
    plan = records[-1].get("plan") if records else None
    for record in reversed(records):
        peak = record.get("peak_bytes")
        if record.get("plan") != plan or not isinstance(peak, int) or isinstance(peak, bool):
            break
        points.append((record["step"], peak))
    capacity = records[-1].get("capacity_bytes") if records else None
    return points[::-1], capacity if isinstance(capacity, int) and not isinstance(capacity, bool) else None


class CreepWatch:
    def __init__(self, store: Store, events: Events, clock: Clock) -> None:
        self.store = store
        self.events = events
        self.clock = clock
        # When each attempt's timeline was last looked at, and its modification time then.
        self._checked: dict[int, tuple[float, float | None]] = {}
        self._reported: set[int] = set()

    def check(self, attempt: AttemptRow, files_of: Callable[[AttemptRow], AttemptFiles]) -> Creep | None:
        """Read the attempt's timeline (its folder opened by ``files_of``) if it is due; report
        creep found there once. A failure here is logged: a warning must never end the attempt
        it is about (the daemon's collection of attempts ends one whose handling raised)."""
        try:
            return self._check(attempt, files_of)
        except Exception as error:  # noqa: BLE001 - logged, and the attempt runs on
            log_error(f"reading attempt {attempt.id}'s step timeline for creep", error)
            return None

    def _check(self, attempt: AttemptRow, files_of: Callable[[AttemptRow], AttemptFiles]) -> Creep | None:
        now = self.clock.monotonic()
        checked_at, seen = self._checked.get(attempt.id, (float("-inf"), None))
        if attempt.id in self._reported or now - checked_at < CHECK_SECONDS:
            return None
        with files_of(attempt) as files:
            written = files.mtime(METRICS)
            self._checked[attempt.id] = (now, written)
            if written is None or written == seen:
                return None  # no step since the last look: nothing new to read
            points, capacity = timeline(step_records(files, TAIL_BYTES))
        creep = find_creep(points, capacity)
        if creep is None:
            return None
        self._reported.add(attempt.id)
        job = self.store.job(attempt.job_id)
        # A restarted daemon has forgotten what it reported.
        if self.store.has_event_since(job.id, "creep", attempt.started_at):
            return creep
        self.events.event(
            job, "creep", f"attempt {attempt.number}: {creep.describe(capacity)}", code="memory_creep",
            data={
                "attempt": attempt.number, "first_step": creep.first_step, "last_step": creep.last_step,
                "bytes_per_step": creep.bytes_per_step, "reaches_capacity_at": creep.reaches_capacity_at,
            },
            next_step="oomguard keeps it running and answers an OOM as always; memory that grows every step is often a "
            "leak: tensors kept across steps (a list of losses not .item()'d, a callback's cache)",
        )
        return creep

    def forget(self, attempt_id: int) -> None:
        self._checked.pop(attempt_id, None)
        self._reported.discard(attempt_id)
