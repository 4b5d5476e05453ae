"""A job's state: the one place that writes it, through an explicit table of transitions.

Stored values are the ones `oomguard status`, the CLI's filters and older databases know:
queued, running, finished, failed, cancelled. Waiting (for a slot, a GPU, a neighbour's memory,
a retry's pause, disk space) is a queued job with a note (the `waiting`, `waiting_since` and
`wait_free_bytes` columns; for disk space `disk_path`, `disk_wait_bytes` and `disk_needed`,
which the scheduler reads to let it go: daemon/disk_wait.py), not a state of its own, so that
every reader of the store sees the same five values as before. Every change of state is an
event (daemon/events.py), and an attempt's end is written here with the change it brings to its
job, in one transaction.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

from oomguard.daemon.clock import Clock
from oomguard.daemon.disk_wait import DiskWait, disk_wait, disk_wait_of
from oomguard.daemon.events import Events, log_error
from oomguard.daemon.store import Store
from oomguard.daemon.store_rows import AttemptRow, JobRow
from oomguard.jobs.script_report import read_script_report
from oomguard.jobs.spec import JobSpec
from oomguard.strategies.doctor import decide
from oomguard.strategies.decision import Decision, GiveUp, NextPlan, PastAttempt, Retry, Wait, WaitForDisk
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.policy import Policy
from oomguard.strategies.step_up import StepUp
from oomguard.strategies.step_up_history import LAUNCH_STEP_UP_RUNG, STEP_UP_FAILED_RUNG
from oomguard.strategies.units import format_bytes

# What a relaunch with other knobs keeps for a command job: the script draws its own noise per
# micro-batch, so its weights are not checked, only its schedule (jobs/script_report.py).
COMMAND_SPLIT_KEEPS = (
    "relaunched under other plans, it kept the same schedule (optimizer steps, effective batch, samples, learning "
    "rate), not bitwise-equal weights: a script draws its noise per micro-batch"
)


class State(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


ENDED = frozenset({State.FINISHED, State.FAILED, State.CANCELLED})

# From each state (None: not recorded yet), the states a job may move to. queued -> queued is
# a queued job whose note changes (waiting for a GPU, for a slot). Ended jobs never move again.
TRANSITIONS: Mapping[State | None, frozenset[State]] = {
    None: frozenset({State.QUEUED}),
    State.QUEUED: frozenset({State.QUEUED, State.RUNNING, State.FAILED, State.CANCELLED}),
    State.RUNNING: frozenset({State.QUEUED, State.FINISHED, State.FAILED, State.CANCELLED}),
    State.FINISHED: frozenset(),
    State.FAILED: frozenset(),
    State.CANCELLED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A change of state that the transition table does not allow (a bug of oomguard's)."""


def check(current: State | None, new: State) -> None:
    if new not in TRANSITIONS[current]:
        was = current.value if current is not None else "not recorded"
        raise IllegalTransition(f"a job cannot go from {was} to {new.value}")


class Lifecycle:
    def __init__(self, store: Store, events: Events, clock: Clock, on_ended: Callable[[int], None] | None = None) -> None:
        self.store = store
        self.events = events
        self.clock = clock
        # Told the id of each job that ends (the scheduler forgets what it kept of it).
        self.on_ended = on_ended

    def _move(self, job_id: int, new: State, **fields: Any) -> None:
        check(State(self.store.job(job_id).state), new)
        self.store.update_job(job_id, state=new.value, **fields)

    # Entering and leaving the queue ------------------------------------------------------------

    def enqueue(self, **job: Any) -> int:
        """Record a new job, queued (Store.add_job's fields)."""
        check(None, State.QUEUED)
        return self.store.add_job(**job)

    def start(self, job: JobRow, **attempt: Any) -> int:
        """Record the job's next attempt and the job as running, in one transaction: a daemon
        that dies before its process starts finds the row and looks for it (adoption)."""
        now = attempt["started_at"]
        with self.store.atomic():
            attempt_id = self.store.add_attempt(job_id=job.id, **attempt)
            self._move(
                job.id, State.RUNNING, started_at=job.started_at or now, next_rung=None, next_reason=None, waiting=None,
                wait_free_bytes=None, waiting_since=None, **NO_DISK_WAIT,
            )
        return attempt_id

    def requeue(self, job: JobRow, message: str, *, code: str, data: Mapping[str, Any] | None = None) -> None:
        """A running job back in the queue, its plan unchanged (the daemon stopped or restarted)."""
        self._move(job.id, State.QUEUED)
        self.events.event(job, "requeued", message, code=code, data=data)

    def escalate(self, job: JobRow, plan: Plan, rung: str, reason: str, next_step: str, *, old_plan: Plan) -> None:
        """Queued again under the next plan of the ladder."""
        self._move(job.id, State.QUEUED, plan=json.dumps(plan.to_dict()), next_rung=rung, next_reason=reason)
        self.events.event(
            job, "escalated", f"rung {rung}: {reason}", code=STEP_UP_FAILED_RUNG if rung == STEP_UP_FAILED_RUNG else "ladder",
            data={"rung": rung, "from": old_plan.short(), "to": plan.short()}, next_step=next_step,
        )

    def replan(self, job: JobRow, decision: NextPlan, step: int) -> None:
        """Queued again under the plan the runner ended its attempt for (a step back up that needs
        a new process, or the way back from one: the runner's record of it is its own event)."""
        self._move(job.id, State.QUEUED, plan=json.dumps(decision.plan.to_dict()), next_rung=decision.rung, next_reason=decision.reason)
        self.events.event(
            job, "requeued", f"the next attempt goes on under [{decision.plan.short()}] from the checkpoint at step {step} (a new process)",
            code="replan", data={"rung": decision.rung, "to": decision.plan.short(), "step": step},
        )

    def wait_for_memory(self, job: JobRow, free_bytes: int, waiting: str, reason: str) -> None:
        """Queued again, the same plan, until a GPU has ``free_bytes`` free (a neighbour's spike)."""
        self._move(job.id, State.QUEUED, next_rung=None, next_reason=reason, waiting=waiting, wait_free_bytes=free_bytes)
        self.events.event(job, "contention", reason, code="contention", data={"free_bytes": free_bytes})

    def wait_for_disk(self, job: JobRow, decision: WaitForDisk, wait: DiskWait) -> None:
        """Queued again, the same plan, until ``wait.path`` has room: the scheduler does not
        start it before. Its people are told once, with what to do."""
        self._move(
            job.id, State.QUEUED, next_rung=None, next_reason=decision.reason, waiting=wait.note(), waiting_since=self.clock.time(),
            disk_path=wait.path, disk_wait_bytes=wait.wait_free, disk_needed=wait.needed, disk_budget=wait.budget,
        )
        needed = format_bytes(wait.needed) if wait.needed is not None else f"an unknown amount (oomguard waits for {format_bytes(wait.wait_free)})"
        if wait.budget is None:
            what_next = f"make room at {wait.path} ({needed} free needed)"
        else:
            what_next = (
                f"make room in {wait.path} ({needed} free needed within the job's disk budget of {format_bytes(wait.budget)}): remove "
                "checkpoints it keeps for good (train.keep_every_steps), or cancel it and submit it again with a larger [resources] disk"
            )
        self.events.event(
            job, "waiting_for_disk", f"{wait.note()}: {decision.reason}", code="disk_budget" if wait.budget is not None else "disk_full",
            data={"path": wait.path, "needed_bytes": wait.needed, "free_bytes": wait.free, "wait_free_bytes": wait.wait_free, "budget_bytes": wait.budget},
            next_step=f"{what_next}: oomguard starts the job again by itself as soon as there is room, from its last verified checkpoint "
            "(none was deleted); or `oomguard cancel` it",
        )

    def disk_space_back(self, job: JobRow, free: int | None) -> None:
        """A job that waited for disk space has it: an ordinary queued job again (no message:
        its people were told when it began to wait, and the job's end tells them the rest)."""
        wait = disk_wait_of(job)
        self._move(job.id, State.QUEUED, waiting=None, waiting_since=None, **NO_DISK_WAIT)
        has = format_bytes(free) if free is not None else "room (not measurable by the daemon)"
        self.events.event(
            job, "resumed", f"{wait.path if wait else job.disk_path} has {has} free: the job goes on from its last verified checkpoint",
            code="disk_space_back", data={"path": job.disk_path, "free_bytes": free, "wait_free_bytes": job.disk_wait_bytes},
        )

    def retry(self, job: JobRow, decision: Retry, waiting: str | None) -> None:
        """Queued again, the same plan (a transient crash, a time limit); ``waiting`` says for how
        long it pauses. What the next attempts ask of a cluster is kept with the job."""
        asked = {
            name: value for name, value in (("host_memory", decision.host_memory), ("checkpoint_every_seconds", decision.checkpoint_every_seconds))
            if value is not None
        }
        self._move(job.id, State.QUEUED, next_rung=None, next_reason=decision.reason, waiting=waiting, **asked)
        self.events.event(
            job, "retry", decision.reason, code="retry", data={"after_seconds": decision.after_seconds, **asked},
        )

    def step_up_at_launch(self, job: JobRow, step_up: StepUp, number: int) -> None:
        """A command job relaunched under a faster plan it stepped down from (the daemon's step
        up: its script cannot change plans while it runs)."""
        old = job.plan
        self.keep_plan(job, step_up.plan)
        self.events.event(
            job, "stepped-up", f"attempt {number}: {step_up.reason}; the command is relaunched under it", code="step_up",
            data={"attempt": number, "from": old.short(), "to": step_up.plan.short()},
        )

    def keep_plan(self, job: JobRow, plan: Plan) -> None:
        """The plan the job's last attempt ended under (a probe or an in-process recovery moved it)."""
        self.store.update_job(job.id, plan=json.dumps(plan.to_dict()))

    # Notes on queued jobs ------------------------------------------------------------------------

    def note_waiting(self, job: JobRow, reason: str, *, code: str) -> None:
        """A queued job that does not fit on the GPUs now, and why (an event when it changes;
        ``code``: placement.Waiting's)."""
        self._move(job.id, State.QUEUED, waiting=reason, waiting_since=job.waiting_since or self.clock.time())
        self.events.event(job, "waiting", reason, code=code)

    def note_slots_taken(self, note: str, replaces: str) -> None:
        """Every queued job without a note (or with an older one of this kind) waits for a slot:
        one statement, which changes no job's state (Store.note_waiting writes queued jobs only)."""
        self.store.note_waiting(note, replaces=replaces)

    # Ending ----------------------------------------------------------------------------------------

    def end(
        self, job: JobRow, state: State, result: str, report: str | None = None, next_step: str | None = None, *,
        code: str, data: Mapping[str, Any] | None = None,
    ) -> None:
        """The job ends in ``state``; ``code`` says why (the event's), ``result`` in words."""
        if state not in ENDED:
            raise IllegalTransition(f"{state.value} does not end a job")
        if self.on_ended is not None:
            self.on_ended(job.id)
        self._move(job.id, state, ended_at=self.clock.time(), result=result, report=report, waiting=None, waiting_since=None, **NO_DISK_WAIT)
        self.events.event(job, state.value, result, code=code, data=data, next_step=next_step, report=report)

    def end_attempt(self, attempt_id: int, outcome: Outcome, exit_code: int | None = None) -> None:
        """How an attempt ended (its job's next step is the caller's, in the same transaction)."""
        self.store.update_attempt(
            attempt_id, ended_at=self.clock.time(), outcome_kind=outcome.kind, outcome=json.dumps(outcome.to_dict()),
            exit_code=outcome.exit_code if outcome.exit_code is not None else exit_code, resumed_from=outcome.resumed_from,
        )

    # After an attempt ------------------------------------------------------------------------------

    def after_attempt(self, job: JobRow, outcome: Outcome, spec: JobSpec, *, stopping: bool, widest: int | None = None) -> Decision | None:
        """What the job does after an attempt ended with ``outcome``: it ends, goes back to the
        queue as it was (the daemon stops), or the doctor decides (the decision is returned:
        a retry's pause is the scheduler's to keep). ``widest``: how many GPUs the job could
        run on now (the scheduler's count), when its resources.gpus is a range."""
        if outcome.kind == "finished":
            if spec.command is not None:
                self._end_command_job(job, spec)
                return None
            final = Path(job.workdir) / "final"
            self.end(
                job, State.FINISHED, f"finished {outcome.step} steps; final model in {final}", next_step=f"nothing: the final model is in {final}",
                code="finished", data={"step": outcome.step},
            )
            return None
        if job.cancel_requested:
            self.end(job, State.CANCELLED, f"cancelled at step {outcome.step} (checkpoint kept in {job.workdir})", code="cancelled_running", data={"step": outcome.step})
            return None
        if outcome.kind == "cancelled":
            # Cancelled where the attempt ran (scancel), not through oomguard: the job ends too.
            self.end(
                job, State.CANCELLED, f"{outcome.message}; checkpoint at step {outcome.step} kept in {job.workdir}", code="cancelled_outside",
                data={"step": outcome.step}, next_step=f"nothing: the job has ended; submit it again to go on from its checkpoint in {job.workdir}",
            )
            return None
        if job.narrow_plan is not None and self._narrowed(job, outcome, stopping):
            return None
        if outcome.kind == "interrupted" and stopping:
            self.requeue(job, f"stopped with the daemon at step {outcome.step}; it resumes when the daemon starts again", code="daemon_stopped", data={"step": outcome.step})
            return None
        # The plan the attempt ended under: its probe or an in-process recovery may have
        # moved it from the one it started with.
        plan = outcome.plan or job.plan
        history = past_attempts(self.store.attempts(job.id))
        decision = decide(outcome, plan, history, _policy_after(outcome, spec, widest))
        if isinstance(decision, (Retry, Wait, WaitForDisk)) and outcome.plan is not None:
            self.keep_plan(job, outcome.plan)
        if isinstance(decision, NextPlan) and outcome.kind == "replan":
            self.replan(job, decision, outcome.step)
        elif isinstance(decision, NextPlan):
            self.escalate(
                job, decision.plan, decision.rung, decision.reason,
                next_step=f"the next attempt runs under [{decision.plan.short()}] from the last checkpoint", old_plan=plan,
            )
        elif isinstance(decision, Wait):
            waiting = f"waiting for {format_bytes(decision.free_bytes)} free after a neighbour's spike"
            self.wait_for_memory(job, decision.free_bytes, waiting, decision.reason)
        elif isinstance(decision, WaitForDisk):
            path = decision.path if Path(decision.path).is_absolute() else str(Path(job.workdir) / decision.path)
            self.wait_for_disk(job, decision, disk_wait(path, decision.needed, decision.free, decision.budget))
        elif isinstance(decision, Retry):
            waiting = None
            if decision.after_seconds > 0:
                ended = f"{outcome.kind}: {outcome.summary}" if outcome.summary else outcome.kind
                waiting = f"retrying {decision.after_seconds:.0f} s after the attempt ended ({ended})"
            self.retry(job, decision, waiting)
        elif isinstance(decision, GiveUp):
            self.end(
                job, State.FAILED, decision.reason, report=decision.report,
                next_step=f"nothing more: the job has ended; `oomguard show {job.id}` has the report; {decision.next_step}",
                code="gave_up", data={"outcome": outcome.kind, "step": outcome.step},
            )
        return decision

    def _narrowed(self, job: JobRow, outcome: Outcome, stopping: bool) -> bool:
        """A job asked to give GPUs back (daemon/narrowing.py): whatever ended its attempt, the
        ask is answered; an attempt stopped for it goes on, from its checkpoint, on fewer GPUs
        (True: queued so)."""
        assert job.narrow_plan is not None
        narrowing = json.loads(job.narrow_plan)
        self.store.update_job(job.id, narrow_plan=None)
        if outcome.kind != "interrupted" or stopping:
            return False
        self.escalate(
            job, Plan.from_dict(narrowing["plan"]), narrowing["rung"], narrowing["reason"],
            next_step="the next attempt runs on fewer GPUs from the checkpoint it wrote", old_plan=outcome.plan or job.plan,
        )
        return True

    def _end_command_job(self, job: JobRow, spec: JobSpec) -> None:
        """A finished command job, checked against its target (the steps of its job file, the
        learning rate its first attempt's schedule ends at), with what its relaunches kept."""
        attempts = self.store.attempts(job.id)
        last = attempts[-1]
        with self.events.files_of(last) as files:
            end = read_script_report(files, last.plan).end_state(spec.train.max_steps)
        result = f"the command exited with code 0; {end.describe()}"
        split = len({a.plan_json for a in attempts}) > 1
        if split:
            result += f"; {COMMAND_SPLIT_KEEPS}"
        next_step = "nothing: the script has written its results"
        if end.differences:
            next_step = f"check the script's results: it did not end where the job file says (`oomguard show {job.id}`)"
        code = "command_off_target" if end.differences else "command_finished"
        self.end(job, State.FINISHED, result, next_step=next_step, code=code, data={"split": split})

    def failed_on(self, job_id: int, what: str, error: BaseException) -> None:
        """An error of oomguard's while handling one job: the job ends, failed, with the error
        recorded and its people told, instead of the same error at every tick."""
        log_error(f"{what} (job {job_id})", error)
        job = self.store.job(job_id)
        if State(job.state) not in ENDED:
            self.end(
                job, State.FAILED, f"oomguard failed while {what}: {type(error).__name__}: {error}",
                next_step="nothing: the job has ended; the daemon's log has the details; submit it again, and report the error",
                code="oomguard_error", data={"while": what, "error": type(error).__name__},
            )


# The columns of a job's wait for disk space, cleared (it starts, ends, or has room again).
NO_DISK_WAIT: Mapping[str, Any] = {"disk_path": None, "disk_wait_bytes": None, "disk_needed": None, "disk_budget": None}


def past_attempts(attempts: Sequence[AttemptRow]) -> list[PastAttempt]:
    """The job's ended attempts as the doctor reads them: the plan each ended under, how, and
    whether the daemon launched it under a step up (a command job's, at a relaunch)."""
    return [
        PastAttempt(plan=a.outcome.plan or a.plan, outcome=a.outcome, stepped_up=a.rung == LAUNCH_STEP_UP_RUNG)
        for a in attempts if a.outcome is not None
    ]


def _policy_after(outcome: Outcome, spec: JobSpec, widest: int | None) -> Policy:
    """The job's policy for the decision after ``outcome``: out of memory with GPUs free (the
    scheduler's count, ``widest``), a built-in job whose resources.gpus is a range may widen
    onto them rather than step down."""
    policy = spec.policy()
    if outcome.kind == "oom" and widest is not None and spec.command is None:
        policy = dataclasses.replace(policy, widest=min(spec.resources.widest, widest))
    return policy
