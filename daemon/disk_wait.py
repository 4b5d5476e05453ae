"""A job waiting for disk space: how much free space it waits for, and the words status, show and
its events use for it. The lifecycle records the wait (daemon/lifecycle.py), the scheduler
looks at the disk every DISK_CHECK_SECONDS and lets the job go when there is room
(daemon/scheduler.py).

What the job waits for: the bytes its attempt said it needs (a checkpoint's size as its
manifest records it, and a reserve: jobs/disk_guard.py). When that is unknown (a command job's
own write), more than was free when it stopped, by a hundredth of the disk (at least
UNKNOWN_NEED_GROWTH_BYTES), or a tenth of the disk free, whichever comes first: enough that a
job does not start again into the same full disk, little enough that it starts once someone
has cleaned up. A job over its disk budget ([resources] disk: jobs/checkpoint_budget.py) waits
for room in the budget: what its checkpoints folder leaves of it, measured the same way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from oomguard.jobs.checkpoints import folder_bytes
from oomguard.jobs.disk_space import Room, room
from oomguard.strategies.units import format_bytes

if TYPE_CHECKING:
    from oomguard.daemon.store_rows import JobRow

# How often the scheduler measures the free space of the jobs waiting for it (a statvfs per
# path, and one indexed query of those jobs: never the whole queue).
DISK_CHECK_SECONDS = 10.0
UNKNOWN_NEED_GROWTH_BYTES = 64 << 20
# How a queued job's note begins while it waits for disk space (status' note column).
DISK_NOTE = "waiting for disk: "


@dataclass(frozen=True)
class DiskWait:
    """What a job waits for: ``wait_free`` bytes free at ``path``; ``needed`` as its attempt
    said it (None: unknown); ``free`` as it was when it stopped. With a ``budget`` (the job's
    [resources] disk) the room is missing in it, not on the disk: free is what the folder at
    ``path`` leaves of the budget."""

    path: str
    wait_free: int
    needed: int | None
    free: int | None
    budget: int | None = None

    def note(self, free_now: int | None = None) -> str:
        """"waiting for disk: /w/checkpoints needs 1.6 MiB free, has 12.0 KiB"."""
        has = free_now if free_now is not None else self.free
        if self.needed is not None:
            need = f"needs {format_bytes(self.needed)} free"
        else:
            need = f"needs an unknown amount free (the job did not say; waiting for {format_bytes(self.wait_free)})"
        if self.budget is not None:
            need += f" within its disk budget of {format_bytes(self.budget)} ([resources] disk)"
        return f"{DISK_NOTE}{self.path} {need}, has {format_bytes(has)}"

    def has_room(self, free_now: int | None) -> bool:
        """Whether the job may start again. A path that cannot be measured (gone, or not
        reachable for the daemon) lets it start: the attempt measures again itself."""
        return free_now is None or free_now >= self.wait_free


def wait_free(needed: int | None, free: int | None, measured: Room | None) -> int:
    """The free bytes a job waits for (the module's docstring says why)."""
    if needed is not None:
        return needed
    free = free if free is not None else (measured.free if measured is not None else 0)
    total = measured.total if measured is not None else 0
    grown = free + max(UNKNOWN_NEED_GROWTH_BYTES, total // 100)
    return min(grown, max(free, total // 10)) if total else grown


def disk_wait(path: str, needed: int | None, free: int | None, budget: int | None = None) -> DiskWait:
    """The wait for room at ``path`` (measured now, for a wait of unknown size)."""
    return DiskWait(path=path, wait_free=wait_free(needed, free, room(path)), needed=needed, free=free, budget=budget)


def free_at(path: str) -> int | None:
    """The bytes free at ``path`` now (os.statvfs: f_bavail * f_frsize), None when unknown."""
    measured = room(os.fsdecode(path))
    return measured.free if measured is not None else None


def free_for(wait: DiskWait) -> int | None:
    """The room there is now for what ``wait`` waits for: the disk's free bytes at its path, or
    what the checkpoints folder there leaves of its budget."""
    if wait.budget is None:
        return free_at(wait.path)
    try:
        return max(0, wait.budget - folder_bytes(Path(wait.path)))
    except OSError:
        return None


def disk_wait_of(job: JobRow) -> DiskWait | None:
    """The job's wait for disk space as the store holds it (None: it waits for none)."""
    if job.disk_path is None or job.disk_wait_bytes is None:
        return None
    return DiskWait(path=job.disk_path, wait_free=job.disk_wait_bytes, needed=job.disk_needed, free=None, budget=job.disk_budget)


def disk_note(job: JobRow) -> str:
    """"waiting for disk: PATH needs N free, has F" (status, show), with what is free there now;
    the note as the daemon wrote it when the path cannot be measured from here."""
    wait = disk_wait_of(job)
    free = free_for(wait) if wait is not None else None
    if wait is not None and free is not None:
        return wait.note(free)
    return job.waiting or f"{DISK_NOTE}{job.disk_path}"
