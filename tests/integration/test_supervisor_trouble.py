"""What users (or accidents) can put in front of the daemon must never stop it: links in the
inbox, attempt files of the wrong shape, a store read while the daemon is down."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from oomguard.daemon import processes
from oomguard.daemon.paths import StateDir
from oomguard.daemon.spool import Spool
from oomguard.daemon.store import Store
from oomguard.daemon.supervisor import Supervisor
from oomguard.daemon.users import Account
from oomguard.jobs.emulated_gpus import EmulatedGpuFolder, parse_gpus
from tests.jobs_helpers import TINY_JOB, tiny_job


def state_and_store(tmp_path: Path) -> tuple[StateDir, Store]:
    state = StateDir(tmp_path / "state").create()
    return state, Store(state.database)


def test_a_link_in_the_inbox_is_refused_and_what_it_points_to_stays(tmp_path: Path) -> None:
    state, store = state_and_store(tmp_path)
    target = tmp_path / "someone-elses.toml"
    target.write_text(TINY_JOB.format(name="theirs", batch_size=8, max_steps=4, checkpoint_every_steps=2, keep_checkpoints=2))
    (state.inbox / "mine.toml").symlink_to(target)
    spool = Spool(state.inbox, state.accepted, state.rejected, rescan_seconds=0.0)
    supervisor = Supervisor(state, store, spool=spool)
    spool.start()
    try:
        supervisor.tick()
    finally:
        spool.stop()
    assert store.jobs() == []
    assert target.exists() and (state.rejected / "mine.toml").is_symlink()
    assert "symbolic link" in (state.rejected / "mine.toml.error").read_text()


def ended_process() -> tuple[int, int]:
    """The pid and start time of a process that has ended (so it reads as gone)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    started = processes.start_ticks(child.pid)
    child.wait()
    return child.pid, started or 0


def test_attempt_files_of_the_wrong_shape_end_the_attempt_not_the_daemon(tmp_path: Path) -> None:
    state, store = state_and_store(tmp_path)
    supervisor = Supervisor(state, store)
    job_id = supervisor.add_job(tiny_job(), Account.current())
    attempt_dir = Path(store.job(job_id).workdir) / "attempts" / "001"
    attempt_dir.mkdir(parents=True)
    (attempt_dir / "outcome.json").write_text(json.dumps({"kind": "oom", "memory": "lots", "plan": 7}))
    (attempt_dir / "exit.json").write_text("[1]")
    (attempt_dir / "heartbeat.json").write_text(json.dumps({"recoveries": 5}))
    pid, started = ended_process()
    supervisor.lifecycle.start(store.job(job_id), number=1, plan=store.job(job_id).plan_json, directory=str(attempt_dir), pid=pid, pid_started=started, started_at=1.0)

    again = Supervisor(state, store)  # a restarted daemon adopts the attempt, which has ended
    again.stopping = True  # collect only; start nothing
    again.tick()

    (attempt,) = store.attempts(job_id)
    assert attempt.outcome_kind == "crashed" and "outcome.json cannot be read" in attempt.outcome.message
    job = store.job(job_id)
    assert job.state == "queued"  # a crash retry with the same plan
    assert [e.kind for e in store.events(job_id)][-2:] == ["attempt-ended", "retry"]


def test_an_attempt_recorded_before_its_shim_started_is_not_run_twice(tmp_path: Path) -> None:
    state, store = state_and_store(tmp_path)
    supervisor = Supervisor(state, store)
    job_id = supervisor.add_job(tiny_job(), Account.current())
    attempt_dir = Path(store.job(job_id).workdir) / "attempts" / "001"
    # The daemon died after recording the attempt and before starting its shim.
    supervisor.lifecycle.start(store.job(job_id), number=1, plan=store.job(job_id).plan_json, directory=str(attempt_dir), started_at=1.0)
    again = Supervisor(state, store)
    again.stopping = True
    again.tick()
    (attempt,) = store.attempts(job_id)
    assert attempt.outcome_kind == "interrupted"
    assert store.job(job_id).state == "queued"


def test_a_job_left_running_without_an_attempt_is_queued_again(tmp_path: Path) -> None:
    state, store = state_and_store(tmp_path)
    job_id = Supervisor(state, store).add_job(tiny_job(), Account.current())
    # Only a store written by an older oomguard holds this (the lifecycle records a job as
    # running with its attempt, in one transaction): written here by hand.
    store.update_job(job_id, state="running")
    Supervisor(state, store)
    assert store.job(job_id).state == "queued"
    assert store.events(job_id)[-1].kind == "requeued"


def test_users_read_the_store_while_the_daemon_is_down(tmp_path: Path) -> None:
    state, store = state_and_store(tmp_path)
    Supervisor(state, store).add_job(tiny_job(), Account.current())
    store.close()
    assert not Path(f"{state.database}-wal").exists()
    reader = Store(state.database, readonly=True)
    assert [job.name for job in reader.jobs()] == ["tiny"]


def test_bad_usage_files_on_an_emulated_gpu_are_ignored(tmp_path: Path) -> None:
    folder = EmulatedGpuFolder(tmp_path).create(parse_gpus("64MiB"))
    (tmp_path / "0" / "1.json").write_text(json.dumps({"pid": 1, "bytes": "lots"}))
    (tmp_path / "0" / "2.json").write_text(json.dumps({"pid": 1, "bytes": -5}))
    (tmp_path / "0" / "3.json").write_text("[]")
    (tmp_path / "0" / "4.json").symlink_to("/etc/hostname")
    assert folder.processes(0) == []


def test_a_job_that_waits_too_long_for_a_gpu_is_reported_once(tmp_path: Path) -> None:
    from oomguard.daemon.gpus import EmulatedGpus
    from oomguard.daemon.monitor import GpuMonitor

    state, store = state_and_store(tmp_path)
    source = EmulatedGpus(state.emulated_gpus, "64MiB")
    neighbour = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        source.folder.publish(0, neighbour.pid, 60 * 2**20, "neighbour")
        supervisor = Supervisor(state, store, gpus=GpuMonitor(source, store), stall_seconds=0.0)
        job_id = supervisor.add_job(tiny_job(), Account.current())
        for _ in range(3):
            supervisor.tick()
    finally:
        neighbour.kill()
        neighbour.wait()
    job = store.job(job_id)
    assert job.state == "queued" and "the job's need is not known yet" in job.waiting
    kinds = [e.kind for e in store.events(job_id)]
    assert kinds.count("waiting") == 1 and kinds.count("stalled") == 1
    (stalled,) = [e for e in store.events(job_id) if e.kind == "stalled"]
    assert stalled.code == "waiting_too_long" and stalled.data["seconds"] >= 0.0
    waiting = next(e for e in store.events(job_id) if e.kind == "waiting")
    assert waiting.code == "no_room" and stalled.message.endswith(waiting.message)  # the stall says what it waits for


def test_ranks_that_outlive_a_killed_shim_are_killed_when_the_attempt_is_collected(tmp_path: Path) -> None:
    # The shim was SIGKILLed (it cannot pass anything on); a rank torchrun started in a
    # session of its own still runs, marked with the attempt's directory.
    state, store = state_and_store(tmp_path)
    supervisor = Supervisor(state, store)
    job_id = supervisor.add_job(tiny_job(), Account.current())
    attempt_dir = Path(store.job(job_id).workdir) / "attempts" / "001"
    attempt_dir.mkdir(parents=True)
    rank = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
        env={processes.ATTEMPT_DIR_ENV: str(attempt_dir), "PATH": "/usr/bin:/bin"},
    )
    try:
        pid, started = ended_process()
        supervisor.lifecycle.start(
            store.job(job_id), number=1, plan=store.job(job_id).plan_json, directory=str(attempt_dir), pid=pid, pid_started=started, started_at=1.0,
        )
        assert processes.marked_with(str(attempt_dir)) == {rank.pid}
        again = Supervisor(state, store)
        again.stopping = True  # collect only; start nothing
        again.tick()
        assert rank.wait(timeout=10) == -9
        assert store.attempts(job_id)[0].ended_at is not None
    finally:
        rank.kill()
        rank.wait()
