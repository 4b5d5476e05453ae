"""What the two commands that supervise in the foreground (`daemon` and `run`) share: one
process per state directory (a lock), and what SIGTERM/SIGINT do to their attempts."""

from __future__ import annotations

import fcntl
import os
import signal
import threading
from pathlib import Path
from typing import Any

from oomguard.daemon.cli.output import EXIT_LOCKED, CliError


class DaemonLock:
    """One daemon per state directory: an flock on STATE/daemon.lock."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            raise CliError(f"another oomguard daemon (pid {holder}) is using {path.parent}; stop it first", EXIT_LOCKED) from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(str(os.getpid()))
        self.file.flush()


def stop_on_signals(supervisor: Any, *, stop_jobs: bool = True, wake: threading.Event | None = None) -> None:
    """SIGTERM/SIGINT: checkpoint and stop running attempts (``stop_jobs``), or leave them
    running for the next daemon to adopt; ``wake`` is set so that a waiting loop acts at once."""

    def handler(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if stop_jobs:
            if not supervisor.stopping:
                print(f"received {name}: checkpointing and stopping running attempts", flush=True)
            supervisor.stop_all()
        else:
            print(f"received {name}: leaving running attempts running; the next daemon adopts them", flush=True)
            supervisor.leave_all()
        if wake is not None:
            wake.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
