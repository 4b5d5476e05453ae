"""Judging a device OOM from its figures: fragmentation, a per-process cap, other processes, or plain.

The figures come from strategies/oom_figures.py; the rules (and why) are in strategies/oom_text.py's
docstring. ``is_fragmentation`` is also the doctor's test on the runner's own figures: one rule for
both, so that ``oomguard diagnose`` and the ladder never disagree about what fragmentation is.
Whether other processes crowded this one out is strategies/contention.py's decision.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from oomguard.strategies.contention import driver_slack, others_hold_more
from oomguard.strategies.oom_figures import (
    ASYNC,
    async_figures,
    caching_allocator_figures,
    mps_figures,
    warning_figures,
    xla_figures,
)
from oomguard.strategies.oom_verdict import OomVerdict
from oomguard.strategies.outcome import MemoryFigures
from oomguard.strategies.units import GiB, describe_size, format_bytes

_DEVICE_WORDS = {"cuda": "GPU", "hip": "GPU", "xpu": "GPU", "mps": "MPS device", "xla": "XLA device"}


def is_fragmentation(memory: MemoryFigures | None) -> bool:
    """The memory is there but in pieces, which expandable segments fix: reserved-but-
    unallocated memory at least as large as the failed request; or at least half of it while
    the allocator had to flush its cache to fit earlier requests during the attempt (cached
    blocks kept failing to fit them)."""
    if memory is None:
        return False
    return unallocated_fits_request(memory.requested, memory.reserved_unallocated, memory.alloc_retries)


def fragmentation_evidence(memory: MemoryFigures) -> str:
    """Which of ``is_fragmentation``'s rules held, in words."""
    unallocated = format_bytes(memory.reserved_unallocated)
    if (memory.reserved_unallocated or 0) >= (memory.requested or 0):
        return f"{unallocated} reserved but unallocated is at least the request"
    return (
        f"{unallocated} reserved but unallocated is at least half the request, and the allocator flushed its cache "
        f"{memory.alloc_retries} time(s) to fit earlier requests"
    )


def unallocated_fits_request(requested: int | None, unallocated: int | None, alloc_retries: int | None = None) -> bool:
    """``is_fragmentation`` on bare figures (an error message gives no retry count)."""
    if requested is None or unallocated is None or unallocated <= 0:
        return False
    if unallocated >= requested:
        return True
    return bool(alloc_retries) and 2 * unallocated >= requested


def device_verdict(device: str | None, text: str) -> OomVerdict:
    """The judged figures of a device OOM's message, by the allocator that wrote it (``device``: the one the
    message's shape names, None when only its words tell)."""
    if device == "mps":
        return judge(mps_figures(text))
    if device == "xla":
        return judge(xla_figures(text))
    # The caching allocator's wordings are CUDA's unless they name HIP or XPU (ROCm builds run the same code).
    device = device or _device_name(text)
    if ASYNC.search(text):
        return judge(async_figures(text, device or "cuda"))
    if "Tried to allocate" in text:
        return judge(*caching_allocator_figures(text, device or "cuda"))
    return judge(OomVerdict(kind="oom", device=device, message=text))


def warning_verdict(text: str) -> OomVerdict:
    """The verdict on a log that ends with the caching allocator's warning on a failed allocation."""
    v = warning_figures(text)
    return dataclasses.replace(
        v,
        reason=f"PyTorch's caching allocator warned that it could not get {describe_size(v.requested)} with "
        f"{describe_size(v.free)} free of {describe_size(v.total)} on GPU {v.gpu_index}, and the log ends there with no "
        "error after it (the process hung or was killed): the job needs less memory",
    )


def judge(v: OomVerdict, notes: Sequence[str] = ()) -> OomVerdict:
    """oom / oom_fragmentation / oom_other_process from the figures of a device OOM."""
    size = describe_size
    note = "".join(f"; {n}" for n in notes)
    device = _DEVICE_WORDS.get(v.device or "", "device")
    if unallocated_fits_request(v.requested, v.reserved_unallocated):
        return dataclasses.replace(
            v,
            kind="oom_fragmentation",
            reason=f"PyTorch held {size(v.reserved_unallocated)} reserved but unallocated, at least the {size(v.requested)} "
            f"it failed to allocate: the memory is there but in pieces, which expandable segments fix{note}",
        )
    capped = _cap_reason(v, device)
    if capped is not None:
        return dataclasses.replace(v, kind="oom", reason=capped + note)
    # This process: NVML's figure, or at least what PyTorch reserved.
    ours = v.process_in_use if v.process_in_use is not None else v.reserved
    unaccounted = _unaccounted(v, ours)
    crowded = _others_reason(v, device, ours, unaccounted)
    if crowded is not None:
        return dataclasses.replace(v, kind="oom_other_process", reason=crowded + note)
    if v.requested is None and v.total is None:
        return dataclasses.replace(v, kind="oom", reason=f"the {device} ran out of memory (the message gives no sizes){note}")
    return dataclasses.replace(v, kind="oom", reason=_plain_reason(v, device, ours, unaccounted) + note)


def _cap_reason(v: OomVerdict, device: str) -> str | None:
    """Why the per-process cap refused the request, when it did."""
    # c10 rounds to two decimals, so a request that meets the cap exactly was over it. The caching allocator counts
    # its reserved bytes against the cap, cudaMallocAsync its allocated bytes (it prints no reserved figure); a limit
    # that is the whole device (cudaMallocAsync prints one without a fraction) is no cap.
    counted = v.reserved if v.reserved is not None else v.allocated
    cap = v.allowed if v.allowed is not None and (v.total is None or v.allowed < v.total) else None
    if cap is None or counted is None or v.requested is None or counted + v.requested < cap:
        return None
    return (
        f"PyTorch's {describe_size(counted)} plus the {describe_size(v.requested)} requested reach the per-process limit "
        f"of {describe_size(v.allowed)} allowed (set_per_process_memory_fraction): the limit refused it, not a full {device}"
    )


def _unaccounted(v: OomVerdict, ours: int | None) -> int | None:
    """Device memory in use that neither this process (``ours``) nor a listed process accounts for."""
    if v.total is None or v.free is None or ours is None:
        return None
    return v.total - v.free - ours - sum(v.other_processes.values())


def _others_reason(v: OomVerdict, device: str, ours: int | None, unaccounted: int | None) -> str | None:
    """Why other processes are to blame, when they are: the listed ones, plus what is unaccounted for beyond the
    driver's slack when the message has per-process figures."""
    size = describe_size
    held = sum(v.other_processes.values())
    parts = [f"process {pid} {size(used)}" for pid, used in list(v.other_processes.items())[:3]]
    if v.process_in_use is not None and unaccounted is not None and v.total and unaccounted > driver_slack(v.total):
        held += unaccounted
        parts.append(f"{size(unaccounted)} not accounted for")
    if not others_hold_more(held, ours, v.free, v.requested):
        return None
    return (
        f"other processes held {size(held)} of the {size(v.total)} {device} ({', '.join(parts)}) while this "
        f"process held {size(ours)}: without them the {size(v.requested)} would have fit"
    )


def _plain_reason(v: OomVerdict, device: str, ours: int | None, unaccounted: int | None) -> str:
    """The reason of a plain OOM: what was asked for and what there was."""
    size = describe_size
    reason = f"tried to allocate {size(v.requested)} with {size(v.free)} free of {size(v.total)}"
    if v.process_in_use is not None:
        reason += f" and {size(ours)} in use by this process"
    elif v.reserved is not None:
        reason += f" and {size(v.reserved)} reserved by PyTorch"
    elif v.allocated is not None:
        reason += f" and {size(v.allocated)} allocated by PyTorch"
    if v.allowed is not None:
        reason += f" ({size(v.allowed)} allowed)"
    reason += ": the job needs less memory"
    if v.process_in_use is None and unaccounted is not None and v.total and unaccounted > min(GiB, v.total // 4):
        reason += (
            f"; {size(unaccounted)} of the {device} is in use outside PyTorch's allocator (by another process, or "
            "non-PyTorch memory in this one: the message has no per-process figures to tell which)"
        )
    return reason


def _device_name(text: str) -> str | None:
    match = re.search(r"\b(CUDA|HIP|XPU)\b", text)
    return match.group(1).lower() if match else None
