"""Keeping the daemon's own records bounded over months of use: ended jobs are forgotten after
a while, and no job keeps more than a bounded number of events.

What is forgotten is the daemon's alone: a job's rows (job, attempts, events, the answers to
requests about it), its secrets file and its job file in spool/accepted, and refused files in
spool/rejected that old. A job's workdir (its checkpoints, final model and attempt folders)
belongs to its owner and is never touched here: the final model is what the job was for, and
each attempt's log there is capped already (daemon/log_cap.py).

SQLite reuses the pages that deleted rows free, so the database file stops growing once the
policy holds it steady; it does not shrink (a VACUUM would rewrite the file while the CLI reads).

The daemon runs :func:`collect` at start and every GC_EVERY_SECONDS with its --forget-after;
`oomguard gc` runs it at once (daemon/cli/gc.py).
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from oomguard.daemon.paths import StateDir
from oomguard.daemon.store import Store

# How often the daemon applies the policy (and once when it starts).
GC_EVERY_SECONDS = 3600.0
# Ended jobs are forgotten this long after they ended, unless --forget-after says otherwise.
DEFAULT_FORGET_AFTER_DAYS = 30.0
# A job's events, at most: past this, the oldest but its first EVENTS_KEPT_FIRST give way to one
# event that counts them by kind. A job that ran for weeks behind a busy neighbour (a wait, a
# retry, a step back up each time) could otherwise add events for as long as it ran.
EVENTS_PER_JOB = 1000
EVENTS_KEPT_FIRST = 100
DAY_SECONDS = 86400.0


@dataclass(frozen=True)
class Collected:
    """What one collection removed."""

    jobs: int = 0
    attempts: int = 0
    events: int = 0
    requests: int = 0
    files: int = 0
    compacted_jobs: int = 0
    compacted_events: int = 0

    def summary(self) -> str:
        if self == Collected():
            return "nothing to collect"
        return (
            f"forgot {self.jobs} ended job(s) ({self.attempts} attempt(s), {self.events} event(s), {self.requests} answered "
            f"request(s), {self.files} spool or secrets file(s)); compacted the events of {self.compacted_jobs} job(s) "
            f"({self.compacted_events} removed)"
        )


def collect(store: Store, state: StateDir, *, older_than_seconds: float, now: float, events_per_job: int = EVENTS_PER_JOB) -> Collected:
    """Forget what ended more than ``older_than_seconds`` before ``now``, and compact the events
    of every job past ``events_per_job``."""
    cutoff = now - older_than_seconds
    forgotten = store.forget_jobs_ended_before(cutoff)
    files = sum(_remove_job_files(state, job_id) for job_id in forgotten.job_ids) + _remove_rejected_before(state.rejected, cutoff)
    compacted_jobs, compacted_events = 0, 0
    for job_id in store.jobs_with_more_events_than(events_per_job):
        removed = store.drop_middle_events(job_id, keep_first=EVENTS_KEPT_FIRST, keep_last=events_per_job - EVENTS_KEPT_FIRST - 1)
        if removed:
            kinds = ", ".join(f"{kind} x{n}" for kind, n in Counter(removed).most_common())
            store.add_event(
                job_id, "compacted", f"{len(removed)} older events removed to keep the store bounded ({kinds})",
                code="events_compacted", data={"removed": len(removed), "kinds": dict(Counter(removed))},
            )
            compacted_jobs, compacted_events = compacted_jobs + 1, compacted_events + len(removed)
    return Collected(
        jobs=len(forgotten.job_ids), attempts=forgotten.attempts, events=forgotten.events, requests=forgotten.requests, files=files,
        compacted_jobs=compacted_jobs, compacted_events=compacted_events,
    )


def _remove_job_files(state: StateDir, job_id: int) -> int:
    """The daemon's own files of a forgotten job: its secrets and its accepted job file."""
    removed = 0
    for path in [state.secrets / f"{job_id}.json", *state.accepted.glob(f"{job_id:06d}-*")]:
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def _remove_rejected_before(rejected: Path, cutoff: float) -> int:
    """Refused inbox files (and their .error files) older than ``cutoff``. A refused entry can be
    a folder a user moved in: removed without following any link in it (shutil.rmtree's
    descriptor-based walk)."""
    removed = 0
    try:
        entries = list(os.scandir(rejected))
    except FileNotFoundError:
        return 0
    for entry in entries:
        try:
            if entry.stat(follow_symlinks=False).st_mtime >= cutoff:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed
