"""One attempt's log as `oomguard logs` prints it, and goes on printing it with --follow.

A long log is kept in several files (daemon/log_cap.py): output.log holds its first bytes and
ends with a line saying where the rest goes; output.tail.log.1 and output.tail.log hold its
end, and output.tail.log is renamed to .1 each time it fills (the older .1 dropped). So the
log is printed as output.log, then, once a tail file exists, how many bytes no file holds any
more, then the tail files, oldest first. The tail file being read is followed by its identity
(device and inode, through the descriptor held open), not by its name: when the name goes to a
new file, the old one is read to its end first, wherever it was renamed to.
"""

from __future__ import annotations

import codecs
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from oomguard.jobs.attempt import LOG, LOG_DROPPED, LOG_TAIL, LOG_TAIL_OLDER, AttemptFiles

# A log is copied a block at a time: a log of gigabytes is never held in memory, and a reader
# that went away is noticed at the next block.
LOG_BLOCK_BYTES = 1 << 16

Identity = tuple[int, int]  # (st_dev, st_ino)


class AttemptLog:
    """Prints an attempt's log through ``write`` (text, decoded as UTF-8 with a character split
    between two reads kept whole), from where the last print_new stopped."""

    def __init__(self, folder: Path, write: Callable[[str], None]) -> None:
        self.folder = Path(folder)
        self._files = AttemptFiles(self.folder)  # opened never through a link, only regular files
        self._write = write
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._head_at = 0
        self._in_tail = False
        self._reading: BinaryIO | None = None  # the tail file being read, whatever its name now
        self._read_whole: dict[Identity, int] = {}  # tail files read to their end (their size), while on disk
        self._accounted = 0  # of the bytes the writer dropped: said, or printed before they were dropped

    def print_new(self) -> None:
        """Print what the log gained since the last call (all of it, the first time). OSError
        when a file of it cannot be read (PermissionError: someone else's)."""
        if not self._in_tail:
            # Looked at before output.log is read: once a tail file exists, the head is whole.
            rotated = _identity(self.folder / LOG_TAIL) is not None or _identity(self.folder / LOG_TAIL_OLDER) is not None
            try:
                with self._files.open(LOG) as head:
                    head.seek(self._head_at)
                    self._head_at += self._copy(head)
            except FileNotFoundError:
                return  # the attempt has not started writing yet
            if not rotated:
                return
            self._in_tail = True
        self._print_tail()

    def close(self) -> None:
        if self._reading is not None:
            self._reading.close()
            self._reading = None

    def _print_tail(self) -> None:
        if self._reading is not None:
            newest = _identity(self.folder / LOG_TAIL)
            self._copy(self._reading)
            held = _identity_of(self._reading)
            if held == newest:
                return  # still the newest: more may come
            # Renamed away before the look above, so nothing is written to it any more, and
            # the copy after the look read it to its end.
            self._read_whole[held] = os.fstat(self._reading.fileno()).st_size
            self.close()
        for name in (LOG_TAIL_OLDER, LOG_TAIL):
            try:
                handle = self._files.open(name)
            except FileNotFoundError:
                continue
            if _identity_of(handle) in self._read_whole:
                handle.close()
                continue
            self._say_dropped()
            self._copy(handle)
            if name == LOG_TAIL:
                self._reading = handle
            else:
                self._read_whole[_identity_of(handle)] = os.fstat(handle.fileno()).st_size
                handle.close()

    def _say_dropped(self) -> None:
        """Before a tail file not printed yet: how much output is missing before it. The writer
        counts what it dropped (output.dropped.json) after the file left the disk; the files
        this reader printed whole and that are gone since are not missing here. The count is
        read before the files are looked at, so that a file gone but not counted yet is never
        taken for a gap."""
        counted = self._files.read_json(LOG_DROPPED)
        dropped = counted.get("dropped_bytes") if isinstance(counted, dict) else None
        on_disk = {_identity(self.folder / name) for name in (LOG_TAIL_OLDER, LOG_TAIL)}
        for gone in [identity for identity in self._read_whole if identity not in on_disk]:
            self._accounted += self._read_whole.pop(gone)
        if isinstance(dropped, int) and dropped > self._accounted:
            self._write(f"oomguard logs: {dropped - self._accounted} bytes of output were dropped here (a long log keeps only its first and last bytes)\n")
            self._accounted = dropped

    def _copy(self, handle: BinaryIO) -> int:
        """Print ``handle`` from where it is to its end; returns how many bytes that was."""
        copied = 0
        for block in iter(lambda: handle.read(LOG_BLOCK_BYTES), b""):
            self._write(self._decoder.decode(block))
            copied += len(block)
        return copied


def _identity(path: Path) -> Identity | None:
    """Which file ``path`` names now, if a regular file (a link is not followed)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def _identity_of(handle: BinaryIO) -> Identity:
    st = os.fstat(handle.fileno())
    return (st.st_dev, st.st_ino)
