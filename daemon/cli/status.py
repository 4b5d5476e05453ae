"""`oomguard status`: a table of the jobs, with the progress, speed, ETA and memory their
latest heartbeat shows."""

from __future__ import annotations

import argparse
from typing import Any

from oomguard.daemon.cli.output import EXIT_OK, print_table, short_plan
from oomguard.daemon.cli.state import heartbeat_of, open_store
from oomguard.daemon.store import TERMINAL_STATES
from oomguard.daemon.store_rows import AttemptRow, JobRow
from oomguard.daemon.text import escape, shorten
from oomguard.strategies.units import format_duration_short

# The longest plan text the table shows: a plan with every knob turned and a four-digit batch
# is 86 characters ("mb=1x1024 expandable ckpt attn=sliced offload=params bf16 adamw8bit ...").
PLAN_WIDTH = 120

# What `status` lists without --all: every job that runs (or is about to), the head of the
# queue, and the jobs that ended last. A queue of 10,000 jobs is then one screen (under a
# second) rather than 10,000 rows (18 s); the counts of all jobs come first.
STATUS_QUEUED_SHOWN = 20
STATUS_ENDED_SHOWN = 10


def status_rows(jobs: list[JobRow], queue: list[JobRow], everything: bool) -> list[JobRow]:
    """The jobs `status` lists, in id order: all of them, or the running and otherwise active
    ones, the first STATUS_QUEUED_SHOWN of ``queue`` (the queued jobs in the order they will
    run, Store.queued_jobs) and the STATUS_ENDED_SHOWN that ended last."""
    if everything:
        return jobs
    ended = sorted((j for j in jobs if j.state in TERMINAL_STATES), key=lambda j: j.ended_at or 0)
    active = [j for j in jobs if j.state != "queued" and j.state not in TERMINAL_STATES]
    chosen = {j.id for j in (*active, *queue[:STATUS_QUEUED_SHOWN], *ended[-STATUS_ENDED_SHOWN:])}
    return [j for j in jobs if j.id in chosen]


def cmd_status(args: argparse.Namespace) -> int:
    from collections import Counter

    from rich.table import Table

    from oomguard.strategies.units import format_bytes

    _, store = open_store(args.state_dir)
    jobs = store.jobs()
    rows = status_rows(jobs, store.queued_jobs(), args.all)
    newest = store.newest_attempts([job.id for job in rows])
    counts = Counter(job.state for job in jobs)
    summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "no jobs"
    table = Table(title=f"oomguard jobs ({args.state_dir}): {summary}")
    for column in ("job", "name", "user", "state", "GPUs", "plan", "step", "samples/s", "ETA", "peak / cap", "attempts", "note"):
        table.add_column(column, overflow="fold")
    for job in rows:
        newest_attempt = newest.get(job.id)
        attempt = newest_attempt.attempt if newest_attempt else None
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
        if _number(heartbeat.get("peak_bytes")) is not None and job.state not in TERMINAL_STATES:
            memory = f"{format_bytes(int(heartbeat['peak_bytes']))} / {format_bytes(_int_or_none(heartbeat.get('capacity_bytes')))}"
        gpus = ",".join(str(index) for index in attempt.gpus) if running and attempt and attempt.gpus else ""
        if job.state == "queued" and job.waiting:
            note = f"waiting: {job.waiting}"
        elif job.cancel_requested and job.state not in TERMINAL_STATES:
            note = "cancel requested"
        elif running and attempt is not None and attempt.scheduler_id is not None:
            note = scheduler_note(attempt)
        else:
            note = (job.result or "").splitlines()[0] if job.result else ""
        cells = (
            str(job.id), job.name, job.owner, job.state, gpus, plan_shown(job, heartbeat), f"{step}/{max_steps}",
            f"{speed:.1f}" if speed else "", eta, memory, str(newest_attempt.count if newest_attempt else 0), note,
        )
        table.add_row(*(escape(cell) for cell in cells))
    if len(rows) < len(jobs):
        table.caption = (
            f"{len(rows)} of {len(jobs)} jobs shown: those running, the next {STATUS_QUEUED_SHOWN} queued and the "
            f"last {STATUS_ENDED_SHOWN} ended; `oomguard status --all` lists every job"
        )
    print_table(table)
    return EXIT_OK


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

