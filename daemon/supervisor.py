"""The supervisor: the daemon's loop, over parts with one job each.

One `tick()` does everything that is due; the daemon and `oomguard run` call it in a loop
(tests call `drain()`, with a fake Launcher and Clock). All state is in the Store, so a new
Supervisor over the same Store carries on where an earlier one stopped.

- intake (daemon/intake.py): job files and requests from the spool, validated and recorded;
- scheduler (daemon/scheduler.py): which queued job starts next, and where;
- attempts (daemon/attempts.py): starting, watching, adopting and collecting attempts through
  a Launcher (daemon/launch/), the only part that starts or signals processes;
- lifecycle (daemon/lifecycle.py): the only writer of a job's state, and what a job does after
  an attempt (the doctor's decision applied); events (daemon/events.py) tell people.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from oomguard.daemon.attempts import STALL_SECONDS, STOP_GRACE_SECONDS, Attempts, files_of
from oomguard.daemon.conclude import outcome_without_report
from oomguard.daemon.clock import Clock, SystemClock
from oomguard.daemon.events import Events, EventSink, log_error
from oomguard.daemon.intake import Intake, Secrets, hide_stored_secrets
from oomguard.daemon.launch import Launcher
from oomguard.daemon.launch.local import LocalLauncher
from oomguard.daemon.lifecycle import COMMAND_SPLIT_KEEPS, ENDED, Lifecycle, State
from oomguard.daemon.narrowing import narrow_for_waiting_jobs
from oomguard.daemon.monitor import GpuMonitor
from oomguard.daemon.paths import StateDir
from oomguard.daemon.scheduler import SLOTS_TAKEN, JobCache, Scheduler
from oomguard.daemon.spool import DEFAULT_MAX_USER_PRIORITY, Request, Spool
from oomguard.daemon.store import Store
from oomguard.daemon.store_gc import GC_EVERY_SECONDS, Collected, collect
from oomguard.daemon.store_rows import JobRow
from oomguard.daemon.users import Account
from oomguard.jobs.device import DeviceSpec
from oomguard.jobs.spec import JobSpec
from oomguard.strategies.decision import Retry, WaitForDisk
from oomguard.strategies.outcome import Outcome

if TYPE_CHECKING:
    from oomguard.daemon.notifier import Notifier

# Re-exported: the CLI, tests and bench read them from here.
__all__ = ["COMMAND_SPLIT_KEEPS", "SLOTS_TAKEN", "STALL_SECONDS", "STOP_GRACE_SECONDS", "Supervisor", "outcome_without_report"]


class Supervisor:
    def __init__(
        self,
        state: StateDir,
        store: Store,
        *,
        max_parallel: int | None = 1,
        device: DeviceSpec = DeviceSpec(),
        on_event: EventSink | None = None,
        spool: Spool | None = None,
        gpus: GpuMonitor | None = None,
        notifier: Notifier | None = None,
        admin_group: str | None = None,
        stall_seconds: float = STALL_SECONDS,
        max_user_priority: int | None = DEFAULT_MAX_USER_PRIORITY,
        launcher: Launcher | None = None,
        clock: Clock | None = None,
        forget_after_seconds: float | None = None,
    ) -> None:
        """``forget_after_seconds``: ended jobs are forgotten this long after they ended, and
        every job's events are kept bounded (daemon/store_gc.py), at start and every
        GC_EVERY_SECONDS; None: never (`oomguard run`, tests)."""
        self.state = state
        self.store = store
        # How attempts' processes start and stop; the only way the supervisor touches a process.
        self.launcher: Launcher = launcher if launcher is not None else LocalLauncher()
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.gpus = gpus
        self.stopping = False
        self.leaving = False
        self.secrets = Secrets(state.secrets)
        self.events = Events(store, files_of=partial(files_of, store), secret_urls=self.secrets.urls, on_event=on_event, notifier=notifier)
        self.jobs = JobCache(store)
        self.lifecycle = Lifecycle(store, self.events, self.clock, on_ended=self.jobs.forget)
        self.intake = Intake(
            state, store, self.lifecycle, self.events, self.launcher, self.secrets, spool=spool,
            max_user_priority=max_user_priority, admin_group=admin_group,
        )
        self.attempts = Attempts(
            store, self.clock, self.launcher, self.lifecycle, self.events, self.secrets, self.jobs,
            gpus=gpus, stall_seconds=stall_seconds, after=self._after, pause=self._pause,
        )
        self.scheduler = Scheduler(
            store, self.clock, self.launcher, self.lifecycle, self.events, self.jobs, gpus=gpus, max_parallel=max_parallel,
            stall_seconds=stall_seconds, running=self.attempts.running, start=self.attempts.start, device=device,
        )
        hide_stored_secrets(store, self.secrets)
        self.attempts.adopt()
        self.forget_after_seconds = forget_after_seconds
        self._collected_at: float | None = None

    def event(
        self, job: JobRow, kind: str, message: str, *, code: str, data: Mapping[str, Any] | None = None,
        next_step: str | None = None, report: str | None = None,
    ) -> None:
        """Record, print and (with ``next_step``) notify what happened to a job (daemon/events.py)."""
        self.events.event(job, kind, message, code=code, data=data, next_step=next_step, report=report)

    def add_job(self, spec: JobSpec, owner: Account, spool_file: str | None = None, workdir: str | None = None) -> int:
        """Record a job, queued (daemon/intake.py); its id."""
        return self.intake.add_job(spec, owner, spool_file=spool_file, workdir=workdir)

    def _answer(self, request: Request) -> None:
        self.intake.answer(request)

    def _secret_urls(self, job_id: int) -> tuple[str, ...]:
        return self.secrets.urls(job_id)

    # The loop -------------------------------------------------------------------------------

    def tick(self) -> None:
        """Everything that is due. One bad file, job or attempt must not stop the others: each
        is handled on its own, and an error is recorded against it (Lifecycle.failed_on)."""
        self.intake.take_spool()
        self._handle_cancellations()
        if self.gpus is not None:
            try:
                self.gpus.tick()
            except Exception as error:  # noqa: BLE001 - a lost GPU must not stop the daemon
                log_error("sampling the GPUs", error)
        self.attempts.reap()
        if not self.stopping:
            self.scheduler.run_pass()
            self._narrow_widened_jobs()
        self._collect_if_due()

    def _narrow_widened_jobs(self) -> None:
        """A job that widened onto free GPUs gives them back to a job waiting for them."""
        if self.gpus is None:
            return
        try:
            narrow_for_waiting_jobs(self.store, self.events, self.gpus.read, self.jobs.spec, self.attempts.request_stop)
        except Exception as error:  # noqa: BLE001 - the queue goes on; the widened job keeps its GPUs
            log_error("giving widened jobs' GPUs back", error)

    def _collect_if_due(self) -> None:
        """The store's collection (daemon/store_gc.py), when it is due; a failure is logged and
        tried again at the next time, never out of the loop."""
        if self.forget_after_seconds is None:
            return
        now = self.clock.monotonic()
        # Hourly, or four times per --forget-after when that is shorter (an accelerated soak).
        if self._collected_at is not None and now - self._collected_at < min(GC_EVERY_SECONDS, self.forget_after_seconds / 4):
            return
        self._collected_at = now
        try:
            collected = collect(self.store, self.state, older_than_seconds=self.forget_after_seconds, now=self.clock.time())
        except Exception as error:  # noqa: BLE001 - the store's housekeeping must not stop the daemon
            log_error("collecting the store", error)
            return
        if collected != Collected():
            print(f"oomguard: {collected.summary()}", flush=True)

    def drain(self, *, max_ticks: int = 100, until: Callable[[], bool] | None = None) -> int:
        """Run tick() synchronously until ``until()`` holds, or (without it) until a tick changes
        nothing: no new event and the same attempts running. Returns the ticks it took; raises
        RuntimeError when ``max_ticks`` were not enough (a loop that never settles is a bug).
        For tests, with a fake Launcher and Clock: nothing sleeps, and no process starts."""
        for ticks in range(1, max_ticks + 1):
            before = (self.store.last_event_id(), tuple(self.attempts.running))
            self.tick()
            if until() if until is not None else (self.store.last_event_id(), tuple(self.attempts.running)) == before:
                return ticks
        raise RuntimeError(f"the supervisor did not settle within {max_ticks} ticks")

    def _after(self, job: JobRow, outcome: Outcome) -> None:
        """What the job does after an attempt ended; a retry after a pause waits in the scheduler."""
        spec = self.jobs.spec(job)
        widest = self.scheduler.gpus_to_widen_onto(job) if spec.resources.widest > 1 else None
        decision = self.lifecycle.after_attempt(job, outcome, spec, stopping=self.stopping, widest=widest)
        if isinstance(decision, (Retry, WaitForDisk)) and decision.after_seconds > 0:
            self._pause(job.id, decision.after_seconds)

    def _pause(self, job_id: int, seconds: float) -> None:
        self.scheduler.not_before[job_id] = self.clock.monotonic() + seconds

    # Cancelling and stopping ----------------------------------------------------------------

    def _handle_cancellations(self) -> None:
        for job in self.store.jobs_to_cancel():
            if job.state == State.QUEUED.value:
                self.lifecycle.end(job, State.CANCELLED, "cancelled before its next attempt started", code="cancelled_queued")
                continue
            for attempt in self.store.running_attempts():
                if attempt.job_id == job.id and not attempt.term_sent_at:
                    self.attempts.request_stop(attempt)
                    self.event(
                        job, "cancelling", f"asked attempt {attempt.number} to checkpoint and stop", code="cancelling", data={"attempt": attempt.number},
                    )

    def stop_all(self) -> None:
        """Ask every running attempt to checkpoint and stop; their jobs go back to the queue."""
        self.stopping = True
        for attempt in self.store.running_attempts():
            if not attempt.term_sent_at:
                self.attempts.request_stop(attempt)

    def leave_all(self) -> None:
        """Stop supervising and leave running attempts running: they are in sessions of their
        own, and the next daemon adopts them (or collects how they ended meanwhile)."""
        self.stopping = True
        self.leaving = True

    def active(self) -> bool:
        return bool(self.attempts.running)

    def stopped(self) -> bool:
        """Nothing left to wait for: attempts stopped, or left to the next daemon."""
        return self.stopping and (self.leaving or not self.active())

    def job_done(self, job_id: int) -> bool:
        return State(self.store.job(job_id).state) in ENDED
