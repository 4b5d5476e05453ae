"""The figures of an out-of-memory message: every size it prints, in bytes, by the allocator that wrote it.

PyTorch's caching allocator (CUDA, HIP, XPU; both wordings), its cudaMallocAsync backend, its warning on a failed
allocation, MPS, XLA, and the host-side messages that name a request. Each ``*_figures`` function returns an
``OomVerdict`` whose kind is still to be judged (strategies/oom_judge.py). ``requested_bytes`` is the one reader of
"Tried to allocate X": the runner (jobs/memory_cap.py) reads its own OOM's request with it too.

Units: c10 prints KiB/MiB/GiB (powers of 1024) rounded to two decimals, so byte counts read back are within 0.005 of
a unit. PyTorch's MPS allocator labelled its 1024-based figures "KB/MB/GB" before it switched to KiB/MiB/GiB, so in
an MPS message GB means 2**30; elsewhere KB/MB/GB are powers of 1000 (strategies/units.py, ``printed_size_bytes``).
"""

from __future__ import annotations

import re

from oomguard.strategies.oom_verdict import OomVerdict
from oomguard.strategies.units import GiB, PRINTED_NUMBER, PRINTED_SIZE, PRINTED_UNIT, printed_size_bytes


def _size(pattern: re.Pattern[str], text: str, *, binary_kb: bool = False) -> int | None:
    match = pattern.search(text)
    if match is None:
        return None
    return printed_size_bytes(match.group("n"), match.group("u"), binary_kb=binary_kb)


def _sized(before: str, after: str = "") -> re.Pattern[str]:
    """A pattern for a size between two phrases, with the number and unit named n and u."""
    return re.compile(before + rf"(?P<n>{PRINTED_NUMBER})\s*(?P<u>{PRINTED_UNIT})\b" + after, re.IGNORECASE)


# PyTorch's caching allocator, both wordings (c10/cuda/CUDACachingAllocator.cpp; HIP and XPU
# copy it). New (>= 2.1): "Tried to allocate X. GPU 0 has a total capacity of T of which F is
# free. [Process P has U memory in use. ...] [Including non-PyTorch memory, this process has U
# memory in use.] [A allowed; ]Of the allocated memory A is allocated by PyTorch, [with P
# allocated in private pools (e.g., CUDA Graphs), ]and R is reserved by PyTorch but unallocated."
# Old: "Tried to allocate X (GPU 0; T total capacity; A already allocated; F free; [C allowed; ]
# R reserved in total by PyTorch)", before 1.4 "... F free; C cached)".
_REQUESTED = _sized(r"Tried to allocate ")
_TOTAL_NEW = _sized(r"has a total capac(?:i)?ty of ")  # "capacty": a typo some versions printed
_GPU_NEW = re.compile(r"\bGPU\s+(\d+) has a total capac", re.IGNORECASE)
_FREE_NEW = _sized(r"of which ", r" is free")
_PROCESS = re.compile(r"Process (\d+) has " + PRINTED_SIZE + r" memory in use")
_THIS_PROCESS = _sized(r"this process has ", r" memory in use")
_ALLOWED = _sized(r"", r" allowed;")
_ALLOCATED_NEW = _sized(r"Of the allocated memory ", r" is allocated by PyTorch")
_PRIVATE_POOLS = _sized(r"with ", r" allocated in private pools")
_UNALLOCATED_NEW = _sized(r"and ", r" is reserved by PyTorch but unallocated")
_OLD_PARENS = re.compile(r"\(GPU\s+(\d+);([^)]*)\)")
_TOTAL_OLD = _sized(r"", r" total capac(?:i)?ty")
_ALLOCATED_OLD = _sized(r"", r" already allocated")
_FREE_OLD = _sized(r"", r" free\b")
_RESERVED_OLD = _sized(r"", r" reserved in total by PyTorch")
_CACHED_OLD = _sized(r"", r" cached")
# MPS (aten/src/ATen/mps/MPSAllocator.mm): "MPS backend out of memory (MPS allocated: A, other
# allocations: O[, max allowed: M]). Tried to allocate X on private pool."
_MPS_ALLOCATED = _sized(r"MPS allocated: ")
_MPS_OTHER = _sized(r"other allocations: ")
_MPS_ALLOWED = _sized(r"max allowed: ")
# jax/XLA: "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 7406166528 bytes." or
# "Failed to allocate request for 2.99GiB (3206250496B) on device ordinal 0".
_XLA_EXACT = re.compile(r"\((\d+)B\)")
_XLA_REQUEST = _sized(r"(?:trying to allocate|allocating|allocate request for) ")
_XLA_ORDINAL = re.compile(r"device ordinal (\d+)")
# PyTorch's cudaMallocAsync backend (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync,
# c10/cuda/CUDAMallocAsyncAllocator.cpp, mallocAsync), one figure a line: "Allocation on device 0 would exceed allowed
# memory. (out of memory)\nCurrently allocated     : A\nRequested               : X\nDevice limit            : T\n
# Free (according to CUDA): F\nPyTorch limit (set by user-supplied memory fraction)\n                        : L".
ASYNC = re.compile(r"Allocation on device (\d+) would exceed allowed memory")
_ASYNC_ALLOCATED = _sized(r"Currently allocated\s*:\s*")
_ASYNC_REQUESTED = _sized(r"\bRequested\s*:\s*")
_ASYNC_TOTAL = _sized(r"Device limit\s*:\s*")
_ASYNC_FREE = _sized(r"Free \(according to \w+\)\s*:\s*")
_ASYNC_LIMIT = _sized(r"PyTorch limit[^:]*:\s*")
# The caching allocator's warning on every failed cudaMalloc (torch 2.13, c10 LOG(WARNING), pytorch#180946), and its
# expandable-segments form (cuMemCreate failed): "memory allocation failed with OOM on device 1 while trying to allocate
# 20971520 bytes (free: 15794176, total: 150111977472)." / "expandable_segments: memory mapping failed with OOM on device 0
# while trying to map 20971520 bytes (free: 5832704, total: 101975851008)".
ALLOC_WARNING = re.compile(
    r"memory (?:allocation|mapping) failed with OOM on device (\d+) while trying to (?:allocate|map) (\d+) bytes "
    r"\(free: (\d+), total: (\d+)\)"
)
_HOST_REQUEST = re.compile(r"you tried to allocate (\d+) bytes")
_NUMPY_REQUEST = _sized(r"Unable to allocate ", r" for an array")
_NCCL_CALLOC = re.compile(r"Failed to CUDA calloc (\d+) bytes")


def caching_allocator_figures(text: str, device: str | None) -> tuple[OomVerdict, list[str]]:
    """The figures of a caching-allocator message (kind still to be judged), and notes for the reason."""
    notes: list[str] = []
    requested = requested_bytes(text)
    old = _OLD_PARENS.search(text)
    if old is not None:
        parts = old.group(2)
        allocated = _size(_ALLOCATED_OLD, parts)
        reserved = _size(_RESERVED_OLD, parts)
        unallocated = _size(_CACHED_OLD, parts)  # before 1.4 "cached" was reserved minus allocated
        if unallocated is None and reserved is not None and allocated is not None and reserved >= allocated:
            unallocated = reserved - allocated
        return OomVerdict(
            kind="oom", device=device, gpu_index=int(old.group(1)), requested=requested, total=_size(_TOTAL_OLD, parts),
            free=_size(_FREE_OLD, parts), allocated=allocated, reserved_unallocated=unallocated,
            allowed=_size(_ALLOWED, parts + ";"), message=text,
        ), notes
    gpu = _GPU_NEW.search(text)
    total = _size(_TOTAL_NEW, text)
    allocated = _size(_ALLOCATED_NEW, text)
    unallocated = _size(_UNALLOCATED_NEW, text)
    this = _size(_THIS_PROCESS, text)
    others = {int(m.group(1)): printed_size_bytes(m.group(2), m.group(3)) for m in _PROCESS.finditer(text)}
    # NVML answers "not available" on some systems (Windows under WDDM) and PyTorch prints it
    # as 16 EiB; a figure larger than the device is no figure.
    if total is not None:
        if this is not None and this > total:
            notes.append("the per-process figures are not usable (larger than the device)")
            this = None
        others = {pid: used for pid, used in others.items() if used <= total}
    if this is None and others and allocated is not None and unallocated is not None:
        pid = _own_entry(others, allocated + unallocated)
        if pid is not None:
            this = others.pop(pid)
            notes.append(f"process {pid} taken to be this one (its pid differs in a container)")
    return OomVerdict(
        kind="oom", device=device, gpu_index=int(gpu.group(1)) if gpu else None, requested=requested, total=total,
        free=_size(_FREE_NEW, text), allocated=allocated, reserved_unallocated=unallocated, process_in_use=this,
        other_processes=others, allowed=_size(_ALLOWED, text), private_pools=_size(_PRIVATE_POOLS, text), message=text,
    ), notes


def _own_entry(processes: dict[int, int], reserved: int) -> int | None:
    """The listed process that is this one: in use at or a little above PyTorch's reserved bytes
    (its CUDA context and non-PyTorch memory come on top)."""
    close = {pid: used - reserved for pid, used in processes.items() if 0 <= used - reserved <= max(2 * GiB, reserved // 4)}
    return min(close, key=lambda pid: close[pid]) if close else None


def mps_figures(text: str) -> OomVerdict:
    allocated = _size(_MPS_ALLOCATED, text, binary_kb=True)
    other = _size(_MPS_OTHER, text, binary_kb=True)
    return OomVerdict(
        kind="oom",
        device="mps",
        requested=requested_bytes(text, binary_kb=True),
        allocated=allocated,
        process_in_use=allocated + other if allocated is not None and other is not None else None,
        allowed=_size(_MPS_ALLOWED, text, binary_kb=True),
        message=text,
    )


def async_figures(text: str, device: str) -> OomVerdict:
    gpu = ASYNC.search(text)
    return OomVerdict(
        kind="oom", device=device, gpu_index=int(gpu.group(1)) if gpu else None, requested=_size(_ASYNC_REQUESTED, text),
        total=_size(_ASYNC_TOTAL, text), free=_size(_ASYNC_FREE, text), allocated=_size(_ASYNC_ALLOCATED, text),
        allowed=_size(_ASYNC_LIMIT, text), message=text,
    )


def warning_figures(text: str) -> OomVerdict:
    """The figures of the caching allocator's warning on a failed allocation (a line ``ALLOC_WARNING`` matches)."""
    gpu, requested, free, total = (int(n) for n in ALLOC_WARNING.search(text).groups())  # type: ignore[union-attr]
    return OomVerdict(kind="oom", device="cuda", gpu_index=gpu, requested=requested, free=free, total=total, message=text)


def xla_figures(text: str) -> OomVerdict:
    exact = _XLA_EXACT.search(text)
    ordinal = _XLA_ORDINAL.search(text)
    return OomVerdict(
        kind="oom",
        device="xla",
        requested=int(exact.group(1)) if exact else _size(_XLA_REQUEST, text),
        gpu_index=int(ordinal.group(1)) if ordinal else None,
        message=text,
    )


# Failed requests -------------------------------------------------------------------------------


def requested_bytes(text: str, *, binary_kb: bool = False) -> int | None:
    """The failed request of an allocator's OOM message ("Tried to allocate 20.00 MiB"), None when it names none.
    ``binary_kb``: "KB/MB/GB" are powers of 1024 (PyTorch's MPS allocator)."""
    return _size(_REQUESTED, text, binary_kb=binary_kb)


def host_requested(text: str) -> int | None:
    """The failed request of a host OOM: PyTorch's CPU allocator's bytes, or numpy's array size."""
    requested = _HOST_REQUEST.search(text)
    return int(requested.group(1)) if requested else _size(_NUMPY_REQUEST, text)


def nccl_requested(text: str) -> int | None:
    """The bytes NCCL failed to allocate ("Failed to CUDA calloc N bytes"), when it says."""
    calloc = _NCCL_CALLOC.search(text)
    return int(calloc.group(1)) if calloc else None
