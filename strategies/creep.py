"""Creep: device memory that grows slowly from step to step (a callback that keeps tensors, a
list of losses kept on the device, an allocator cache that only grows), found in an attempt's
step timeline (metrics.jsonl: each optimizer step's peak) long before it ends in an OOM.

A step's peak varies with its batch (caption lengths, aspect-ratio buckets, timesteps), so
single peaks say little. The steps are cut into ``WINDOWS`` consecutive windows; creep is when
the lowest peak of each window is at least the lowest of the one before, above it in all but
one pair (growth, not one jump: a cache filled once, a larger bucket), and the last lies above
the first by ``GROWTH_SHARE`` of it, or ``HEADROOM_SHARE`` of the room left under the capacity
where that is less (at least ``GROWTH_FLOOR``, so that a few bytes on a small run never count). Jitter moves the windows' highest peaks, not their floors; a leak
lifts every floor. Only steps of one plan are compared (a plan change
changes the peak), and the first steps of a process are left out (the optimizer state
appears in the first step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from oomguard.strategies.units import format_bytes

WINDOWS = 5
# Steps in each window at least: fewer and a window's floor is one step's peak.
MIN_STEPS_PER_WINDOW = 6
# Steps of a process left out: the first creates the optimizer state, the second may still
# settle (caches, the first checkpoint).
SETTLING_STEPS = 2
GROWTH_SHARE = 0.03
HEADROOM_SHARE = 0.1
GROWTH_FLOOR = 1 << 20


@dataclass(frozen=True)
class Creep:
    first_step: int
    last_step: int
    # Growth of the peak's floor, bytes per optimizer step.
    bytes_per_step: float
    floor_from: int
    floor_to: int
    # The step at which the highest peak so far, growing at that rate, reaches the capacity.
    reaches_capacity_at: int | None

    def describe(self, capacity: int | None) -> str:
        text = (
            f"device memory creeps up {format_bytes(int(self.bytes_per_step))} per step "
            f"({format_bytes(int(self.bytes_per_step * 1000))} per 1000 steps): the lowest peaks rose from "
            f"{format_bytes(self.floor_from)} to {format_bytes(self.floor_to)} over steps {self.first_step}-{self.last_step}"
        )
        if self.reaches_capacity_at is not None and capacity:
            text += f"; at this rate the step peaks reach the {format_bytes(capacity)} the job has near step {self.reaches_capacity_at}"
        return text


def find_creep(points: Sequence[tuple[int, int]], capacity: int | None = None) -> Creep | None:
    """Creep in ``points`` (step, peak bytes) of one plan in one process, in step order; None
    when the floors do not rise steadily or there are too few steps to say."""
    steady = list(points[SETTLING_STEPS:])
    if len(steady) < WINDOWS * MIN_STEPS_PER_WINDOW:
        return None
    size = len(steady) // WINDOWS
    # The newest steps count: the oldest that do not fill a window are left out.
    steady = steady[len(steady) - size * WINDOWS:]
    windows = [steady[i * size:(i + 1) * size] for i in range(WINDOWS)]
    floors = [min(peak for _, peak in window) for window in windows]
    rises = [later - earlier for earlier, later in zip(floors, floors[1:])]
    if min(rises) < 0 or sum(rise > 0 for rise in rises) < len(rises) - 1:
        return None
    # A share of the floor, or of the room left under the capacity where that is less (a
    # 20 GB job with 2 GB to spare is in danger long before it has grown by 3 %).
    wanted = GROWTH_SHARE * floors[0]
    if capacity and capacity > floors[0]:
        wanted = min(wanted, HEADROOM_SHARE * (capacity - floors[0]))
    if floors[-1] - floors[0] < max(GROWTH_FLOOR, wanted):
        return None
    # Between the middles of the first and last windows.
    steps = windows[-1][size // 2][0] - windows[0][size // 2][0]
    if steps <= 0:
        return None
    rate = (floors[-1] - floors[0]) / steps
    highest = max(peak for _, peak in windows[-1])
    last_step = steady[-1][0]
    reaches = None
    if capacity and highest < capacity:
        reaches = last_step + int((capacity - highest) / rate)
    return Creep(steady[0][0], last_step, rate, floors[0], floors[-1], reaches)
