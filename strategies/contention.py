"""Contention: the OOM was a neighbour's doing, not the job's.

Another process on the same GPU grew while this job asked for no more than it had been
using: the memory it needs is usually there. The answer is to wait for it and run the same
plan again, never a permanent rung for someone else's spike.

The one place that decides it, from whatever figures there are: the runner's before/after
readings of the other processes (``find_contention``, then ``bytes_to_wait_for``), or an
error message's per-process figures (``others_hold_more``, which oom_judge calls). The runner
and the daemon only gather the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.strategies.memory_model import MARGIN_RAN
from oomguard.strategies.outcome import MemoryFigures
from oomguard.strategies.units import MiB, format_bytes

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


def bytes_to_wait_for(contention: Contention, steady_peak: int | None) -> int:
    """How many bytes must be free on the job's GPUs before it runs the same plan again: what it
    needed (its steady peak, or what it held plus asked for at the OOM) with a margin, but never
    more than the room the job had before the neighbour grew, which is there again when the
    neighbour goes (a job that ran at its edge must not wait forever)."""
    needed = max(steady_peak or 0, contention.needed)
    # The margin a plan that ran gets, so the retry is not a coin toss.
    free_bytes = int(needed * (1 + MARGIN_RAN))
    if contention.room_before is not None:
        free_bytes = min(free_bytes, contention.room_before)
    return free_bytes


def driver_slack(total: int) -> int:
    """Device memory that neither "free" nor a listed process accounts for, below which it is read
    as driver overhead rather than another process."""
    return min(512 * MiB, total // 20)


def others_hold_more(others: int, ours: int | None, free: int | None, requested: int | None) -> bool:
    """From an error message's figures: the other processes (``others`` bytes) hold more than this
    one (``ours``), and without them the failed request would have fit (unknown figures do not
    rule it out)."""
    room = free is None or requested is None or free + others >= requested
    return ours is not None and others > ours and room
