"""One attempt's log as `oomguard logs` prints it, and goes on printing it with --follow.

A long log is kept in several files (daemon/log_cap.py): output.log holds its first bytes and
ends with a line saying where the rest goes; output.tail.log.1 and output.tail.log hold its
end, and output.tail.log is renamed to .1 each time it fills (the older .1 dropped). So the
log is printed as output.log, then, once a tail file exists, how many bytes no file holds any
more, then the tail files, oldest first. The tail file being read is followed by its identity
(device and inode, through the descriptor held open), not by its name: when the name goes to a
new file, the old one is read to its end first, wherever it was renamed to.

A file's identity is its own only while the file exists: a file system gives the inode number
of a deleted file to a file made after it (ext4 often to the very next one, and a rotation
deletes the old output.tail.log.1 just before it makes the new output.tail.log). So every tail
file whose identity is remembered is held open, which keeps it in existence, until no name
holds it any more; identities are compared only between files that are open. (A file held
open after the writer deleted it keeps its disk space until the next look lets it go: two
segments at most.)
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
        self._printed: list[BinaryIO] = []  # tail files printed to their end, held open while a name holds them
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
        for handle in [self._reading, *self._printed]:
            if handle is not None:
                handle.close()
        self._reading = None
        self._printed = []

    def _print_tail(self) -> None:
        if self._reading is not None:
            newest = _identity(self.folder / LOG_TAIL)
            self._copy(self._reading)
            if _identity_of(self._reading) == newest:
                return  # still the newest: more may come
            # Renamed away before the look above, so nothing is written to it any more, and
            # the copy after the look read it to its end.
            self._printed.append(self._reading)
            self._reading = None
        while self._reading is None:
            older = self._open_unprinted(LOG_TAIL_OLDER)
            # The writer counts a file once it left the disk: read after .1 was opened and while
            # .1 still holds that file (checked below), the count holds none printed from here
            # on (and all before, but for one dropped a moment ago and not counted yet, which
            # the next gap then says).
            dropped = self._dropped_count()
            if older is not None:
                if _identity(self.folder / LOG_TAIL_OLDER) != _identity_of(older):
                    older.close()  # dropped meanwhile: the count may hold it
                    continue
                self._print_after_gap(older, dropped)
                self._printed.append(older)
            newest = self._open_unprinted(LOG_TAIL)
            if newest is None:
                return  # renamed to .1 a moment ago and not made again yet: the next look reads it
            if self._older_unprinted():
                # A rotation since .1 was opened renamed a file there that goes first: one
                # before ``newest``, or ``newest`` itself (then the one before it is missing).
                newest.close()
                continue
            self._print_after_gap(newest, dropped)
            self._reading = newest

    def _open_unprinted(self, name: str) -> BinaryIO | None:
        """The tail file ``name``, open; None when it is not there or was printed already."""
        try:
            handle = self._files.open(name)
        except FileNotFoundError:
            return None
        if self._is_printed(_identity_of(handle)):
            handle.close()
            return None
        return handle

    def _older_unprinted(self) -> bool:
        """Whether output.tail.log.1 holds a file not printed yet. When it holds none, or a
        printed one, output.tail.log was not renamed since it was opened (it would be in .1, or
        a later file), so .1 holds the file just before it: nothing is missing between."""
        older = _identity(self.folder / LOG_TAIL_OLDER)
        return older is not None and not self._is_printed(older)

    def _is_printed(self, identity: Identity) -> bool:
        """Whether ``identity`` is a tail file's printed already. Compared with files held open
        only: while a file exists, no other has its identity."""
        return any(_identity_of(handle) == identity for handle in self._printed)

    def _print_after_gap(self, handle: BinaryIO, dropped: int | None) -> None:
        """Print the tail file ``handle`` from its start, after saying how much output is missing
        before it: the writer's count ``dropped`` (output.dropped.json), less what this reader
        printed of the files that are gone since."""
        on_disk = {_identity(self.folder / name) for name in (LOG_TAIL_OLDER, LOG_TAIL)}
        for gone in [printed for printed in self._printed if _identity_of(printed) not in on_disk]:
            self._accounted += gone.tell()  # printed to its end
            gone.close()
            self._printed.remove(gone)
        if dropped is not None and dropped > self._accounted:
            self._write(f"oomguard logs: {dropped - self._accounted} bytes of output were dropped here (a long log keeps only its first and last bytes)\n")
            self._accounted = dropped
        self._copy(handle)

    def _dropped_count(self) -> int | None:
        """How many bytes the writer counts as dropped (it counts a file after it left the disk)."""
        counted = self._files.read_json(LOG_DROPPED)
        dropped = counted.get("dropped_bytes") if isinstance(counted, dict) else None
        return dropped if isinstance(dropped, int) else None

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
