"""Where a batch scheduler (Slurm) has each running attempt: its state and reason kept for
`status`, an event each time the scheduler requeued it itself, when it began to run (its
silence counts from then, not from its submission), and a pending attempt that will never
start ended with its job. Nothing here for a local launcher, which has no queue."""

from __future__ import annotations

from oomguard.daemon.clock import Clock
from oomguard.daemon.events import Events
from oomguard.daemon.launch import Handle, Launcher, QueueState
from oomguard.daemon.lifecycle import Lifecycle, State
from oomguard.daemon.store import Store
from oomguard.daemon.store_rows import AttemptRow
from oomguard.strategies.outcome import Outcome


class ClusterQueue:
    def __init__(self, store: Store, clock: Clock, launcher: Launcher, lifecycle: Lifecycle, events: Events) -> None:
        self.store = store
        self.clock = clock
        self.launcher = launcher
        self.lifecycle = lifecycle
        self.events = events
        # When the scheduler was first seen running each attempt (clock.time()).
        self.ran_from: dict[int, float] = {}

    def note(self, attempt: AttemptRow, handle: Handle) -> QueueState | None:
        """Where a batch scheduler has the attempt (status shows it), and an event each time
        the scheduler requeued it itself (a node failure, a preemption: the same attempt goes
        on from its checkpoint when it runs again)."""
        queued = self.launcher.queue_state(handle)
        if queued is None:
            return None
        known = (attempt.scheduler_state, attempt.scheduler_reason, attempt.scheduler_restarts or 0)
        if (queued.state, queued.reason, queued.restarts) == known:
            return queued
        self.store.update_attempt(attempt.id, scheduler_state=queued.state, scheduler_reason=queued.reason, scheduler_restarts=queued.restarts)
        if queued.state == "RUNNING" and known[0] != "RUNNING":
            self.ran_from[attempt.id] = self.clock.time()  # its silence counts from here, not from its submission
        if queued.restarts > known[2]:
            job = self.store.job(attempt.job_id)
            self.events.event(
                job, "requeued", f"Slurm requeued attempt {attempt.number} (job {handle.scheduler_id}, restart {queued.restarts}); it goes on "
                "from its checkpoint when it runs again", code="scheduler_requeued",
                data={"attempt": attempt.number, "scheduler_id": handle.scheduler_id, "restarts": queued.restarts},
            )
        return queued

    def give_up(self, attempt: AttemptRow, handle: Handle, queued: QueueState) -> None:
        """A pending attempt the cluster will never start as it was asked (its time limit over
        the partition's, an invalid account, ...): cancelled, and the job fails saying what to
        change, rather than waiting in the queue for ever."""
        self.launcher.stop(handle, kill=True)
        self.forget(attempt.id)
        job = self.store.job(attempt.job_id)
        why = f"Slurm will never start job {handle.scheduler_id} as it was submitted (pending: {queued.never_starts})"
        with self.store.atomic():
            self.lifecycle.end_attempt(attempt.id, Outcome(kind="crashed", message=why))
            self.lifecycle.end(
                job, State.FAILED, why, next_step="nothing: the job has ended; change what the reason names, and submit it again",
                code="never_starts", data={"attempt": attempt.number, "reason": queued.reason},
            )

    def forget(self, attempt_id: int) -> None:
        self.ran_from.pop(attempt_id, None)
