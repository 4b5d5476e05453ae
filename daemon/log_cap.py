"""A job's log with a cap on its size: the first bytes and the last bytes are kept.

An attempt may run for weeks and print a line per step (or a progress bar's many a second):
written as it comes, its log would fill the workdir's disk. What a person, and the daemon,
want of a long log is its start (the configuration, the versions, the probe: why the run is
the way it is) and its end (what it died of: daemon/conclude.py reads the OOM message there).
So CappedLog, which the shim (daemon/shim.py) writes the command's output through, keeps

    output.log           the first ``head`` bytes, then one line saying where the rest goes
    output.tail.log.1    the previous segment of the tail: ``tail // 2`` bytes
    output.tail.log      the newest segment: up to ``tail // 2`` bytes; when it is full it is
                         renamed to output.tail.log.1 (the older .1 dropped) and a new one begins
    output.dropped.json  {"dropped_bytes": N}: how much of the output no file holds any more

On disk: never more than head + tail + one line (the marker) + the small JSON. Of the end, at
least the last ``tail // 2`` bytes are always there (from ``tail // 2`` to ``tail``, as the
newest segment fills). Two segments rather than one file cut from the front: a file cannot be
shortened at its start in place, and readers (``oomguard logs``, conclude) join the two.

The names are jobs/attempt.py's (LOG, LOG_TAIL, LOG_TAIL_OLDER, LOG_DROPPED), where the
readers find them. One writer per folder: the attempt's shim.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

from oomguard.jobs.attempt import LOG, LOG_DROPPED, LOG_TAIL, LOG_TAIL_OLDER

# A log's default cap, head and tail together. A runner prints ~100 bytes a step: at a step a
# second that is ~8 MiB a day, a quarter of a GiB a month, and a progress bar that redraws
# itself many times that. Capped at 64 MiB, an attempt's log stays that small whatever it
# prints: a workdir that holds a model's checkpoints does not notice it, and a box that runs
# tens of attempts a month keeps all their logs within a few GiB.
DEFAULT_LOG_LIMIT = 64 * 2**20
# The head's share of the cap (the tail has the rest). 16 MiB of 64 holds any start-up's lines
# (configuration, versions, the probe) and the first hours to days of training; the tail's 48
# MiB (at least 24 MiB always there) holds any traceback, every rank's of a large job
# included, with the hours that led to it. conclude reads only the last 256 KiB of it.
HEAD_SHARE = 4  # the head is a quarter of the cap
# The smallest cap the shim accepts: a tail segment must hold a whole traceback.
MIN_LOG_LIMIT = 64 * 1024
# How far back from the head's end a line's end is looked for, so that the head ends with a
# whole line (a longer line is cut, at a character's start).
LINE_SEARCH_BYTES = 4096

_OPEN_FLAGS = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def check_limit(limit: int) -> int:
    """``limit`` (bytes) if a log can be capped at it; ValueError saying why not."""
    if limit < MIN_LOG_LIMIT:
        raise ValueError(f"a log limit of {limit} bytes is too small: give at least {MIN_LOG_LIMIT} bytes")
    return limit


def split_limit(limit: int) -> tuple[int, int]:
    """The cap ``limit`` as (head bytes, tail bytes)."""
    head = check_limit(limit) // HEAD_SHARE
    return head, limit - head


class CappedLog:
    """Writes a stream of output into a folder's capped log (see the module's docstring).

    Opened again on a folder that already holds a log (a Slurm requeue runs the same attempt's
    shim again; a workdir used before), it goes on where that one stopped: in the tail when a
    tail file exists, else in the head while it has room."""

    def __init__(self, folder: Path, head_bytes: int, tail_bytes: int) -> None:
        if head_bytes < 0 or tail_bytes < 2:
            raise ValueError(f"a log needs a head of 0 bytes or more and a tail of 2 or more, not {head_bytes} and {tail_bytes}")
        self.head_bytes = head_bytes
        self.tail_bytes = tail_bytes
        self.segment_bytes = tail_bytes // 2
        # The folder, once: every file is opened and renamed relative to it (openat, renameat).
        self._folder = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._head: int | None = None
        self._tail: int | None = None
        try:
            self._head = self._open(LOG)
            self.head_size = os.fstat(self._head).st_size
            # Whether the head ends with a whole line (the marker then needs no newline of its own).
            self._head_ends_line = self.head_size == 0 or os.pread(self._head, 1, self.head_size - 1) == b"\n"
            self.dropped = self._saved_dropped = self._read_dropped()
            # A tail file is made right after the marker: the head was closed before.
            if self._exists(LOG_TAIL) or self._exists(LOG_TAIL_OLDER):
                self._tail = self._open(LOG_TAIL)
                self.tail_size = os.fstat(self._tail).st_size
            else:
                self.tail_size = 0
        except BaseException:
            self.close()
            raise

    @classmethod
    def with_limit(cls, folder: Path, limit: int = DEFAULT_LOG_LIMIT) -> CappedLog:
        return cls(folder, *split_limit(limit))

    def write(self, data: bytes) -> None:
        """Add ``data`` to the log. OSError (a full disk) leaves it as the failed write left it."""
        if self._tail is None:
            room = self.head_bytes - self.head_size
            if len(data) <= room:
                self._write_head(data)
                return
            cut = _head_cut(data, room, head_ends_line=self._head_ends_line)
            self._write_head(data[:cut])
            self._start_tail()
            data = data[cut:]
        # Even a write larger than the tail goes through the segments in order (the shim's are
        # at most a read of the pipe): what is dropped is always whole files, so a reader finds
        # a gap only between two files, never inside one.
        view = memoryview(data)
        while view:
            room = self.segment_bytes - self.tail_size
            if room <= 0:
                self._rotate()
                continue
            self.tail_size += _write_all(self._tail_fd(), view[:room])
            view = view[room:]
        self._save_dropped()

    def close(self) -> None:
        for name in ("_head", "_tail", "_folder"):
            descriptor = getattr(self, name, None)
            if descriptor is not None:
                os.close(descriptor)
                setattr(self, name, None)

    def __enter__(self) -> CappedLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Inside ----------------------------------------------------------------------------------

    def _write_head(self, data: bytes) -> None:
        if data:
            self.head_size += _write_all(self._head_fd(), data)
            self._head_ends_line = data.endswith(b"\n")

    def _start_tail(self) -> None:
        """The head is full: one line in it says where the rest goes (before the tail file is
        made: a reader that sees a tail file knows the head is whole), then the tail begins."""
        marker = (
            f"oomguard: output.log reached {self.head_size} bytes; the rest of the output goes to {LOG_TAIL}, renamed to "
            f"{LOG_TAIL_OLDER} every {self.segment_bytes} bytes (only the last {self.segment_bytes} to {self.tail_bytes} "
            "bytes are kept; `oomguard logs JOB` prints the head and the tail)\n"
        )
        self._write_head(("" if self._head_ends_line else "\n").encode() + marker.encode())
        self._tail = self._open(LOG_TAIL)
        self.tail_size = os.fstat(self._tail).st_size

    def _rotate(self) -> None:
        """The newest segment is full: it becomes the older one, and the older one is dropped.
        Renamed first and counted after, so that a reader never counts as dropped what a file
        still holds."""
        try:
            older = os.stat(LOG_TAIL_OLDER, dir_fd=self._folder, follow_symlinks=False).st_size
        except FileNotFoundError:
            older = 0
        os.rename(LOG_TAIL, LOG_TAIL_OLDER, src_dir_fd=self._folder, dst_dir_fd=self._folder)
        os.close(self._tail_fd())
        self._tail = None
        self.dropped += older
        self._save_dropped()
        self._tail = self._open(LOG_TAIL)
        self.tail_size = os.fstat(self._tail).st_size

    def _open(self, name: str) -> int:
        """``name`` in the folder, for appending (and reading the head's last byte): never
        through a symbolic link, and only a regular file (a FIFO put there would block the
        shim, and with it the command). Mode 0o666 less the umask, as the log always had."""
        descriptor = os.open(name, _OPEN_FLAGS, 0o666, dir_fd=self._folder)
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            os.close(descriptor)
            raise OSError(errno.EINVAL, "not a regular file", name)
        os.set_blocking(descriptor, True)
        return descriptor

    def _exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self._folder, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def _read_dropped(self) -> int:
        try:
            reading = os.open(LOG_DROPPED, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self._folder)
        except OSError:
            return 0
        try:
            value = json.loads(os.read(reading, 4096)).get("dropped_bytes")
        except (OSError, ValueError, AttributeError):
            return 0
        finally:
            os.close(reading)
        return value if isinstance(value, int) and value >= 0 else 0

    def _save_dropped(self) -> None:
        """output.dropped.json, when the count changed; replaced whole (a reader sees the old
        count or the new one)."""
        if self.dropped == self._saved_dropped:
            return
        temporary = f".{LOG_DROPPED}.tmp"
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=self._folder)
        try:
            _write_all(descriptor, json.dumps({"dropped_bytes": self.dropped}).encode())
        finally:
            os.close(descriptor)
        os.rename(temporary, LOG_DROPPED, src_dir_fd=self._folder, dst_dir_fd=self._folder)
        self._saved_dropped = self.dropped

    def _head_fd(self) -> int:
        assert self._head is not None, "the log is closed"
        return self._head

    def _tail_fd(self) -> int:
        assert self._tail is not None, "the log's tail is not open"
        return self._tail


def _head_cut(data: bytes, room: int, *, head_ends_line: bool) -> int:
    """How much of ``data`` still goes into a head with ``room`` bytes left: up to the end of
    its last line that fits (looked for in the last LINE_SEARCH_BYTES); else nothing, when the
    head ends with a whole line and so little room is left; else as much as fits without
    cutting a UTF-8 character."""
    if room <= 0:
        return 0
    newline = data.rfind(b"\n", max(0, room - LINE_SEARCH_BYTES), room)
    if newline >= 0:
        return newline + 1
    if head_ends_line and room <= LINE_SEARCH_BYTES:
        return 0
    cut = room
    # data[cut] is the first byte left out: a continuation byte (0b10xxxxxx) belongs to a
    # character begun before it, which goes to the tail whole (a character has at most 4 bytes).
    while cut > 0 and room - cut < 3 and data[cut] & 0xC0 == 0x80:
        cut -= 1
    return cut


def _write_all(descriptor: int, data: bytes | memoryview) -> int:
    """Write all of ``data`` (a write may take less than it is given); returns its length."""
    view = memoryview(data)
    while view:
        view = view[os.write(descriptor, view) :]
    return len(data)
