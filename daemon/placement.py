"""Where a job runs: which GPUs, or why it must wait.

A job gets GPUs to itself unless it allows sharing (``resources.share``); then it may join
other sharing jobs on a GPU that has the memory it needs free. A job whose memory need is not
known yet (never ran, no ``resources.memory``) needs a GPU that is nearly empty: it is about to
measure what it needs, and a neighbour's leftovers would make it measure too little.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.daemon.gpus import GpuState
from oomguard.jobs.device import DeviceSpec
from oomguard.strategies.units import format_bytes

# A job with an unknown need starts only on a GPU with at least this share of it free.
UNKNOWN_NEED_FREE_SHARE = 0.9


@dataclass(frozen=True)
class Need:
    gpus: int
    share: bool
    # Device memory the job needs free on each GPU (None: not known yet).
    free_bytes: int | None


@dataclass(frozen=True)
class Holder:
    """A running oomguard attempt on a GPU."""

    job_id: int
    share: bool
    # What it expects to need on the GPU, and what its processes hold there now: memory it
    # is about to take is not free for another job.
    need_bytes: int | None = None
    used_bytes: int = 0


@dataclass(frozen=True)
class Placed:
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """Where the scheduler starts an attempt: its GPUs (None: a daemon without GPUs to place
    by) and the device it trains on there (the real card, or an emulated capacity). The job's
    record knows neither: both are decided when the attempt starts."""

    gpus: tuple[int, ...] | None
    device: DeviceSpec


@dataclass(frozen=True)
class Waiting:
    reason: str
    # Its waiting event's code: "too_few_gpus" (the box has fewer than the job asks for) or
    # "no_room" (not enough free GPUs now).
    code: str = "no_room"


def place(need: Need, gpus: list[GpuState], holders: dict[int, list[Holder]]) -> Placed | Waiting:
    """The GPUs for ``need`` now, or why there are none."""
    if need.gpus > len(gpus):
        return Waiting(f"needs {need.gpus} GPUs; this box has {len(gpus)} (lower resources.gpus)", code="too_few_gpus")
    fitting: list[GpuState] = []
    refusals: list[str] = []
    for gpu in gpus:
        problem = _refusal(need, gpu, holders.get(gpu.index, []))
        if problem is None:
            fitting.append(gpu)
        else:
            refusals.append(f"GPU {gpu.index} {problem}")
    if len(fitting) < need.gpus:
        wanted = f"{need.gpus} GPU" + ("s" if need.gpus > 1 else "")
        return Waiting(f"needs {wanted}: " + "; ".join(refusals))
    # Sharing jobs fill the fullest GPU that still fits (whole GPUs stay free for the
    # exclusive ones); exclusive jobs take the emptiest.
    fitting.sort(key=lambda g: (g.free, g.index) if need.share else (-g.free, g.index))
    return Placed(tuple(sorted(g.index for g in fitting[: need.gpus])))


def _refusal(need: Need, gpu: GpuState, holders: list[Holder]) -> str | None:
    # Sharing takes a known need on both sides: a holder that is still measuring its need
    # must not measure with a neighbour beside it.
    if holders and not (need.share and need.free_bytes is not None and all(h.share and h.need_bytes is not None for h in holders)):
        jobs = ", ".join(str(h.job_id) for h in holders)
        return f"is taken by job {jobs}"
    promised = sum(max(0, (h.need_bytes or 0) - h.used_bytes) for h in holders)
    available = gpu.free - promised
    if need.free_bytes is not None:
        if available < need.free_bytes:
            held = f" ({format_bytes(promised)} of it promised to jobs starting there)" if promised else ""
            return f"has {format_bytes(gpu.free)} free of {format_bytes(gpu.total)}{held}, the job needs {format_bytes(need.free_bytes)}"
        return None
    if gpu.free < UNKNOWN_NEED_FREE_SHARE * gpu.total:
        return (
            f"has {format_bytes(gpu.free)} free of {format_bytes(gpu.total)}; the job's need is not known yet, so it waits "
            f"for {int(UNKNOWN_NEED_FREE_SHARE * 100)}% free (set resources.memory to place it sooner)"
        )
    return None
