"""How an attempt's processes are started, watched, adopted and stopped: the Launcher.

The supervisor decides *what* runs (the job, its plan, the command line, the environment);
a Launcher decides *where and how*. `LocalLauncher` (daemon/launch/local.py) starts the attempt
shim in a session of its own on this machine; it is the only place in the daemon that starts
or signals a process. Tests of scheduling and lifecycle use a fake one (tests/fakes.py).

The types here are plain data, so that a launcher can be swapped without the supervisor
knowing which one runs its attempts, and so that a handle can be rebuilt from the store by a
restarted daemon.
"""

from __future__ import annotations

import subprocess
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from oomguard.daemon.users import Account
from oomguard.jobs.attempt import AttemptFiles


@dataclass(frozen=True)
class LaunchRequest:
    """One attempt to start: ``argv`` (the runner, or the user's command) runs as ``owner`` in
    ``cwd`` (None: the workdir), entered by the attempt's own processes, never by the daemon."""

    attempt_dir: Path
    argv: tuple[str, ...]
    env: Mapping[str, str]
    owner: Account
    workdir: Path
    cwd: str | None
    # The attempt's configuration (attempt.json), handed over on the shim's standard input:
    # the daemon never writes into a folder of the user's.
    stdin: bytes
    gpus: tuple[int, ...] | None


@dataclass(frozen=True)
class Handle:
    """A started attempt, as the store keeps it: its leading process and that process's start
    time (a pid alone may be reused; pid and start time name one process for good)."""

    attempt_dir: str
    pid: int | None  # None: recorded, but no process was found for it
    started: int | None


@dataclass(frozen=True)
class Exit:
    """How an attempt's processes ended, as far as the launcher saw it."""

    returncode: int | None  # None when nothing recorded it (killed with its shim, or no daemon watched)
    recorded: bool  # an exit status was recorded (exit.json), or the launcher watched the process end
    failed_process: dict[str, Any] | None = None  # the first process that recorded its own death
    oom_kills: int | None = None  # the kernel's OOM kills while it ran
    no_folder: bool = False  # it could not enter the workdir or make the attempt's folder, as the owner


class Launcher(Protocol):
    def start(self, request: LaunchRequest) -> Handle:
        """Start the attempt; LaunchFailed when it cannot be started."""
        ...

    def adopt(self, attempt_dir: str, pid: int | None, started: int | None) -> Handle:
        """An attempt an earlier daemon started (``pid`` None: recorded just before its start)."""
        ...

    def running(self, handle: Handle) -> bool: ...

    def collect(self, handle: Handle, owner_uid: int, files: AttemptFiles) -> Exit:
        """End whatever is left of an attempt whose leading process has ended, and say how it ended."""
        ...

    def stop(self, handle: Handle, *, kill: bool) -> None:
        """Ask the attempt to checkpoint and stop (SIGTERM), or kill every process of it."""
        ...

    def restarted_since(self, moment: float) -> bool:
        """Did the machine (or whatever runs the attempts) restart after ``moment``, stopping
        every attempt that ran then?"""
        ...

    def processes_of(self, attempts: Sequence[tuple[Handle, int]], pids: Collection[int]) -> dict[str, set[int]]:
        """Which of ``pids`` belong to each of ``attempts`` (handle, owner uid), by attempt folder."""
        ...

    def run_as(self, account: Account, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        """Run a short program as ``account`` (coreutils at intake), in /; may raise
        subprocess.TimeoutExpired, OSError or subprocess.SubprocessError."""
        ...
