"""Retention and the disk budget (issue 18, item 2): the last `keep_checkpoints`, and for good
those whose step is a multiple of `train.keep_every_steps`; a `[resources] disk` budget the
checkpoints folder may not grow past (the oldest go first, never the newest that verifies nor
one kept for good; when that is not enough, the job waits as on a full disk)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from oomguard.daemon.disk_wait import DISK_NOTE, DiskWait, free_for
from oomguard.daemon.paths import StateDir
from oomguard.daemon.store import Store
from oomguard.daemon.supervisor import Supervisor
from oomguard.daemon.users import Account
from oomguard.jobs import checkpoints
from oomguard.jobs.checkpoint_budget import within_budget
from oomguard.jobs.disk_space import DiskFull
from oomguard.strategies.decision import PastAttempt, WaitForDisk
from oomguard.strategies.doctor import decide
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.policy import Policy
from tests.fakes import FakeClock, FakeLauncher
from tests.jobs_helpers import tiny_job

KiB = 1024
BLOCK = 4096
# Each fake checkpoint: a 40 KiB file and its manifest (one 4 KiB block).
CHECKPOINT = 40 * KiB + BLOCK


def write(folder: Path, step: int, keep: int = 100, keep_every: int | None = None) -> None:
    checkpoints.save(folder, step, {}, lambda d: (d / "state.bin").write_bytes(b"\0" * (40 * KiB)), keep, keep_every)


def steps(folder: Path) -> list[int]:
    return sorted(checkpoints.verify(p).step for p in checkpoints.candidates(folder))


# Retention ----------------------------------------------------------------------------------------


def test_the_last_k_and_those_kept_for_good_stay(tmp_path: Path) -> None:
    for step in range(2, 22, 2):
        write(tmp_path, step, keep=2, keep_every=6)
    assert steps(tmp_path) == [6, 12, 18, 20]  # 18 and 20 the newest two; 6, 12, 18 for good


def test_without_keep_every_only_the_last_k_stay(tmp_path: Path) -> None:
    for step in range(2, 12, 2):
        write(tmp_path, step, keep=2)
    assert steps(tmp_path) == [8, 10]


def test_a_checkpoint_kept_for_good_still_verifies_and_resumes_first(tmp_path: Path) -> None:
    for step in (3, 6, 9):
        write(tmp_path, step, keep=1, keep_every=3)
    assert checkpoints.latest_valid(tmp_path).step == 9  # type: ignore[union-attr]
    assert [c.step for c in checkpoints.valid_newest_first(tmp_path)] == [9, 6, 3]


def test_the_bytes_of_a_folder_count_whole_blocks(tmp_path: Path) -> None:
    write(tmp_path, 1)
    assert checkpoints.folder_bytes(tmp_path, BLOCK) == CHECKPOINT == checkpoints.recorded_bytes(tmp_path, BLOCK)
    assert checkpoints.folder_bytes(tmp_path / "nothing-here", BLOCK) == 0


# The budget, in the runner ------------------------------------------------------------------------


def test_a_checkpoint_that_fits_the_budget_changes_nothing(tmp_path: Path) -> None:
    write(tmp_path, 1)
    within_budget(tmp_path, CHECKPOINT, 2 * CHECKPOINT, None, pytest.fail)
    within_budget(tmp_path, 10 * CHECKPOINT, None, None, pytest.fail)  # no budget
    assert steps(tmp_path) == [1]


def test_the_oldest_checkpoints_go_first_to_fit_the_budget(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        write(tmp_path, step)
    said: list[str] = []
    within_budget(tmp_path, CHECKPOINT, 2 * CHECKPOINT, None, said.append)
    assert steps(tmp_path) == [3]  # room for the new one beside the newest
    assert said == [
        f"removed checkpoint step-00000{n} (44.0 KiB) to keep the checkpoints within the job's disk budget of 88.0 KiB" for n in (1, 2)
    ]


def test_neither_the_newest_good_checkpoint_nor_one_kept_for_good_goes(tmp_path: Path) -> None:
    for step in (4, 5, 7):
        write(tmp_path, step, keep_every=4)
    # The newest is damaged: the newest that verifies (5) is the last good one.
    (tmp_path / "step-000007" / "state.bin").write_bytes(b"\1" * (40 * KiB))
    budget = 3 * CHECKPOINT // 2
    with pytest.raises(DiskFull) as raised:
        within_budget(tmp_path, CHECKPOINT, budget, 4, lambda text: None)
    assert steps_on_disk(tmp_path) == [4, 5]  # the damaged one went; 4 is kept for good, 5 is the last good
    full = raised.value
    assert (full.path, full.needed, full.free, full.budget) == (str(tmp_path), CHECKPOINT, 0, budget)
    assert str(full) == f"no room for a checkpoint at {tmp_path}: needs 44.0 KiB free within the job's disk budget of 66.0 KiB ([resources] disk), has 0.0 KiB"


def steps_on_disk(folder: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in checkpoints.candidates(folder))


def test_with_nothing_it_may_remove_the_checkpoint_waits(tmp_path: Path) -> None:
    write(tmp_path, 1)
    with pytest.raises(DiskFull) as raised:
        within_budget(tmp_path, CHECKPOINT, CHECKPOINT + BLOCK, None, lambda text: None)
    assert steps(tmp_path) == [1] and raised.value.free == BLOCK and raised.value.budget == CHECKPOINT + BLOCK


# The budget, in the daemon ------------------------------------------------------------------------

OVER_BUDGET = Outcome(
    kind="disk_full", step=6, phase="checkpoint", message="no room for a checkpoint ...", disk_path="/w/checkpoints",
    disk_needed=CHECKPOINT, disk_free=BLOCK, disk_budget=3 * CHECKPOINT,
)


def test_the_doctor_waits_for_room_in_the_budget() -> None:
    plan = Plan.initial(8)
    decision = decide(OVER_BUDGET, plan, [PastAttempt(plan, OVER_BUDGET)], Policy())
    assert isinstance(decision, WaitForDisk) and decision.budget == 3 * CHECKPOINT
    assert "has 44.0 KiB free within the job's disk budget of 132.0 KiB" in decision.reason


def test_room_in_a_budget_is_what_the_folder_leaves_of_it(tmp_path: Path) -> None:
    write(tmp_path, 1)
    wait = DiskWait(path=str(tmp_path), wait_free=CHECKPOINT, needed=CHECKPOINT, free=0, budget=2 * CHECKPOINT)
    assert free_for(wait) == CHECKPOINT
    write(tmp_path, 2)
    assert free_for(wait) == 0 and not wait.has_room(free_for(wait))
    assert wait.note(0) == f"{DISK_NOTE}{tmp_path} needs 44.0 KiB free within its disk budget of 88.0 KiB ([resources] disk), has 0.0 KiB"


@pytest.fixture
def supervised(tmp_path: Path) -> Iterator[tuple[Supervisor, Store, FakeClock, FakeLauncher]]:
    clock = FakeClock()
    state = StateDir(tmp_path / "state").create()
    store = Store(state.database, now=clock.time)
    launcher = FakeLauncher()
    yield Supervisor(state, store, launcher=launcher, clock=clock), store, clock, launcher
    store.close()


def test_a_job_over_its_budget_waits_until_its_folder_has_room(supervised, tmp_path: Path) -> None:
    supervisor, store, clock, launcher = supervised
    folder = tmp_path / "work" / "checkpoints"
    for step in (2, 4):
        write(folder, step)
    job_id = supervisor.add_job(tiny_job("budget"), Account.current())
    supervisor.drain()
    outcome = Outcome(**{**OVER_BUDGET.__dict__, "disk_path": str(folder), "disk_budget": 2 * CHECKPOINT})
    launcher.finish(launcher.started[0], outcome, returncode=5)
    supervisor.drain()
    job = store.job(job_id)
    assert (job.state, job.disk_path, job.disk_budget, job.disk_wait_bytes) == ("queued", str(folder), 2 * CHECKPOINT, CHECKPOINT)
    (event,) = [e for e in store.events(job_id) if e.kind == "waiting_for_disk"]
    assert event.code == "disk_budget" and event.data["budget_bytes"] == 2 * CHECKPOINT
    clock.advance(30)
    supervisor.drain()
    assert len(launcher.started) == 1  # two checkpoints fill the budget: no room for a third
    (folder / "step-000002" / "state.bin").unlink()  # the user makes room (a checkpoint kept for good, say)
    (folder / "step-000002" / "manifest.json").unlink()
    (folder / "step-000002").rmdir()
    clock.advance(10)
    supervisor.drain()
    assert len(launcher.started) == 2 and store.job(job_id).disk_path is None
    assert [e.code for e in store.events(job_id) if e.kind == "resumed"] == ["disk_space_back"]
