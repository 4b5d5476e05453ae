"""`oomguard status`: a table of the jobs, with the progress, speed, ETA and memory their
latest heartbeat shows.

It reads only what it shows: the counts of every state in one query, then the rows it lists
(Store.jobs_at_a_glance, Store.jobs_page), so a queue of 10,000 jobs costs what a queue of 30
does."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from oomguard.daemon.cli.output import EXIT_OK, CliError, print_table, short_plan
from oomguard.daemon.cli.state import heartbeat_of, open_store
from oomguard.daemon.cli.status_limits import STATUS_ENDED_SHOWN, STATUS_PAGE_SIZE, STATUS_QUEUED_SHOWN
from oomguard.daemon.store import TERMINAL_STATES
from oomguard.daemon.text import escape, shorten
from oomguard.strategies.units import format_bytes, format_duration_short

if TYPE_CHECKING:
    from oomguard.daemon.store_rows import AttemptRow, JobRow

# The longest plan text the table shows: a plan with every knob turned and a four-digit batch
# is 86 characters ("mb=1x1024 expandable ckpt attn=sliced offload=params bf16 adamw8bit ...").
PLAN_WIDTH = 120


def cmd_status(args: argparse.Namespace) -> int:
    from rich.table import Table

    if args.page is not None and args.page < 1:
        raise CliError(f"--page counts from 1, got {args.page}")
    _, store = open_store(args.state_dir, snapshot=True)
    counts = store.job_counts()
    total = sum(counts.values())
    if args.all:
        rows = store.jobs()
    elif args.page is not None:
        rows = store.jobs_page(offset=(args.page - 1) * STATUS_PAGE_SIZE, limit=STATUS_PAGE_SIZE)
    else:
        rows = store.jobs_at_a_glance(queued=STATUS_QUEUED_SHOWN, ended=STATUS_ENDED_SHOWN)
    newest = store.newest_attempts([job.id for job in rows])
    summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "no jobs"
    table = Table(title=f"oomguard jobs ({args.state_dir}): {summary}")
    for column in ("job", "name", "user", "state", "GPUs", "plan", "step", "samples/s", "ETA", "peak / cap", "attempts", "note"):
        table.add_column(column, overflow="fold")
    for job in rows:
        newest_attempt = newest.get(job.id)
        table.add_row(*(escape(cell) for cell in _cells(job, newest_attempt.attempt if newest_attempt else None, newest_attempt.count if newest_attempt else 0)))
    table.caption = _caption(len(rows), total, args.page)
    print_table(table)
    return EXIT_OK


def _cells(job: JobRow, attempt: AttemptRow | None, attempts: int) -> tuple[str, ...]:
    """One job's row: its progress, speed, ETA and memory as its newest attempt's heartbeat says."""
    running = job.state == "running"
    heartbeat = heartbeat_of(attempt) or {}
    spec = job.spec_dict()  # as stored: a job of an older oomguard may not load as a JobSpec
    max_steps = spec["train"]["max_steps"]
    step = _number(heartbeat.get("step")) or 0
    speed = _number(heartbeat.get("samples_per_s")) if running else None
    eta = ""
    if speed and speed > 0:
        steps_left = max_steps - step
        eta = format_duration_short(steps_left * spec["train"]["batch_size"] / speed)
    memory = ""
    held = heartbeat.get("reserved_bytes") if _number(heartbeat.get("reserved_bytes")) is not None else heartbeat.get("peak_bytes")
    if _number(held) is not None and job.state not in TERMINAL_STATES:
        # What the job holds of the device (reserved, with a caching allocator) against its cap.
        memory = f"{format_bytes(int(held))} / {format_bytes(_int_or_none(heartbeat.get('capacity_bytes')))}"
    gpus = ",".join(str(index) for index in attempt.gpus) if running and attempt and attempt.gpus else ""
    if job.state == "queued" and job.disk_path is not None:
        from oomguard.daemon.disk_wait import disk_note

        note = disk_note(job)
    elif job.state == "queued" and job.waiting:
        note = f"waiting: {job.waiting}"
    elif job.cancel_requested and job.state not in TERMINAL_STATES:
        note = "cancel requested"
    elif running and attempt is not None and attempt.scheduler_id is not None:
        note = scheduler_note(attempt)
    else:
        note = (job.result or "").splitlines()[0] if job.result else ""
    return (
        str(job.id), job.name, job.owner, job.state, gpus, plan_shown(job, heartbeat), f"{step}/{max_steps}",
        f"{speed:.1f}" if speed else "", eta, memory, str(attempts), note,
    )


def _caption(shown: int, total: int, page: int | None) -> str | None:
    """What the table leaves out, and how to see it."""
    if page is not None:
        pages = max(1, -(-total // STATUS_PAGE_SIZE))
        first = (page - 1) * STATUS_PAGE_SIZE
        listed = f"jobs {first + 1}-{first + shown} of {total} by id" if shown else f"no jobs on this page ({total} in all)"
        more = f"; `oomguard status --page {page + 1}` lists the next" if page < pages else ""
        return f"page {page} of {pages}: {listed}{more}"
    if shown < total:
        return (
            f"{shown} of {total} jobs shown: those running, the next {STATUS_QUEUED_SHOWN} queued and the "
            f"last {STATUS_ENDED_SHOWN} ended; `oomguard status --page 1` pages through every job, `--all` lists them at once"
        )
    return None


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
        return shorten(reported, PLAN_WIDTH)  # the owner's file: any text, kept short (escaped as every cell)
    return short_plan(job.plan_dict())


def _number(value: Any) -> int | float | None:
    """A number from a file a job's owner writes (heartbeat.json), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) != float("inf"):
        return value
    return None


def _int_or_none(value: Any) -> int | None:
    number = _number(value)
    return int(number) if number is not None else None

