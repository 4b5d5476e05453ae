"""The doctor's answer to a full disk (an attempt that ended "disk_full"): wait for room. Apart
from doctor.py because it reads nothing of the ladder or the job's history."""

from __future__ import annotations

from collections.abc import Sequence

from oomguard.strategies.decision import PastAttempt, WaitForDisk
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.units import format_bytes


# Disk-full attempts in a row beyond the first wait this long, doubling, at most the maximum,
# besides the room: a quota (EDQUOT) that statvfs does not show, or a disk that fills again as
# soon as it has room, must not start an attempt after another without a pause.
DISK_BACKOFF_SECONDS = 30.0
DISK_BACKOFF_MAX_SECONDS = 1800.0


def after_disk_full(outcome: Outcome, plan: Plan, history: Sequence[PastAttempt] = ()) -> WaitForDisk:
    """Wait for room, whatever came before: a full disk is no reason to take a rung, to count a
    try or to give up (the job waits, visibly, and its people are told once). ``history``: the
    job's attempts, this one included."""
    streak = 0
    for past in reversed(history):
        if past.outcome.kind != "disk_full":
            break
        streak += 1
    pause = min(DISK_BACKOFF_SECONDS * 2 ** (streak - 2), DISK_BACKOFF_MAX_SECONDS) if streak >= 2 else 0.0
    path = outcome.disk_path or "the job's workdir"
    needed = f"{format_bytes(outcome.disk_needed)} free" if outcome.disk_needed is not None else "room (how much is unknown)"
    if outcome.disk_budget is not None:
        needed += f" within the job's disk budget of {format_bytes(outcome.disk_budget)}"
    return WaitForDisk(
        reason=f"the disk was full at step {outcome.step} ({outcome.summary or 'no room'}) -> wait until {path} has {needed}, "
        f"then run the same plan [{plan.short()}] from the last verified checkpoint"
        + (f" (not before {pause:.0f} s: the disk was full {streak} times in a row)" if pause else ""),
        path=path, needed=outcome.disk_needed, free=outcome.disk_free, after_seconds=pause, budget=outcome.disk_budget,
    )
