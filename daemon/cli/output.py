"""What every command shares about its output: the exit codes, CliError (a problem the user can
fix, printed without a traceback), and printing what may quote a user's text (escaped, one
record per line) or a rich table."""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

from oomguard.daemon.text import escape, escape_block

if TYPE_CHECKING:
    from oomguard.daemon.store_rows import JobRow

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_LOCKED = 4
EXIT_INTERRUPTED = 130
# The reader of standard output went away (`oomguard logs 1 | head`): 128 + SIGPIPE, what a shell
# reports for any program the closed pipe stopped (cat, grep), so a pipeline reads the same
# with oomguard in it; 0 would claim every line was delivered.
EXIT_READER_GONE = 141


class CliError(Exception):
    """A problem the user can fix; printed without a traceback."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def print_event(job: JobRow, kind: str, message: str) -> None:
    """One record of the daemon's log: the event's first line, then any further lines (a
    report) indented below it, all escaped (text.escape_block): nothing a user wrote can start
    a line that reads as a record of its own, or act on the terminal of whoever reads it."""
    stamp = time.strftime("%H:%M:%S")
    first, _, rest = str(message).partition("\n")
    print(f"[{stamp}] " + escape_block(f"job {job.id} {job.name}: {kind}: {first}", rest), flush=True)


def stdout_to_devnull() -> None:
    """Point standard output at /dev/null once its reader has gone: what is still buffered is
    dropped there instead of failing again at exit with a traceback (Python's own recipe, "Note
    on SIGPIPE" in the signal module's documentation)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def print_table(table: Any) -> None:
    """A rich table on standard output, whole rows when piped (not cut to 80 columns)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError  # ended as by any other command (main), not by rich's exit(1)

    # No console markup or emoji codes: a cell holds a user's text ("[/bold]" in a message
    # made rich raise, and `status` fail for everyone); the cells are escaped (text.escape).
    _Console(width=None if sys.stdout.isatty() else 240, markup=False, emoji=False).print(table)


def say(line: str) -> None:
    """Print one line of output that may quote a user's text, escaped: one line, inert."""
    print(escape(line))


def short_plan(plan: Any) -> str:
    """Plan.short() of a plan dict; '?' for what is no plan (a runner's record may hold anything)."""
    from oomguard.strategies.plan import Plan

    try:
        return Plan.from_dict(plan).short()
    except (TypeError, ValueError, AttributeError):
        return "?"
