"""What the Store's read methods return: one frozen dataclass per table row.

Fields are the columns, typed (a 0/1 column is a bool, an attempt's "0,1" GPUs a tuple of
ints, an event's JSON figures a dict). A column that holds a serialized object keeps its
stored text (``spec_json``, ``plan_json``, ``outcome_json``) and offers the object parsed on
first use (``spec``, ``plan``, ``outcome``): a scheduling pass reads 10,000 queued jobs every
tick and needs only their ids and plan texts (parsing every plan costs ~0.5 s there), and a
job stored by an older oomguard may hold a spec that no longer loads, which only the code that
needs its spec should find out. The stored text is also what compares plans exactly.

``as_stored()`` gives the row as the store held it before rows were typed (column order and
values): `oomguard show --json` and `run --json` print that, byte for byte as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # imported where a row's object is first parsed: `oomguard status` needs none
    from oomguard.jobs.spec import JobSpec
    from oomguard.strategies.outcome import Outcome
    from oomguard.strategies.plan import Plan

def _columns(row_class: type, renamed: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """(column, attribute) pairs in the table's column order (the dataclass' field order)."""
    return tuple((renamed.get(f.name, f.name), f.name) for f in fields(row_class))


RowT = TypeVar("RowT")


def _made(row_class: type[RowT], values: dict[str, Any]) -> RowT:
    """A row with these field values, every one given. Not through __init__: a frozen
    dataclass' sets each field with object.__setattr__, which made reading a queue of 10,000
    jobs (every scheduling tick) twice as slow as the query itself."""
    row = object.__new__(row_class)
    row.__dict__.update(values)
    return row


@dataclass(frozen=True)
class JobRow:
    id: int
    name: str
    owner: str
    spec_json: str  # JobSpec.to_dict() as JSON, masked (daemon/job_secrets.public_spec)
    state: str
    priority: int
    submitted_at: float
    started_at: float | None
    ended_at: float | None
    workdir: str
    plan_json: str  # the Plan the next (or current) attempt runs under, as JSON
    next_rung: str | None  # rung and reason that produced the plan, recorded on the next attempt
    next_reason: str | None
    cancel_requested: bool
    result: str | None  # why it ended: one line
    report: str | None  # the doctor's report when it failed
    spool_file: str | None
    # No longer written (an attempt's device is decided when it starts: jobs/device.py); kept
    # for the rows of older databases and for `show --json`, which prints every column.
    emulate_device_memory: str | None
    owner_uid: int | None  # None: recorded before owner_uid was kept (the owner's name decides)
    waiting: str | None  # why a queued job is not running now (shown in status)
    wait_free_bytes: int | None  # contention: free memory to wait for per GPU
    waiting_since: float | None
    # Asked of a cluster for the next attempts by the doctor (None: the job file's or the
    # daemon config's): host memory in bytes, and how often the runner checkpoints.
    host_memory: int | None = None
    checkpoint_every_seconds: float | None = None
    # A queued job waiting for disk space (daemon/disk_wait.py; None: it is not): the path,
    # the free bytes it waits for, what its attempt said it needs (None: unknown), and its disk
    # budget when the room is missing there ([resources] disk; None: on the disk).
    disk_path: str | None = None
    disk_wait_bytes: int | None = None
    disk_needed: int | None = None
    disk_budget: int | None = None
    # A widened job asked to give GPUs back: the plan (JSON) it goes on under once its attempt
    # has stopped at a checkpoint (daemon/narrowing.py; None: not asked).
    narrow_plan: str | None = None

    @classmethod
    def from_stored(cls, row: dict[str, Any]) -> JobRow:
        values = {attribute: row.get(column) for column, attribute in _JOB_COLUMNS}
        values["cancel_requested"] = bool(values["cancel_requested"])
        return _made(cls, values)

    def as_stored(self) -> dict[str, Any]:
        stored = {column: getattr(self, attribute) for column, attribute in _JOB_COLUMNS}
        stored["cancel_requested"] = int(self.cancel_requested)
        return stored

    @cached_property
    def spec(self) -> JobSpec:
        """The job file as stored (masked), rebuilt without validation (JobSpec.load)."""
        from oomguard.jobs.spec import JobSpec

        return JobSpec.load(self.spec_dict())

    def spec_dict(self) -> dict[str, Any]:
        """The stored spec as a dict (what masking and `show --json` work on)."""
        return json.loads(self.spec_json)

    @cached_property
    def plan(self) -> Plan:
        from oomguard.strategies.plan import Plan

        return Plan.from_dict(self.plan_dict())

    def plan_dict(self) -> dict[str, Any]:
        """The stored plan as a dict (what `show --json` prints)."""
        return json.loads(self.plan_json)


_JOB_COLUMNS = _columns(JobRow, {"spec_json": "spec", "plan_json": "plan"})


@dataclass(frozen=True)
class AttemptRow:
    id: int
    job_id: int
    number: int
    plan_json: str  # the Plan it started under, as JSON
    rung: str | None
    reason: str | None
    directory: str
    pid: int | None
    started_at: float
    ended_at: float | None
    outcome_kind: str | None
    outcome_json: str | None  # Outcome.to_dict() as JSON, once it ended
    exit_code: int | None
    resumed_from: int | None
    term_sent_at: float | None
    # How many of the rungs the runner took itself are events already (daemon/attempts.py).
    recoveries_reported: int
    gpus: tuple[int, ...] | None  # the GPUs it was placed on (None: placed by no GPU)
    pid_started: int | None  # its shim's start time (processes.start_ticks)
    stalled_at: float | None
    # Submitted to a batch scheduler (Slurm): its job id there, the state and reason it last
    # had, and how often the scheduler requeued it itself (None: not submitted to one).
    scheduler_id: str | None = None
    scheduler_state: str | None = None
    scheduler_reason: str | None = None
    scheduler_restarts: int | None = None

    @classmethod
    def from_stored(cls, row: dict[str, Any]) -> AttemptRow:
        values = {attribute: row.get(column) for column, attribute in _ATTEMPT_COLUMNS}
        values["recoveries_reported"] = values["recoveries_reported"] or 0
        gpus = values["gpus"]
        values["gpus"] = None if gpus is None else tuple(int(index) for index in gpus.split(",") if index)
        return _made(cls, values)

    def as_stored(self) -> dict[str, Any]:
        stored = {column: getattr(self, attribute) for column, attribute in _ATTEMPT_COLUMNS}
        stored["gpus"] = None if self.gpus is None else ",".join(str(index) for index in self.gpus)
        return stored

    @cached_property
    def plan(self) -> Plan:
        from oomguard.strategies.plan import Plan

        return Plan.from_dict(self.plan_dict())

    def plan_dict(self) -> dict[str, Any]:
        """The stored plan as a dict (what `show --json` prints)."""
        return json.loads(self.plan_json)

    @cached_property
    def outcome(self) -> Outcome | None:
        """How it ended (None: it has not, as far as the store knows)."""
        from oomguard.strategies.outcome import Outcome

        return Outcome.from_dict(self.outcome_dict()) if self.outcome_json else None

    def outcome_dict(self) -> dict[str, Any] | None:
        """The stored outcome as a dict (what `show --json` prints)."""
        return json.loads(self.outcome_json) if self.outcome_json else None


_ATTEMPT_COLUMNS = _columns(AttemptRow, {"plan_json": "plan", "outcome_json": "outcome"})


@dataclass(frozen=True)
class NewestAttempt:
    """A job's newest attempt and how many attempts it has (Store.newest_attempts)."""

    attempt: AttemptRow
    count: int


@dataclass(frozen=True)
class EventRow:
    id: int
    job_id: int
    at: float
    kind: str  # what happened: queued, started, escalated, failed...
    message: str  # the line `oomguard show` and the daemon's log print
    # The kind's specific cause, a stable name (daemon/events.py lists them); None for an
    # event recorded before codes were kept.
    code: str | None = None
    # Its figures (attempt number, rung, plans, bytes, seconds...), for code rather than people.
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_stored(cls, row: dict[str, Any]) -> EventRow:
        data = row.get("data")
        return cls(
            id=row["id"], job_id=row["job_id"], at=row["at"], kind=row["kind"], message=row["message"], code=row.get("code"),
            data=json.loads(data) if data else {},
        )

    def as_stored(self) -> dict[str, Any]:
        """The event's columns, ``data`` as its stored JSON text."""
        return {
            "id": self.id, "job_id": self.job_id, "at": self.at, "kind": self.kind, "message": self.message, "code": self.code,
            "data": json.dumps(self.data),
        }


@dataclass(frozen=True)
class RequestRow:
    """A user's request from the spool (or a refused job file), with the daemon's answer."""

    id: int
    file: str
    requester: str
    action: str
    job_key: str
    job_id: int | None
    accepted: bool
    answer: str
    at: float

    @classmethod
    def from_stored(cls, row: dict[str, Any]) -> RequestRow:
        values = {f.name: row.get(f.name) for f in fields(cls)}
        values["accepted"] = bool(values["accepted"])
        return cls(**values)


@dataclass(frozen=True)
class SampledProcess:
    pid: int
    used: int  # bytes it held on the GPU


@dataclass(frozen=True)
class GpuSampleRow:
    id: int
    at: float
    gpu: int
    name: str | None
    total: int
    used: int
    processes: tuple[SampledProcess, ...]

    @classmethod
    def from_stored(cls, row: dict[str, Any]) -> GpuSampleRow:
        values = {f.name: row.get(f.name) for f in fields(cls)}
        values["processes"] = tuple(SampledProcess(p["pid"], p["used"]) for p in json.loads(row.get("processes") or "[]"))
        return cls(**values)

    @property
    def free(self) -> int:
        return max(self.total - self.used, 0)
