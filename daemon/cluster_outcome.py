"""How a batch scheduler's end of an attempt (Slurm's job state) changes its Outcome.

The runner's report comes first where it has one: a runner that checkpointed on the way out
said so. What only the scheduler knows decides the rest:

- OUT_OF_MEMORY: the job went over the host memory it asked for (--mem): host_oom, with the
  limit, for the doctor to ask for more;
- TIMEOUT/DEADLINE: the time limit passed: time_limit (the runner's "interrupted" by the
  SIGTERM at the limit, after a checkpoint, included), with the limit when the attempt made
  no checkpoint at all, for the doctor to make the next checkpoint more often;
- NODE_FAIL/PREEMPTED/BOOT_FAIL: the cluster's doing (when Slurm did not requeue it itself):
  interrupted, to go on from the checkpoint without a rung;
- CANCELLED not asked for by oomguard: someone cancelled it in Slurm (scancel): the job is
  cancelled with that reason.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from oomguard.daemon.launch import SchedulerEnd
from oomguard.daemon.store_rows import AttemptRow
from oomguard.jobs.attempt import HEARTBEAT, AttemptFiles
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.units import format_bytes, format_duration_words

TIME_LIMIT_STATES = ("TIMEOUT", "DEADLINE")
CLUSTER_FAILURE_STATES = ("NODE_FAIL", "PREEMPTED", "BOOT_FAIL")


def with_scheduler_end(attempt: AttemptRow, files: AttemptFiles, end: SchedulerEnd, reported: Outcome | None) -> Outcome | None:
    """The attempt's outcome as the scheduler's end makes it, naming the state when that
    decided it (None: the scheduler says nothing the shim's exit status and the log do not,
    so those decide)."""
    outcome = _from_scheduler_end(attempt, files, end, reported)
    if outcome is None or outcome is reported:
        return outcome
    return dataclasses.replace(outcome, scheduler_state=end.state)


def _from_scheduler_end(attempt: AttemptRow, files: AttemptFiles, end: SchedulerEnd, reported: Outcome | None) -> Outcome | None:
    state = end.state
    kept = _checkpoints(files)
    said = f"Slurm ended job {attempt.scheduler_id} {state}" + (f" ({end.reason})" if end.reason else "")
    if reported is not None:
        if reported.kind == "interrupted" and state in TIME_LIMIT_STATES and not attempt.term_sent_at:
            # The SIGTERM at the limit (the signal before it came too late): it checkpointed.
            return dataclasses.replace(reported, kind="time_limit", message=f"{said}: stopped at the time limit after a checkpoint at step {reported.step}")
        return reported
    if state == "OUT_OF_MEMORY":
        given = f"the {format_bytes(end.host_memory)} of host memory it was given" if end.host_memory else "the host memory it was given"
        return Outcome(
            kind="host_oom", step=kept.newest or 0, resumed_from=kept.resumed_from, host_memory_limit=end.host_memory,
            message=f"{said}: a process of it used more than {given} (sbatch --mem) and the kernel killed it",
        )
    if state in TIME_LIMIT_STATES:
        limit = f" ({format_duration_words(end.time_limit)})" if end.time_limit else ""
        if kept.reported:  # the built-in runner
            made_none = kept.newest is None or kept.newest == kept.resumed_from
            step = kept.newest or 0
            where = f"its newest checkpoint is at step {kept.newest}" if kept.newest is not None else "it has no checkpoint"
        else:  # a script: its checkpoints are its own; how far it got
            made_none = False
            step = kept.step or 0
            where = "it goes on from the script's own newest checkpoint"
        return Outcome(
            kind="time_limit", step=step, resumed_from=kept.resumed_from,
            time_limit_without_checkpoint=end.time_limit if made_none else None,
            message=f"{said}: killed at its time limit{limit} before it could checkpoint; {where}",
        )
    if state in CLUSTER_FAILURE_STATES or (state == "CANCELLED" and attempt.term_sent_at):
        return Outcome(
            kind="interrupted", step=kept.newest or 0, resumed_from=kept.resumed_from,
            message=f"{said}; the next attempt continues from its checkpoint",
        )
    if state == "CANCELLED":
        return Outcome(
            kind="cancelled", step=kept.newest or 0, resumed_from=kept.resumed_from,
            message=f"{said}: cancelled in Slurm, not by oomguard (scancel by its owner or an administrator)",
        )
    return None


@dataclass(frozen=True)
class _Checkpoints:
    """Where the attempt's checkpoints stood at its last heartbeat (the built-in runner says;
    a script's heartbeat says only how far it got)."""

    reported: bool  # the heartbeat says where its checkpoints stand (the built-in runner)
    newest: int | None  # the step of its newest checkpoint
    resumed_from: int | None
    step: int | None  # how far it got


def _checkpoints(files: AttemptFiles) -> _Checkpoints:
    heartbeat = files.read_json(HEARTBEAT)
    heartbeat = heartbeat if isinstance(heartbeat, dict) else {}

    def step(name: str) -> int | None:
        value = heartbeat.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    return _Checkpoints("last_checkpoint" in heartbeat, step("last_checkpoint"), step("resumed_from"), step("step"))
