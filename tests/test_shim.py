"""The attempt shim: it writes the attempt's configuration, runs the command in the
attempt's log, and records the exit status for whichever daemon looks next."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from oomguard.daemon import processes
from oomguard.daemon.shim import EXIT_STATUS


def start_shim(attempt_dir: Path, *command: str, config: str = '{"number": 1}') -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, "-m", "oomguard.daemon.shim", str(attempt_dir), "--", *command],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    assert process.stdin is not None
    process.stdin.write(config.encode())
    process.stdin.close()
    return process


def test_the_shim_writes_the_config_runs_the_command_and_records_its_exit(tmp_path: Path):
    attempt = tmp_path / "attempts" / "001"
    shim = start_shim(attempt, sys.executable, "-c", "import sys; print('hello from the runner'); sys.exit(3)")
    assert shim.wait(timeout=30) == 0
    assert json.loads((attempt / "attempt.json").read_text()) == {"number": 1}
    assert "hello from the runner" in (attempt / "output.log").read_text()
    status = json.loads((attempt / EXIT_STATUS).read_text())
    assert status["returncode"] == 3 and status["signals"] == []


def test_sigterm_to_the_group_reaches_the_command_and_the_shim_records_it(tmp_path: Path):
    attempt = tmp_path / "a"
    script = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\nprint('ready', flush=True)\ntime.sleep(60)"
    shim = start_shim(attempt, sys.executable, "-c", script)
    deadline = time.monotonic() + 30
    while "ready" not in ((attempt / "output.log").read_text() if (attempt / "output.log").exists() else ""):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(shim.pid, signal.SIGTERM)
    assert shim.wait(timeout=30) == 0
    status = json.loads((attempt / EXIT_STATUS).read_text())
    assert status["returncode"] == 75 and status["signals"] == ["SIGTERM"]


def test_a_command_that_cannot_start_is_recorded(tmp_path: Path):
    shim = start_shim(tmp_path / "b", str(tmp_path / "no-such-program"))
    assert shim.wait(timeout=30) == 127
    status = json.loads((tmp_path / "b" / EXIT_STATUS).read_text())
    assert status["returncode"] == 127 and "No such file" in status["error"]
    assert "cannot start" in (tmp_path / "b" / "output.log").read_text()


def test_bad_usage(tmp_path: Path):
    done = subprocess.run([sys.executable, "-m", "oomguard.daemon.shim", str(tmp_path)], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and "usage:" in done.stderr


def test_a_process_is_known_by_pid_and_start_time():
    me = processes.start_ticks(os.getpid())
    assert me is not None and processes.is_running(os.getpid(), me)
    assert not processes.is_running(os.getpid(), me + 1)  # the same pid, another process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while processes.start_ticks(child.pid) is not None:  # a zombie until collected: not running
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child.wait()
    assert processes.start_ticks(child.pid) is None


def test_attempt_files_are_read_only_as_regular_files_never_through_a_link(tmp_path: Path):
    """The daemon runs as root and reads files in users' folders: a link or a FIFO there is
    treated as nothing reported, never followed or waited on."""
    from oomguard.jobs.attempt import read_json

    secret = tmp_path / "secret.json"
    secret.write_text('{"root": "only"}')
    (tmp_path / "heartbeat.json").symlink_to(secret)
    os.mkfifo(tmp_path / "outcome.json")
    (tmp_path / "exit.json").write_text('{"returncode": 0')  # half written
    (tmp_path / "good.json").write_text('{"returncode": 0}')
    assert read_json(tmp_path / "heartbeat.json") is None
    assert read_json(tmp_path / "outcome.json") is None  # returns at once, no writer needed
    assert read_json(tmp_path / "exit.json") is None
    assert read_json(tmp_path / "missing.json") is None
    assert read_json(tmp_path / "good.json") == {"returncode": 0}
