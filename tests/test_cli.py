"""The CLI starts without torch and refuses bad input with a message and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.e2e.conftest import oomguard, tiny_job

QUICKSTART = Path(__file__).parents[1] / "jobs" / "examples" / "quickstart.toml"


def test_the_daemon_and_cli_never_import_torch() -> None:
    code = (
        "import sys, oomguard.daemon.cli, oomguard.daemon.supervisor, oomguard.daemon.spool;"
        "heavy = [m for m in ('torch', 'diffusers', 'accelerate') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_bad_emulated_size_is_refused(tmp_path: Path) -> None:
    result = oomguard("run", str(QUICKSTART), "--workdir", str(tmp_path / "w"), "--emulate-device-memory", "48 furlongs")
    assert result.returncode == 2
    assert "--emulate-device-memory: not a memory size: '48 furlongs'" in result.stderr


def test_run_refuses_a_workdir_that_holds_a_finished_run(tmp_path: Path) -> None:
    (tmp_path / "w" / "final").mkdir(parents=True)
    result = oomguard("run", str(tiny_job(tmp_path)), "--workdir", str(tmp_path / "w"))
    assert result.returncode == 2 and "already holds a finished run" in result.stderr


def test_a_missing_job_file_is_refused(tmp_path: Path) -> None:
    result = oomguard("submit", str(tmp_path / "nope.toml"), state_dir=tmp_path / "state")
    assert result.returncode == 2 and "nope.toml" in result.stderr and "not found" in result.stderr


def test_submit_without_a_daemon_leaves_the_job_in_the_spool(tmp_path: Path) -> None:
    result = oomguard("submit", str(tiny_job(tmp_path)), "--wait", "0", state_dir=tmp_path / "state")
    assert result.returncode == 0 and "the daemon queues it when it runs" in result.stdout
    assert len(list((tmp_path / "state" / "spool" / "inbox").glob("*.toml"))) == 1


def test_the_environment_variable_sets_the_emulated_cap(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OOMGUARD_EMULATE_DEVICE_MEMORY", "12 parsecs")
    result = oomguard("run", str(tiny_job(tmp_path)), "--workdir", str(tmp_path / "w"))
    assert result.returncode == 2 and "not a memory size: '12 parsecs'" in result.stderr
