"""The attempts of this machine: a shim (daemon/shim.py) per attempt, in a session of its own.

The only place in the daemon that starts or signals a process. The shim runs as the job's
owner, enters the workdir itself, writes attempt.json from its standard input, runs the command
and records its exit status in the attempt's folder (exit.json), so that a restarted daemon
adopts a running attempt (pid + start time) or collects how it ended while it was away.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomguard.daemon import processes
from oomguard.daemon.as_user import spawn_options
from oomguard.daemon.launch import Exit, Handle, LaunchRequest, QueueState
from oomguard.daemon.log_cap import check_limit
from oomguard.daemon.shim import CANNOT_USE_FOLDER, EXIT_STATUS, NO_ROOM_FOR_FOLDER
from oomguard.daemon.users import Account
from oomguard.jobs.attempt import AttemptFiles
from oomguard.strategies.errors import LaunchFailed

SHIM_MODULE = "oomguard.daemon.shim"


class LocalLauncher:
    queues_attempts = False

    def __init__(self, *, log_limit_bytes: int | None = None) -> None:
        """``log_limit_bytes``: the cap on each attempt's log, head and tail together
        (daemon/log_cap.py; ValueError below its least); None: the shim's default."""
        # The shims this daemon started, by pid: their exit status is ours to collect (a zombie
        # keeps its pid until then, so the pid cannot name another process meanwhile).
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self.log_limit_bytes = check_limit(log_limit_bytes) if log_limit_bytes is not None else None

    def start(self, request: LaunchRequest) -> Handle:
        # Every folder of the job is entered by the shim, as the job's owner, never by the
        # daemon: Popen changes to its cwd= before it drops root's rights, so the shim starts
        # in / and enters the workdir itself (daemon/shim.py). The daemon (root, in system
        # mode) must not enter a folder for them that they may not, follow a link they put on
        # its path, nor tell them, by failing here or not, whether a folder exists that they
        # cannot see.
        options = ["--workdir", str(request.workdir)]
        if request.cwd:
            options += ["--cwd", request.cwd]
        if self.log_limit_bytes is not None:
            options += ["--log-limit", str(self.log_limit_bytes)]
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", SHIM_MODULE, str(request.attempt_dir), *options, "--", *request.argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=dict(request.env),
                cwd="/",
                start_new_session=True,
                **spawn_options(request.owner),
            )
        except OSError as error:
            owner = request.owner.name
            raise LaunchFailed(
                f"cannot start the attempt's shim ({sys.executable}) as {owner}: {error.strerror or error}",
                f"let {owner} run {sys.executable} (README: For installers)",
            ) from error
        self._children[process.pid] = process
        handle = Handle(str(request.attempt_dir), process.pid, processes.start_ticks(process.pid))
        assert process.stdin is not None
        try:
            process.stdin.write(request.stdin)
            process.stdin.close()
        except BrokenPipeError:
            pass  # the shim died at once; collecting it records how
        return handle

    def adopt(self, handle: Handle, owner_uid: int) -> Handle:
        if handle.pid is None:
            found = _find_shim(handle.attempt_dir)
            # Anyone can start a process with that command line: only the owner's is the shim.
            if found is not None and processes.real_uid(found[0]) == owner_uid:
                return Handle(handle.attempt_dir, *found)
        return handle

    def queue_state(self, handle: Handle) -> QueueState | None:
        return None  # no queue: an attempt runs as soon as it starts

    def running(self, handle: Handle) -> bool:
        if handle.pid is None:
            return False
        child = self._children.get(handle.pid)
        if child is not None:
            return child.poll() is None
        return processes.is_running(handle.pid, handle.started)

    def collect(self, handle: Handle, owner_uid: int, files: AttemptFiles) -> Exit:
        child = self._children.pop(handle.pid, None) if handle.pid is not None else None
        if handle.pid is not None:
            # The shim is gone; whatever of its group is left (a runner whose shim was killed)
            # must not go on writing into the workdir beside the next attempt.
            _kill_group(handle.pid)
            # Ranks that left the group (a session of their own) and outlived the shim.
            # Only the owner's: anyone may mark a process of their own with this attempt's folder.
            processes.send(processes.marked_with(handle.attempt_dir, owner_uid), signal.SIGKILL)
        ended = exit_from_files(files)
        # A shim of ours that could not enter the workdir, as the owner, had nowhere to write.
        no_folder = not ended.recorded and child is not None and child.returncode in (CANNOT_USE_FOLDER, NO_ROOM_FOR_FOLDER)
        return Exit(
            # Ended as this daemon watched it, recorded or not.
            returncode=ended.returncode, recorded=ended.recorded or child is not None, failed_process=ended.failed_process,
            oom_kills=ended.oom_kills, no_folder=no_folder, no_room=no_folder and child is not None and child.returncode == NO_ROOM_FOR_FOLDER,
        )

    def stop(self, handle: Handle, *, kill: bool) -> None:
        pid = handle.pid
        if pid is None or not processes.is_running(pid, handle.started):
            return  # not started yet, or gone (its pid may belong to someone else by now)
        if kill:
            # Nothing handles SIGKILL: the ranks in sessions of their own are killed here, not
            # by the shim (SIGTERM reaches them through the shim).
            processes.send(processes.of_attempt(pid, handle.attempt_dir), signal.SIGKILL)
        try:
            os.killpg(pid, signal.SIGKILL if kill else signal.SIGTERM)
        except ProcessLookupError:
            pass

    def restarted_since(self, moment: float) -> bool:
        return _booted_after(moment)

    def processes_of(self, attempts: Sequence[tuple[Handle, int]], pids: Collection[int]) -> dict[str, set[int]]:
        # Which attempt each process belongs to: its mark (the owner's processes only), or the shim's group.
        marked = processes.marks() if pids else {}
        found: dict[str, set[int]] = {}
        for handle, owner_uid in attempts:
            found[handle.attempt_dir] = {
                pid for pid in pids
                if (marked.get(pid) == handle.attempt_dir and processes.real_uid(pid) == owner_uid) or _in_group(pid, handle.pid)
            }
        return found

    def run_as(self, account: Account, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        return run_as(account, argv, timeout)


def run_as(account: Account, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """A short program as ``account`` (every launcher's run_as). In /, never in a folder of the
    user's (Popen enters cwd= before it drops root's rights)."""
    return subprocess.run(
        argv, **spawn_options(account), cwd="/", env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"}, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=timeout,
    )


@dataclass(frozen=True)
class ShimExit:
    """What the shim's exit.json says (every launcher's collect reads it)."""

    returncode: int | None
    recorded: bool  # the shim wrote exit.json
    failed_process: dict[str, Any] | None
    oom_kills: int | None


def exit_from_files(files: AttemptFiles) -> ShimExit:
    """How the attempt's command ended, as its shim recorded it."""
    status = files.read_json(EXIT_STATUS)
    if not isinstance(status, dict):
        status = None
    returncode = status.get("returncode") if status and isinstance(status.get("returncode"), int) else None
    failed = status.get("failed_process") if status and isinstance(status.get("failed_process"), dict) else None
    oom_kills = status.get("oom_kills") if status and isinstance(status.get("oom_kills"), int) else None
    return ShimExit(returncode, status is not None, failed, oom_kills)


def _kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left of it (a process group id is not reused while it has members)


def _find_shim(attempt_dir: str) -> tuple[int, int | None] | None:
    """The shim of ``attempt_dir`` among the running processes, by its command line."""
    wanted = [SHIM_MODULE.encode(), attempt_dir.encode()]
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            arguments = (pid_dir / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(arguments) > 3 and arguments[1:3] == [b"-m", wanted[0]] and arguments[3] == wanted[1]:
            started = processes.start_ticks(int(pid_dir.name))
            if started is not None:
                return int(pid_dir.name), started
    return None


def _in_group(pid: int, group: int | None) -> bool:
    """Is ``pid`` in the process group ``group`` (an attempt's shim leads its group)?"""
    try:
        return os.getpgid(pid) == group
    except OSError:
        return False


def _booted_after(moment: float) -> bool:
    """Did the machine start after ``moment`` (so whatever ran then was stopped by a reboot)?"""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return int(line.split()[1]) > moment
    return False
