"""The runner's one view of device memory, whichever way its capacity is set.

- No cap: the real device; peaks from torch.cuda where there is CUDA.
- A cap on a CUDA machine: a per-process memory fraction, so the OOMs are PyTorch's own.
- A cap without CUDA: the emulated device, which counts real tensors and raises PyTorch's OOM.

A cap is a CapSchedule, so it may change at given steps (another process taking memory).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Mapping

import torch

from oomguard.jobs.device_memory import EmulatedDevice, limit_cuda_memory
from oomguard.jobs.sizes import CapSchedule, parse_size
from oomguard.strategies.outcome import MemoryFigures

_REQUESTED = re.compile(r"Tried to allocate ([\d.]+ ?[KMGT]?i?B|\d+ bytes)")


def requested_bytes(message: str) -> int | None:
    """The failed request of a CUDA OOM message ("Tried to allocate 20.00 MiB")."""
    match = _REQUESTED.search(message)
    if not match:
        return None
    text = match.group(1).replace(" bytes", "B")
    return parse_size(text)


class DeviceMemory:
    def __init__(
        self,
        schedule: CapSchedule | None,
        device: torch.device,
        groups: Callable[[], Mapping[str, Iterable[torch.Tensor | None]]] | None = None,
    ) -> None:
        self.schedule = schedule
        self.device = device
        self.emulated: EmulatedDevice | None = None
        # The cap now in force on a real GPU (set_per_process_memory_fraction), if any.
        self.limit: int | None = None
        if schedule is not None and device.type != "cuda":
            self.emulated = EmulatedDevice(capacity=schedule.limit_at(0), groups=groups)

    def __enter__(self) -> DeviceMemory:
        if self.emulated is not None:
            self.emulated.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.emulated is not None:
            self.emulated.__exit__(*exc_info)

    def begin_step(self, step: int) -> None:
        """Apply the capacity the schedule gives for ``step``."""
        if self.schedule is None:
            return
        limit = self.schedule.limit_at(step)
        self.limit = limit
        if self.emulated is not None:
            self.emulated.capacity = limit
        elif limit is not None:
            limit_cuda_memory(limit, self.device.index or 0)
        else:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device.index or 0)

    def capacity(self) -> int | None:
        if self.emulated is not None:
            return self.emulated.capacity
        if self.device.type == "cuda":
            # What this process can have now: the free memory and what it holds already
            # (neighbours' memory is not ours to plan with), within the cap if one is set.
            free, _ = torch.cuda.mem_get_info(self.device)
            available = free + torch.cuda.memory_reserved(self.device)
            return min(available, self.limit) if self.limit is not None else available
        return None

    def track(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count tensors made outside the tracker (loaded checkpoints) as on the device."""
        if self.emulated is not None:
            self.emulated.track(t for t in tensors if t is not None)

    def move_in(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count tensors that the runner built on the host and just moved to the device; an
        OOM when they do not fit, as ``.to(device)`` raises on a GPU."""
        if self.emulated is not None:
            self.emulated.move_in(tensors)

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Host-side work (loading images, writing checkpoints) that a GPU run does off the card."""
        if self.emulated is not None:
            return self.emulated.paused()
        return contextlib.nullcontext()

    def live_bytes(self) -> int | None:
        if self.emulated is not None:
            return self.emulated.live_bytes
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return None

    def peak_bytes(self) -> int | None:
        if self.emulated is not None:
            return self.emulated.peak_bytes
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return None

    def reset_peak(self) -> None:
        if self.emulated is not None:
            self.emulated.reset_peak()
        elif self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def oom_figures(self, message: str) -> MemoryFigures:
        """The memory figures of the OOM that just happened."""
        if self.emulated is not None and self.emulated.last_oom is not None:
            info = self.emulated.last_oom
            return MemoryFigures(
                requested=info.requested,
                allocated=info.allocated,
                reserved=info.reserved,
                free=info.free,
                total=info.total,
                breakdown=dict(info.breakdown),
            )
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return MemoryFigures(
                requested=requested_bytes(message),
                allocated=torch.cuda.memory_allocated(self.device),
                reserved=torch.cuda.memory_reserved(self.device),
                free=free,
                total=self.capacity(),
                # Counted since the process started: the runner is one attempt.
                alloc_retries=torch.cuda.memory_stats(self.device).get("num_alloc_retries"),
            )
        return MemoryFigures(requested=requested_bytes(message))

