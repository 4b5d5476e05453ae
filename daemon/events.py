"""What happened to a job: recorded in the store, printed, and (where its people may act) sent
to them through the Notifier.

An event has a kind (queued, started, escalated, failed...), a code (the kind's specific cause,
a stable name: kind "failed" has "gave_up", "spawn_failed", "unknown_owner"...; a kind with one
cause uses the kind itself), its figures as ``data`` (attempt number, rung, plans, bytes,
seconds waited...) and the message people read (`oomguard show`, the daemon's log). Code and
tests read kind, code and data; the message is for people and may change its words."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from oomguard.daemon.store import Store
from oomguard.daemon.store_rows import AttemptRow, JobRow
from oomguard.daemon.text import escape, escape_block
from oomguard.jobs.attempt import HEARTBEAT, AttemptFiles

if TYPE_CHECKING:
    from oomguard.daemon.notifier import Notifier

# (job row, kind, message): the daemon prints each event; `oomguard run` shows them.
EventSink = Callable[[JobRow, str, str], None]


class Events:
    def __init__(
        self,
        store: Store,
        *,
        files_of: Callable[[AttemptRow], AbstractContextManager[AttemptFiles]],
        secret_urls: Callable[[int], tuple[str, ...]],
        on_event: EventSink | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.store = store
        self.files_of = files_of  # an attempt's files, opened as its owner's
        self.secret_urls = secret_urls  # a job's own notification URLs (kept out of the store)
        self.on_event = on_event
        self.notifier = notifier

    def event(
        self, job: JobRow, kind: str, message: str, *, code: str, data: Mapping[str, Any] | None = None,
        next_step: str | None = None, report: str | None = None,
    ) -> None:
        """Record, print and (with ``next_step``: what its people may do) notify what happened to
        a job: its ``kind``, ``code`` and figures (``data``, JSON values) for code to read, and
        its ``message`` for people. ``message`` is one line whatever it quotes (a runner's
        message may hold newlines and terminal escapes: text.escape shows them), so that a
        user's text can never write a line of its own into the daemon's log; the doctor's
        ``report`` follows on lines of its own."""
        message = escape(message) + ("\n" + escape(report, keep="\n") if report else "")
        self.store.add_event(job.id, kind, message, code=code, data=dict(data or {}))
        if self.on_event is not None:
            self.on_event(job, kind, message)
        if next_step is not None:
            self._notify(job, kind, message, next_step)

    def _notify(self, job: JobRow, kind: str, message: str, next_step: str) -> None:
        if self.notifier is None:
            return
        from oomguard.daemon.notify_message import JobFacts

        job = self.store.job(job.id)
        spec = job.spec
        attempts = self.store.attempts(job.id)
        heartbeat: Any = {}
        if attempts:
            with self.files_of(attempts[-1]) as files:
                heartbeat = files.read_json(HEARTBEAT) or {}
        heartbeat = heartbeat if isinstance(heartbeat, dict) else {}
        outcome = (attempts[-1].outcome_dict() if attempts else None) or {}
        oom = outcome.get("memory") or {}
        facts = JobFacts(
            job_id=job.id,
            job_name=job.name,
            user=job.owner,
            event=kind,
            attempts=len(attempts),
            plan=job.plan.short(),
            step=outcome.get("step", heartbeat.get("step")),
            max_steps=spec.train.max_steps,
            # At an OOM: what it held plus what it asked for, against what it had.
            peak_bytes=((oom.get("allocated") or 0) + (oom.get("requested") or 0)) or heartbeat.get("peak_bytes"),
            cap_bytes=oom.get("total") or heartbeat.get("capacity_bytes"),
            summary=message.splitlines()[0],
            next_step=next_step,
            gpus=",".join(str(index) for index in attempts[-1].gpus or ()) if attempts else "",
        )
        self.notifier.notify(facts, urls=self.secret_urls(job.id), tags=spec.notify.tags, events=spec.notify.events)


def log_error(what: str, error: BaseException) -> None:
    """An error of oomguard's, in the daemon's log."""
    tail = "".join(traceback.format_exception(error))[-3000:]
    # An error may quote what a user wrote: one line, then the traceback indented below it.
    print(escape_block(f"oomguard: error while {what}: {type(error).__name__}: {error}", tail), flush=True)

