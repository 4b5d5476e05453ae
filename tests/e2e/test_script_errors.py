"""A new user's mistakes with a command job, end to end with the real CLI and daemon: a folder
or a script that is not there is refused at submit naming it; a script that fails at once
ends its job at the second attempt, and status, show, the notification and the report quote
its error with a plain next step instead of ladder advice."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import as_root
from tests.e2e.conftest import oomguard, wait_for
from tests.e2e.test_lab_box import as_user
from tests.e2e.test_notifications import Endpoint

MISSING_CSV = "FileNotFoundError: [Errno 2] No such file or directory: 'x.csv'"


def command_job(folder: Path, argv: list[str], cwd: Path, extra: str = "") -> Path:
    path = folder / "job.toml"
    path.write_text(
        f'name = "my-script"\ntrainer = "command"\n[command]\nargv = {json.dumps(argv)}\ncwd = {json.dumps(str(cwd))}\n'
        f"[train]\nbatch_size = 4\nmax_steps = 10\n{extra}"
    )
    return path


def project(folder: Path, script: str = "print('hello')\n") -> Path:
    (folder / "project").mkdir()
    (folder / "project" / "train.py").write_text(script)
    return folder / "project"


def test_submit_names_the_missing_folder_or_script_and_how_to_fix_it(tmp_path: Path) -> None:
    cwd = project(tmp_path)
    mistyped = oomguard("submit", str(command_job(tmp_path, [sys.executable, "trian.py", "--lr=1e-4"], cwd)), state_dir=tmp_path / "state")
    assert mistyped.returncode == 2
    assert mistyped.stderr.strip() == (
        f"oomguard: rejected: {tmp_path / 'job.toml'}: command.argv: script trian.py not found: {cwd / 'trian.py'} does not exist "
        f"(relative to [command] cwd, {cwd}); did you mean 'train.py'?; fix its path in argv"
    )
    no_folder = oomguard("submit", str(command_job(tmp_path, [sys.executable, "train.py"], tmp_path / "projcet")), state_dir=tmp_path / "state")
    assert no_folder.returncode == 2
    assert f"command.cwd: folder {tmp_path / 'projcet'} does not exist; set cwd to the folder your script runs in" in no_folder.stderr
    assert not list((tmp_path / "state" / "spool" / "inbox").glob("*.toml"))  # nothing reached the daemon


def test_the_daemon_refuses_a_job_file_dropped_in_by_hand_whose_script_is_missing(tmp_path: Path, daemon_factory) -> None:
    daemon = daemon_factory()
    cwd = project(tmp_path)
    text = command_job(tmp_path, [sys.executable, "trian.py"], cwd).read_text()
    (daemon.state_dir / "spool" / "inbox" / "by-hand.toml").write_text(text)
    error = wait_for(
        lambda: (path := daemon.state_dir / "spool" / "rejected" / "by-hand.toml.error").exists() and path.read_text(), 20, "the rejection",
    )
    assert "command.argv: script trian.py not found" in error and "did you mean 'train.py'?" in error


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    server = Endpoint()
    yield server
    server.close()


def test_a_script_that_fails_at_once_ends_at_its_second_attempt_and_everything_quotes_its_error(
    tmp_path: Path, daemon_factory, endpoint: Endpoint
) -> None:
    cwd = project(tmp_path, script="print('loading data', flush=True)\nopen('x.csv')\n")
    job = command_job(
        tmp_path, [sys.executable, "train.py"], cwd,
        extra=f'[ladder]\nallow = ["micro_batch"]\ncrash_retries = 5\n[notify]\nurls = ["json://127.0.0.1:{endpoint.port}/job"]\n',
    )
    daemon = daemon_factory()
    began = time.monotonic()
    oomguard("submit", str(job), state_dir=daemon.state_dir, check=True)
    record = daemon.wait_job("1", timeout=60)
    # Two attempts and the first retry's 5 s pause, not 6 attempts over minutes of back-off.
    assert time.monotonic() - began < 30
    assert record["state"] == "failed" and len(record["attempts"]) == 2
    assert record["result"] == f"the attempt crashed twice in a row at step 0 with the same error: {MISSING_CSV}"

    status = oomguard("status", state_dir=daemon.state_dir, check=True).stdout
    assert "FileNotFoundError: [Errno 2] No such file or" in status
    show = oomguard("show", "1", state_dir=daemon.state_dir, check=True).stdout
    assert f"attempt 2: [mb=4x1] crashed at step 0: {MISSING_CSV}" in show
    for advice in ("[ladder]", "does not allow", "allow the rungs"):
        assert advice not in show

    message = wait_for(lambda: [body for path, body in endpoint.received if path == "/job"], 20, "the notification")[0]["message"]
    assert f"what happened: {record['result']}" in message
    assert "what next: nothing more: the job has ended; `oomguard show 1` has the report; fix the script and resubmit" in message
    assert "allow" not in message

    report = oomguard("report", "1", "-o", str(tmp_path / "report.png"), state_dir=daemon.state_dir)
    assert report.returncode == 0 and (tmp_path / "report.png").exists(), report.stderr


@as_root
def test_submit_as_a_user_says_only_what_that_user_can_see(accounts, others_can_run_oomguard, open_tmp: Path) -> None:
    # A script in a folder alice may not search: she learns that she cannot look, nothing more.
    private = open_tmp / "private"
    private.mkdir(mode=0o700)
    home = open_tmp / "alice"
    home.mkdir()
    job = command_job(home, [sys.executable, str(private / "train.py")], home)
    result = as_user(accounts["alice"].name, "submit", str(job), "--wait", "0", state=open_tmp / "state", cwd=home)
    assert result.returncode == 2
    assert f"command.argv: cannot look at script \"{private / 'train.py'}\": Permission denied" in result.stderr
