"""Giving GPUs back: a built-in job that widened onto free GPUs (its resources.gpus is a range)
goes back to its own number of GPUs when another job waits for one, through the queue's
priority rules: a waiting job of the same priority or higher. The widened job is asked to
checkpoint and stop (as a cancel does); its next attempt runs under the plan chosen here, the
best the memory model says fits on fewer GPUs, from that checkpoint, so no step is lost. A job
for which no plan on fewer GPUs fits keeps them, and the other job waits.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from oomguard.daemon.events import Events
from oomguard.daemon.lifecycle import past_attempts
from oomguard.daemon.store import Store
from oomguard.daemon.store_rows import AttemptRow, JobRow
from oomguard.jobs.spec import JobSpec
from oomguard.strategies.doctor import narrowed


def narrow_for_waiting_jobs(
    store: Store, events: Events, read_gpus: Callable[[], Sequence[Any]], spec_of: Callable[[JobRow], JobSpec], request_stop: Callable[[AttemptRow], None],
) -> None:
    """Ask each widened job that holds GPUs a waiting job could use to give them back. Runs at
    every tick: the queue is read only while some running job is widened (the running attempts
    are few; a queue may hold thousands of jobs)."""
    widened: list[tuple[AttemptRow, JobRow, JobSpec]] = []
    for attempt in store.running_attempts():
        if attempt.term_sent_at or not attempt.gpus:
            continue
        job = store.job(attempt.job_id)
        spec = spec_of(job)
        if job.narrow_plan is None and spec.command is None and job.plan.world_size > spec.resources.gpus:
            widened.append((attempt, job, spec))
    if not widened:
        return
    waiting = [job for job in store.queued_jobs() if job.waiting is not None and job.disk_path is None and job.wait_free_bytes is None]
    totals = {gpu.index: gpu.total for gpu in read_gpus()}
    for attempt, job, spec in widened:
        claimant = next((other for other in waiting if other.priority >= job.priority), None)
        if claimant is None:
            continue
        capacity = min(totals.get(index, 0) for index in attempt.gpus)
        decision = narrowed(job.plan, past_attempts(store.attempts(job.id)), spec.policy(), spec.resources.gpus, capacity)
        if decision is None:
            continue
        store.update_job(job.id, narrow_plan=json.dumps({"plan": decision.plan.to_dict(), "rung": decision.rung, "reason": decision.reason}))
        request_stop(attempt)
        events.event(
            job, "narrowing",
            f"job {claimant.id} ({claimant.name}) waits for a GPU: attempt {attempt.number} checkpoints and stops, and the job goes on "
            f"{decision.reason}", code="narrowing", data={"for": claimant.id, "to": decision.plan.short()},
        )
