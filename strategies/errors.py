"""The exception types a user's input or a user's machine can raise, in one module: the lowest
layer (strategies imports nothing of ours), so that the daemon, the CLI, the job contract and
the runner raise and catch the same classes.

Each keeps the standard base a caller would catch (ValueError for a bad value, LookupError for
a name that matches nothing, OSError for a folder), and its ``str()`` names the problem and,
where the user can do something, the fix. The CLI's own CliError (daemon/cli/output.py) adds
an exit code to such a message.
"""

from __future__ import annotations

import os


class OomguardError(Exception):
    """Any problem oomguard reports to a user rather than as a bug of its own."""


# The job file and its [command] ------------------------------------------------------------

# C0 controls and DEL as Python escapes: a message about a job file stays one line.
_CONTROL_ESCAPES = {c: ascii(chr(c))[1:-1] for c in (*range(32), 127)}


class JobFileError(OomguardError, ValueError):
    """A job file that cannot be used; ``str()`` is one line: ``{path}: {key}: {problem}``.

    ``key`` is the dotted key of the offending value (``"train.batch_size"``), or None when
    the problem concerns the whole file (unreadable, empty, not TOML).
    """

    def __init__(self, path: str | os.PathLike[str], key: str | None, problem: str) -> None:
        # One line, always: a key, path or placeholder with a newline in it (all legal in TOML)
        # made a message of two lines, whose second could pass for a line of the daemon's log.
        path = os.fspath(path).translate(_CONTROL_ESCAPES)
        key = key.translate(_CONTROL_ESCAPES) if key is not None else None
        problem = problem.translate(_CONTROL_ESCAPES)
        super().__init__(path, key, problem)
        self.path = path
        self.key = key
        self.problem = problem

    def __str__(self) -> str:
        if self.key:
            return f"{self.path}: {self.key}: {self.problem}"
        return f"{self.path}: {self.problem}"


class CommandError(OomguardError, ValueError):
    """A [command] table that cannot be run; str() says what and how to fix it. ``where`` is
    the key in [command] it concerns: "argv", "when.KNOB" or "env.NAME"."""

    def __init__(self, message: str, where: str = "argv") -> None:
        super().__init__(message)
        self.where = where


# Jobs in the store ---------------------------------------------------------------------------


class JobNotFound(OomguardError, LookupError):
    """No job has that id or name."""


class AmbiguousJobName(OomguardError, LookupError):
    """A name that several jobs have, none of them the asker's or several of them; str() lists the ids."""


class ReportError(OomguardError):
    """Nothing to draw (e.g. the job has no attempts yet)."""


# Users, folders and the state directory ------------------------------------------------------


class PermissionRefused(OomguardError):
    """A user asked for something they may not do; str() names who, what and why."""


class UnknownUser(PermissionRefused, LookupError):
    """A uid (or name) has no passwd entry on this machine, so nothing may run as it."""


class InsecureStateDir(OomguardError):
    """The state directory could be changed by someone other than the daemon; str() says how to fix it."""


class UnsafeFolder(OomguardError, OSError):
    """A folder could not be opened without following a link its users could have made, or is not its owner's."""


class InboxNameTaken(OomguardError, FileExistsError):
    """Every fresh name `write_to_inbox` drew existed already in the inbox."""


# The machine -----------------------------------------------------------------------------------


class NoGpus(OomguardError, RuntimeError):
    """NVML found no usable NVIDIA GPU."""


class LaunchFailed(OomguardError):
    """An attempt could not be started at all; ``fix`` says what an installer must do.
    ``retry_after``: it may start later (a cluster's controller that does not answer now): the
    job waits this many seconds instead of failing."""

    def __init__(self, why: str, fix: str, *, retry_after: float | None = None) -> None:
        super().__init__(why)
        self.why = why
        self.fix = fix
        self.retry_after = retry_after


class CheckpointError(OomguardError):
    """A checkpoint directory is missing files or its files do not match its manifest."""
