"""Stand-ins for the parts of the daemon that touch the world: a Launcher that starts nothing
and a Clock that moves only when a test moves it. With them, Supervisor.drain() runs the
daemon's loop synchronously: no process, no sleep. Also store rows made without a store, for
the scheduler's pure functions."""

from __future__ import annotations

import itertools
import json
import subprocess
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from oomguard.daemon.launch import Exit, Handle, LaunchRequest, QueueState
from oomguard.daemon.store_rows import AttemptRow, JobRow
from oomguard.daemon.users import Account
from oomguard.jobs.attempt import OUTCOME, AttemptFiles
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.errors import LaunchFailed


def job_row(**fields: Any) -> JobRow:
    """A queued job's row; ``fields`` as the store holds them (``plan`` as JSON text)."""
    stored: dict[str, Any] = {
        "id": 1, "name": "j", "owner": "me", "spec": "{}", "state": "queued", "priority": 0, "submitted_at": 0.0, "workdir": "/w",
        "plan": json.dumps({"batch_size": 4, "micro_batch": 4}), "cancel_requested": 0,
    }
    return JobRow.from_stored({**stored, **fields})


def attempt_row(**fields: Any) -> AttemptRow:
    """An attempt's row; ``fields`` as the store holds them (``outcome`` as JSON text)."""
    stored: dict[str, Any] = {"id": 1, "job_id": 1, "number": 1, "plan": "{}", "directory": "/w/attempts/001", "started_at": 0.0}
    return AttemptRow.from_stored({**stored, **fields})


class FakeClock:
    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start
        self.ticks = 0.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.ticks

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.ticks += seconds


class FakeLauncher:
    """Records what it is asked to start; an attempt runs until the test ends it with
    finish(), which writes what its runner and shim would have written (outcome.json)."""

    queues_attempts = False

    def __init__(self) -> None:
        self.started: list[LaunchRequest] = []
        self.stops: list[tuple[str, bool]] = []  # (attempt folder, kill)
        self.adopted: list[Handle] = []
        self.fail_with: LaunchFailed | None = None  # start() raises it
        self.failures_left: int | None = None  # with fail_with: how many starts fail (None: every one)
        self._alive: set[str] = set()
        # Where a batch scheduler has each attempt, as a test sets it (by attempt folder).
        self.queue: dict[str, QueueState] = {}
        self._exits: dict[str, Exit] = {}
        self._pids = itertools.count(10_000)

    def start(self, request: LaunchRequest) -> Handle:
        if self.fail_with is not None and self.failures_left != 0:
            if self.failures_left is not None:
                self.failures_left -= 1
            raise self.fail_with
        self.started.append(request)
        Path(request.attempt_dir).mkdir(parents=True, exist_ok=True)  # the shim makes it, as the owner
        self._alive.add(str(request.attempt_dir))
        return Handle(str(request.attempt_dir), next(self._pids), 1)

    def adopt(self, handle: Handle, owner_uid: int) -> Handle:
        self.adopted.append(handle)
        return handle

    def running(self, handle: Handle) -> bool:
        return handle.attempt_dir in self._alive

    def queue_state(self, handle: Handle) -> QueueState | None:
        return self.queue.get(handle.attempt_dir)

    def collect(self, handle: Handle, owner_uid: int, files: AttemptFiles) -> Exit:
        return self._exits.pop(handle.attempt_dir, Exit(returncode=None, recorded=False))

    def stop(self, handle: Handle, *, kill: bool) -> None:
        self.stops.append((handle.attempt_dir, kill))

    def restarted_since(self, moment: float) -> bool:
        return False

    def processes_of(self, attempts: Sequence[tuple[Handle, int]], pids: Collection[int]) -> dict[str, set[int]]:
        return {handle.attempt_dir: set() for handle, _ in attempts}

    def run_as(self, account: Account, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        raise AssertionError(f"a unit test asked to run {argv} as {account.name}")

    # What tests do to the attempts ------------------------------------------------------------

    def running_folders(self) -> set[str]:
        return set(self._alive)

    def finish(self, request: LaunchRequest, outcome: Outcome | None = None, returncode: int | None = 0) -> None:
        """End the attempt: its runner reported ``outcome`` (None: it wrote no report) and its
        shim recorded ``returncode``."""
        folder = Path(request.attempt_dir)
        folder.mkdir(parents=True, exist_ok=True)  # the shim makes it, as the owner
        if outcome is not None:
            (folder / OUTCOME).write_text(json.dumps(outcome.to_dict()))
        self._exits[str(folder)] = Exit(returncode=returncode, recorded=True)
        self._alive.discard(str(folder))

    def lose(self, request: LaunchRequest) -> None:
        """The attempt's processes are gone without a trace (killed with its shim, or never started)."""
        self._alive.discard(str(request.attempt_dir))
