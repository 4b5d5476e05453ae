"""The unit files in systemd/ (verified by systemd's own tools where they exist) and the
daemon's side of Type=notify: READY, WATCHDOG and STOPPING over a real datagram socket."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.daemon.sd_notify import SystemdNotifier

ROOT = Path(__file__).parents[2]
UNITS = ["oomguard.service", "oomguard-user.service"]
OOMGUARD = Path(sys.executable).with_name("oomguard")


def with_real_exec_start(unit: Path, folder: Path) -> Path:
    """The unit as an install would have it: ExecStart pointing at an installed oomguard."""
    lines = [f"ExecStart={OOMGUARD} daemon" if line.startswith("ExecStart=") else line for line in unit.read_text().splitlines()]
    copy = folder / unit.name
    copy.write_text("\n".join(lines) + "\n")
    return copy


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("name", UNITS)
def test_unit_files_verify(tmp_path, name):
    unit = with_real_exec_start(ROOT / "systemd" / name, tmp_path)
    verify(unit)
    text = unit.read_text()
    # What the daemon relies on: notify with a watchdog, restarts, attempts left running, a
    # training process killed for host memory not taking the service down.
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "KillMode=process", "OOMPolicy=continue"):
        assert line in text


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_dashboards_unit_verifies_and_serves_on_loopback(tmp_path):
    unit = tmp_path / "oomguard-web.service"
    text = (ROOT / "systemd" / "oomguard-web.service").read_text().replace("/usr/local/bin/oomguard", str(OOMGUARD))
    unit.write_text(text)
    verify(unit)
    assert f"ExecStart={OOMGUARD} serve --listen 127.0.0.1:" in text and "Restart=on-failure" in text


def verify(unit: Path) -> None:
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr.strip() == "", result.stderr


@pytest.mark.skipif(shutil.which("systemd-tmpfiles") is None, reason="systemd-tmpfiles is not installed")
def test_tmpfiles_make_an_inbox_everyone_may_write_but_not_list(tmp_path):
    result = subprocess.run(
        ["systemd-tmpfiles", "--create", f"--root={tmp_path}", str(ROOT / "systemd" / "oomguard.tmpfiles")],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    state = tmp_path / "var" / "lib" / "oomguard"
    assert (state / "spool" / "inbox").stat().st_mode & 0o7777 == 0o1733
    assert (state / "spool" / "rejected").stat().st_mode & 0o7777 == 0o700
    assert (state / "jobs").is_dir()
    assert (state / "secrets").stat().st_mode & 0o7777 == 0o700


def listen(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(30)
    return sock


def test_without_a_socket_nothing_is_sent():
    notifier = SystemdNotifier({})
    assert notifier.send("READY=1") is False
    assert notifier.watchdog_interval is None
    notifier.tick()


def test_watchdog_interval_is_half_of_watchdog_usec_and_only_for_this_process():
    assert SystemdNotifier({"WATCHDOG_USEC": "60000000"}).watchdog_interval == 30.0
    assert SystemdNotifier({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "1"}).watchdog_interval is None


def test_a_gone_socket_is_reported_once_and_never_raises(tmp_path, capsys):
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert notifier.send("READY=1") is False
    assert notifier.send("WATCHDOG=1") is False
    assert capsys.readouterr().out.count("cannot notify systemd") == 1


def test_the_daemon_says_ready_pings_the_watchdog_and_says_stopping(tmp_path):
    sock = listen(tmp_path / "notify.sock")
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "400000", "PATH": "/usr/bin:/bin"}
    daemon = subprocess.Popen(
        [sys.executable, "-m", "oomguard.daemon.cli", "--state-dir", str(tmp_path / "state"), "daemon", "--poll-interval", "0.05"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        ready = sock.recv(4096).decode()
        assert ready.startswith("READY=1\nSTATUS=watching ") and ready.endswith("spool/inbox")
        pings = [sock.recv(4096).decode() for _ in range(3)]
        assert pings == ["WATCHDOG=1"] * 3
        daemon.send_signal(signal.SIGTERM)
        messages = []
        while "STOPPING=1" not in messages:
            messages.append(sock.recv(4096).decode())
        assert daemon.wait(timeout=30) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
        daemon.wait()
        sock.close()
