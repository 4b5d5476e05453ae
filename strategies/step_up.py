"""Stepping back up: a job that stepped down the ladder because the device had less room (a
neighbour arrived, the card shrank) goes back to the faster plan once the room is back.

Without it a neighbour that stayed an hour slowed the next three weeks. The runner asks at each
checkpoint boundary (so a step up that fails costs at most the steps since that checkpoint's
start, and never the run): :func:`step_up` names the fastest plan it stepped down from that the
memory model says fits the room there is now, with its margin. A plan that ran out of memory at
this much room or more is not tried again (its measurement says so), and :class:`BackOff`
spaces the tries after a step up that failed: 1, 2, 4, ... checkpoint boundaries, so a job on a
card that keeps changing cannot flap.

A plan the running process can switch to (rungs that need no restart) is taken in the process;
one that needs a new process (offload, precision, the 8-bit optimizer, LoRA, a quantized base)
ends the attempt just after its checkpoint, and the next attempt resumes from it under that plan
(jobs/loop.py, strategies/step_up_history.py). Stepping off an approximate rung is the most
valuable step up: from there on the run is exact again, and the reason says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from oomguard.strategies import planner, rungs
from oomguard.strategies.planner import with_process_settings
from oomguard.strategies.memory_model import Measurement, MemoryModel
from oomguard.strategies.plan import Plan
from oomguard.strategies.units import format_bytes

# How many checkpoint boundaries the first wait after a failed step up lasts, and the most.
FIRST_BACK_OFF = 1
MOST_BACK_OFF = 64
@dataclass(frozen=True)
class StepUp:
    plan: Plan
    reason: str
    # Whether it takes a new process (a rung that differs needs a restart).
    restart: bool = False


def in_process_reach(current: Plan, other: Plan) -> bool:
    """Whether a running process under ``current`` can switch to ``other`` (every knob that
    differs belongs to a rung that needs no restart)."""
    return all(not rung.needs_restart for name in planner.rungs_between(current, other) if (rung := rungs.rung(name)) is not None)


def step_up(
    current: Plan, above: Sequence[Plan], measurements: Sequence[Measurement], capacity: int | None, *, origin: Plan | None = None,
) -> StepUp | None:
    """The plan to step back up to now, of ``above`` (the plans the job stepped down from), or
    None: none that is above ``current`` (is_above) fits ``capacity`` by the measurements (with
    the memory model's margins), or the room is not known. ``origin``: the job's
    own plan, against which a plan's faithfulness is judged (exact before approximate)."""
    if capacity is None:
        return None
    origin = origin or current
    failed = {m.plan for m in measurements if not m.fits and m.capacity is not None and m.capacity >= capacity}
    model = MemoryModel(measurements)
    # A cure for fragmentation (a process rung) stays whatever plan is stepped up to.
    levelled = dict.fromkeys(with_process_settings(plan, current) for plan in above)
    candidates = [plan for plan in levelled if plan not in failed and is_above(model, origin, plan, current)]
    if not candidates:
        return None
    choice = planner.choose(origin, candidates, model, capacity)
    if choice is None:
        return None
    peak = f"its peak {format_bytes(int(choice.predicted_peak))}" if choice.predicted_peak is not None else "it"
    speed = f" (~{choice.expected_samples_per_s:.1f} samples/s)" if choice.expected_samples_per_s is not None else ""
    restart = not in_process_reach(current, choice.plan)
    return StepUp(
        plan=choice.plan,
        reason=f"stepped back up to [{choice.plan.short()}]{speed}: {format_bytes(capacity)} of room again, and {peak} fits it with the margin"
        + exact_again(origin, current, choice.plan),
        restart=restart,
    )


def is_above(model: MemoryModel, origin: Plan, plan: Plan, current: Plan) -> bool:
    """Whether ``plan`` is a step up from ``current``: more faithful (fewer or milder approximate
    rungs), or as faithful and needing more memory (the rungs trade memory for time: of two
    plans for the same work, the one that needs more is the faster). Measured speeds are not
    weighed against each other: taken at different times on a busy box they differ by more than
    the plans do (one plan's median samples/s moved by 17 % between two measurements in one
    attempt beside another job, bench/contention_pairs.py). A plan below is never gone to, so a
    job that stepped down twice cannot go round between the plans it left."""
    plan_rank, current_rank = planner.faithfulness(origin, plan), planner.faithfulness(origin, current)
    if plan_rank != current_rank:
        return plan_rank < current_rank
    plan_peak, current_peak = model.predicted_peak(plan), model.predicted_peak(current)
    return plan_peak is not None and current_peak is not None and plan_peak > current_peak


def approximate_rungs(origin: Plan, plan: Plan) -> list[str]:
    """The approximate rungs (they change the numerics) ``plan`` has taken from ``origin``."""
    return [name for name in planner.rungs_between(origin, plan) if (rung := rungs.rung(name)) is not None and not rung.exact]


def exact_again(origin: Plan, current: Plan, target: Plan) -> str:
    """What a step from ``current`` to ``target`` does to the run's numerics, when it leaves an
    approximate rung: the rest of the run is exact again, or which approximate rungs remain."""
    left = [name for name in approximate_rungs(origin, current) if name not in approximate_rungs(origin, target)]
    if not left:
        return ""
    remaining = approximate_rungs(origin, target)
    if not remaining:
        return f"; off the approximate rung {', '.join(left)}: the rest of the run is exact again"
    return f"; off the approximate rung {', '.join(left)} ({', '.join(remaining)} still approximate)"


def back_off_wait(failures: int) -> int:
    """The wait (boundaries, or a command job's relaunches) after the ``failures``-th step up
    that did not hold: 0 before any, then 1, 2, 4, ... at most MOST_BACK_OFF."""
    return 0 if failures <= 0 else min(FIRST_BACK_OFF * 2 ** (failures - 1), MOST_BACK_OFF)


@dataclass
class BackOff:
    """How many checkpoint boundaries to let pass before the next step up: none at first, then
    FIRST_BACK_OFF after a step up that ran out of memory, twice as many after each further one."""

    wait: int = 0
    next_wait: int = FIRST_BACK_OFF

    @classmethod
    def after_failures(cls, failures: int) -> BackOff:
        """The back-off of a new attempt of a job whose step ups failed ``failures`` times (in
        earlier attempts): the wait the last failure set, counted from this attempt's start."""
        return cls(wait=back_off_wait(failures), next_wait=back_off_wait(failures + 1))

    def ready(self) -> bool:
        """At a checkpoint boundary: whether a step up may be tried (else one boundary less to wait)."""
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def failed(self) -> int:
        """A step up ran out of memory: the wait before the next try (boundaries)."""
        self.wait = self.next_wait
        self.next_wait = min(self.next_wait * 2, MOST_BACK_OFF)
        return self.wait

    def waiting(self) -> bool:
        """Whether boundaries are still to pass before a step up (asked without counting one)."""
        return self.wait > 0
