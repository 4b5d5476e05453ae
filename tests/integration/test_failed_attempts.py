"""A failed attempt says what it died of: the exception line of its traceback reaches the
events, `oomguard status` and `show`, the notification and the report; a crash that repeats
itself ends the job at the second attempt with a plain next step, and no ladder advice."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from oomguard.daemon.paths import StateDir
from oomguard.daemon.report import load_report
from oomguard.daemon.store import Store
from oomguard.daemon.supervisor import Supervisor, outcome_without_report
from oomguard.daemon.users import Account
from oomguard.jobs.spec import JobSpec
from oomguard.strategies import doctor
from tests.conftest import as_root
from tests.e2e.conftest import oomguard, wait_for

MISSING_CSV = "FileNotFoundError: [Errno 2] No such file or directory: 'x.csv'"
SCRIPT = "print('loading data', flush=True)\nopen('x.csv')\n"


class Notifications:
    """Stands in for the Notifier: keeps what the daemon would send."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def notify(self, facts: Any, **where: Any) -> bool:
        self.sent.append(facts)
        return True


def command_job(argv: list[str], cwd: Path) -> JobSpec:
    """A command job as the daemon keeps it (its paths not looked at again)."""
    return JobSpec.parse({"name": "script", "trainer": "command", "command": {"argv": argv, "cwd": str(cwd)}, "train": {"batch_size": 4, "max_steps": 3}})


@pytest.fixture
def daemon_parts(tmp_path: Path, monkeypatch) -> tuple[StateDir, Store, Notifications]:
    # The 5 s pause before a crash's first retry is the doctor's to choose; here it is waived.
    monkeypatch.setattr(doctor, "CRASH_BACKOFF_SECONDS", 0.0)
    state = StateDir(tmp_path / "state").create()
    store = Store(state.database)
    yield state, store, Notifications()
    store.close()


def run_until_it_ends(supervisor: Supervisor, store: Store, job_id: int) -> dict[str, Any]:
    wait_for(lambda: (supervisor.tick(), supervisor.job_done(job_id))[1], 60, "the job to end", interval=0.05)
    return store.job(job_id)


def test_a_script_that_fails_the_same_way_twice_ends_at_its_second_attempt_quoting_the_error(tmp_path: Path, daemon_parts) -> None:
    state, store, notifications = daemon_parts
    (tmp_path / "train.py").write_text(SCRIPT)
    supervisor = Supervisor(state, store, notifier=notifications)  # type: ignore[arg-type]
    job_id = supervisor.add_job(command_job([sys.executable, "train.py"], cwd=tmp_path), Account.current())
    job = run_until_it_ends(supervisor, store, job_id)

    assert job.state == "failed" and len(store.attempts(job_id)) == 2  # not three: the crash repeated itself
    assert job.result == f"the attempt crashed twice in a row at step 0 with the same error: {MISSING_CSV}"
    assert "[ladder]" not in job.report and "does not allow" not in job.report
    ended = [(e.code, e.data["attempt"], e.data["step"]) for e in store.events(job_id) if e.kind == "attempt-ended"]
    assert ended == [("crashed", 1, 0), ("crashed", 2, 0)]
    assert store.events(job_id)[-1].code == "gave_up"
    # A message test on purpose: the retry says what the script died of, in its own words.
    retry = next(e.message for e in store.events(job_id) if e.kind == "retry")
    assert MISSING_CSV in retry

    (failed,) = [facts for facts in notifications.sent if facts.event == "failed"]
    assert MISSING_CSV in failed.summary
    assert "fix the script and resubmit" in failed.next_step and "allow" not in failed.next_step

    state_dir = str(state.root)
    show = oomguard("--state-dir", state_dir, "show", str(job_id), check=True).stdout
    assert f"attempt 1: [mb=4x1] crashed at step 0: {MISSING_CSV}" in show
    assert "[ladder]" not in show
    status = oomguard("--state-dir", state_dir, "status", check=True).stdout
    assert "FileNotFoundError: [Errno 2] No such file or" in status

    notes = load_report(job, store.attempts(job_id), store.events(job_id)).notes
    assert f"attempt 2 crashed: {MISSING_CSV}" in notes


def test_a_command_that_dies_is_summed_up_by_its_exception_line(tmp_path: Path) -> None:
    (tmp_path / "output.log").write_text("loading\nTraceback (most recent call last):\n  File \"t.py\", line 2\n" + MISSING_CSV + "\nbye\n")
    assert outcome_without_report(tmp_path, 1).summary == MISSING_CSV
    cannot_open = f"{sys.executable}: can't open file '{tmp_path}/trian.py': [Errno 2] No such file or directory"
    (tmp_path / "output.log").write_text(cannot_open + "\n")
    assert outcome_without_report(tmp_path, 2).summary == cannot_open
    # Several ranks: the first one that recorded its death is the cause, not those stopped after it.
    (tmp_path / "output.log").write_text("[rank1]: KeyboardInterrupt\n")
    first = {"pid": 7, "rank": "0", "out_of_memory": False, "error": "KeyError: 'label'", "at": 1.0}
    assert outcome_without_report(tmp_path, 1, failed_process=first).summary == "KeyError: 'label'"


def test_a_cwd_gone_by_the_time_the_job_starts_is_named(tmp_path: Path, daemon_parts) -> None:
    # The shim enters it, as the job's owner: what the attempt fails with names the folder.
    state, store, notifications = daemon_parts
    gone = tmp_path / "project-moved"
    supervisor = Supervisor(state, store, notifier=notifications)  # type: ignore[arg-type]
    job_id = supervisor.add_job(command_job([sys.executable, "train.py"], cwd=gone), Account.current())
    job = run_until_it_ends(supervisor, store, job_id)
    assert job.state == "failed" and len(store.attempts(job_id)) == 2
    assert job.result.endswith(f"the same error: FileNotFoundError: [Errno 2] No such file or directory: '{gone}'")
    log = (Path(store.attempts(job_id)[0].directory) / "output.log").read_text()
    assert f"oomguard: cannot start {sys.executable} in its [command] cwd {gone}: No such file or directory" in log
    (failed,) = notifications.sent
    assert "fix the script and resubmit" in failed.next_step and "allow" not in failed.next_step


def test_a_cancelled_job_gets_no_ladder_advice(tmp_path: Path, daemon_parts) -> None:
    state, store, notifications = daemon_parts
    supervisor = Supervisor(state, store, notifier=notifications)  # type: ignore[arg-type]
    job_id = supervisor.add_job(command_job([sys.executable, "-c", "pass"], cwd=tmp_path), Account.current())
    store.request_cancel(job_id)
    job = run_until_it_ends(supervisor, store, job_id)
    assert job.state == "cancelled" and job.report is None
    assert all("allow" not in facts.next_step for facts in notifications.sent)


@as_root
def test_the_jobs_owner_enters_its_cwd_not_the_daemon(open_tmp: Path, accounts, others_can_run_oomguard, monkeypatch) -> None:
    # A folder alice may not enter: her job does not run in it because the daemon (root) could.
    monkeypatch.setattr(doctor, "CRASH_BACKOFF_SECONDS", 0.0)
    state = StateDir(open_tmp / "state").create()
    store = Store(state.database)
    private = open_tmp / "private"
    private.mkdir(mode=0o700)
    supervisor = Supervisor(state, store)
    job_id = supervisor.add_job(command_job([sys.executable, "-c", "print('ran')"], cwd=private), accounts["alice"])
    job = run_until_it_ends(supervisor, store, job_id)
    store.close()
    assert job.state == "failed"
    assert job.result.endswith(f"the same error: PermissionError: [Errno 13] Permission denied: '{private}'")
