"""The attempt's output as the shim handles it: one pipe that the command's standard output and
error go to, copied into the capped log (daemon/log_cap.py) as it comes. The shim's own lines go
into the same log, after what it has read so far."""

from __future__ import annotations

import fcntl
import os
import select
from collections.abc import Callable

from oomguard.daemon.log_cap import CappedLog

# The command's output: read this much at a time, and at most READS_PER_WAKE times before the
# shim looks at its other events again (a command that never pauses must not hide a failed
# rank's mark).
READ_BYTES = 64 * 1024
READS_PER_WAKE = 64
# The pipe's buffer: what the command may write while the shim is busy (its teardown looks at
# the processes every tenth of a second) before its writes wait. 256 KiB rather than Linux's
# 64 KiB default, and not its 1 MiB most: a user's pipes together past pipe-user-pages-soft
# (64 MiB) get one page each, theirs and their data loaders' too; 256 attempts of one user
# stay under it.
PIPE_BYTES = 256 * 1024
# Once the attempt's processes are gone, how long the shim waits for more output from a writer
# it could not find (one that holds the pipe open) before it closes the log.
DRAIN_SECONDS = 1.0


class CommandOutput:
    """The command's output: a pipe whose reading end the shim copies into the capped log.
    Its own lines go into the same log, after what it has read so far."""

    def __init__(self, log: CappedLog) -> None:
        self.log = log
        # Both ends close-on-exec: Popen makes the writing end the command's 1 and 2, and the
        # shim closes its own copy once the command has started (or failed to), so that the
        # reading end ends (EOF) when the last process of the attempt that holds it does.
        self.read_end, self.write_end = os.pipe()
        try:
            fcntl.fcntl(self.read_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except (OSError, AttributeError):
            pass  # the default 64 KiB (a user over their pipe quota, or not Linux)
        os.set_blocking(self.read_end, False)
        self.ended = False
        self._lost = 0
        self._why = ""

    def started(self) -> None:
        if self.write_end >= 0:
            os.close(self.write_end)
            self.write_end = -1

    def copy(self) -> None:
        """Copy what the pipe holds now into the log (at most READS_PER_WAKE reads)."""
        for _ in range(READS_PER_WAKE):
            try:
                data = os.read(self.read_end, READ_BYTES)
            except BlockingIOError:
                return
            if not data:
                self.ended = True
                return
            self.write(data)

    def copying(self, find: Callable[[], set[int]]) -> Callable[[], set[int]]:
        """``find``, copying the output each time it is called: processes.end_all calls it
        every tenth of a second while the attempt's processes stop, and what they print as
        they stop (a traceback) must not wait for a full pipe."""

        def find_and_copy() -> set[int]:
            self.copy()
            return find()

        return find_and_copy

    def copy_to_end(self, seconds: float) -> None:
        """The rest of the output, once the attempt's processes are gone: until every writer
        has closed the pipe, or none wrote for ``seconds`` (one the shim could not find)."""
        while True:
            self.copy()
            if self.ended or not select.select([self.read_end], [], [], seconds)[0]:
                return

    def write(self, data: bytes) -> None:
        """Into the log. A write that fails (a full disk) loses that output, not the attempt:
        the shim goes on reading, so that the command never blocks on its output, and says
        how much was lost once the log can be written again."""
        try:
            if self._lost:
                self.log.write(f"oomguard: {self._lost} bytes of output were lost: the log could not be written ({self._why})\n".encode())
                self._lost = 0
            self.log.write(data)
        except OSError as error:
            self._lost += len(data)
            self._why = error.strerror or str(error)

    def __enter__(self) -> CommandOutput:
        return self

    def __exit__(self, *exc: object) -> None:
        self.started()
        os.close(self.read_end)
