"""A job's state moves only along the transition table (daemon/lifecycle.py), and the values it
stores are the ones status, the CLI and older databases know."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from oomguard.daemon.events import Events
from oomguard.daemon.lifecycle import ENDED, TRANSITIONS, IllegalTransition, Lifecycle, State, check
from oomguard.daemon.store import TERMINAL_STATES, Store
from oomguard.daemon.store_rows import JobRow
from tests.fakes import FakeClock

ALLOWED = [(before, after) for before, afters in TRANSITIONS.items() for after in sorted(afters)]
FORBIDDEN = [
    (before, after) for before, after in itertools.product([None, *State], State) if after not in TRANSITIONS[before]
]


@pytest.mark.parametrize(("before", "after"), ALLOWED)
def test_every_allowed_transition_passes(before: State | None, after: State) -> None:
    check(before, after)


@pytest.mark.parametrize(("before", "after"), FORBIDDEN)
def test_every_other_transition_raises(before: State | None, after: State) -> None:
    with pytest.raises(IllegalTransition):
        check(before, after)


def test_the_stored_values_are_the_ones_readers_know() -> None:
    assert [state.value for state in State] == ["queued", "running", "finished", "failed", "cancelled"]
    assert {state.value for state in ENDED} == set(TERMINAL_STATES)
    assert all(not TRANSITIONS[state] for state in ENDED)


@pytest.fixture
def lifecycle(tmp_path: Path) -> Lifecycle:
    clock = FakeClock()
    store = Store(tmp_path / "oomguard.db", now=clock.time)
    events = Events(store, files_of=lambda attempt: pytest.fail("no attempt files here"), secret_urls=lambda job_id: ())
    return Lifecycle(store, events, clock)


def enqueue(lifecycle: Lifecycle, tmp_path: Path) -> JobRow:
    job_id = lifecycle.enqueue(
        name="j", owner="me", owner_uid=0, spec={}, priority=0, workdir=None, plan={"batch_size": 4, "micro_batch": 4}, spool_file=None,
        jobs_root=tmp_path,
    )
    return lifecycle.store.job(job_id)


def test_a_job_runs_and_ends_through_the_lifecycle(lifecycle: Lifecycle, tmp_path: Path) -> None:
    job = enqueue(lifecycle, tmp_path)
    assert job.state == "queued"
    lifecycle.note_waiting(job, "needs 1 GPU", code="no_room")
    assert lifecycle.store.job(job.id).waiting == "needs 1 GPU"
    attempt_id = lifecycle.start(lifecycle.store.job(job.id), number=1, plan="{}", directory="/a/001", started_at=5.0)
    job = lifecycle.store.job(job.id)
    assert job.state == "running" and job.waiting is None and job.started_at == 5.0
    assert lifecycle.store.attempts(job.id)[0].id == attempt_id
    lifecycle.end(job, State.FINISHED, "finished 4 steps", code="finished", data={"step": 4})
    job = lifecycle.store.job(job.id)
    assert (job.state, job.result, job.ended_at) == ("finished", "finished 4 steps", lifecycle.clock.time())
    events = lifecycle.store.events(job.id)
    assert [(e.kind, e.code, e.data) for e in events] == [("waiting", "no_room", {}), ("finished", "finished", {"step": 4})]


def test_an_ended_job_never_moves_again(lifecycle: Lifecycle, tmp_path: Path) -> None:
    job = enqueue(lifecycle, tmp_path)
    lifecycle.end(job, State.CANCELLED, "cancelled before its next attempt started", code="cancelled_queued")
    with pytest.raises(IllegalTransition, match="from cancelled to running"):
        lifecycle.start(job, number=1, plan="{}", directory="/a/001", started_at=5.0)
    with pytest.raises(IllegalTransition, match="from cancelled to queued"):
        lifecycle.requeue(job, "again", code="daemon_stopped")
    assert lifecycle.store.job(job.id).state == "cancelled" and lifecycle.store.attempts(job.id) == []


def test_a_queued_job_cannot_finish_and_queued_does_not_end_a_job(lifecycle: Lifecycle, tmp_path: Path) -> None:
    job = enqueue(lifecycle, tmp_path)
    with pytest.raises(IllegalTransition, match="from queued to finished"):
        lifecycle.end(job, State.FINISHED, "finished", code="finished")
    with pytest.raises(IllegalTransition, match="queued does not end a job"):
        lifecycle.end(job, State.QUEUED, "?", code="?")
