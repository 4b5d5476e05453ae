"""After a step ran out of memory, what the training loop and the probe both do: give memory
back (``free``), judge whether the process is fit to go on (``unfit_to_continue``), record the
OOM for the memory model (``oom_measurement``), and agree on it across the ranks
(``agreed_oom``, ``RankAlone``)."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING


from oomguard.jobs.memory_cap import DeviceMemory
from oomguard.jobs.rank_group import RankGroup
from oomguard.strategies.memory_model import Measurement
from oomguard.strategies.outcome import MemoryFigures, Outcome
from oomguard.strategies.plan import Plan

if TYPE_CHECKING:
    from oomguard.jobs.training import Training


def oom_measurement(plan: Plan, figures: MemoryFigures, training: Training | None, step: int) -> Measurement:
    """An OOM of the runner, with the static bytes of its training when it had one."""
    return figures.measurement(plan, step, training.static_bytes() if training is not None else None)


def free(memory: DeviceMemory, training: Training | None = None) -> None:
    """Give memory back after an OOM or a probe: drop gradients, collect cycles, and return
    cached blocks to the device. Called outside any except block, so that the traceback and
    the tensors it holds are gone already."""
    if training is not None:
        training.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    memory.empty_cache()


# Bytes a failed step may leave on the device, as a share of the capacity, before the process
# counts as unfit to go on in. An OOM inside backward can leave part of the autograd graph's
# buffers alive with no Python object holding them (pytorch/pytorch#82218; measured here with
# gradient checkpointing: 0.4-1.0 MiB of a 1.6 MiB device, for good): training on in that
# process would run out again, so a new process takes over from the emergency checkpoint.
LEFTOVER_TOLERANCE = 0.01


def leftover_bytes(memory: DeviceMemory, baseline: int) -> int:
    """Bytes on the device beyond ``baseline`` (what should be there) after ``free``."""
    live = memory.live_bytes()
    return 0 if live is None else max(0, live - baseline)


def unfit_to_continue(memory: DeviceMemory, baseline: int) -> int | None:
    """The bytes a failed step left behind when they are too many to keep training in this
    process (None when the process is clean enough)."""
    capacity = memory.capacity()
    leftover = leftover_bytes(memory, baseline)
    if capacity is None or leftover <= LEFTOVER_TOLERANCE * capacity:
        return None
    return leftover


# Where an OOM leaves the training as it was before the step (nothing applied): the process may
# go on. One in optimizer.step may have updated some weights: the last checkpoint stands.
IN_PROCESS_PHASES = ("data", "forward", "backward")


class RankAlone(Exception):
    """This rank ran out of memory where the other ranks cannot learn of it (inside a sharded
    model's collectives): it ends alone, and jobs/ranks.py stops the others. Holds the Outcome."""

    def __init__(self, outcome: Outcome, measurements: tuple[Measurement, ...] = ()) -> None:
        super().__init__(outcome.message)
        self.outcome = outcome
        # What was measured up to it (the probe's plans), for the attempt's outcome.
        self.measurements = measurements


def agreed_oom(ranks: RankGroup, sharded: bool, oom: Outcome | None) -> Outcome | None:
    """Every rank's view of a step that failed on this rank (``oom``) or on another (None here,
    PeerOutOfMemory raised): the OOM of the lowest rank that had one, the same on every rank.
    A sharded model's OOM cannot be agreed on (RankAlone). A single process's is its own."""
    if ranks.solo:
        return oom
    if oom is not None:
        if sharded:
            raise RankAlone(oom)
        ranks.join_failed(before_average=oom.phase != "optimizer")
    first = ranks.first(oom.to_dict() if oom is not None else None)
    return Outcome.from_dict(first) if first is not None else None
