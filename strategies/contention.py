"""Contention: the OOM was a neighbour's doing, not the job's.

Another process on the same GPU grew while this job asked for no more than it had been
using: the memory it needs is usually there. The answer is to wait for it and run the same
plan again, never a permanent rung for someone else's spike.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.strategies.outcome import MemoryFigures, format_bytes

# Growth below this is noise (allocator rounding, a CUDA context starting), not a neighbour.
MIN_GROWTH_BYTES = 2**20
MIN_GROWTH_SHARE = 0.01
# "No more than usual": within this share of the steady peak the plan had before the OOM.
USUAL_MARGIN = 0.03


@dataclass(frozen=True)
class Contention:
    others_before: int
    others_at_oom: int
    needed: int  # what this job held plus what it asked for when it ran out
    room_before: int | None = None  # what this job could have had before the others grew

    @property
    def grown_by(self) -> int:
        return self.others_at_oom - self.others_before

    def describe(self) -> str:
        return (
            f"other processes on the GPU grew by {format_bytes(self.grown_by)} "
            f"({format_bytes(self.others_before)} -> {format_bytes(self.others_at_oom)}) while this job needed "
            f"{format_bytes(self.needed)}, no more than it had room for before: contention"
        )


def find_contention(memory: MemoryFigures | None, steady_peak: int | None) -> Contention | None:
    """Contention, when the figures show it: others grew noticeably, their growth explains the
    OOM (what the job needed fitted in the room it had before they grew), and the job itself
    did not grow (it needed no more than its usual peak, when that is known).
    ``steady_peak`` is the plan's peak over its steady steps before the OOM (None: unknown)."""
    if memory is None or memory.others_before is None or memory.others_at_oom is None or memory.total is None:
        return None
    grown = memory.others_at_oom - memory.others_before
    capacity = memory.total
    if grown < max(MIN_GROWTH_BYTES, int(MIN_GROWTH_SHARE * capacity)):
        return None
    needed = (memory.allocated or 0) + (memory.requested or 0)
    # `total` is the room this process had at the OOM; before the neighbour grew it had that
    # much more.
    room_before = capacity + grown
    if needed > room_before:
        return None
    if steady_peak is not None and needed > steady_peak * (1 + USUAL_MARGIN):
        return None
    return Contention(others_before=memory.others_before, others_at_oom=memory.others_at_oom, needed=needed, room_before=room_before)
