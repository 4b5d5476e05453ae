"""`oomguard status`: a table of the jobs, with the progress, speed, ETA and memory their
latest heartbeat shows.

It reads only what it shows: the counts of every state in one query, then the rows it lists
(Store.jobs_at_a_glance, Store.jobs_page), so a queue of 10,000 jobs costs what a queue of 30
does."""

from __future__ import annotations

import argparse

from oomguard.daemon.cli.output import EXIT_OK, CliError, print_table
from oomguard.daemon.cli.state import heartbeat_of, open_store
from oomguard.daemon.cli.status_limits import STATUS_ENDED_SHOWN, STATUS_PAGE_SIZE, STATUS_QUEUED_SHOWN
from oomguard.daemon.queue_rows import QueueRow, jobs_listed, page_count, queue_row
from oomguard.daemon.text import escape
from oomguard.strategies.units import format_bytes, format_duration_short


def cmd_status(args: argparse.Namespace) -> int:
    from rich.table import Table

    if args.page is not None and args.page < 1:
        raise CliError(f"--page counts from 1, got {args.page}")
    _, store = open_store(args.state_dir, snapshot=True)
    counts = store.job_counts()
    total = sum(counts.values())
    rows = store.jobs() if args.all else jobs_listed(store, args.page)
    newest = store.newest_attempts([job.id for job in rows])
    summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "no jobs"
    table = Table(title=f"oomguard jobs ({args.state_dir}): {summary}")
    for column in ("job", "name", "user", "state", "GPUs", "plan", "step", "samples/s", "ETA", "peak / cap", "attempts", "note"):
        table.add_column(column, overflow="fold")
    for job in rows:
        newest_attempt = newest.get(job.id)
        attempt = newest_attempt.attempt if newest_attempt else None
        row = queue_row(job, attempt, newest_attempt.count if newest_attempt else 0, heartbeat_of(attempt))
        table.add_row(*(escape(cell) for cell in _cells(row)))
    table.caption = _caption(len(rows), total, args.page)
    print_table(table)
    return EXIT_OK


def _cells(row: QueueRow) -> tuple[str, ...]:
    memory = f"{format_bytes(row.held_bytes)} / {format_bytes(row.capacity_bytes)}" if row.held_bytes is not None else ""
    return (
        str(row.job_id), row.name, row.owner, row.state, row.gpus, row.plan, f"{row.step}/{row.max_steps}",
        f"{row.samples_per_s:.1f}" if row.samples_per_s else "", format_duration_short(row.eta_seconds) if row.eta_seconds is not None else "",
        memory, str(row.attempts), row.note,
    )


def _caption(shown: int, total: int, page: int | None) -> str | None:
    """What the table leaves out, and how to see it."""
    if page is not None:
        pages = page_count(total)
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
