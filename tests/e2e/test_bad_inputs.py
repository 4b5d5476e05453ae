"""The named bad-input corpus (tests/bad_inputs/manifest.toml) against one real daemon.

Every case is refused with a message that names the problem: `oomguard submit` and the other
command lines by their exit code and stderr, files dropped in the inbox by the .error file the
daemon writes in spool/rejected, requests by the answer the daemon records. After every case the
daemon is still running; at the end, the valid jobs submitted beside the bad inputs (one of
another user, running the whole time, whose cancel by a third user is refused) have finished,
no bad input became a job, and the daemon never logged an internal error.

The malformed job files of tests/bad_jobs go the same two ways: to `oomguard submit` (in this
process, through cli.main: seventy CLI processes cost a minute of CPU, and the corpus's submit
cases run the real command line) and into the inbox. Cases that need other users run only as
root (tests/conftest.py makes throwaway accounts).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from oomguard.daemon.paths import StateDir
from oomguard.daemon.spool import Rejection, Spool
from oomguard.daemon.store import Store
from oomguard.daemon import cli
from oomguard.strategies.errors import JobNotFound
from tests.bad_inputs.corpus import Case, bad_job_expectation, bad_job_files, load_cases
from tests.conftest import as_root
from tests.e2e.conftest import Daemon, kill_leftovers, oomguard, tiny_job, wait_for

CASES = load_cases()
BAD_JOBS = bad_job_files()
CAN_USE_ACCOUNTS = not as_root.args[0]  # as_root is skipif(condition): the condition says "not root"

# A command job of alice's that runs until the last test releases it: it is running while the
# bad inputs arrive and bob tries to cancel it.
WAITING_SCRIPT = """\
import os, sys, time
deadline = time.time() + 240
while not os.path.exists(sys.argv[1]) and time.time() < deadline:
    time.sleep(0.2)
"""
# A command job whose arguments are full of shell syntax: the script records what it was given.
RECORDING_SCRIPT = """\
import json, os, sys
with open(sys.argv[1], "w") as handle:
    json.dump({"argv": sys.argv[2:], "env": os.environ.get("INJECTED")}, handle)
"""
SHELL_ARGUMENTS = [
    "$(touch PWNED)", "; touch PWNED2", "`touch PWNED3`", "&& id", "| cat", "a b  c", "'single'", '"double"', "*", "~", "\\",
    "--bs={micro_batch}", "--out={workdir}/$(id)", "{{literal}}", "\n", "--x=$HOME",
]


def params(target: str) -> list[Any]:
    return [
        pytest.param(case, id=case.name, marks=[as_root] if case.needs == "root" else [])
        for case in CASES if target in case.targets
    ]


def command_job(name: str, argv: list[str], env: dict[str, str] | None = None) -> str:
    text = f'name = "{name}"\ntrainer = "command"\n\n[command]\nargv = {json.dumps(argv)}\n'
    if env:
        text += "env = { " + ", ".join(f"{key} = {json.dumps(value)}" for key, value in env.items()) + " }\n"
    return text + "\n[train]\nbatch_size = 1\nmax_steps = 1\n"


@dataclass
class Box:
    """The shared daemon and what the tests put beside the bad inputs."""

    folder: Path
    daemon: Daemon
    accounts: dict[str, Any] | None
    release: Path
    good_jobs: list[str] = field(default_factory=list)
    alice_job: int | None = None
    _finished_job: int | None = None

    @property
    def state(self) -> StateDir:
        return StateDir(self.daemon.state_dir)

    def store(self) -> Store:
        return Store(self.state.database, readonly=True)

    def job(self, key: str) -> dict[str, Any] | None:
        try:
            return self.store().job(key)
        except JobNotFound:
            return None

    def wait_job(self, key: str, timeout: float = 180) -> dict[str, Any]:
        return wait_for(lambda: (job := self.job(key)) is not None and job.state in ("finished", "failed", "cancelled") and job, timeout, f"job {key} to end")

    def ids(self) -> dict[str, Any]:
        return {"alice_job": self.alice_job, "finished_job": self.finished_job()}

    def finished_job(self) -> int:
        """The id of the first valid job, once it has finished (requests about ended jobs)."""
        if self._finished_job is None:
            job = self.wait_job("good-before")
            assert job.state == "finished", job
            self._finished_job = job.id
        return self._finished_job

    def staging(self, name: str) -> Path:
        """A folder of its own for one case's input, on the inbox's file system (renames are atomic)."""
        folder = self.folder / "staging" / name
        folder.mkdir(parents=True)
        folder.chmod(0o755)
        return folder

    def drop(self, case: Case, **ids: Any) -> None:
        """Make the case's input beside the inbox and move it in, as a user's `mv` would."""
        made = case.make(self.staging(case.name), accounts=self.accounts, **ids)
        os.rename(os.fsencode(made), os.path.join(os.fsencode(self.state.inbox), case.file_name))

    def run(self, case: Case, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """`oomguard ARGS` as the case's user (default: this test's)."""
        if case.user is None:
            return oomguard(*args, state_dir=self.daemon.state_dir, timeout=timeout)
        assert self.accounts is not None
        return subprocess.run(
            ["runuser", "-u", self.accounts[case.user].name, "--", sys.executable, "-m", "oomguard.daemon.cli",
             "--state-dir", str(self.daemon.state_dir), *args],
            capture_output=True, text=True, timeout=timeout, cwd=self.folder, env={**os.environ, "HOME": str(self.folder)},
        )

    def error_of(self, case: Case) -> str | None:
        """The .error the daemon wrote for the case's file, when it has."""
        rejected = os.fsencode(self.state.rejected)
        if case.error_prefix is None:
            path = os.path.join(rejected, case.file_name + b".error")
            return Path(os.fsdecode(path)).read_text(encoding="utf-8") if os.path.exists(path) else None
        for entry in os.listdir(rejected):
            name = os.fsdecode(entry)
            if name.startswith(case.error_prefix) and name.endswith(".error"):
                return Path(os.fsdecode(os.path.join(rejected, entry))).read_text(encoding="utf-8")
        return None


@pytest.fixture(scope="module")
def box(request: pytest.FixtureRequest) -> Iterator[Box]:
    folder = Path(tempfile.mkdtemp(prefix="oomguard-bad-", dir="/tmp"))
    folder.chmod(0o755)  # other users' jobs and commands reach into it
    accounts = None
    if CAN_USE_ACCOUNTS:
        accounts = request.getfixturevalue("accounts")
        request.getfixturevalue("others_can_run_oomguard")
    # Two at once: alice's job waits the whole module in one slot, the others run in the other.
    daemon = Daemon(folder / "state", "--max-parallel", "2").start()
    the_box = Box(folder=folder, daemon=daemon, accounts=accounts, release=folder / "release")
    try:
        good = oomguard("submit", str(tiny_job(folder, name="good-before", max_steps=3)), state_dir=daemon.state_dir, check=True)
        assert "queued" in good.stdout
        the_box.good_jobs.append("good-before")
        if accounts is not None:
            script = folder / "wait_for_release.py"
            script.write_text(WAITING_SCRIPT)
            script.chmod(0o644)
            job = folder / "alice-job.toml"
            job.write_text(command_job("alice-job", [sys.executable, str(script), str(the_box.release)]))
            os.chown(job, accounts["alice"].uid, accounts["alice"].gid)
            os.rename(job, the_box.state.inbox / "alice-job.toml")
            the_box.alice_job = wait_for(lambda: (j := the_box.job("alice-job")) and j.id, 30, "alice's job to be queued")
            the_box.good_jobs.append("alice-job")
        yield the_box
    finally:
        the_box.release.touch()
        if daemon.alive():
            daemon.stop()
        kill_leftovers(folder)
        shutil.rmtree(folder, ignore_errors=True)


def assert_clear(message: str, expected: str) -> None:
    """The message says what is wrong (the expected words), in a few lines, without a traceback."""
    assert expected in message, f"expected {expected!r} in {message!r}"
    assert "Traceback" not in message
    assert len(message) < 2000, f"a message of {len(message)} characters"


# ------------------------------------------------------------------------------------ the corpus


def test_there_are_enough_malformed_job_files() -> None:
    assert len(BAD_JOBS) >= 12


def test_the_corpus_has_at_least_50_named_cases() -> None:
    names = [case.name for case in CASES] + [path.stem for path in bad_job_files()]
    assert len(names) >= 50 and len(set(names)) == len(names)
    assert {case.category for case in CASES} >= {"huge", "binary", "spool", "request", "cli"}


# ------------------------------------------------------------------------------------ oomguard submit


@pytest.mark.parametrize("case", params("submit"))
def test_submit_refuses(case: Case, box: Box) -> None:
    path = case.make(box.staging(f"submit-{case.name}"), accounts=box.accounts)
    # A FIFO used to block `submit` for ever and /dev/zero to fill its memory: a timeout says so.
    result = box.run(case, "submit", str(path), timeout=60)
    assert result.returncode == case.exit, result.stderr
    assert_clear(result.stderr, case.expected())
    assert box.daemon.alive()


def spool_entries(box: Box) -> set[str]:
    return {f"{folder.name}/{entry.name}" for folder in (box.state.inbox, box.state.accepted, box.state.rejected) for entry in folder.iterdir()}


@pytest.mark.parametrize("path", BAD_JOBS, ids=lambda path: path.stem)
def test_submit_refuses_a_malformed_job_file(path: Path, box: Box, capsys: pytest.CaptureFixture[str]) -> None:
    before = spool_entries(box)
    code = cli.main(["--state-dir", str(box.daemon.state_dir), "submit", str(path)])
    error = capsys.readouterr().err
    assert code == 2, error
    assert_clear(error, bad_job_expectation(path))
    assert path.name in error
    assert spool_entries(box) == before, "a refused file reached the spool"


# ------------------------------------------------------------------------------------ the inbox


@pytest.fixture(scope="module")
def malformed_errors(box: Box) -> dict[str, str | None]:
    """Every malformed job file dropped in the inbox at once (copied, as a user with a shell
    would: no validation on the way); the .error of each once the daemon has written it."""
    staging = box.staging("malformed")
    dropped = {path.name: f"malformed-{path.name}" for path in BAD_JOBS}
    for path in BAD_JOBS:
        shutil.copy(path, staging / dropped[path.name])
        os.rename(staging / dropped[path.name], box.state.inbox / dropped[path.name])

    def error(name: str) -> str | None:
        written = box.state.rejected / f"{dropped[name]}.error"
        return written.read_text() if written.exists() else None

    wait_for(lambda: all(error(path.name) is not None for path in BAD_JOBS), 60, "every malformed file to be rejected")
    return {path.name: error(path.name) for path in BAD_JOBS}


@pytest.mark.parametrize("path", BAD_JOBS, ids=lambda path: path.stem)
def test_the_daemon_rejects_a_malformed_job_file_in_the_inbox(path: Path, box: Box, malformed_errors: dict[str, str | None]) -> None:
    error = malformed_errors[path.name]
    assert error is not None
    assert_clear(error, bad_job_expectation(path))
    assert (box.state.rejected / f"malformed-{path.name}").exists()
    assert not (box.state.inbox / f"malformed-{path.name}").exists()
    assert box.daemon.alive()


@pytest.fixture(scope="module")
def inbox_errors(box: Box) -> dict[str, str | None]:
    """Every inbox case dropped at once; the .error of each once the daemon has written it."""
    cases = [case for case in CASES if "inbox" in case.targets and (case.needs != "root" or box.accounts is not None)]
    for case in cases:
        box.drop(case)
    # A folder is found by the daemon's rescan (every 10 s) when its event was not a move.
    wait_for(lambda: all(box.error_of(case) is not None for case in cases), 60, "every bad file in the inbox to be rejected")
    return {case.name: box.error_of(case) for case in cases}


@pytest.mark.parametrize("case", params("inbox"))
def test_the_daemon_rejects_a_file_dropped_in_the_inbox(case: Case, box: Box, inbox_errors: dict[str, str | None]) -> None:
    error = inbox_errors[case.name]
    assert error is not None
    assert_clear(error, case.expected())
    # The message names the file (by the name the daemon gave it, when it had to rename it).
    assert (case.error_prefix or case.shown_name) in error
    assert not os.path.lexists(os.path.join(os.fsencode(box.state.inbox), case.file_name))
    assert box.daemon.alive()


# ------------------------------------------------------------------------------------ requests


@pytest.fixture(scope="module")
def request_answers(box: Box) -> dict[str, str | None]:
    """Every request case dropped at once; the daemon's answer (the store) or its .error."""
    ids = box.ids()
    cases = [case for case in CASES if "request" in case.targets and (case.needs != "root" or box.accounts is not None)]
    for case in cases:
        box.drop(case, **ids)

    def answer(case: Case) -> str | None:
        if case.answered:
            row = box.store().request_by_file(case.shown_name)
            return None if row is None else ("accepted: " if row.accepted else "refused: ") + row.answer
        return box.error_of(case)

    wait_for(lambda: all(answer(case) is not None for case in cases), 60, "every request to be answered or rejected")
    return {case.name: answer(case) for case in cases}


@pytest.mark.parametrize("case", params("request"))
def test_the_daemon_refuses_a_bad_request(case: Case, box: Box, request_answers: dict[str, str | None]) -> None:
    answer = request_answers[case.name]
    assert answer is not None
    assert_clear(answer, case.expected(**box.ids()))
    if case.answered:
        assert answer.startswith("refused: ")
    if box.alice_job is not None:
        alice = box.job(str(box.alice_job))
        assert alice is not None and not alice.cancel_requested and alice.state in ("queued", "running")
    assert box.daemon.alive()


# ------------------------------------------------------------------------------------ command lines


@pytest.mark.parametrize("case", params("cli"))
def test_a_bad_command_line_is_refused(case: Case, box: Box) -> None:
    result = box.run(case, *case.command_line(**box.ids()))
    assert result.returncode == case.exit, result.stderr
    assert_clear(result.stderr, case.expected(**box.ids()))
    assert box.daemon.alive()


# ------------------------------------------------------------------------------------ races


@pytest.mark.parametrize("case", params("spool"))
def test_a_file_that_goes_between_the_event_and_the_read(case: Case, tmp_path: Path) -> None:
    """The spool in-process: the file is offered, then removed before take() reads it."""
    state = StateDir(tmp_path / "state").create()
    spool = Spool(state.inbox, state.accepted, state.rejected, rescan_seconds=0.0)
    path = case.make(state.inbox)
    os.utime(path, (1, 1))
    assert spool.pending() == [state.inbox.resolve() / case.shown_name]
    path.unlink()
    result = spool.take(state.inbox.resolve() / case.shown_name)
    assert isinstance(result, Rejection)
    assert_clear(result.error, case.expected())
    assert case.expected() in (state.rejected / f"{case.shown_name}.error").read_text()


def test_files_that_vanish_as_they_arrive_leave_no_trace(box: Box) -> None:
    staging = box.staging("vanishing")
    for number in range(30):
        made = staging / f"vanish-{number}.toml"
        made.write_text('name = "vanish"\n')
        moved = box.state.inbox / made.name
        os.rename(made, moved)
        moved.unlink()
    time.sleep(1)
    assert box.daemon.alive()
    assert box.job("vanish") is None


# ------------------------------------------------------------------------------------ not errors


def test_shell_syntax_in_a_commands_arguments_reaches_the_script_verbatim(box: Box) -> None:
    """No shell ever runs: each argument, "$(touch PWNED)" and all, is one argument as written
    (placeholders filled), and an environment value is passed as it is."""
    script = box.folder / "record_arguments.py"
    script.write_text(RECORDING_SCRIPT)
    record = box.folder / "arguments.json"
    job = box.folder / "shell-syntax.toml"
    job.write_text(command_job("shell-syntax", [sys.executable, str(script), str(record), *SHELL_ARGUMENTS], env={"INJECTED": "$(id) `id` {attempt}"}))
    submitted = oomguard("submit", str(job), state_dir=box.daemon.state_dir, check=True)
    assert "queued" in submitted.stdout
    box.good_jobs.append("shell-syntax")
    finished = box.wait_job("shell-syntax")
    assert finished.state == "finished", finished
    recorded = json.loads(record.read_text())
    workdir = finished.workdir
    expected = [argument.replace("{micro_batch}", "1").replace("{workdir}", workdir).replace("{{", "{").replace("}}", "}") for argument in SHELL_ARGUMENTS]
    assert recorded == {"argv": expected, "env": "$(id) `id` 1"}
    for folder in (box.folder, Path(workdir)):
        assert not list(folder.rglob("PWNED*")), "a shell ran"


def test_a_valid_job_file_with_a_very_long_name_is_queued(box: Box) -> None:
    """`submit` made the inbox name from the file's: 240 characters made it too long (OSError)."""
    job = box.folder / ("j" * 240 + ".toml")
    job.write_text(command_job("long-file-name", ["true"]))
    result = oomguard("submit", str(job), state_dir=box.daemon.state_dir)
    assert result.returncode == 0, result.stderr
    assert "queued" in result.stdout
    box.good_jobs.append("long-file-name")


# ------------------------------------------------------------------------------------ and after all that


@pytest.mark.slow
def test_the_daemon_is_up_and_every_valid_job_finished(box: Box) -> None:
    assert box.daemon.alive()
    good = oomguard("submit", str(tiny_job(box.folder, name="good-after", max_steps=2)), state_dir=box.daemon.state_dir, check=True)
    assert "queued" in good.stdout
    box.good_jobs.append("good-after")
    box.release.touch()  # alice's job may end now
    for name in box.good_jobs:
        job = box.wait_job(name)
        assert job.state == "finished", job
        assert not job.cancel_requested, job
    # Nothing else became a job: every bad input was refused before it reached the store.
    assert sorted(job.name for job in box.store().jobs()) == sorted(box.good_jobs)
    assert box.daemon.alive()
    output = box.daemon.output()
    assert "Traceback" not in output and "error while" not in output, output[-4000:]
