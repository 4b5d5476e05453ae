"""The SQLite store: dicts in, typed rows out, migrations (a database made before they had
names included), ordering."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from oomguard.daemon.store import Store
from oomguard.daemon.store_rows import JobRow
from oomguard.daemon.store_schema import KNOWN_MIGRATIONS, MIGRATIONS, UNNAMED_MIGRATIONS
from oomguard.strategies.plan import Plan
from oomguard.strategies.errors import JobNotFound

# A database made by the oomguard that counted its migrations in user_version alone (3: the
# three of UNNAMED_MIGRATIONS), with a job that ran out of memory once, then finished; a
# refused request; a GPU sample. Made before migrations had names, by that code.
BEFORE_NAMED_MIGRATIONS = Path(__file__).parent / "fixtures" / "store_v3.db"


@pytest.fixture
def fresh_store(tmp_path: Path) -> Store:
    store = Store(tmp_path / "oomguard.db")
    yield store
    store.close()


def add(store: Store, name: str, priority: int = 0, workdir: str | None = None) -> int:
    return store.add_job(
        name=name, owner="alice", spec={"name": name}, priority=priority, workdir=workdir,
        plan={"batch_size": 4, "micro_batch": 4}, spool_file=None, jobs_root=Path("/jobs"),
    )


def test_a_job_gets_a_default_workdir_under_the_jobs_root(fresh_store: Store) -> None:
    job_id = add(fresh_store, "a")
    assert fresh_store.job(job_id).workdir == f"/jobs/{job_id}"
    assert fresh_store.job(add(fresh_store, "b", workdir="/elsewhere")).workdir == "/elsewhere"


def test_jobs_by_id_or_newest_of_a_name(fresh_store: Store) -> None:
    first, second = add(fresh_store, "same"), add(fresh_store, "same")
    assert fresh_store.job(str(first)).id == first
    assert fresh_store.job("same").id == second
    with pytest.raises(JobNotFound, match="no job 'other'"):
        fresh_store.job("other")


def test_queue_order_is_priority_then_first_come(fresh_store: Store) -> None:
    low, high, low2, high2 = add(fresh_store, "l"), add(fresh_store, "h", 5), add(fresh_store, "l2"), add(fresh_store, "h2", 5)
    assert [j.id for j in fresh_store.queued_jobs()] == [high, high2, low, low2]


def test_attempts_and_events_round_trip(fresh_store: Store) -> None:
    job_id = add(fresh_store, "a")
    attempt_id = fresh_store.add_attempt(job_id=job_id, number=1, plan="{}", directory="/x", started_at=1.0, pid=42)
    assert [a.id for a in fresh_store.running_attempts()] == [attempt_id]
    fresh_store.update_attempt(attempt_id, ended_at=2.0, outcome_kind="oom", gpus="0,2")
    assert fresh_store.running_attempts() == []
    (attempt,) = fresh_store.attempts(job_id)
    assert (attempt.outcome_kind, attempt.gpus, attempt.outcome) == ("oom", (0, 2), None)
    assert attempt.as_stored()["gpus"] == "0,2"
    fresh_store.add_event(job_id, "failed", "hello", code="gave_up", data={"attempt": 1, "free_bytes": 2**40})
    (event,) = fresh_store.events(job_id)
    assert (event.kind, event.code, event.data, event.message) == ("failed", "gave_up", {"attempt": 1, "free_bytes": 2**40}, "hello")
    fresh_store.add_event(job_id, "queued", "again")
    assert fresh_store.events(job_id)[-1].code == "queued"  # a kind with one cause: the kind


def test_rows_parse_what_the_store_holds_as_json_and_give_it_back_as_stored(fresh_store: Store) -> None:
    job = fresh_store.job(add(fresh_store, "a"))
    assert isinstance(job, JobRow) and job.plan == Plan(batch_size=4, micro_batch=4)
    assert job.spec_dict() == {"name": "a"} and job.cancel_requested is False
    stored = job.as_stored()
    assert list(stored)[:4] == ["id", "name", "owner", "spec"] and stored["plan"] == job.plan_json and stored["cancel_requested"] == 0


def applied(store: Store) -> list[str]:
    return [migration.name for migration in MIGRATIONS.applied(store.db)]


def test_reopening_keeps_everything_and_does_not_migrate_again(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    job_id = add(store, "a")
    assert applied(store) == list(KNOWN_MIGRATIONS)
    store.close()
    again = Store(tmp_path / "db")
    assert again.job(job_id).name == "a"
    assert applied(again) == list(KNOWN_MIGRATIONS)  # recorded once each
    assert again.db.execute("PRAGMA user_version").fetchone()[0] == len(KNOWN_MIGRATIONS)
    assert again.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_database_from_before_named_migrations_opens_without_running_them_again(tmp_path: Path) -> None:
    path = tmp_path / "oomguard.db"
    shutil.copy(BEFORE_NAMED_MIGRATIONS, path)
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == len(UNNAMED_MIGRATIONS)
    store = Store(path)
    assert applied(store) == list(KNOWN_MIGRATIONS)
    (job,) = store.jobs()
    assert (job.name, job.state, job.plan.short(), job.spec.train.max_steps) == ("fixture", "finished", "mb=4x2", 8)
    first, second = store.attempts(job.id)
    assert first.outcome is not None and (first.outcome.kind, first.outcome.phase, first.plan.short()) == ("oom", "backward", "mb=8x1")
    assert second.outcome_kind == "finished" and second.rung == "micro_batch"
    events = store.events(job.id)
    assert [e.kind for e in events] == ["queued", "started", "attempt-ended", "escalated", "started", "attempt-ended", "finished"]
    assert all(e.code is None and e.data == {} for e in events)  # recorded before codes were kept
    assert store.request_by_file("r1.toml").accepted is False
    (sample,) = store.latest_gpu_samples()
    assert (sample.gpu, sample.processes) == (0, ())
    # It works as any other: new events carry codes, and reopening migrates nothing.
    store.add_event(job.id, "note", "after the upgrade", code="note", data={"n": 1})
    store.close()
    again = Store(path)
    assert applied(again) == list(KNOWN_MIGRATIONS) and again.events(job.id)[-1].data == {"n": 1}
    again.close()


def test_a_newer_schema_is_refused_with_advice(tmp_path: Path) -> None:
    connection = sqlite3.connect(tmp_path / "db")
    connection.execute(f"PRAGMA user_version = {len(KNOWN_MIGRATIONS) + 1}")
    connection.close()
    with pytest.raises(RuntimeError, match="newer than this oomguard knows .*; upgrade oomguard"):
        Store(tmp_path / "db")


def test_a_migration_this_oomguard_does_not_know_is_refused_with_advice(tmp_path: Path) -> None:
    Store(tmp_path / "db").close()
    connection = sqlite3.connect(tmp_path / "db")
    connection.execute("insert into _sqlite_migrations (migration_set, name, applied_at) values ('oomguard', 'from_the_future', 'x')")
    connection.commit()
    connection.close()
    with pytest.raises(RuntimeError, match="newer than this oomguard knows .*; upgrade oomguard"):
        Store(tmp_path / "db")


def test_each_jobs_newest_attempt_and_count_in_one_query_per_500_jobs(fresh_store: Store) -> None:
    ids = [add(fresh_store, f"j{i}") for i in range(1203)]
    for job_id in ids[:1202:2]:  # every other job, including across the 500-job chunks
        for number in (1, 2, 3):
            fresh_store.add_attempt(job_id=job_id, number=number, plan="{}", directory=f"/w/{job_id}/{number}", started_at=1.0, pid=None)
    newest = fresh_store.newest_attempts(ids)
    assert sorted(newest) == ids[:1202:2]
    assert all(row.count == 3 and row.attempt.number == 3 and row.attempt.directory == f"/w/{job_id}/3" for job_id, row in newest.items())
    assert fresh_store.newest_attempts([]) == {}


def test_status_reads_the_counts_the_active_jobs_the_head_of_the_queue_and_the_last_ended(fresh_store: Store) -> None:
    ids = [add(fresh_store, f"j{i}", priority=5 if i == 40 else 0) for i in range(50)]
    for job_id, state, ended_at in ((ids[0], "running", None), (ids[1], "finished", 30.0), (ids[2], "failed", 10.0), (ids[3], "cancelled", 20.0)):
        fresh_store.update_job(job_id, state=state, ended_at=ended_at)
    assert fresh_store.job_counts() == {"queued": 46, "running": 1, "finished": 1, "failed": 1, "cancelled": 1}
    # The running job, the first three of the queue in the order they run (job 40 first: its
    # priority), the two that ended last; in id order.
    assert [j.id for j in fresh_store.jobs_at_a_glance(queued=3, ended=2)] == [ids[0], ids[1], ids[3], ids[4], ids[5], ids[40]]
    assert [j.id for j in fresh_store.jobs_page(offset=10, limit=3)] == ids[10:13]


def test_every_write_to_a_job_or_an_attempt_moves_the_write_count(fresh_store: Store) -> None:
    """The scheduler reads the queue again only when this count moved (Scheduler.run_pass)."""
    counts = [fresh_store.job_writes]
    job_id = add(fresh_store, "a")
    counts.append(fresh_store.job_writes)
    fresh_store.update_job(job_id, priority=3)
    counts.append(fresh_store.job_writes)
    fresh_store.note_waiting("waiting for a GPU", replaces="waiting")
    counts.append(fresh_store.job_writes)
    fresh_store.request_cancel(job_id)
    counts.append(fresh_store.job_writes)
    attempt_id = fresh_store.add_attempt(job_id=job_id, number=1, plan="{}", directory="/x", started_at=1.0, pid=42)
    counts.append(fresh_store.job_writes)
    fresh_store.update_attempt(attempt_id, ended_at=2.0)
    counts.append(fresh_store.job_writes)
    assert counts == sorted(set(counts))  # each one moved it
    fresh_store.add_event(job_id, "note", "an event is not a job")
    assert fresh_store.job_writes == counts[-1]
