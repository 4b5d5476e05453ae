"""One job as a row of the queue, for `oomguard status` and the web dashboard alike: its
progress, speed, ETA and memory as its newest attempt's heartbeat says, and a note on why it
waits or how it ended.

The heartbeat is the caller's to read and pass in: `status` reads it as the user running it
(a file of another user's job is None to them), the dashboard reads it only for a viewer who
may see the job's files (daemon/web/viewer.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oomguard.daemon.cli.output import short_plan
from oomguard.daemon.owner_numbers import owner_int, owner_number
from oomguard.daemon.cli.status_limits import STATUS_ENDED_SHOWN, STATUS_PAGE_SIZE, STATUS_QUEUED_SHOWN
from oomguard.daemon.store import TERMINAL_STATES, Store
from oomguard.daemon.text import shorten

if TYPE_CHECKING:
    from oomguard.daemon.store_rows import AttemptRow, JobRow

# The longest plan text a row shows: a plan with every knob turned and a four-digit batch
# is 86 characters ("mb=1x1024 expandable ckpt attn=sliced offload=params bf16 adamw8bit ...").
PLAN_WIDTH = 120


@dataclass(frozen=True)
class QueueRow:
    job_id: int
    name: str
    owner: str
    state: str
    gpus: str  # "0,1" while running on GPUs, else ""
    plan: str
    step: int
    max_steps: int
    samples_per_s: float | None  # while running, as its heartbeat says
    eta_seconds: float | None
    held_bytes: int | None  # what it holds of the device (reserved, where a caching allocator keeps more)
    capacity_bytes: int | None
    attempts: int
    note: str


def jobs_listed(store: Store, page: int | None) -> list[JobRow]:
    """The jobs a queue lists: page ``page`` (from 1) of every job in id order, STATUS_PAGE_SIZE
    to a page; None: at a glance (every running job, the head of the queue, the last ended)."""
    if page is None:
        return store.jobs_at_a_glance(queued=STATUS_QUEUED_SHOWN, ended=STATUS_ENDED_SHOWN)
    return store.jobs_page(offset=(page - 1) * STATUS_PAGE_SIZE, limit=STATUS_PAGE_SIZE)


def page_count(total: int) -> int:
    return max(1, -(-total // STATUS_PAGE_SIZE))


def queue_row(job: JobRow, attempt: AttemptRow | None, attempts: int, heartbeat: dict[str, Any] | None) -> QueueRow:
    running = job.state == "running"
    heartbeat = heartbeat or {}
    spec = job.spec_dict()  # as stored: a job of an older oomguard may not load as a JobSpec
    max_steps = spec["train"]["max_steps"]
    step = owner_number(heartbeat.get("step")) or 0
    speed = owner_number(heartbeat.get("samples_per_s")) if running else None
    eta = (max_steps - step) * spec["train"]["batch_size"] / speed if speed and speed > 0 else None
    held = owner_int(heartbeat.get("reserved_bytes"))
    if held is None:
        held = owner_int(heartbeat.get("peak_bytes"))
    live = job.state not in TERMINAL_STATES
    return QueueRow(
        job_id=job.id, name=job.name, owner=job.owner or "?", state=job.state,
        gpus=",".join(str(index) for index in attempt.gpus) if running and attempt and attempt.gpus else "",
        plan=plan_shown(job, heartbeat), step=int(step), max_steps=max_steps, samples_per_s=speed or None, eta_seconds=eta,
        held_bytes=held if live else None, capacity_bytes=owner_int(heartbeat.get("capacity_bytes")) if live and held is not None else None,
        attempts=attempts, note=_note(job, attempt, running),
    )


def _note(job: JobRow, attempt: AttemptRow | None, running: bool) -> str:
    if job.state == "queued" and job.disk_path is not None:
        from oomguard.daemon.disk_wait import disk_note

        return disk_note(job)
    if job.state == "queued" and job.waiting:
        return f"waiting: {job.waiting}"
    if job.cancel_requested and job.state not in TERMINAL_STATES:
        return "cancel requested"
    if running and attempt is not None and attempt.scheduler_id is not None:
        return scheduler_note(attempt)
    return (job.result or "").splitlines()[0] if job.result else ""


def scheduler_note(attempt: AttemptRow) -> str:
    """Where Slurm has a running job's attempt: "Slurm job 12: PENDING (Priority)"."""
    note = f"Slurm job {attempt.scheduler_id}: {attempt.scheduler_state or 'submitted'}"
    if attempt.scheduler_reason:
        note += f" ({attempt.scheduler_reason})"
    if attempt.scheduler_restarts:
        note += f", requeued {attempt.scheduler_restarts}x"
    return note


def plan_shown(job: JobRow, heartbeat: dict[str, Any]) -> str:
    """The plan a job trains under: a queued job's next attempt's; else what its newest
    attempt last reported (a runner that took a rung in the process reports the plan it moved
    to, which the job's stored plan, the next attempt's, does not know)."""
    reported = heartbeat.get("plan")
    if job.state != "queued" and isinstance(reported, str) and reported:
        return shorten(reported, PLAN_WIDTH)  # the owner's file: any text, kept short (escaped where shown)
    return short_plan(job.plan_dict())
