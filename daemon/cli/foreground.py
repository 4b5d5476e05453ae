"""What the two commands that supervise in the foreground (`daemon` and `run`) share: one
process per state directory (a lock), and what SIGTERM/SIGINT do to their attempts."""

from __future__ import annotations

import fcntl
import os
import signal
from pathlib import Path
from typing import Any

from oomguard.daemon.cli.output import EXIT_LOCKED, CliError
from oomguard.daemon.wakeup import Wakeup


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


class StopSignals:
    """SIGTERM/SIGINT: checkpoint and stop running attempts (``stop_jobs``), or leave them
    running for the next daemon to adopt.

    The handler only notes the signal and wakes the loop; the loop acts on it (``act``). A
    handler runs between two bytecodes of whatever the main thread was doing, inside the
    supervisor's tick with the store mid-transaction as likely as anywhere, so it must not
    call into the supervisor itself."""

    def __init__(self, supervisor: Any, *, stop_jobs: bool = True, wake: Wakeup | None = None) -> None:
        self.supervisor, self.stop_jobs, self.wake = supervisor, stop_jobs, wake
        self.received: list[str] = []  # appended by the handler, in the order they came
        self.acted_on = 0
        signal.signal(signal.SIGTERM, self._note)
        signal.signal(signal.SIGINT, self._note)

    def _note(self, signum: int, frame: object) -> None:
        self.received.append(signal.Signals(signum).name)
        if self.wake is not None:
            self.wake.set()

    def act(self) -> None:
        """What the signals received since the last call ask for. A second SIGTERM asks the
        attempts started meanwhile to stop too."""
        while self.acted_on < len(self.received):
            name = self.received[self.acted_on]
            self.acted_on += 1
            if self.stop_jobs:
                if not self.supervisor.stopping:
                    print(f"received {name}: checkpointing and stopping running attempts", flush=True)
                self.supervisor.stop_all()
            else:
                print(f"received {name}: leaving running attempts running; the next daemon adopts them", flush=True)
                self.supervisor.leave_all()
