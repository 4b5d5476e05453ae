"""The signals the shim handles: it outlives SIGTERM/SIGINT/SIGHUP and passes each on to the
attempt's processes that its process group missed (ranks in sessions of their own), and SIGUSR1
(a cluster's time limit is near) to all of them when asked to (--pass-usr1), again every
USR1_AGAIN_SECONDS until the command ends. The command starts with SIGUSR1 ignored, until it
installs a handler of its own (daemon/shim.py explains why)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

from oomguard.daemon import kernel_oom, processes

# SIGUSR1 (a cluster's time limit is near) is passed on again this often until the command ends.
USR1_AGAIN_SECONDS = 5.0


def pass_signals_on(ours: Callable[[], set[int]], *, pass_usr1: bool) -> list[str]:
    """Outlive SIGTERM/SIGINT/SIGHUP, passing each on to the attempt's processes outside our
    group, and SIGUSR1, passing it on to all of them when ``pass_usr1``; returns the list of
    the names of those received (it fills as they come)."""
    received: list[str] = []

    def note(signum: int, frame: object) -> None:
        received.append(signal.Signals(signum).name)
        # The daemon signalled our process group; ranks in sessions of their own missed it.
        group = os.getpgrp()
        processes.send({pid for pid in ours() if _group_of(pid) not in (group, None)}, signum)

    def time_limit_near(signum: int, frame: object) -> None:
        received.append(signal.Signals(signum).name)
        if pass_usr1:  # only the shim was signalled (--signal=B:)
            processes.send(ours(), signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, note)
    signal.signal(signal.SIGUSR1, time_limit_near)
    return received


def pass_usr1_again(ours: Callable[[], set[int]], received: list[str], status: dict[str, Any]) -> float | None:
    """SIGUSR1 passed on again every USR1_AGAIN_SECONDS until the command ends: Slurm may send
    it early, before the runner has its handler (the command starts with SIGUSR1 ignored, so
    that one that comes too soon is not its death); a second one changes nothing. Returns the
    seconds until it is due again; None before the first SIGUSR1 (nothing is due)."""
    if "SIGUSR1" not in received:
        return None
    now = time.monotonic()
    due = status.setdefault("usr1_again_at", now) + USR1_AGAIN_SECONDS
    if now < due:
        return due - now
    status["usr1_again_at"] = now
    processes.send(ours(), signal.SIGUSR1)
    return USR1_AGAIN_SECONDS


def ignore_usr1_and_prefer_me() -> None:
    """The command's start (before it execs): SIGUSR1 ignored until it installs its own
    handler, and the kernel's first choice under host memory pressure."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    kernel_oom.prefer_me()


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None
