"""Stepping back up: a job that stepped down the ladder because the device had less room (a
neighbour arrived, the card shrank) goes back to the faster plan once the room is back.

Without it a neighbour that stayed an hour slowed the next three weeks. The runner asks at each
checkpoint boundary (so a step up that fails costs at most the steps since that checkpoint's
start, and never the run): :func:`step_up` names the fastest plan it stepped down from that the
memory model says fits the room there is now, with its margin. A plan that ran out of memory at
this much room or more is not tried again (its measurement says so), and :class:`BackOff`
spaces the tries after a step up that failed: 1, 2, 4, ... checkpoint boundaries, so a job on a
card that keeps changing cannot flap.

Only plans the running process can switch to (rungs that need no restart) are stepped up to
here; every one of them is exact, so the trajectory is that of the run that never stepped down.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from oomguard.strategies import planner, rungs
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


def in_process_reach(current: Plan, other: Plan) -> bool:
    """Whether a running process under ``current`` can switch to ``other`` (every knob that
    differs belongs to a rung that needs no restart)."""
    return all(not rung.needs_restart for name in planner.rungs_between(current, other) if (rung := rungs.rung(name)) is not None)


def step_up(current: Plan, above: Sequence[Plan], measurements: Sequence[Measurement], capacity: int | None) -> StepUp | None:
    """The plan to step back up to now, of ``above`` (the plans this process stepped down
    from), or None: none fits ``capacity`` by the measurements (with the memory model's
    margins), none is faster than ``current``, or the room is not known."""
    if capacity is None:
        return None
    failed = {m.plan for m in measurements if not m.fits and m.capacity is not None and m.capacity >= capacity}
    candidates = [plan for plan in dict.fromkeys(above) if plan != current and plan not in failed and in_process_reach(current, plan)]
    if not candidates:
        return None
    model = MemoryModel(measurements)
    choice = planner.choose(current, [current, *candidates], model, capacity)
    if choice is None or choice.plan == current:
        return None
    peak = f"its peak {format_bytes(int(choice.predicted_peak))}" if choice.predicted_peak is not None else "it"
    speed = f" (~{choice.expected_samples_per_s:.1f} samples/s)" if choice.expected_samples_per_s is not None else ""
    return StepUp(
        plan=choice.plan,
        reason=f"stepped back up to [{choice.plan.short()}]{speed}: {format_bytes(capacity)} of room again, and {peak} fits it with the margin",
    )


@dataclass
class BackOff:
    """How many checkpoint boundaries to let pass before the next step up: none at first, then
    FIRST_BACK_OFF after a step up that ran out of memory, twice as many after each further one."""

    wait: int = 0
    next_wait: int = FIRST_BACK_OFF

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
