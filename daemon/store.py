"""The daemon's state in SQLite (through sqlite-utils): jobs, attempts, events, requests from
users and GPU samples. Read methods return typed rows (daemon/store_rows.py).

Reads go straight to the sqlite3 connection; sqlite-utils (which imports numpy when it is
there: ~70 ms) is loaded for the first write or migration, so that a read-only `oomguard
status` starts in a fraction of that.

Nothing important lives only in memory: a restarted daemon reads everything back from here.
WAL lets the CLI read while the daemon writes; a busy timeout makes writers wait their turn.
Opening it for writing brings its schema up to date (daemon/store_schema.py).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from oomguard.daemon.store_rows import AttemptRow, EventRow, GpuSampleRow, JobRow, NewestAttempt, RequestRow
from oomguard.strategies.errors import AmbiguousJobName, JobNotFound

if TYPE_CHECKING:
    import sqlite_utils

JobState = Literal["queued", "running", "finished", "failed", "cancelled"]
TERMINAL_STATES: tuple[JobState, ...] = ("finished", "failed", "cancelled")


def owns(job: JobRow, uid: int, user: str | None) -> bool:
    """Whether the user ``uid`` (named ``user``) owns ``job``: by its owner's uid, or, for a job
    recorded before owner_uid was kept (None), by its owner's name."""
    return job.owner_uid == uid or (job.owner_uid is None and user is not None and job.owner == user)


def _listed(items: Iterator[str], most: int = 10) -> str:
    """At most ``most`` items, then how many more: an error message stays a few lines."""
    items = list(items)
    more = f" and {len(items) - most} more (`oomguard status --all` lists them)" if len(items) > most else ""
    return ", ".join(items[:most]) + more


@dataclass(frozen=True)
class Forgotten:
    """What Store.forget_jobs_ended_before deleted."""

    job_ids: tuple[int, ...]
    attempts: int
    events: int
    requests: int


class Store:
    def __init__(self, path: Path, *, readonly: bool = False, now: Callable[[], float] = time.time) -> None:
        """``readonly``: for users who may read a system daemon's store but not write it.
        ``now``: the clock its timestamps come from (the daemon's; a test's fake one)."""
        self._now = now
        # How many writes to jobs and attempts this Store has made: the scheduler loads the
        # queue again only when it moved (the daemon is their only writer; the CLI talks to it
        # through the spool). Reading a queue of 10,000 jobs at every tick took a fifth of a core.
        self.job_writes = 0
        self._db: sqlite_utils.Database | None = None
        if readonly:
            if not path.exists():
                raise FileNotFoundError(f"no oomguard database at {path}: is the daemon running with this --state-dir?")
            # With the daemon stopped there is no -wal file, and a read-only connection cannot
            # make one: the database file alone is then the whole truth (immutable).
            wal = path.with_name(path.name + "-wal")
            mode = "mode=ro" if wal.exists() else "mode=ro&immutable=1"
            self.conn = sqlite3.connect(f"file:{path}?{mode}", uri=True, timeout=10)
            return
        from oomguard.daemon.store_schema import migrate

        path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(path)
        self.db.execute("PRAGMA busy_timeout = 10000")
        self.db.enable_wal()
        migrate(self.db)

    @property
    def db(self) -> sqlite_utils.Database:
        """sqlite-utils over the same connection: what writes and migrations go through."""
        if self._db is None:
            import sqlite_utils

            self._db = sqlite_utils.Database(self.conn)
        return self._db

    def _query(self, sql: str, params: list[Any] | None = None) -> list[dict[str, Any]]:
        """The rows of a query as dicts (column: value), as sqlite-utils' query gives them."""
        cursor = self.conn.execute(sql, params or [])
        columns = [description[0] for description in cursor.description]
        return [dict(zip(columns, row)) for row in cursor.fetchall()]

    def close(self) -> None:
        self.conn.close()

    @contextmanager
    def atomic(self) -> Iterator[None]:
        with self.db.atomic():
            yield

    # Jobs -----------------------------------------------------------------------------------

    def add_job(self, *, name: str, owner: str, owner_uid: int | None = None, spec: dict[str, Any], priority: int, workdir: str | None, plan: dict[str, Any], spool_file: str | None, jobs_root: Path) -> int:
        """Record a queued job; its workdir defaults to jobs_root/<id>."""
        self.job_writes += 1
        with self.db.atomic():
            table = self.db["jobs"]
            table.insert(
                {
                    "name": name,
                    "owner": owner,
                    "owner_uid": owner_uid,
                    "spec": json.dumps(spec),
                    "state": "queued",
                    "priority": priority,
                    "submitted_at": self._now(),
                    "workdir": workdir or "",
                    "plan": json.dumps(plan),
                    "spool_file": spool_file,
                }
            )
            job_id = table.last_pk
            if not workdir:
                table.update(job_id, {"workdir": str(jobs_root / str(job_id))})
        return int(job_id)

    def job(self, key: int | str) -> JobRow:
        """A job by id, or by name (the newest job of that name)."""
        text = str(key)
        if text.isdigit():
            rows = list(self._query("select * from jobs where id = ?", [int(text)]))
        else:
            rows = list(self._query("select * from jobs where name = ? order by id desc limit 1", [text]))
        if not rows:
            raise JobNotFound(f"no job {text!r}; `oomguard status` lists the jobs")
        return JobRow.from_stored(rows[0])

    def job_for(self, key: int | str, uid: int, user: str | None = None) -> JobRow:
        """The job the user ``uid`` (named ``user``) means by ``key``: an id is that job,
        whoever's it is; a name is their own job of that name, else the one job of anyone else
        that has it. Several of their own, or several of others' and none of their own, is
        AmbiguousJobName, which lists the ids to use instead.

        Why not the newest job of the name (Store.job): another user who named a job like
        yours made your `show`/`cancel NAME` land on theirs."""
        text = str(key)
        if text.isdigit():
            return self.job(text)
        rows = [JobRow.from_stored(row) for row in self._query("select * from jobs where name = ? order by id", [text])]
        if not rows:
            raise JobNotFound(f"no job {text!r}; `oomguard status` lists the jobs")
        own = [row for row in rows if owns(row, uid, user)]
        if len(own) == 1:
            return own[0]
        if len(own) > 1:
            listed = _listed(f"{row.id} ({row.state})" for row in own)
            raise AmbiguousJobName(f"several of your jobs are named {text!r}: {listed}; name the one you mean by its id, e.g. {own[-1].id}")
        if len(rows) == 1:
            return rows[0]
        listed = _listed(f"{row.id} ({row.owner}, {row.state})" for row in rows)
        raise AmbiguousJobName(
            f"you have no job named {text!r}, and several other users' jobs are named so: {listed}; name the one you mean by its id"
        )

    def _jobs(self, sql: str, params: list[Any] | None = None) -> list[JobRow]:
        return [JobRow.from_stored(row) for row in self._query(sql, params or [])]

    def jobs(self) -> list[JobRow]:
        return self._jobs("select * from jobs order by id")

    def job_counts(self) -> dict[str, int]:
        """How many jobs are in each state (one query over the state index, whatever the queue's size)."""
        return {row["state"]: row["n"] for row in self._query("select state, count(*) as n from jobs group by state")}

    def jobs_at_a_glance(self, queued: int, ended: int) -> list[JobRow]:
        """In id order: every job that is neither queued nor ended (running, waiting), the first
        ``queued`` jobs of the queue in the order they will run, and the ``ended`` that ended
        last. What `oomguard status` lists: reading 10,000 rows to show 30 took 0.3 s."""
        ended_states = ", ".join(f"'{state}'" for state in TERMINAL_STATES)
        return self._jobs(
            f"select * from jobs where id in ("
            f"select id from jobs where state != 'queued' and state not in ({ended_states}) "
            f"union select id from (select id from jobs where state = 'queued' order by priority desc, id limit ?) "
            f"union select id from (select id from jobs where state in ({ended_states}) order by ended_at desc, id desc limit ?)"
            f") order by id",
            [queued, ended],
        )

    def jobs_page(self, offset: int, limit: int) -> list[JobRow]:
        """``limit`` jobs in id order from the ``offset``-th."""
        return self._jobs("select * from jobs order by id limit ? offset ?", [limit, offset])

    def job_by_spool_file(self, spool_file: str) -> JobRow | None:
        return self.jobs_by_spool_files([spool_file]).get(spool_file)

    def jobs_by_spool_files(self, spool_files: list[str]) -> dict[str, JobRow]:
        """The jobs recorded for these inbox files, by file name (one query per 500 names: a
        submit of 1,000 files asks after all of them at once)."""
        found: dict[str, JobRow] = {}
        for start in range(0, len(spool_files), 500):
            chunk = spool_files[start:start + 500]
            rows = self._jobs(f"select * from jobs where spool_file in ({', '.join('?' * len(chunk))})", chunk)
            found.update((row.spool_file, row) for row in rows if row.spool_file is not None)
        return found

    def queued_jobs(self) -> list[JobRow]:
        """Jobs waiting to run: highest priority first, then first come first served."""
        return self._jobs("select * from jobs where state = 'queued' order by priority desc, id")

    def disk_waiting_jobs(self) -> list[JobRow]:
        """Queued jobs waiting for disk space. Through the partial index of those jobs (named:
        SQLite's planner would rather take the state index, and read all 10,000 queued rows)."""
        return self._jobs("select * from jobs indexed by idx_jobs_disk_wait where disk_path is not null and state = 'queued' order by id")

    def running_jobs(self) -> list[JobRow]:
        return self._jobs("select * from jobs where state = 'running' order by id")

    def jobs_to_cancel(self) -> list[JobRow]:
        """Jobs whose cancel was requested that have not ended yet."""
        return self._jobs("select * from jobs where cancel_requested = 1 and state in ('queued', 'running')")

    def update_job(self, job_id: int, **fields: Any) -> None:
        self.job_writes += 1
        self.db["jobs"].update(job_id, fields)

    def note_waiting(self, reason: str, replaces: str) -> None:
        """Give ``reason`` to every queued job that says nothing about why it waits, or an older
        reason that starts with ``replaces`` (one statement: a queue of 10,000 jobs is one write)."""
        self.job_writes += 1
        with self.db.conn:
            self.db.conn.execute(
                "UPDATE jobs SET waiting = ?, waiting_since = COALESCE(waiting_since, ?) WHERE state = 'queued' "
                "AND (waiting IS NULL OR (substr(waiting, 1, ?) = ? AND waiting != ?))",
                (reason, self._now(), len(replaces), replaces, reason),
            )

    def request_cancel(self, job_id: int) -> None:
        self.job_writes += 1
        self.db["jobs"].update(job_id, {"cancel_requested": 1})

    # Attempts -------------------------------------------------------------------------------

    def add_attempt(self, **fields: Any) -> int:
        self.job_writes += 1
        table = self.db["attempts"]
        table.insert(fields)
        return int(table.last_pk)

    def attempt(self, attempt_id: int) -> AttemptRow:
        rows = self._query("select * from attempts where id = ?", [attempt_id])
        if not rows:
            raise LookupError(f"no attempt {attempt_id} in the store")
        return AttemptRow.from_stored(rows[0])

    def update_attempt(self, attempt_id: int, **fields: Any) -> None:
        self.job_writes += 1
        self.db["attempts"].update(attempt_id, fields)

    def attempts(self, job_id: int) -> list[AttemptRow]:
        return [AttemptRow.from_stored(row) for row in self._query("select * from attempts where job_id = ? order by number", [job_id])]

    def newest_attempts(self, job_ids: list[int]) -> dict[int, NewestAttempt]:
        """Each job's newest attempt and how many attempts it has (jobs without one are left
        out). One query per 500 jobs rather than one per job."""
        newest: dict[int, NewestAttempt] = {}
        for start in range(0, len(job_ids), 500):
            chunk = job_ids[start:start + 500]
            # SQLite takes the other columns from the row holding max(number).
            rows = self._query(
                f"select *, max(number) as newest, count(*) as count from attempts where job_id in ({', '.join('?' * len(chunk))}) group by job_id",
                chunk,
            )
            newest.update((row["job_id"], NewestAttempt(AttemptRow.from_stored(row), row["count"])) for row in rows)
        return newest

    def running_attempts(self) -> list[AttemptRow]:
        return [AttemptRow.from_stored(row) for row in self._query("select * from attempts where ended_at is null order by id")]

    # Events ---------------------------------------------------------------------------------

    def add_event(self, job_id: int, kind: str, message: str, *, code: str | None = None, data: dict[str, Any] | None = None) -> None:
        """``code``: the kind's specific cause (the kind itself when it has one cause);
        ``data``: the event's figures, stored as JSON."""
        self.db["events"].insert(
            {"job_id": job_id, "at": self._now(), "kind": kind, "message": message, "code": code or kind, "data": json.dumps(data or {})}
        )

    def last_event_id(self) -> int:
        """The newest event's id (0: none yet): whether anything happened since it was read."""
        return int(self.conn.execute("select max(id) from events").fetchone()[0] or 0)

    def has_event_since(self, job_id: int, kind: str, since: float) -> bool:
        return self.conn.execute("select 1 from events where job_id = ? and kind = ? and at >= ? limit 1", [job_id, kind, since]).fetchone() is not None

    def events(self, job_id: int | None = None, after_id: int = 0) -> list[EventRow]:
        if job_id is None:
            rows = self._query("select * from events where id > ? order by id", [after_id])
        else:
            rows = self._query("select * from events where job_id = ? and id > ? order by id", [job_id, after_id])
        return [EventRow.from_stored(row) for row in rows]

    # Requests from users (through the spool) ---------------------------------------------------

    def add_request(self, **fields: Any) -> int:
        table = self.db["requests"]
        table.insert({**fields, "at": self._now()})
        return int(table.last_pk)

    def request_by_file(self, file: str) -> RequestRow | None:
        return self.requests_by_files([file]).get(file)

    def requests_by_files(self, files: list[str]) -> dict[str, RequestRow]:
        """The answers recorded for these inbox files, by file name (one query per 500 names)."""
        found: dict[str, RequestRow] = {}
        for start in range(0, len(files), 500):
            chunk = files[start:start + 500]
            rows = self._query(f"select * from requests where file in ({', '.join('?' * len(chunk))})", chunk)
            found.update((row["file"], RequestRow.from_stored(row)) for row in rows)
        return found

    # Forgetting (daemon/store_gc.py) ----------------------------------------------------------

    def forget_jobs_ended_before(self, cutoff: float) -> Forgotten:
        """Delete the jobs that ended before ``cutoff`` with their attempts, events and the
        answers to requests about them, and every answered request older than it; in one
        transaction."""
        ended = ", ".join(f"'{state}'" for state in TERMINAL_STATES)
        ids = [row[0] for row in self.conn.execute(f"select id from jobs where state in ({ended}) and ended_at < ?", [cutoff])]
        counts = {"attempts": 0, "events": 0, "requests": 0}
        with self.db.atomic():
            for start in range(0, len(ids), 500):
                chunk = ids[start:start + 500]
                marks = ", ".join("?" * len(chunk))
                for table in ("attempts", "events", "requests"):
                    counts[table] += self.conn.execute(f"delete from {table} where job_id in ({marks})", chunk).rowcount
                self.conn.execute(f"delete from jobs where id in ({marks})", chunk)
            counts["requests"] += self.conn.execute("delete from requests where at < ?", [cutoff]).rowcount
        if ids:
            self.job_writes += 1
        return Forgotten(tuple(ids), counts["attempts"], counts["events"], counts["requests"])

    def jobs_with_more_events_than(self, most: int) -> list[int]:
        return [row[0] for row in self.conn.execute("select job_id from events group by job_id having count(*) > ? order by job_id", [most])]

    def drop_middle_events(self, job_id: int, *, keep_first: int, keep_last: int) -> list[str]:
        """Delete a job's events but its first ``keep_first`` and last ``keep_last``; the kinds
        of those deleted."""
        with self.db.atomic():
            rows = self.conn.execute(
                "select id, kind from events where job_id = ? order by id limit -1 offset ?", [job_id, keep_first],
            ).fetchall()
            dropped = rows[: max(0, len(rows) - keep_last)]
            for start in range(0, len(dropped), 500):
                chunk = [event_id for event_id, _ in dropped[start:start + 500]]
                self.conn.execute(f"delete from events where id in ({', '.join('?' * len(chunk))})", chunk)
        return [kind for _, kind in dropped]

    # GPU samples ----------------------------------------------------------------------------

    def add_gpu_samples(self, at: float, samples: list[dict[str, Any]], keep_per_gpu: int) -> None:
        """Record one sample per GPU; past ``keep_per_gpu`` rows for a GPU, every other row of
        its older half goes, so the history stays bounded and thins out with age."""
        with self.db.atomic():
            self.db["gpu_samples"].insert_all({**sample, "at": at} for sample in samples)
            for sample in samples:
                gpu = sample["gpu"]
                count = self.db.execute("select count(*) from gpu_samples where gpu = ?", [gpu]).fetchone()[0]
                if count > keep_per_gpu:
                    self.db.execute(
                        "delete from gpu_samples where id in (select id from (select id, row_number() over (order by at) as n "
                        "from gpu_samples where gpu = ? order by at limit ?) where n % 2 = 0)",
                        [gpu, count // 2],
                    )

    def gpu_samples(self, gpu: int | None = None, since: float = 0.0) -> list[GpuSampleRow]:
        if gpu is None:
            rows = self._query("select * from gpu_samples where at >= ? order by at, gpu", [since])
        else:
            rows = self._query("select * from gpu_samples where gpu = ? and at >= ? order by at", [gpu, since])
        return [GpuSampleRow.from_stored(row) for row in rows]

    def latest_gpu_samples(self) -> list[GpuSampleRow]:
        rows = self._query("select * from gpu_samples where id in (select max(id) from gpu_samples group by gpu) order by gpu")
        return [GpuSampleRow.from_stored(row) for row in rows]
