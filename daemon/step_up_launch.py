"""The plan an attempt starts under, and what it is told to step back up
(strategies/step_up_history.py): a built-in job's runner gets the job's history and steps up
itself; a command job, whose script cannot be asked to change plans while it runs, is
relaunched under the faster plan it stepped down from when the GPU it was placed on has the
room for it now (by the measurements, with the memory model's margin)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from oomguard.daemon.gpus import GpuState
from oomguard.daemon.lifecycle import past_attempts
from oomguard.daemon.placement import Placement
from oomguard.daemon.store_rows import AttemptRow, JobRow
from oomguard.jobs.spec import JobSpec
from oomguard.strategies.plan import Plan
from oomguard.strategies.step_up import StepUp
from oomguard.strategies.step_up_history import LAUNCH_STEP_UP_RUNG, StepUpHistory, launch_step_up, step_up_history


@dataclass(frozen=True)
class LaunchPlan:
    plan: Plan
    # A command job's step up at this relaunch (None: it runs under the job's plan).
    step_up: StepUp | None = None
    # A built-in job's history, for its runner to step up from (None: its first attempt).
    history: StepUpHistory | None = None

    def rung(self, job: JobRow) -> str | None:
        """The rung the attempt is recorded under: the step up's, else the doctor's."""
        return LAUNCH_STEP_UP_RUNG if self.step_up is not None else job.next_rung

    def reason(self, job: JobRow) -> str | None:
        return self.step_up.reason if self.step_up is not None else job.next_reason


def launch_plan(
    job: JobRow, spec: JobSpec, attempts: Sequence[AttemptRow], placement: Placement, gpus: Sequence[GpuState] | None, *, restarts: bool = True,
) -> LaunchPlan:
    """The plan the job's next attempt starts under, placed on ``placement`` (``gpus``: what
    the cards held when it was placed; None without GPUs to place by). ``restarts``: whether a
    built-in job's runner may end its attempt to step up in a new process (not where each
    attempt waits in a batch scheduler's queue)."""
    history = past_attempts(attempts)
    plan = job.plan
    if not history:
        return LaunchPlan(plan)
    if spec.command is None:
        return LaunchPlan(plan, history=step_up_history(history, spec.policy(), plan, restarts=restarts))
    if spec.resources.share:
        return LaunchPlan(plan)  # the free memory of a shared GPU is its other jobs' to take too
    room = room_on(placement, gpus, resumes_at=history[-1].outcome.step)
    found = launch_step_up(history, spec.policy(), plan, room)
    return LaunchPlan(found.plan, step_up=found) if found is not None else LaunchPlan(plan)


def room_on(placement: Placement, gpus: Sequence[GpuState] | None, *, resumes_at: int) -> int | None:
    """The device memory an attempt placed on ``placement`` has, as the daemon sees it before it
    starts: the least free on its GPUs, within the emulated capacity at the step it resumes
    from. None when neither is known (no GPUs to place by, and the real device)."""
    limits: list[int] = []
    if placement.gpus is not None and gpus is not None:
        limits += [gpu.free for gpu in gpus if gpu.index in placement.gpus]
    schedule = placement.device.emulated_capacity
    if schedule is not None:
        cap = schedule.limit_at(resumes_at)
        if cap is not None:
            limits.append(cap)
    return min(limits) if limits else None
