"""The SQLite store: dicts in, dicts out, migrations, ordering."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from oomguard.daemon.store import MIGRATIONS, JobNotFound, Store


@pytest.fixture
def fresh_store(tmp_path: Path) -> Store:
    store = Store(tmp_path / "oomguard.db")
    yield store
    store.close()


def add(store: Store, name: str, priority: int = 0, workdir: str | None = None) -> int:
    return store.add_job(
        name=name, owner="alice", spec={"name": name}, priority=priority, workdir=workdir,
        plan={"batch_size": 4, "micro_batch": 4}, spool_file=None, emulate_device_memory=None, jobs_root=Path("/jobs"),
    )


def test_a_job_gets_a_default_workdir_under_the_jobs_root(fresh_store: Store) -> None:
    job_id = add(fresh_store, "a")
    assert fresh_store.job(job_id)["workdir"] == f"/jobs/{job_id}"
    assert fresh_store.job(add(fresh_store, "b", workdir="/elsewhere"))["workdir"] == "/elsewhere"


def test_jobs_by_id_or_newest_of_a_name(fresh_store: Store) -> None:
    first, second = add(fresh_store, "same"), add(fresh_store, "same")
    assert fresh_store.job(str(first))["id"] == first
    assert fresh_store.job("same")["id"] == second
    with pytest.raises(JobNotFound, match="no job 'other'"):
        fresh_store.job("other")


def test_queue_order_is_priority_then_first_come(fresh_store: Store) -> None:
    low, high, low2, high2 = add(fresh_store, "l"), add(fresh_store, "h", 5), add(fresh_store, "l2"), add(fresh_store, "h2", 5)
    assert [j["id"] for j in fresh_store.queued_jobs()] == [high, high2, low, low2]


def test_attempts_and_events_round_trip(fresh_store: Store) -> None:
    job_id = add(fresh_store, "a")
    attempt_id = fresh_store.add_attempt(job_id=job_id, number=1, plan="{}", directory="/x", started_at=1.0, pid=42)
    assert [a["id"] for a in fresh_store.running_attempts()] == [attempt_id]
    fresh_store.update_attempt(attempt_id, ended_at=2.0, outcome_kind="oom")
    assert fresh_store.running_attempts() == []
    assert fresh_store.attempts(job_id)[0]["outcome_kind"] == "oom"
    fresh_store.add_event(job_id, "queued", "hello")
    assert [e["message"] for e in fresh_store.events(job_id)] == ["hello"]


def test_reopening_keeps_everything_and_does_not_migrate_again(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    job_id = add(store, "a")
    store.close()
    again = Store(tmp_path / "db")
    assert again.job(job_id)["name"] == "a"
    assert again._schema_version() == len(MIGRATIONS)
    assert again.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_newer_schema_is_refused_with_advice(tmp_path: Path) -> None:
    connection = sqlite3.connect(tmp_path / "db")
    connection.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    connection.close()
    with pytest.raises(RuntimeError, match="upgrade oomguard"):
        Store(tmp_path / "db")


def test_each_jobs_newest_attempt_and_count_in_one_query_per_500_jobs(fresh_store: Store) -> None:
    ids = [add(fresh_store, f"j{i}") for i in range(1203)]
    for job_id in ids[:1202:2]:  # every other job, including across the 500-job chunks
        for number in (1, 2, 3):
            fresh_store.add_attempt(job_id=job_id, number=number, plan="{}", directory=f"/w/{job_id}/{number}", started_at=1.0, pid=None)
    newest = fresh_store.newest_attempts(ids)
    assert sorted(newest) == ids[:1202:2]
    assert all(row["count"] == 3 and row["number"] == 3 and row["directory"] == f"/w/{job_id}/3" for job_id, row in newest.items())
    assert fresh_store.newest_attempts([]) == {}
