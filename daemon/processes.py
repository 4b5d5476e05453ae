"""Which processes are an attempt's, and are they still the ones we started?

A pid alone can be reused after a reboot or a long run; the pid and its start time (in clock
ticks since boot, /proc/PID/stat field 22) name one process for good. An attempt's processes
are not just the shim's process group: launchers such as torchrun start every rank in a
session of its own, so they are found as the shim's descendants and by the mark in their
environment."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path


def start_ticks(pid: int) -> int | None:
    """The start time of a live process, None when it is gone (or a zombie: it has ended and
    only waits for its parent to collect it)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')'.
    fields = text[text.rindex(")") + 2:].split()
    state, start = fields[0], fields[19]
    if state in ("Z", "X"):
        return None
    return int(start)


def is_running(pid: int, started: int | None) -> bool:
    ticks = start_ticks(pid)
    return ticks is not None and (started is None or ticks == started)


# The environment variable that marks every process of an attempt with its attempt directory.
# The shim sets it for the command; launchers pass their environment on to the ranks they
# start, so the mark finds ranks that left the shim's session (torchrun starts each rank in a
# session of its own) or were orphaned when their launcher died.
ATTEMPT_DIR_ENV = "OOMGUARD_ATTEMPT_DIR"


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live (not zombie) process."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue  # ended while we looked
        fields = text[text.rindex(")") + 2:].split()
        if fields[0] not in ("Z", "X"):
            parents[int(entry.name)] = int(fields[1])
    return parents


def descendants(pid: int) -> set[int]:
    """The live processes below ``pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def real_uid(pid: int) -> int | None:
    """The user a live process runs as (its real uid, /proc/PID/status), None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def marks(uid: int | None = None) -> dict[int, str]:
    """pid -> attempt directory, for every live process that carries an attempt's mark (of
    those we may read: our own user's, or all as root). With ``uid``, only that user's
    processes: the mark is an environment variable anyone may put in their own processes, so
    as root only the attempt's owner's count as the attempt's (another user's process marked
    with it must neither be counted as its memory nor be ended with it)."""
    prefix = f"{ATTEMPT_DIR_ENV}=".encode()
    found: dict[int, str] = {}
    for pid in _parents():
        try:
            environment = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue  # another user's process, or gone
        for variable in environment.split(b"\0"):
            if variable.startswith(prefix):
                if uid is None or real_uid(pid) == uid:
                    found[pid] = variable[len(prefix):].decode(errors="replace")
                break
    return found


def marked_with(attempt_dir: str, uid: int | None = None) -> set[int]:
    """The live processes marked as processes of ``attempt_dir`` (with ``uid``: of that user)."""
    return {pid for pid, mark in marks(uid).items() if mark == attempt_dir}


def of_attempt(shim_pid: int | None, attempt_dir: str) -> set[int]:
    """Every live process of one attempt but the caller: the shim's descendants and whatever
    carries the attempt's mark."""
    found = marked_with(attempt_dir)
    if shim_pid is not None:
        found |= descendants(shim_pid)
    found.discard(os.getpid())
    return found


def send(pids: set[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # gone, or not ours to signal


def end_all(find: Callable[[], set[int]], grace_seconds: float) -> set[int]:
    """Ask every process ``find`` returns to stop (SIGTERM), then kill what is left after
    ``grace_seconds`` (SIGKILL). Returns the processes that were signalled."""
    signalled = find()
    send(signalled, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while signalled and time.monotonic() < deadline:
        time.sleep(0.1)
        left = find()
        if not left:
            return signalled
        send(left - signalled, signal.SIGTERM)  # started meanwhile (a launcher restarting ranks)
        signalled |= left
    left = find()
    send(left, signal.SIGKILL)
    return signalled | left
