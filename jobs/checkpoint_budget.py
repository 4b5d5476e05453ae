"""A job's disk budget (``[resources] disk``): its checkpoints folder may not grow past it.

Before a checkpoint is written, the folder's bytes and the new checkpoint's must fit. When they
do not, the oldest checkpoints go first, down to what fits, but never the newest one that
verifies (the last good checkpoint is never deleted before a newer one verifies) nor one kept
for good (``train.keep_every_steps``): the budget is a hard cap, ``keep_checkpoints`` what to
keep within it. When even that is not enough, the checkpoint is treated like a full disk
(DiskFull with the budget): the job waits, with the same note and message, until someone makes
room in the folder (daemon/disk_wait.py measures it there). Torch-free.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from oomguard.jobs import checkpoints
from oomguard.jobs.disk_space import DiskFull, room
from oomguard.strategies.units import format_bytes


def within_budget(checkpoints_dir: Path, size: int, budget: int | None, keep_every: int | None, say: Callable[[str], None]) -> None:
    """Make room in the budget for a checkpoint of ``size`` bytes, or raise DiskFull."""
    if budget is None:
        return
    measured = room(checkpoints_dir)
    block = measured.block if measured is not None else 4096
    used = checkpoints.folder_bytes(checkpoints_dir, block)
    if used + size <= budget:
        return
    newest = checkpoints.latest_valid(checkpoints_dir, warn=say)
    for path in reversed(checkpoints.candidates(checkpoints_dir)):  # the oldest first
        if used + size <= budget:
            break
        if (newest is not None and path == newest.path) or checkpoints.kept_for_good(path, keep_every):
            continue
        taken = checkpoints.folder_bytes(path, block)
        shutil.rmtree(path, ignore_errors=True)
        used -= taken
        say(f"removed checkpoint {path.name} ({format_bytes(taken)}) to keep the checkpoints within the job's disk budget of {format_bytes(budget)}")
    if used + size > budget:
        raise DiskFull(
            checkpoints_dir, size, max(0, budget - used), "a checkpoint", budget=budget,
        )
