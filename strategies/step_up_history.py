"""Stepping back up across attempts: what a new attempt is told of the job's earlier ones (the
plans it stepped down from, what they measured, a step up on trial, how many failed), and the
doctor's side of a relaunch's step up for a command job, whose script the daemon cannot ask to
change plans while it runs.

A built-in job's runner steps up itself (jobs/step_ups.py): at the start of an attempt, before
it builds anything, and at each checkpoint boundary, where a plan that needs a new process
ends the attempt as "replan" (no try used) and the next one resumes from that checkpoint under
it. A command job steps up when it is relaunched anyway (a time limit, an interruption, a
retry): the daemon launches it under the faster plan when the GPU it was placed on has the room
(``launch_step_up``). Either way a step up that runs out of memory before it has held goes
straight back to the plan that worked, and the next try waits 1, 2, 4, ... up to 64 boundaries
(a command job: relaunches).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from oomguard.strategies import rungs
from oomguard.strategies.decision import Decision, NextPlan, PastAttempt, Retry, own_plan
from oomguard.strategies.memory_model import Measurement
from oomguard.strategies.outcome import MemoryFigures, Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.planner import rungs_between
from oomguard.strategies.policy import Policy
from oomguard.strategies.step_up import BackOff, StepUp, back_off_wait, step_up

UP = "up"
BACK = "back"
# The rung names the next attempt is recorded under: a runner's step up through a restart, a
# command job's step up at a relaunch (the daemon's), and the way back from either.
STEP_UP_RUNG = "step_up"
LAUNCH_STEP_UP_RUNG = "step_up_at_relaunch"
STEP_UP_FAILED_RUNG = "step_up_failed"

# Measurements an attempt is told of, at most (the newest): a job of many attempts (a Slurm
# run of daily time limits) must not carry its whole history into every attempt.json.
MOST_MEASUREMENTS = 256


@dataclass(frozen=True)
class StepUpHistory:
    """What a built-in job's attempt knows of the job's earlier attempts, to step back up."""

    # The job's own plan: faithfulness is judged against it (exact before approximate).
    origin: Plan
    # The plans the job stepped down from for lack of room, in the order it left them.
    above: tuple[Plan, ...] = ()
    measurements: tuple[Measurement, ...] = ()
    # The plan an earlier attempt stepped up from (it ended "replan" to step up, and none after
    # it trained): this attempt goes back to it if it runs out of memory before its first
    # checkpoint boundary.
    trial_from: Plan | None = None
    # Step ups that did not hold, in all the job's attempts.
    failures: int = 0
    # Whether a step up may end the attempt for a new process: not where every attempt waits in
    # a batch scheduler's queue first (Slurm), which can take longer than the step up saves.
    restarts: bool = True

    def back_off(self) -> BackOff:
        return BackOff.after_failures(self.failures)

    def to_dict(self) -> dict[str, Any]:
        return {
            "origin": self.origin.to_dict(),
            "above": [plan.to_dict() for plan in self.above],
            "measurements": [m.to_dict() for m in self.measurements],
            "trial_from": self.trial_from.to_dict() if self.trial_from is not None else None,
            "failures": self.failures,
            "restarts": self.restarts,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepUpHistory:
        trial_from = data.get("trial_from")
        return cls(
            origin=Plan.from_dict(data["origin"]),
            above=tuple(Plan.from_dict(plan) for plan in data.get("above") or ()),
            measurements=tuple(Measurement.from_dict(m) for m in data.get("measurements") or ()),
            trial_from=Plan.from_dict(trial_from) if trial_from else None,
            failures=int(data.get("failures") or 0),
            restarts=bool(data.get("restarts", True)),
        )


def step_up_history(history: Sequence[PastAttempt], policy: Policy, plan: Plan, *, restarts: bool = True) -> StepUpHistory:
    """What the next attempt under ``plan`` is told, from the job's ended attempts."""
    from oomguard.strategies.doctor import unsafe_rungs  # the doctor imports this module

    origin = own_plan(policy, history, plan)
    unsafe = set(unsafe_rungs(history, policy))
    above = [p for past in history for p in stepped_down_from(past)]
    # A plan under which the loss diverged is never gone back to.
    safe = [p for p in dict.fromkeys(above) if not unsafe.intersection(rungs_between(origin, p))]
    return StepUpHistory(
        origin=origin,
        above=tuple(safe),
        measurements=tuple(measured_at_room(history)[-MOST_MEASUREMENTS:]),
        trial_from=step_up_on_trial(history),
        failures=sum(1 for past in history for change in past.outcome.recoveries if change.get("direction") == BACK),
        restarts=restarts,
    )


def measured_at_room(history: Sequence[PastAttempt]) -> list[Measurement]:
    """What the job's attempts measured, each OOM at the room its process had (free plus what it
    held): a script's OOM names the card's total as its capacity, though other processes held
    some of it, and a plan that ran out of memory then may fit the whole card now. (The built-in
    runner's OOM figures name the room already.)"""
    return [_at_room(m, past.outcome.memory) for past in history for m in past.outcome.measurements]


def _at_room(measurement: Measurement, memory: MemoryFigures | None) -> Measurement:
    """``measurement`` at the room of the OOM it was made from (``memory``: the attempt's last)."""
    room = memory.room if memory is not None else None
    if measurement.fits or room is None or memory is None or measurement.capacity != memory.total:
        return measurement  # not the OOM these figures describe, or its room is unknown
    return dataclasses.replace(measurement, capacity=room)


def step_up_on_trial(history: Sequence[PastAttempt]) -> Plan | None:
    """The plan the job's newest step up through a restart left, while the plan it went to has
    not trained since: the attempts after it ended without moving (interrupted, a full disk, a
    time limit before a step)."""
    for past in reversed(history):
        if past.outcome.kind == "replan":
            return replanned_up_from(past.outcome.recoveries)
        if past.outcome.moved or past.outcome.kind not in ("interrupted", "time_limit", "disk_full"):
            return None
    return None



def stepped_down_from(past: PastAttempt) -> list[Plan]:
    """The plans an attempt left for lack of room: the ones its runner recovered from (the
    probe's first included, unless the probe left it only for a faster one; not a step up's, nor
    the plan a failed one went back from), and its own when it ended out of memory (the doctor
    then chose the next)."""
    plans = [Plan.from_dict(change["from"]) for change in past.outcome.recoveries if left_for_room(change)]
    if past.outcome.kind == "oom":
        plans.append(past.plan)
    return plans


def left_for_room(change: dict[str, Any]) -> bool:
    """Whether a recoveries record (jobs/step_ups.py) left its "from" plan for lack of room."""
    return change.get("direction") not in (UP, BACK) and change.get("for_room") is not False


def replanned_up_from(recoveries: Sequence[dict[str, Any]]) -> Plan | None:
    """The plan a "replan" attempt stepped up from (its last record: a step up that needs a new
    process), or None when it went back from one."""
    last = recoveries[-1] if recoveries else None
    return Plan.from_dict(last["from"]) if last is not None and last.get("direction") == UP else None


# -- a command job's step up at a relaunch -------------------------------------------------------


def launch_step_up(history: Sequence[PastAttempt], policy: Policy, plan: Plan, capacity: int | None) -> StepUp | None:
    """For a command job about to be relaunched under ``plan`` on a GPU with ``capacity`` bytes
    free: the plan above it that it stepped down from and the measurements say fits, or None
    (none does; the relaunches since a step up that failed are fewer than its back-off; or the
    last attempt ran out of memory itself, and the doctor has just chosen ``plan`` for it)."""
    from oomguard.strategies.doctor import contention_of  # the doctor imports this module

    last = history[-1]
    if last.outcome.kind in ("oom", "host_oom", "diverged") and contention_of(last) is None:
        return None
    failures = [at for at, past in enumerate(history) if failed_launch_step_up(past)]
    if failures and len(history) - 1 - failures[-1] < back_off_wait(len(failures)):
        return None
    known = step_up_history(history, policy, plan)
    return step_up(plan, known.above, known.measurements, capacity, origin=known.origin)


def failed_launch_step_up(past: PastAttempt) -> bool:
    """An attempt launched under a step up that ran out of memory: its step up did not hold."""
    return past.stepped_up and past.outcome.kind == "oom"


# -- the doctor's side ----------------------------------------------------------------------------


def free_replan(past: PastAttempt, earlier: Sequence[PastAttempt]) -> bool:
    """A "replan" that costs the job no try: one at a step beyond every earlier replan's (it
    trained, or resumed further on, since), or the way back from a step up that the attempt
    before took. One that did neither costs a try: outcome.json is the job owner's file, and a
    job must not go round for ever without moving."""
    outcome = past.outcome
    if outcome.kind != "replan" or outcome.next_plan is None:
        return False
    before = [p.outcome.step for p in earlier if p.outcome.kind == "replan"]
    beyond = outcome.step > max([outcome.resumed_from or 0, *before])
    back = bool(outcome.recoveries) and outcome.recoveries[-1].get("direction") == BACK
    after_up = bool(earlier) and earlier[-1].outcome.kind == "replan" and replanned_up_from(earlier[-1].outcome.recoveries) is not None
    return beyond or (back and after_up)


def after_replan(outcome: Outcome, plan: Plan, history: Sequence[PastAttempt], policy: Policy) -> Decision:
    """The runner ended the attempt to go on under ``outcome.next_plan`` in a new process: the
    next attempt runs under it, from the checkpoint just made, when it is a plan the job may run
    (outcome.json is the job owner's file: a plan it names is checked like a job file's)."""
    from oomguard.strategies.doctor import unsafe_rungs  # the doctor imports this module

    target = outcome.next_plan
    origin = own_plan(policy, history, plan)
    if target is None:
        return Retry(reason="the runner ended the attempt to change plans without naming the plan; the same plan again")
    if (target.batch_size, target.world_size) != (plan.batch_size, plan.world_size):
        return Retry(reason=f"the runner asked to go on under [{target.short()}], another batch or number of processes than the job's; the same plan again")
    allowed = {*policy.allow, *(r.name for r in rungs.ladder() if r.role in ("batch", "process"))}
    refused = [name for name in rungs_between(origin, target) if name not in allowed or name in unsafe_rungs(history, policy)]
    if refused:
        return Retry(reason=f"the runner asked to go on under [{target.short()}], which takes {', '.join(refused)} (not allowed for this job); the same plan again")
    back = bool(outcome.recoveries) and outcome.recoveries[-1].get("direction") == BACK
    return NextPlan(
        plan=target, rung=STEP_UP_FAILED_RUNG if back else STEP_UP_RUNG,
        reason=f"{outcome.message} -> the next attempt goes on under [{target.short()}] from the checkpoint at step {outcome.step}",
    )


def after_failed_launch_step_up(outcome: Outcome, history: Sequence[PastAttempt], describe: str) -> NextPlan:
    """A command job relaunched under a step up ran out of memory (``describe``): back to the plan
    of the attempt before it, which worked; the next step up waits twice as many relaunches."""
    wait = back_off_wait(sum(1 for past in history if failed_launch_step_up(past)))
    # The attempt before the step up ended other than out of memory (launch_step_up): the plan
    # it ended under is the one that worked, and the one the step up left.
    before = history[-2].plan
    return NextPlan(
        plan=before, rung=STEP_UP_FAILED_RUNG,
        reason=f"{describe}: the step back up to [{history[-1].plan.short()}] did not hold -> back to [{before.short()}], the plan that "
        f"worked; the next try after {wait} relaunch(es)",
    )
