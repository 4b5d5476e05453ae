"""The CLI starts without torch and refuses bad input with a message and exit code 2."""

from __future__ import annotations

import argparse

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import oomguard, tiny_job, wait_for

QUICKSTART = Path(__file__).parents[2] / "jobs" / "examples" / "quickstart.toml"


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


def test_a_bad_emulated_gpu_list_is_refused(tmp_path: Path) -> None:
    result = oomguard("daemon", "--emulate-gpus", "two big ones", state_dir=tmp_path / "state")
    assert result.returncode == 2
    assert "--emulate-gpus: not an emulated GPU list: 'two big ones'" in result.stderr and "e.g. 2x64MiB" in result.stderr


def test_gpus_before_any_sample_says_why(tmp_path: Path) -> None:
    result = oomguard("gpus", state_dir=tmp_path / "state")
    assert result.returncode == 1 and "no GPU samples yet" in result.stderr and "--emulate-gpus" in result.stderr


def test_a_neighbour_needs_emulated_gpus(tmp_path: Path) -> None:
    result = oomguard("neighbour", "--take", "10MiB", state_dir=tmp_path / "state")
    assert result.returncode == 2 and "holds no emulated GPUs" in result.stderr and "--emulate-gpus" in result.stderr


def test_cancel_and_report_of_an_unknown_job(tmp_path: Path) -> None:
    for command in (("cancel", "7"), ("report", "7"), ("show", "nope")):
        result = oomguard(*command, state_dir=tmp_path / "state")
        assert result.returncode == 3 and "`oomguard status` lists the jobs" in result.stderr, command


def test_report_of_a_job_that_has_not_started(tmp_path: Path) -> None:
    assert oomguard("submit", str(tiny_job(tmp_path)), "--wait", "0", state_dir=tmp_path / "state").returncode == 0
    # No daemon: record it the way the daemon would, without starting it.
    from oomguard.daemon.paths import StateDir
    from oomguard.daemon.store import Store
    from oomguard.daemon.supervisor import Supervisor
    from oomguard.daemon.users import Account
    from oomguard.jobs.spec import load_job_file

    state = StateDir(tmp_path / "state").create()
    store = Store(state.database)
    Supervisor(state, store).add_job(load_job_file(tiny_job(tmp_path)), Account.current())
    store.close()
    result = oomguard("report", "1", "-o", str(tmp_path / "r.png"), state_dir=tmp_path / "state")
    assert result.returncode == 1 and "has no attempts yet" in result.stderr and not (tmp_path / "r.png").exists()


def test_a_batch_with_a_bad_job_file_is_refused_whole_naming_each_problem(tmp_path: Path) -> None:
    good, bad, missing = tiny_job(tmp_path, "good"), tmp_path / "bad.toml", tmp_path / "missing.toml"
    bad.write_text('name = "bad"\ntrainer = "unconditional"\n[train]\nbatch_size = "eight"\n')
    result = oomguard("submit", str(good), str(bad), str(missing), state_dir=tmp_path / "state")
    assert result.returncode == 2 and result.stdout == ""
    assert "bad.toml" in result.stderr and "missing.toml" in result.stderr and "none of the 3 files was submitted" in result.stderr
    inbox = tmp_path / "state" / "spool" / "inbox"
    assert not inbox.exists() or list(inbox.iterdir()) == []  # nothing half-submitted


def test_status_lists_the_running_the_head_of_the_queue_and_the_last_ended_and_pages_through_all(tmp_path: Path) -> None:
    import re

    from oomguard.daemon.cli.status_limits import STATUS_ENDED_SHOWN, STATUS_PAGE_SIZE, STATUS_QUEUED_SHOWN
    from oomguard.daemon.paths import StateDir
    from oomguard.daemon.store import Store
    from oomguard.jobs.spec import load_job_file

    state = StateDir(tmp_path / "state").create()
    store = Store(state.database)
    spec = load_job_file(tiny_job(tmp_path))
    for i in range(1, 121):
        store.add_job(
            name=f"j{i}", owner="alice", spec=spec.to_dict(), priority=5 if i == 50 else 0, workdir=None,
            plan=spec.initial_plan().to_dict(), spool_file=None, jobs_root=tmp_path / "jobs",
        )
    store.update_job(4, state="running")
    for i in range(61, 91):
        store.update_job(i, state="finished" if i % 2 else "failed", ended_at=1000.0 - i)  # job 61 ended last
    store.close()

    def listed(*options: str) -> list[int]:
        result = oomguard("status", *options, state_dir=state.root)
        assert result.returncode == 0, result.stderr
        return [int(n) for n in re.findall(r"^│\s*(\d+)\s*│", result.stdout, flags=re.M)]

    queued = [1, 2, 3, *range(5, 50), *range(51, 61), *range(91, 121)]
    expected = {4, 50, *queued[: STATUS_QUEUED_SHOWN - 1], *range(61, 61 + STATUS_ENDED_SHOWN)}
    assert listed() == sorted(expected)
    assert listed("--page", "2") == list(range(STATUS_PAGE_SIZE + 1, 2 * STATUS_PAGE_SIZE + 1))
    assert listed("--page", "3") == list(range(2 * STATUS_PAGE_SIZE + 1, 121))
    assert listed("--page", "9") == []
    assert listed("--all") == list(range(1, 121))
    refused = oomguard("status", "--page", "0", state_dir=state.root)
    assert refused.returncode == 2 and "--page counts from 1" in refused.stderr


# A reader that goes away (`oomguard logs 1 | head`) ------------------------------------------------


def state_with_a_long_log(tmp_path: Path) -> Path:
    """A store with one job whose attempt logged 1 MiB: more than a pipe holds."""
    from oomguard.daemon.paths import StateDir
    from oomguard.daemon.store import Store
    from oomguard.daemon.supervisor import Supervisor
    from oomguard.daemon.users import Account
    from oomguard.jobs.spec import load_job_file

    state = StateDir(tmp_path / "state").create()
    store = Store(state.database)
    job_id = Supervisor(state, store).add_job(load_job_file(tiny_job(tmp_path)), Account.current())
    attempt_dir = tmp_path / "attempt"
    attempt_dir.mkdir()
    (attempt_dir / "output.log").write_text("".join(f"step {n} loss 0.5\n" for n in range(60_000)))
    store.add_attempt(job_id=job_id, number=1, plan=store.job(job_id).plan_json, directory=str(attempt_dir), started_at=1.0)
    store.close()
    return state.root


def test_logs_into_a_pipe_whose_reader_stops_early_exits_quietly(tmp_path: Path) -> None:
    state = state_with_a_long_log(tmp_path)
    reader = subprocess.Popen(["head", "-n", "3"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    logs = subprocess.Popen(
        [sys.executable, "-m", "oomguard.daemon.cli", "--state-dir", str(state), "logs", "1"], stdout=reader.stdin, stderr=subprocess.PIPE,
    )
    assert reader.stdin is not None and reader.stdout is not None
    reader.stdin.close()  # only head holds the pipe's reading end now
    shown = reader.stdout.read()
    assert reader.wait(timeout=60) == 0
    _, errors = logs.communicate(timeout=60)
    assert shown.decode().splitlines() == ["== attempt 1 (mb=8x1) ==", "step 0 loss 0.5", "step 1 loss 0.5"]
    assert errors.decode() == ""  # no BrokenPipeError traceback
    assert logs.returncode == 141  # 128 + SIGPIPE, as a shell reports a command the pipe's end stopped


# Every command, with what it needs to print something (``{...}`` filled in by the test).
EVERY_COMMAND = [
    ["status"], ["status", "--all"], ["gpus"], ["show", "1"], ["show", "1", "--json"], ["logs", "1"], ["logs", "1", "--follow"],
    ["report", "1", "-o", "{workdir}.png"], ["neighbour", "--take", "1MiB", "--seconds", "0.1"], ["cancel", "1", "--wait", "1"],
    ["diagnose", "{log}"], ["diagnose", "{log}", "--json"], ["submit", "{job}", "--wait", "0"], ["daemon"],
    ["run", "{job}", "--workdir", "{workdir}"], ["status", "--page", "1"], ["gc", "--older-than", "0"], ["--help"],
    ["serve", "--listen", "127.0.0.1:0"], ["web-url"],
]


def test_the_pipe_test_covers_every_command() -> None:
    from oomguard.daemon.cli.parser import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(commands.choices) <= {command[0] for command in EVERY_COMMAND}


@pytest.mark.parametrize("command", EVERY_COMMAND, ids=" ".join)
def test_every_command_exits_quietly_when_its_reader_has_gone(tmp_path: Path, command: list[str]) -> None:
    from oomguard.daemon.paths import StateDir
    from oomguard.daemon.store import Store
    from oomguard.jobs.emulated_gpus import EmulatedGpu, EmulatedGpuFolder

    state = state_with_a_long_log(tmp_path)
    EmulatedGpuFolder(StateDir(state).emulated_gpus).create((EmulatedGpu(index=0, total=2**30),))
    store = Store(StateDir(state).database)
    store.add_gpu_samples(1.0, [{"gpu": 0, "name": "emulated 1 GiB", "total": 2**30, "used": 0, "processes": "[]"}], keep_per_gpu=10)
    store.close()
    log = tmp_path / "attempt" / "output.log"
    command = [part.format(job=tiny_job(tmp_path, "other"), workdir=tmp_path / "run", log=log) for part in command]
    # `web-url` asks a dashboard for the link it prints: one serves the state directory meanwhile.
    server = subprocess.Popen([sys.executable, "-m", "oomguard.daemon.cli", "--state-dir", str(state), "serve", "--listen", "127.0.0.1:0"]) if command == ["web-url"] else None
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader went away before a byte was written
    try:
        if server is not None:
            wait_for(lambda: (state / "web.sock").exists(), 30, "the dashboard's socket")
        done = subprocess.run(
            [sys.executable, "-m", "oomguard.daemon.cli", "--state-dir", str(state), *command], stdout=write_end, stderr=subprocess.PIPE,
            timeout=60,
        )
    finally:
        os.close(write_end)
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    # argparse itself swallows the error of --help's write when stdout is unbuffered
    # (PYTHONUNBUFFERED): its text is lost either way, and nothing is printed about it.
    assert done.stderr.decode() == "" and done.returncode == (141 if command != ["--help"] or not os.environ.get("PYTHONUNBUFFERED") else 0)


def test_gc_forgets_the_ended_jobs_older_than_asked_and_says_what_it_removed(tmp_path: Path) -> None:
    import time

    from oomguard.daemon.paths import StateDir
    from oomguard.daemon.store import Store

    state = StateDir(tmp_path / "state").create()
    store = Store(state.database)
    ids = [
        store.add_job(name=f"j{i}", owner="alice", spec={"name": f"j{i}"}, priority=0, workdir=None, plan={}, spool_file=None, jobs_root=tmp_path)
        for i in range(3)
    ]
    store.update_job(ids[0], state="finished", ended_at=time.time() - 3 * 86400)
    store.update_job(ids[1], state="failed", ended_at=time.time() - 3600)
    store.add_event(ids[0], "finished", "done")
    store.close()
    result = oomguard("gc", "--older-than", "2", state_dir=state.root)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("forgot 1 ended job(s) (0 attempt(s), 1 event(s)")
    store = Store(state.database, readonly=True)
    assert [job.id for job in store.jobs()] == ids[1:]
    store.close()
    assert oomguard("gc", state_dir=state.root).stdout.strip() == "nothing to collect"
    bad = oomguard("gc", "--older-than", "-1", state_dir=state.root)
    assert bad.returncode == 2 and "--older-than takes a number of days, 0 or more" in bad.stderr
    missing = oomguard("gc", state_dir=tmp_path / "elsewhere")
    assert missing.returncode == 2 and "no oomguard database" in missing.stderr


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--forget-after", "-3", "--forget-after takes a number of days above 0, or `never`, not '-3'"),
        ("--forget-after", "soon", "--forget-after takes a number of days above 0, or `never`, not 'soon'"),
        ("--log-limit", "1KiB", "--log-limit: a log limit of 1024 bytes is too small: give at least 65536 bytes"),
        ("--log-limit", "lots", "--log-limit: not a memory size: 'lots'"),
    ],
)
def test_the_daemon_refuses_a_bad_housekeeping_option_before_it_starts(tmp_path: Path, option: str, value: str, message: str) -> None:
    result = oomguard("daemon", option, value, state_dir=tmp_path / "state", timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr
