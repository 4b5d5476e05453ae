"""Real `oomguard` processes in a temp dir: the CLI and the daemon, as a user runs them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from oomguard.daemon.cli.state import find_job, job_record
from oomguard.daemon.paths import StateDir
from oomguard.daemon.store import Store
from tests.jobs_helpers import TINY_JOB

# Emulated peaks of TINY_JOB (measured): micro-batch 8 about 4.1 MiB, 4 about 2.5 MiB. This
# cap lets the full batch run until step 5, then only micro-batch 4 fits: the first OOM comes
# after the first checkpoint (step 4).
TINY_CAP = "64MiB,3500KiB@5"


def tiny_job(folder: Path, name: str = "tiny", max_steps: int = 12) -> Path:
    path = folder / f"{name}.toml"
    path.write_text(TINY_JOB.format(name=name, batch_size=8, max_steps=max_steps, checkpoint_every_steps=4, keep_checkpoints=2))
    return path


def oomguard(
    *args: str, state_dir: Path | None = None, timeout: float = 120, check: bool = False, cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it, in ``cwd`` (by default the tests' own folder)."""
    prefix = ["--state-dir", str(state_dir)] if state_dir else []
    result = subprocess.run(
        [sys.executable, "-m", "oomguard.daemon.cli", *prefix, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"oomguard {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class Daemon:
    """An `oomguard daemon` process; its output goes to STATE/daemon.out."""

    def __init__(self, state_dir: Path, *extra: str) -> None:
        self.state_dir = state_dir
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None
        self.output_path = state_dir / "daemon.out"

    def start(self) -> Daemon:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        output = self.output_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "oomguard.daemon.cli", "--state-dir", str(self.state_dir), "daemon", "--poll-interval", "0.1", *self.extra],
            stdout=output,
            stderr=subprocess.STDOUT,
        )
        wait_for(lambda: "watching" in self.output(), 30, "the daemon to start")
        return self

    def output(self) -> str:
        return self.output_path.read_text() if self.output_path.exists() else ""

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 90) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def show(self, job: str) -> dict[str, Any]:
        """The record `oomguard show JOB --json` prints, read in this process: tests poll it every
        0.2 s, and a CLI process per poll (about 0.4 s of CPU) took a core from the jobs under
        test. tests/integration/test_cli.py runs `show --json` itself."""
        store = Store(StateDir(self.state_dir).database, readonly=True)
        try:
            return json.loads(json.dumps(job_record(store, find_job(store, job))))
        finally:
            store.close()

    def wait_job(self, job: str, timeout: float = 180) -> dict[str, Any]:
        return wait_for(
            lambda: (record := self.show(job))["state"] in ("finished", "failed", "cancelled") and record, timeout, f"job {job} to end"
        )


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def make(*extra: str, state_dir: Path | None = None) -> Daemon:
        daemon = Daemon(state_dir or tmp_path / "state", *extra).start()
        started.append(daemon)
        return daemon

    yield make
    for daemon in started:
        if daemon.alive():
            daemon.stop()
    kill_leftovers(tmp_path)


def kill_leftovers(folder: Path) -> None:
    """Leave no shim or runner of a test behind: they run in sessions of their own."""
    for pid_dir in Path("/proc").iterdir():
        if pid_dir.name.isdigit():
            try:
                cmdline = (pid_dir / "cmdline").read_bytes()
            except OSError:
                continue
            if b"oomguard" in cmdline and str(folder).encode() in cmdline:
                try:
                    os.kill(int(pid_dir.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture
def lab(accounts, others_can_run_oomguard) -> Iterator[Path]:
    """A folder every user can reach (pytest's tmp_path is private to root), with a home per
    user (alice, bob, carol); whatever ran there is ended with it."""
    folder = Path(tempfile.mkdtemp(prefix="oomguard-lab-", dir="/tmp"))
    folder.chmod(0o755)
    for name in ("alice", "bob", "carol"):
        home = folder / name
        home.mkdir()
        shutil.chown(home, accounts[name].uid, accounts[name].gid)
    try:
        yield folder
    finally:
        kill_leftovers(folder)
        shutil.rmtree(folder, ignore_errors=True)
