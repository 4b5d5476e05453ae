"""How an attempt's processes are started, watched, adopted and stopped: the Launcher.

The supervisor decides *what* runs (the job, its plan, the command line, the environment);
a Launcher decides *where and how*. `LocalLauncher` (daemon/launch/local.py) starts the attempt
shim in a session of its own on this machine; it is the only place in the daemon that starts
or signals a process. Tests of scheduling and lifecycle use a fake one (tests/fakes.py).

`SlurmLauncher` (daemon/launch/slurm.py) submits each attempt to a Slurm cluster instead: the
same shim runs there as a batch job, and Slurm places and queues it.

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
class Resources:
    """What one attempt asks a batch scheduler for (None: the daemon config's default). A
    local launcher places by GPUs instead and does not read them."""

    gpus: int = 1
    gpu_type: str | None = None
    host_memory: int | None = None  # bytes
    cpus: int | None = None
    time_limit: int | None = None  # seconds


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
    resources: Resources = Resources()
    # How the attempt is named where a scheduler lists it ("oomguard-JOB-ATTEMPT").
    label: str = "oomguard"


@dataclass(frozen=True)
class Handle:
    """A started attempt, as the store keeps it: its leading process and that process's start
    time (a pid alone may be reused; pid and start time name one process for good)."""

    attempt_dir: str
    pid: int | None  # None: recorded, but no process was found for it
    started: int | None
    # Its job id at a batch scheduler (Slurm), which names it there for good (None: local).
    scheduler_id: str | None = None


@dataclass(frozen=True)
class QueueState:
    """Where a batch scheduler has an attempt now: "PENDING" with why ("Priority",
    "Resources"), "RUNNING", ..., and how often it requeued it itself (a node failure, a
    preemption)."""

    state: str
    reason: str | None
    restarts: int
    # A pending job the scheduler will never start as it was submitted: why, and what to change.
    never_starts: str | None = None


@dataclass(frozen=True)
class SchedulerEnd:
    """How a batch scheduler ended an attempt: its state ("COMPLETED", "TIMEOUT",
    "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "CANCELLED", ...) and reason, and the limits
    it ran under (None where the scheduler no longer knows the job)."""

    state: str | None
    reason: str | None = None
    time_limit: int | None = None  # seconds
    host_memory: int | None = None  # bytes


@dataclass(frozen=True)
class Exit:
    """How an attempt's processes ended, as far as the launcher saw it."""

    returncode: int | None  # None when nothing recorded it (killed with its shim, or no daemon watched)
    recorded: bool  # an exit status was recorded (exit.json), or the launcher watched the process end
    failed_process: dict[str, Any] | None = None  # the first process that recorded its own death
    oom_kills: int | None = None  # the kernel's OOM kills while it ran
    no_folder: bool = False  # it could not enter the workdir or make the attempt's folder, as the owner
    no_room: bool = False  # the disk was full (or the owner's quota used up): no folder, or no exit status recorded
    scheduler: SchedulerEnd | None = None  # how a batch scheduler ended it (None: local)


class Launcher(Protocol):
    # Each attempt waits in a batch scheduler's queue before it runs (a new process is costly).
    queues_attempts: bool

    def start(self, request: LaunchRequest) -> Handle:
        """Start the attempt; LaunchFailed when it cannot be started."""
        ...

    def adopt(self, handle: Handle, owner_uid: int) -> Handle:
        """An attempt an earlier daemon started, as its row has it (no pid nor scheduler id:
        recorded just before its start, looked for among the owner's)."""
        ...

    def running(self, handle: Handle) -> bool: ...

    def queue_state(self, handle: Handle) -> QueueState | None:
        """Where a batch scheduler has the attempt now (None: no scheduler, or not known)."""
        ...

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
