"""The store's schema: sqlite-utils migrations, applied in order when the database is opened
for writing, each recorded by name in sqlite-utils' _sqlite_migrations table.

A database made before migrations had names (oomguard 0.x counted them in SQLite's
user_version alone) has its first user_version migrations recorded as applied when it is first
opened here, so none runs twice. user_version still counts the migrations applied, so that such
an older oomguard refuses a database this one has moved on, as this one refuses a database
that a newer oomguard has migrated further than it knows.
"""

from __future__ import annotations

import datetime

import sqlite_utils
from sqlite_utils.migrations import Migrations

MIGRATIONS = Migrations("oomguard")


@MIGRATIONS(name="create_tables")
def _create_tables(db: sqlite_utils.Database) -> None:
    db["jobs"].create(
        {
            "id": int,
            "name": str,
            "owner": str,
            "spec": str,  # JobSpec.to_dict() as JSON
            "state": str,
            "priority": int,
            "submitted_at": float,
            "started_at": float,
            "ended_at": float,
            "workdir": str,
            "plan": str,  # the Plan the next (or current) attempt runs under, as JSON
            "next_rung": str,  # rung and reason that produced `plan`, recorded on the next attempt
            "next_reason": str,
            "cancel_requested": int,
            "result": str,  # why it ended: one line
            "report": str,  # the doctor's report when it failed
            "spool_file": str,
            "emulate_device_memory": str,
        },
        pk="id",
        not_null={"name", "owner", "spec", "state", "submitted_at", "workdir", "plan"},
        defaults={"priority": 0, "cancel_requested": 0},
    )
    db["jobs"].create_index(["state", "priority", "id"])
    db["jobs"].create_index(["spool_file"], unique=True)
    db["attempts"].create(
        {
            "id": int,
            "job_id": int,
            "number": int,
            "plan": str,
            "rung": str,
            "reason": str,
            "directory": str,
            "pid": int,
            "started_at": float,
            "ended_at": float,
            "outcome_kind": str,
            "outcome": str,  # Outcome.to_dict() as JSON
            "exit_code": int,
            "resumed_from": int,
            "term_sent_at": float,
        },
        pk="id",
        foreign_keys=[("job_id", "jobs", "id")],
        not_null={"job_id", "number", "plan", "directory", "started_at"},
    )
    db["attempts"].create_index(["job_id", "number"], unique=True)
    db["events"].create(
        {"id": int, "job_id": int, "at": float, "kind": str, "message": str},
        pk="id",
        foreign_keys=[("job_id", "jobs", "id")],
    )
    db["events"].create_index(["job_id", "id"])


@MIGRATIONS(name="add_recoveries_reported")
def _add_recoveries_reported(db: sqlite_utils.Database) -> None:
    # How many of the rungs a runner took itself are events already (they are reported while
    # the attempt runs, from its heartbeat, and must not be reported again when it ends).
    db["attempts"].add_column("recoveries_reported", int, not_null_default=0)


@MIGRATIONS(name="add_lab_box")
def _add_lab_box(db: sqlite_utils.Database) -> None:
    # Users, GPUs, waiting, the shim, stall detection, requests from users, GPU samples.
    db["jobs"].add_column("owner_uid", int)
    db["jobs"].add_column("waiting", str)  # why a queued job is not running now (shown in status)
    db["jobs"].add_column("wait_free_bytes", int)  # contention: free memory to wait for per GPU
    db["jobs"].add_column("waiting_since", float)  # when the current wait began
    db["attempts"].add_column("gpus", str)  # "0,1": the GPUs it was placed on
    db["attempts"].add_column("pid_started", int)  # the shim's start time (processes.start_ticks)
    db["attempts"].add_column("stalled_at", float)
    db["requests"].create(
        {"id": int, "file": str, "requester": str, "action": str, "job_key": str, "job_id": int, "accepted": int, "answer": str, "at": float},
        pk="id",
    )
    db["requests"].create_index(["file"], unique=True)
    db["gpu_samples"].create({"id": int, "at": float, "gpu": int, "name": str, "total": int, "used": int, "processes": str}, pk="id")
    db["gpu_samples"].create_index(["gpu", "at"])


@MIGRATIONS(name="add_event_codes")
def _add_event_codes(db: sqlite_utils.Database) -> None:
    # An event's specific cause (a stable name) and its figures as JSON, for code to read
    # rather than the message (daemon/events.py). Older events keep NULL in both.
    db["events"].add_column("code", str)
    db["events"].add_column("data", str)


@MIGRATIONS(name="add_cluster")
def _add_cluster(db: sqlite_utils.Database) -> None:
    # An attempt submitted to a batch scheduler (daemon/launch/slurm.py): its job id there,
    # the state and reason it last had (status shows them for a pending attempt) and how
    # often the scheduler requeued it itself.
    db["attempts"].add_column("scheduler_id", str)
    db["attempts"].add_column("scheduler_state", str)
    db["attempts"].add_column("scheduler_reason", str)
    db["attempts"].add_column("scheduler_restarts", int)
    # What the doctor asked of the cluster for the job's next attempts (None: the job file's
    # or the daemon config's): host memory after a host OOM at its limit, a checkpoint
    # interval after a time limit passed without a checkpoint.
    db["jobs"].add_column("host_memory", int)
    db["jobs"].add_column("checkpoint_every_seconds", float)


@MIGRATIONS(name="add_ended_indexes")
def _add_ended_indexes(db: sqlite_utils.Database) -> None:
    # `oomguard status` lists the jobs that ended last, and the store's collection
    # (daemon/store_gc.py) forgets those that ended long ago and the answers given long ago:
    # each an index scan rather than a walk through every row of a long history.
    db["jobs"].create_index(["ended_at"])
    db["requests"].create_index(["at"])


@MIGRATIONS(name="add_disk_wait")
def _add_disk_wait(db: sqlite_utils.Database) -> None:
    # A queued job waiting for disk space (daemon/disk_wait.py): the path, the free bytes it
    # waits for, what its attempt said it needs (NULL: unknown), and its disk budget when the
    # room is missing there (NULL: on the disk). The scheduler reads only these jobs every few
    # seconds: a partial index keeps that one small lookup.
    db["jobs"].add_column("disk_path", str)
    db["jobs"].add_column("disk_wait_bytes", int)
    db["jobs"].add_column("disk_needed", int)
    db["jobs"].add_column("disk_budget", int)
    db.execute("CREATE INDEX IF NOT EXISTS idx_jobs_disk_wait ON jobs(id) WHERE disk_path IS NOT NULL")


@MIGRATIONS(name="add_narrowing")
def _add_narrowing(db: sqlite_utils.Database) -> None:
    # A job that widened onto free GPUs and must give some back (another job waits for them):
    # the plan it goes on under once its attempt has stopped at a checkpoint (JSON; NULL: none).
    db["jobs"].add_column("narrow_plan", str)


# The migrations of the oomguard that counted them in user_version alone (0.x): a database it
# made at user_version n has the first n of MIGRATIONS applied, under no recorded name.
UNNAMED_MIGRATIONS = ("create_tables", "add_recoveries_reported", "add_lab_box")
# Every migration is pending on an empty database: their names, in order.
KNOWN_MIGRATIONS = tuple(migration.name for migration in MIGRATIONS.pending(sqlite_utils.Database(memory=True)))


def migrate(db: sqlite_utils.Database) -> None:
    """Bring the schema up to date: every known migration not applied yet, in one transaction."""
    if _user_version(db) == len(KNOWN_MIGRATIONS) and tuple(m.name for m in MIGRATIONS.applied(db)) == KNOWN_MIGRATIONS:
        return  # up to date: no write lock taken
    # BEGIN IMMEDIATE takes the write lock first (waiting up to the busy timeout): a
    # deferred transaction that read the version and then wrote could not be upgraded
    # while the daemon writes, and would fail at once with "database is locked". Each
    # migration's own transaction is a savepoint inside this one: all of them, or none.
    db.conn.execute("BEGIN IMMEDIATE")
    try:
        _refuse_newer(db)
        _name_unnamed_migrations(db)
        MIGRATIONS.apply(db)
        db.conn.execute(f"PRAGMA user_version = {len(KNOWN_MIGRATIONS)}")
    except BaseException:
        db.conn.rollback()
        raise
    db.conn.commit()


def _refuse_newer(db: sqlite_utils.Database) -> None:
    """A database a newer oomguard has migrated further than this one knows how to read."""
    version = _user_version(db)
    unknown = [m.name for m in MIGRATIONS.applied(db) if m.name not in KNOWN_MIGRATIONS]
    if version > len(KNOWN_MIGRATIONS) or unknown:
        version = max(version, len(KNOWN_MIGRATIONS) + len(unknown))
        raise RuntimeError(
            f"the database has schema version {version}, newer than this oomguard knows "
            f"({len(KNOWN_MIGRATIONS)}); upgrade oomguard"
        )


def _name_unnamed_migrations(db: sqlite_utils.Database) -> None:
    """A database made before migrations had names: the ones its user_version counts are
    recorded as applied, so that they do not run again."""
    if db[MIGRATIONS.migrations_table].exists():
        return
    version = _user_version(db)
    if version > len(UNNAMED_MIGRATIONS):
        return  # _refuse_newer has refused it
    MIGRATIONS.ensure_migrations_table(db)
    applied_at = str(datetime.datetime.now(datetime.timezone.utc))  # as sqlite-utils records it
    db[MIGRATIONS.migrations_table].insert_all(
        {"migration_set": MIGRATIONS.name, "name": name, "applied_at": applied_at} for name in UNNAMED_MIGRATIONS[:version]
    )


def _user_version(db: sqlite_utils.Database) -> int:
    return int(db.execute("PRAGMA user_version").fetchone()[0])
