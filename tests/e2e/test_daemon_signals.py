"""The daemon's loop under signals: a burst of SIGCHLD (children ending together) never leaves it
hung and deaf to SIGTERM. It once set a threading.Event from the SIGCHLD handler, which
deadlocks when the handler interrupts that Event's own wait (CI saw the daemon hang for good)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.e2e.conftest import oomguard, tiny_job, wait_for


def test_a_burst_of_sigchld_leaves_the_daemon_taking_jobs_and_stopping_on_sigterm(tmp_path: Path, daemon_factory) -> None:
    daemon = daemon_factory()
    assert daemon.process is not None
    deadline = time.monotonic() + 4.0
    sent = 0
    while time.monotonic() < deadline and daemon.alive():
        os.kill(daemon.process.pid, signal.SIGCHLD)
        sent += 1
        time.sleep(0.0002)
    assert daemon.alive(), daemon.output()[-2000:]
    assert sent > 2000
    # Still supervising: a job submitted now is taken.
    oomguard("submit", str(tiny_job(tmp_path, "after-burst", max_steps=400)), state_dir=daemon.state_dir, check=True)
    wait_for(lambda: daemon.show("1")["state"] == "running", 60, "the daemon to start the job")
    started = time.monotonic()
    assert daemon.stop(timeout=60) == 0
    assert time.monotonic() - started < 60
    assert "received SIGTERM: leaving running attempts running" in daemon.output()
    assert "oomguard daemon stopped" in daemon.output()
