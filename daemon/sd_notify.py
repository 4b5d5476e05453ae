"""systemd's notify protocol (sd_notify) without libsystemd: datagrams to $NOTIFY_SOCKET.

Under a unit with Type=notify the daemon says READY=1 once it watches the spool, WATCHDOG=1
at half the unit's WatchdogSec (systemd restarts a daemon that stops pinging), and
STOPPING=1 on the way out. Without $NOTIFY_SOCKET (a terminal, tests) every call does nothing.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping


class SystemdNotifier:
    def __init__(self, env: Mapping[str, str] = os.environ) -> None:
        self.address = env.get("NOTIFY_SOCKET") or None
        usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
        # WATCHDOG_PID names the process the watchdog is meant for: not ours, not our job.
        ours = pid is None or pid == str(os.getpid())
        self.watchdog_interval = int(usec) / 1e6 / 2 if usec and ours else None
        self._last_ping = 0.0
        self._failed = False

    def send(self, message: str) -> bool:
        """Send one notification; False when there is no socket or it cannot be reached."""
        if self.address is None:
            return False
        # "@name" is a socket in the abstract namespace.
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.connect(target)
                sock.sendall(message.encode())
        except OSError as error:
            if not self._failed:  # say it once, not at every watchdog ping
                print(f"cannot notify systemd at {self.address}: {error}", flush=True)
                self._failed = True
            return False
        return True

    def ready(self, status: str) -> None:
        self.send(f"READY=1\nSTATUS={status}")

    def stopping(self) -> None:
        self.send("STOPPING=1")

    def tick(self) -> None:
        """Ping the watchdog when half its interval has passed (called from the main loop,
        so a hung loop stops the pings and systemd restarts the daemon)."""
        if self.watchdog_interval is None:
            return
        now = time.monotonic()
        if now - self._last_ping >= self.watchdog_interval:
            self.send("WATCHDOG=1")
            self._last_ping = now
