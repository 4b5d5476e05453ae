"""A full disk is not a crash (issue 18, item 2): the doctor waits for room and counts no try,
the lifecycle queues the job with a visible disk wait and tells its people once, the scheduler
starts it again by itself when the space is there (measured through a fake statvfs), and
conclude reads a command job's "No space left on device" as a full disk."""

from __future__ import annotations

import errno
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from oomguard.daemon.conclude import disk_full_of, last_traceback_chain, outcome_without_report
from oomguard.daemon.disk_wait import DISK_CHECK_SECONDS, DISK_NOTE, UNKNOWN_NEED_GROWTH_BYTES, DiskWait, wait_free
from oomguard.daemon.paths import StateDir
from oomguard.daemon.store import Store
from oomguard.daemon.supervisor import Supervisor
from oomguard.daemon.users import Account
from oomguard.jobs.attempt import LOG
from oomguard.jobs.disk_space import DiskFull, Room, is_disk_full, named_path, with_reserve
from oomguard.strategies.decision import GiveUp, NextPlan, PastAttempt, WaitForDisk
from oomguard.strategies.doctor import decide
from oomguard.strategies.doctor_disk import DISK_BACKOFF_SECONDS
from oomguard.strategies.outcome import MemoryFigures, Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.policy import Policy
from tests.fakes import FakeClock, FakeLauncher
from tests.jobs_helpers import tiny_job

MiB = 2**20
START = Plan.initial(16)
FULL = Outcome(
    kind="disk_full", step=8, phase="checkpoint", message="no room for a checkpoint at /w/checkpoints: needs 1.6 MiB free, has 12.0 KiB",
    disk_path="/w/checkpoints", disk_needed=1_700_000, disk_free=12_288,
)
OOM = Outcome(
    kind="oom", step=5, phase="backward", message="CUDA out of memory.",
    memory=MemoryFigures(requested=64 * MiB, allocated=900 * MiB, reserved=902 * MiB, free=0, total=1024 * MiB, breakdown={"activations": 700 * MiB}),
)


# The doctor --------------------------------------------------------------------------------------


def test_the_doctor_waits_for_room_with_the_path_and_the_bytes() -> None:
    decision = decide(FULL, START, [PastAttempt(START, FULL)], Policy())
    assert isinstance(decision, WaitForDisk)
    assert (decision.path, decision.needed, decision.free, decision.after_seconds) == ("/w/checkpoints", 1_700_000, 12_288, 0.0)
    assert "wait until /w/checkpoints has 1.6 MiB free" in decision.reason and f"[{START.short()}]" in decision.reason


@pytest.mark.parametrize("before", [0, 1, 11, 40])
def test_a_full_disk_costs_no_try_and_never_fails_the_job(before: int) -> None:
    """However often the disk was full, the doctor waits; and those attempts do not count
    against ladder.max_attempts when the job later runs out of memory."""
    history = [PastAttempt(START, FULL) for _ in range(before + 1)]
    assert isinstance(decide(FULL, START, history, Policy(max_attempts=2)), WaitForDisk)
    history.append(PastAttempt(START, OOM))
    assert isinstance(decide(OOM, START, history, Policy(max_attempts=2)), NextPlan)


def test_disk_full_attempts_in_a_row_pause_longer_each_time() -> None:
    """A quota statvfs does not show, or a disk that fills again at once, must not start one
    attempt after another: the second in a row waits DISK_BACKOFF_SECONDS, then twice that."""
    pauses = [decide(FULL, START, [PastAttempt(START, FULL)] * n, Policy()).after_seconds for n in (1, 2, 3, 4)]  # type: ignore[union-attr]
    assert pauses == [0.0, DISK_BACKOFF_SECONDS, 2 * DISK_BACKOFF_SECONDS, 4 * DISK_BACKOFF_SECONDS]
    mixed = [PastAttempt(START, FULL), PastAttempt(START, OOM), PastAttempt(START, FULL)]
    assert decide(FULL, START, mixed, Policy()).after_seconds == 0.0  # type: ignore[union-attr]


def test_a_crash_after_disk_waits_still_gets_its_retries() -> None:
    crash = Outcome(kind="crashed", step=3, message="ValueError: boom", traceback_tail="Traceback ...\nValueError: boom\n")
    history = [PastAttempt(START, FULL), PastAttempt(START, crash)]
    assert not isinstance(decide(crash, START, history, Policy(crash_retries=1)), GiveUp)


# The outcome -------------------------------------------------------------------------------------


def test_a_disk_full_outcome_reads_back_and_its_fields_are_checked() -> None:
    assert Outcome.from_dict(json.loads(json.dumps(FULL.to_dict()))) == FULL
    for key, bad in (("disk_needed", "lots"), ("disk_free", -1), ("disk_path", "a\nb"), ("disk_path", 5), ("disk_path", "")):
        with pytest.raises((TypeError, ValueError), match=key):
            Outcome.from_dict({**FULL.to_dict(), key: bad})


def test_what_counts_as_a_full_disk() -> None:
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"))
    wrapped = RuntimeError("unexpected pos 576 vs 534")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert is_disk_full(wrapped)
    assert not is_disk_full(OSError(errno.EIO, "Input/output error")) and not is_disk_full(ValueError("boom"))
    assert named_path("OSError: [Errno 28] No space left on device: 'out/model.pt'") == "out/model.pt"
    assert with_reserve(100 * MiB) == 102 * MiB and with_reserve(10) == 10 + 256 * 1024


def test_what_a_job_of_unknown_need_waits_for() -> None:
    """Unknown need: more than was free by a hundredth of the disk (64 MiB at least), or a tenth
    of the disk free, whichever comes first; a known need is waited for as it is."""
    disk = 100 * 1024 * MiB
    assert wait_free(5 * MiB, 1 * MiB, Room(free=MiB, total=disk, block=4096)) == 5 * MiB
    assert wait_free(None, 1 * MiB, Room(free=MiB, total=disk, block=4096)) == 1 * MiB + disk // 100
    assert wait_free(None, 1 * MiB, Room(free=MiB, total=200 * MiB, block=4096)) == 20 * MiB
    assert wait_free(None, 50 * MiB, Room(free=50 * MiB, total=200 * MiB, block=4096)) == 50 * MiB  # room already
    assert wait_free(None, 1 * MiB, None) == 1 * MiB + UNKNOWN_NEED_GROWTH_BYTES
    wait = DiskWait(path="/w", wait_free=3 * MiB, needed=None, free=MiB)
    assert wait.note() == f"{DISK_NOTE}/w needs an unknown amount free (the job did not say; waiting for 3.0 MiB), has 1.0 MiB"
    assert not wait.has_room(2 * MiB) and wait.has_room(3 * MiB) and wait.has_room(None)


# The lifecycle and the scheduler, through the supervisor with a fake launcher ----------------------


class Disk:
    """A fake statvfs: the free bytes at any path, as the test sets them; counts its reads."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.reads: list[str] = []

    def __call__(self, wait: DiskWait) -> int | None:
        self.reads.append(wait.path)
        return self.free


@pytest.fixture
def box(tmp_path: Path) -> Iterator[tuple[Supervisor, Store, FakeClock, FakeLauncher, Disk]]:
    clock = FakeClock()
    state = StateDir(tmp_path / "state").create()
    store = Store(state.database, now=clock.time)
    launcher = FakeLauncher()
    supervisor = Supervisor(state, store, launcher=launcher, clock=clock)
    disk = Disk(free=10_000)
    supervisor.scheduler.disk_free = disk
    yield supervisor, store, clock, launcher, disk
    store.close()


def events(store: Store, job_id: int) -> list[tuple[str, str | None, dict[str, Any]]]:
    return [(e.kind, e.code, e.data) for e in store.events(job_id)]


def test_a_full_disk_queues_the_job_until_the_space_is_there(box, monkeypatch: pytest.MonkeyPatch) -> None:
    supervisor, store, clock, launcher, disk = box
    job_id = supervisor.add_job(tiny_job("full"), Account.current())
    supervisor.drain()
    launcher.finish(launcher.started[0], FULL, returncode=5)
    supervisor.drain()

    # Queued, with the disk wait in its record and its note, and one event that notifies.
    job = store.job(job_id)
    assert (job.state, job.disk_path, job.disk_wait_bytes, job.disk_needed) == ("queued", "/w/checkpoints", 1_700_000, 1_700_000)
    assert job.waiting == f"{DISK_NOTE}/w/checkpoints needs 1.6 MiB free, has 12.0 KiB"
    waiting = [e for e in store.events(job_id) if e.kind == "waiting_for_disk"]
    assert len(waiting) == 1 and waiting[0].code == "disk_full"
    assert waiting[0].data == {
        "path": "/w/checkpoints", "needed_bytes": 1_700_000, "free_bytes": 12_288, "wait_free_bytes": 1_700_000, "budget_bytes": None,
    }
    notified: list[str] = []
    monkeypatch.setattr(supervisor.events, "_notify", lambda job, kind, message, next_step: notified.append(kind))

    # While the disk stays full: not started, no event, and the queue is not read at each tick
    # (only the disk-waiting jobs, every DISK_CHECK_SECONDS).
    queue_reads: list[int] = []
    real_queued = store.queued_jobs
    monkeypatch.setattr(store, "queued_jobs", lambda: queue_reads.append(1) or real_queued())
    before = len(store.events(job_id))
    for _ in range(30):
        clock.advance(1.0)
        supervisor.tick()
    assert len(launcher.started) == 1 and len(store.events(job_id)) == before and not notified
    assert len(disk.reads) == 3 and set(disk.reads) == {"/w/checkpoints"}  # at 10, 20, 30 s
    assert len(queue_reads) <= 1  # the minute's full pass at most, not one per tick

    # Room again: within DISK_CHECK_SECONDS the job is an ordinary queued job, and starts.
    disk.free = 2_000_000
    for _ in range(int(DISK_CHECK_SECONDS)):
        clock.advance(1.0)
        supervisor.tick()
    assert len(launcher.started) == 2 and store.job(job_id).state == "running"
    job = store.job(job_id)
    assert (job.disk_path, job.disk_wait_bytes, job.disk_needed, job.waiting) == (None, None, None, None)
    resumed = [e for e in events(store, job_id) if e[0] == "resumed"]
    assert resumed == [("resumed", "disk_space_back", {"path": "/w/checkpoints", "free_bytes": 2_000_000, "wait_free_bytes": 1_700_000})]
    assert not notified  # the resume is an event, not a message
    # The same plan, no rung, and no try used: the next attempt is attempt 2 of the same plan.
    first, second = store.attempts(job_id)
    assert first.plan_json == second.plan_json and second.rung is None


def test_a_job_waiting_for_disk_can_be_cancelled(box) -> None:
    supervisor, store, clock, launcher, disk = box
    job_id = supervisor.add_job(tiny_job("full"), Account.current())
    supervisor.drain()
    launcher.finish(launcher.started[0], FULL, returncode=5)
    supervisor.drain()
    store.request_cancel(job_id)
    supervisor.drain()
    job = store.job(job_id)
    assert job.state == "cancelled" and job.disk_path is None and job.waiting is None


def test_the_notification_of_a_disk_wait_names_the_path_and_what_to_do(box, monkeypatch: pytest.MonkeyPatch) -> None:
    supervisor, store, clock, launcher, disk = box
    sent: list[tuple[str, str, str]] = []
    monkeypatch.setattr(supervisor.events, "_notify", lambda job, kind, message, next_step: sent.append((kind, message, next_step)))
    job_id = supervisor.add_job(tiny_job("full"), Account.current())
    supervisor.drain()
    launcher.finish(launcher.started[0], FULL, returncode=5)
    supervisor.drain()
    ((kind, message, next_step),) = [s for s in sent if s[0] == "waiting_for_disk"]
    assert message.startswith(f"{DISK_NOTE}/w/checkpoints needs 1.6 MiB free, has 12.0 KiB")
    assert next_step.startswith("make room at /w/checkpoints (1.6 MiB free needed): oomguard starts the job again by itself")
    assert store.job(job_id).state == "queued"


# conclude: a command job's log -------------------------------------------------------------------

ENOSPC_LOG = """\
step 3/10 loss 0.1
Traceback (most recent call last):
  File "train.py", line 40, in <module>
    torch.save(state, "out/checkpoint-4/model.pt")
OSError: [Errno 28] No space left on device: 'out/checkpoint-4/model.pt'
"""
CHAINED_LOG = """\
Traceback (most recent call last):
  File "train.py", line 40, in save
OSError: [Errno 122] Disk quota exceeded

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "train.py", line 44, in <module>
RuntimeError: could not save the checkpoint
"""


@pytest.fixture
def job(tmp_path: Path):
    store = Store(tmp_path / "oomguard.db")
    job_id = store.add_job(
        name="script", owner="me", spec={}, priority=0, workdir=str(tmp_path / "work"), plan=START.to_dict(), spool_file=None, jobs_root=tmp_path,
    )
    yield store.job(job_id)
    store.close()


def ended_with(tmp_path: Path, log: str) -> Outcome:
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    (attempt / LOG).write_text(log)
    return outcome_without_report(attempt, 1)


def test_a_command_job_that_ran_out_of_disk_waits_for_it(tmp_path: Path, job) -> None:
    outcome = disk_full_of(ended_with(tmp_path, ENOSPC_LOG), job)
    assert outcome.kind == "disk_full" and outcome.disk_needed is None
    # The path the error names, relative to where the command ran (its workdir here).
    assert outcome.disk_path == f"{job.workdir}/out/checkpoint-4/model.pt"
    assert isinstance(outcome.disk_free, int) and outcome.disk_free > 0  # measured at the nearest folder that exists
    assert "how much room it needs is unknown" in outcome.message
    decision = decide(outcome, START, [PastAttempt(START, outcome)], Policy())
    assert isinstance(decision, WaitForDisk) and "room (how much is unknown)" in decision.reason


def test_a_script_that_raised_its_own_error_over_a_full_disk_waits_too(tmp_path: Path, job) -> None:
    outcome = disk_full_of(ended_with(tmp_path, CHAINED_LOG), job)
    assert outcome.kind == "disk_full" and outcome.disk_path == job.workdir  # no path named: the workdir
    assert "Disk quota exceeded" in last_traceback_chain(CHAINED_LOG)


@pytest.mark.parametrize(
    "log",
    [
        "Traceback (most recent call last):\n  File \"train.py\"\nValueError: boom\n",
        # A warning about the disk long before an unrelated crash is not what it died of.
        "warning: No space left on device for the cache, going on without it\nstep 5\n"
        "Traceback (most recent call last):\n  File \"train.py\"\nKeyError: 'x'\n",
    ],
)
def test_other_crashes_stay_crashes(tmp_path: Path, job, log: str) -> None:
    assert disk_full_of(ended_with(tmp_path, log), job).kind == "crashed"


def test_a_disk_full_error_is_one_line_for_people() -> None:
    assert str(DiskFull("/w/checkpoints", 2 * MiB, 4096, "a checkpoint")) == "no room for a checkpoint at /w/checkpoints: needs 2.0 MiB free, has 4.0 KiB"
    assert str(DiskFull("/w", None, None, "a write")) == "no room for a write at /w: needs an unknown amount free, free space unknown"


def test_the_lifecycle_writes_the_disk_wait_and_clears_it(tmp_path: Path) -> None:
    """queued -> queued with the wait's columns and note; room again -> an ordinary queued job;
    a start clears what is left of a wait, whichever way it came."""
    from oomguard.daemon.events import Events
    from oomguard.daemon.lifecycle import Lifecycle

    clock = FakeClock()
    store = Store(tmp_path / "oomguard.db", now=clock.time)
    lifecycle = Lifecycle(store, Events(store, files_of=lambda attempt: pytest.fail("no files"), secret_urls=lambda job_id: ()), clock)
    job_id = lifecycle.enqueue(
        name="j", owner="me", owner_uid=0, spec={}, priority=0, workdir=None, plan=START.to_dict(), spool_file=None, jobs_root=tmp_path,
    )
    wait = DiskWait(path="/w/checkpoints", wait_free=2 * MiB, needed=2 * MiB, free=MiB)
    decision = WaitForDisk(reason="the disk was full", path="/w/checkpoints", needed=2 * MiB, free=MiB)
    lifecycle.wait_for_disk(store.job(job_id), decision, wait)
    job = store.job(job_id)
    assert (job.state, job.disk_path, job.disk_wait_bytes, job.disk_needed, job.waiting_since) == ("queued", "/w/checkpoints", 2 * MiB, 2 * MiB, clock.time())
    assert job.waiting == "waiting for disk: /w/checkpoints needs 2.0 MiB free, has 1.0 MiB"
    assert store.disk_waiting_jobs() == [job]
    clock.advance(60)
    lifecycle.disk_space_back(job, 3 * MiB)
    job = store.job(job_id)
    assert (job.state, job.disk_path, job.disk_wait_bytes, job.disk_needed, job.waiting, job.waiting_since) == ("queued", None, None, None, None, None)
    assert store.disk_waiting_jobs() == []
    assert [(e.kind, e.code) for e in store.events(job_id)] == [("waiting_for_disk", "disk_full"), ("resumed", "disk_space_back")]
    lifecycle.wait_for_disk(store.job(job_id), decision, wait)
    lifecycle.start(store.job(job_id), number=1, plan="{}", directory="/a/001", started_at=5.0)
    job = store.job(job_id)
    assert (job.state, job.disk_path, job.waiting) == ("running", None, None)
    store.close()
