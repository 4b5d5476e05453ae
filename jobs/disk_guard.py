"""The runner's writes against a full disk: before a checkpoint (or the final model) is written,
the room it needs is checked; a write that runs out of room anyway is cleaned up and reported
as DiskFull, which ends the attempt "disk_full" (jobs/loop.py) instead of a crash.

What a checkpoint needs is the newest checkpoint's size as its manifest records it (the next one
holds the same tensors), else the bytes of the state about to be saved; plus a reserve
(disk_space.with_reserve). The last verified checkpoint is never touched here: checkpoints.save
prunes only after a new one verifies, and a failed write removes only its own partial folder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from oomguard.jobs import checkpoints
from oomguard.jobs.checkpoint_budget import within_budget
from oomguard.jobs.disk_space import RESERVE_MIN_BYTES, DiskFull, free_bytes, is_disk_full, room, with_reserve
from oomguard.jobs.training import Training
from oomguard.strategies.outcome import Outcome

# Pickling, the scheduler, RNG and trainer-state files beside the tensors of a checkpoint.
SMALL_FILES_BYTES = 64 * 1024


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def state_bytes(training: Training) -> int:
    """The bytes a checkpoint of ``training`` writes: its weights (adapters and EMA too) and the
    optimizer's state tensors, and the small files beside them."""
    weights = training.weights()
    total = _tensor_bytes(weights.base.values()) + _tensor_bytes((weights.adapters or {}).values()) + _tensor_bytes((weights.ema or {}).values())
    for state in training.optimizer.state.values():
        total += _tensor_bytes(state.values())
    return total + SMALL_FILES_BYTES


def checkpoint_bytes(checkpoints_dir: Path, training: Training) -> int:
    """The bytes the next checkpoint will take: the newest one's, as its manifest records them,
    else those of the state about to be saved."""
    measured = room(checkpoints_dir)
    recorded = checkpoints.recorded_bytes(checkpoints_dir, measured.block if measured is not None else 4096)
    return recorded if recorded is not None else state_bytes(training)


def checkpoint_need(
    checkpoints_dir: Path, training: Training, budget: int | None = None, keep_every: int | None = None, say: Callable[[str], None] = print,
) -> int:
    """The free bytes the next checkpoint needs, its reserve included, once it fits the job's
    disk budget (``budget``; DiskFull when it cannot: jobs/checkpoint_budget.py)."""
    size = checkpoint_bytes(checkpoints_dir, training)
    within_budget(checkpoints_dir, size, budget, keep_every, say)
    return with_reserve(size)


def final_need(training: Training) -> int:
    """The free bytes the final model needs: about its trained weights (no optimizer state),
    and the reserve."""
    return with_reserve(_tensor_bytes(training.weights().base.values()) + SMALL_FILES_BYTES)


@contextmanager
def room_for(path: Path, need: int, what: str) -> Iterator[None]:
    """Check that ``need`` bytes are free at ``path`` before a write, and turn the write's
    running out of room into DiskFull (the write removes its own partial files: checkpoints.save,
    loop._save_final). The job then waits for ``need``, or for more than the write had written
    when it failed, when that was more (the estimate was short): not for more than was free
    when it began, since what filled the disk may be someone else's, gone once they clean up."""
    before = free_bytes(path)
    if before is not None and before < need:
        raise DiskFull(path, need, before, what)
    try:
        yield
    except Exception as error:
        if not (isinstance(error, DiskFull) or is_disk_full(error)):
            raise
        written = error.written if isinstance(error, DiskFull) else 0
        raise DiskFull(path, max(need, with_reserve(written)), free_bytes(path), what) from error


def as_disk_full(error: Exception, path: Path) -> Exception:
    """``error`` of a write into ``path`` as DiskFull when the disk is what failed it: torch.save
    says "unexpected pos 576 vs 534" of a full disk, not ENOSPC, so a failure while less than
    RESERVE_MIN_BYTES are left counts too (read before the partial write is removed)."""
    if isinstance(error, DiskFull):
        return error
    left = free_bytes(path)
    if is_disk_full(error) or (left is not None and left < RESERVE_MIN_BYTES):
        return DiskFull(path, None, left, "a write", written=_bytes_in(path))
    return error


def _bytes_in(folder: Path) -> int:
    """The bytes of the files under ``folder`` (a partial write, before it is removed)."""
    try:
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    except OSError:
        return 0


def disk_full_outcome(full: DiskFull, step: int) -> Outcome:
    """How the attempt ended, at ``step`` (the next attempt goes on from the last verified
    checkpoint, which the outcome's resumed_from and the checkpoints folder name)."""
    return Outcome(
        kind="disk_full", step=step, phase="checkpoint", message=str(full), disk_path=full.path, disk_needed=full.needed, disk_free=full.free,
        disk_budget=full.budget,
    )


def writing_into(write: Callable[[Path], None]) -> Callable[[Path], None]:
    """``write`` (of a checkpoint's files into a folder) whose running out of room is DiskFull,
    judged before checkpoints.save removes the partial folder."""

    def guarded(directory: Path) -> None:
        full: Exception | None = None
        try:
            write(directory)
        except Exception as error:
            full = as_disk_full(error, directory)
            if full is error:
                raise
        if full is not None:
            # Raised outside the except block, without the write's error as its context: that
            # error's frames hold torch's writer, whose open file keeps the partial write's
            # bytes on the disk until it is collected, and the job would wait for them too.
            raise full

    return guarded


def unplanned_disk_full(error: OSError, attempt_dir: Path, checkpoints_dir: Path) -> DiskFull:
    """A write outside a checkpoint (the metrics, the heartbeat) that found no room: the job
    waits for room for its next checkpoint, which it must write to go on."""
    path = Path(error.filename) if isinstance(error.filename, str) else attempt_dir
    recorded = checkpoints.recorded_bytes(checkpoints_dir)
    return DiskFull(path, with_reserve(recorded or 0), free_bytes(path), "the attempt's reports")
