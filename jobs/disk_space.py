"""Free disk space, and what counts as a full disk: read by the runner before and after it
writes (jobs/disk_guard.py) and by the daemon while a job waits for space (daemon/disk_wait.py).
Torch-free: the daemon imports it.

A full disk is not the job's fault and not a crash to retry at once: the job waits until the
space it needs is there, and goes on from its last verified checkpoint.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

# The errors of a write that found no room: the disk is full, or the user's quota is used up.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# The same, as a log or a library's message says it (safetensors: "No space left on device (os
# error 28)"; Python: "[Errno 28] No space left on device: '/path'").
DISK_FULL_TEXT = re.compile(r"No space left on device|Disk quota exceeded")
# The path a Python OSError names after its message: "...device: '/w/ckpt/model.pt'".
_NAMED_PATH = re.compile(r"(?:No space left on device|Disk quota exceeded): '([^'\n]+)'")

# Room kept free beyond a write's own bytes: the metrics, heartbeat, log lines and the outcome
# the attempt still writes (a few hundred bytes a step), and what a file system rounds up. At
# least RESERVE_MIN_BYTES, and RESERVE_SHARE of the write for a large one (pickling and block
# rounding grow with it).
RESERVE_MIN_BYTES = 256 << 10
RESERVE_SHARE = 0.02


@dataclass(frozen=True)
class Room:
    """The space of the file system holding a path, in bytes: what an unprivileged user may
    still write (f_bavail * f_frsize) and its whole size."""

    free: int
    total: int
    block: int


def room(path: str | Path) -> Room | None:
    """The space at ``path``, measured at its nearest folder that exists (a checkpoint folder
    not made yet is on its parent's file system); None when it cannot be measured."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        stat = os.statvfs(where)
    except OSError:
        return None
    return Room(free=stat.f_bavail * stat.f_frsize, total=stat.f_blocks * stat.f_frsize, block=stat.f_frsize or 4096)


def free_bytes(path: str | Path) -> int | None:
    measured = room(path)
    return measured.free if measured is not None else None


def with_reserve(write_bytes: int) -> int:
    """The free bytes a write of ``write_bytes`` needs, its reserve included."""
    return write_bytes + max(RESERVE_MIN_BYTES, int(write_bytes * RESERVE_SHARE))


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) is a write that found no room: ENOSPC or
    EDQUOT, or a library's error that says so in words (safetensors' does)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL_ERRNOS:
            return True
        if DISK_FULL_TEXT.search(str(current)):
            return True
        current = current.__cause__ or current.__context__
    return False


def named_path(text: str) -> str | None:
    """The path a disk-full error in ``text`` names (the last one), if it names one."""
    found = _NAMED_PATH.findall(text)
    return found[-1] if found else None


class DiskFull(Exception):
    """A write found no room at ``path``, or would not have: ``needed`` bytes free (None:
    unknown) where ``free`` were; ``written``: the bytes it had written when it failed.
    ``budget``: the job's disk budget, when that is what has no room (``free`` is then what is
    left of it), not the disk."""

    def __init__(
        self, path: Path | str, needed: int | None, free: int | None, what: str, written: int = 0, budget: int | None = None,
    ) -> None:
        self.path = str(path)
        self.needed = needed
        self.free = free
        self.what = what
        self.written = written
        self.budget = budget
        super().__init__(describe(self.path, needed, free, what, budget))


def describe(path: str, needed: int | None, free: int | None, what: str, budget: int | None = None) -> str:
    """One line for people: "no room for a checkpoint at /w/checkpoints: needs 1.5 MiB free, has 12 KiB"."""
    from oomguard.strategies.units import format_bytes

    need = f"needs {format_bytes(needed)} free" if needed is not None else "needs an unknown amount free"
    if budget is not None:
        need += f" within the job's disk budget of {format_bytes(budget)} ([resources] disk)"
    has = f"has {format_bytes(free)}" if free is not None else "free space unknown"
    return f"no room for {what} at {path}: {need}, {has}"
