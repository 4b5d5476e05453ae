"""The store's collection (daemon/store_gc.py): ended jobs forgotten after a while with all the
daemon keeps of them, nothing of a job that runs or waits, and each job's events bounded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from oomguard.daemon.paths import StateDir
from oomguard.daemon.store import Store
from oomguard.daemon.store_gc import DAY_SECONDS, EVENTS_KEPT_FIRST, Collected, collect

NOW = 1_800_000_000.0


@pytest.fixture
def state(tmp_path: Path) -> StateDir:
    state = StateDir(tmp_path / "state").create()
    state.secrets.mkdir(exist_ok=True)
    return state


def add(store: Store, name: str, state_name: str = "queued", ended_days_ago: float | None = None) -> int:
    job_id = store.add_job(
        name=name, owner="alice", spec={"name": name}, priority=0, workdir=None, plan={"batch_size": 4}, spool_file=f"{name}.toml",
        jobs_root=Path("/jobs"),
    )
    ended_at = NOW - ended_days_ago * DAY_SECONDS if ended_days_ago is not None else None
    store.update_job(job_id, state=state_name, ended_at=ended_at)
    return job_id


def test_ended_jobs_older_than_the_limit_are_forgotten_with_what_the_daemon_kept_of_them(state: StateDir) -> None:
    store = Store(state.database)
    old = add(store, "old", "finished", ended_days_ago=40)
    old_failed = add(store, "old-failed", "failed", ended_days_ago=31)
    recent = add(store, "recent", "finished", ended_days_ago=2)
    running = add(store, "running", "running")
    queued = add(store, "queued")
    for job_id in (old, old_failed, recent, running, queued):
        store.add_attempt(job_id=job_id, number=1, plan="{}", directory=f"/w/{job_id}", started_at=1.0)
        store.add_event(job_id, "queued", "queued")
        (state.accepted / f"{job_id:06d}-job{job_id}.toml").write_text("name = 'x'\n")
        (state.secrets / f"{job_id}.json").write_text("{}")
    store.add_request(file="c.request", requester="alice", action="cancel", job_key=str(old), job_id=old, accepted=1, answer="ok")
    refused = state.rejected / "bad.toml"
    refused.write_text("nope")
    os.utime(refused, (NOW - 40 * DAY_SECONDS,) * 2)
    fresh_refusal = state.rejected / "new.toml"
    fresh_refusal.write_text("nope")
    os.utime(fresh_refusal, (NOW,) * 2)

    collected = collect(store, state, older_than_seconds=30 * DAY_SECONDS, now=NOW)

    assert collected == Collected(jobs=2, attempts=2, events=2, requests=1, files=5)
    assert sorted(job.id for job in store.jobs()) == [recent, running, queued]
    assert store.attempts(old) == [] and store.events(old) == [] and store.request_by_file("c.request") is None
    assert sorted(p.name for p in state.accepted.iterdir()) == [f"{j:06d}-job{j}.toml" for j in (recent, running, queued)]
    assert sorted(p.name for p in state.secrets.iterdir()) == [f"{j}.json" for j in (recent, running, queued)]
    assert [p.name for p in state.rejected.iterdir()] == ["new.toml"]
    assert collect(store, state, older_than_seconds=30 * DAY_SECONDS, now=NOW) == Collected()  # nothing twice
    store.close()


def test_a_jobs_events_past_the_cap_keep_their_first_and_newest_and_say_what_went(state: StateDir) -> None:
    store = Store(state.database)
    busy, calm = add(store, "busy", "running"), add(store, "calm", "running")
    for n in range(300):
        store.add_event(busy, "waiting" if n % 3 else "retry", f"event {n}")
    for n in range(50):
        store.add_event(calm, "waiting", f"event {n}")

    collected = collect(store, state, older_than_seconds=30 * DAY_SECONDS, now=NOW, events_per_job=200)

    events = store.events(busy)
    assert len(events) == 200 and collected.compacted_jobs == 1 and collected.compacted_events == 101
    assert [e.message for e in events[:EVENTS_KEPT_FIRST]] == [f"event {n}" for n in range(EVENTS_KEPT_FIRST)]
    assert [e.message for e in events[EVENTS_KEPT_FIRST:-1]] == [f"event {n}" for n in range(201, 300)]
    summary = events[-1]
    assert summary.kind == "compacted" and summary.data["removed"] == 101
    assert summary.data["kinds"] == {"waiting": sum(1 for n in range(100, 201) if n % 3), "retry": sum(1 for n in range(100, 201) if n % 3 == 0)}
    assert len(store.events(calm)) == 50
    store.close()
