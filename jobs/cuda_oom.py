"""The CUDA caching allocator's out-of-memory error as PyTorch words it (``cuda_oom_message``),
and what the emulated device knew when it raised one (``OOMInfo``): the emulated OOM must read
like a real one, so that the shim, `diagnose` and the doctor see what they would on a card."""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.strategies.units import format_torch_size

__all__ = ["OOMInfo", "cuda_oom_message"]


@dataclass(frozen=True)
class OOMInfo:
    """What the emulated allocator knew when it refused an allocation (all bytes)."""

    requested: int
    allocated: int
    reserved: int
    free: int
    total: int
    breakdown: dict[str, int]
    message: str
    # The caching allocator's num_alloc_retries and num_ooms when it refused, as
    # torch.cuda.memory_stats names them (None: the exact emulation).
    alloc_stats: dict[str, int] | None = None


def cuda_oom_message(
    requested: int, total: int, free: int, allocated: int, reserved: int, device_index: int = 0,
    in_use: int | None = None, allowed: int | None = None,
) -> str:
    """The text of the CUDA caching allocator's OOM error (c10/cuda/CUDACachingAllocator.cpp).

    Reproduces the PyTorch 2.x wording with no CUDA-graph private pools and this process as
    the only GPU user, so that the NVML process line reads "Including non-PyTorch memory,
    this process has ...": ``in_use`` (reserved plus the process's non-PyTorch memory;
    ``reserved`` when None). ``allowed``: the per-process limit that
    set_per_process_memory_fraction set, printed as "X allowed; " where PyTorch prints it.
    ``requested`` is what PyTorch prints there: the size it asked the card for (the segment,
    ``get_allocation_size``), not the tensor's. The double spaces are PyTorch's. Template read
    in c10/cuda/CUDACachingAllocator.cpp at pytorch/pytorch 001074d2 (the ``allowed_info``
    part follows ``proc_info``).
    """
    allowed_part = f"{format_torch_size(allowed)} allowed; " if allowed is not None else ""
    return (
        f"CUDA out of memory. Tried to allocate {format_torch_size(requested)}. "
        f"GPU {device_index} has a total capacity of {format_torch_size(total)} "
        f"of which {format_torch_size(free)} is free. "
        f"Including non-PyTorch memory, this process has {format_torch_size(reserved if in_use is None else in_use)} memory in use. "
        f"{allowed_part}Of the allocated memory {format_torch_size(allocated)} is allocated by PyTorch, "
        f"and {format_torch_size(reserved - allocated)} is reserved by PyTorch but unallocated."
        " If reserved but unallocated memory is large try setting"
        " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid"
        " fragmentation.  See documentation for Memory Management "
        " (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )
