"""What a notification says: the facts the daemon fills in about a job (JobFacts), the events a
job may be notified of, and the plain-text title and body made of them (compose)."""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.daemon.text import escape
from oomguard.jobs.spec import DEFAULT_NOTIFY_EVENTS, NOTIFY_EVENTS
from oomguard.strategies.units import format_torch_size

# A job file's [notify] events are checked against the same names (jobs/spec.py).
EVENTS = NOTIFY_EVENTS
DEFAULT_EVENTS = DEFAULT_NOTIFY_EVENTS  # escalated is opt-in


@dataclass(frozen=True)
class JobFacts:
    """What a message says; the daemon fills it."""

    job_id: int
    job_name: str
    user: str
    event: str  # one of EVENTS
    attempts: int
    plan: str  # short plan text, e.g. "mb=4x4 ckpt"
    step: int | None
    max_steps: int | None
    peak_bytes: int | None
    cap_bytes: int | None
    summary: str  # one line: what happened
    next_step: str  # what happens next
    gpus: str = ""  # e.g. "0,1" or "" when none


def compose(facts: JobFacts) -> tuple[str, str]:
    """(title, body) of the message for ``facts``: one line per field, plain text. Each field
    is one line whatever it holds (text.escape): a job's own text (what its runner reported)
    cannot add a line or a terminal escape to the message."""
    name = escape(facts.job_name)
    title = f"oomguard: job {facts.job_id} ({name}) {escape(facts.event)}"
    step = "unknown" if facts.step is None else escape(facts.step)
    if facts.max_steps is not None:
        step += f" of {escape(facts.max_steps)}"
    memory = []
    if isinstance(facts.peak_bytes, (int, float)):
        memory.append(f"peak {format_torch_size(facts.peak_bytes)}")
    if isinstance(facts.cap_bytes, (int, float)):
        memory.append(f"cap {format_torch_size(facts.cap_bytes)}")
    body = "\n".join(
        [
            f"job: {facts.job_id} ({name})",
            f"user: {escape(facts.user)}",
            f"event: {escape(facts.event)}",
            f"attempts: {facts.attempts}",
            f"plan: {escape(facts.plan)}",
            f"step: {step}",
            f"memory: {' of '.join(memory) if memory else 'not measured'}",
            f"GPUs: {escape(facts.gpus) or 'none'}",
            f"what happened: {escape(facts.summary)}",
            f"what next: {escape(facts.next_step)}",
        ]
    )
    return title, body
