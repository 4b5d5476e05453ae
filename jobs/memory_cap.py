"""The runner's one view of device memory, whichever way its capacity is set.

- No cap: the real device; peaks from torch.cuda where there is CUDA.
- A cap on a CUDA machine: a per-process memory fraction, so the OOMs are PyTorch's own.
- A cap without CUDA: the emulated device, which counts real tensors and raises PyTorch's OOM.

A cap is a CapSchedule, so it may change at given steps (another process taking memory).
On an emulated GPU (jobs/emulated_gpus.py) the capacity is the card's total less what the
other processes on it hold, read at every step; the runner publishes what it holds itself.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping

import torch

from oomguard.jobs.device_memory import EmulatedDevice, limit_cuda_memory
from oomguard.jobs.emulated_gpus import AssignedGpu, emulated_capacity
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
        gpu: AssignedGpu | None = None,
    ) -> None:
        self.schedule = schedule
        self.device = device
        self.emulated: EmulatedDevice | None = None
        # The cap now in force on a real GPU (set_per_process_memory_fraction), if any.
        self.limit: int | None = None
        # An emulated GPU shared with other processes (only without CUDA: a real card is real).
        self.gpu = gpu if device.type != "cuda" else None
        # The least the other processes on the GPU held at a step start in this process: the
        # baseline a neighbour's growth is measured from. Taken from the third step start on:
        # on a real GPU this process's own memory outside the caching allocator (the CUDA
        # context, library workspaces) appears during its first steps and would read as growth.
        self.others_before: int | None = None
        self._step_starts = 0
        self._published: int | None = None
        self._published_at = 0.0
        if (schedule is not None or self.gpu is not None) and device.type != "cuda":
            index = self.gpu.index if self.gpu is not None else 0
            self.emulated = EmulatedDevice(capacity=self._emulated_limit(0), device_index=index, groups=groups)

    def __enter__(self) -> DeviceMemory:
        if self.emulated is not None:
            self.emulated.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.emulated is not None:
            self.emulated.__exit__(*exc_info)

    def _emulated_limit(self, step: int) -> int | None:
        return emulated_capacity(self.schedule, self.gpu, step)

    def begin_step(self, step: int) -> None:
        """Apply the capacity for ``step`` (the schedule's, and the emulated GPU's room now)."""
        self._step_starts += 1
        others = self.others_bytes() if self._step_starts > 2 else None
        if others is not None:
            self.others_before = others if self.others_before is None else min(self.others_before, others)
        if self.emulated is not None:
            self.emulated.capacity = self._emulated_limit(step)
            return
        if self.schedule is None:
            return
        limit = self.schedule.limit_at(step)
        self.limit = limit
        if limit is not None:
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

    def others_bytes(self) -> int | None:
        """What the other processes on this GPU hold now (None: not known here)."""
        if self.gpu is not None:
            return self.gpu.folder.used_by_others(self.gpu.index, os.getpid())
        if self.device.type == "cuda":
            # Everything on the card that is not in our caching allocator (our CUDA context
            # counts too, but it does not grow, and growth is what matters).
            free, total = torch.cuda.mem_get_info(self.device)
            return total - free - torch.cuda.memory_reserved(self.device)
        return None

    def publish(self, *, force: bool = False) -> None:
        """Tell the emulated GPU what this process holds: the last step's peak, as a caching
        allocator keeps it reserved. Written when it changes, at most twice a second."""
        if self.gpu is None or self.emulated is None:
            return
        held = self.emulated.peak_bytes
        now = time.monotonic()
        if held != self._published and (force or now - self._published_at >= 0.5):
            self.gpu.folder.publish(self.gpu.index, os.getpid(), held, "runner")
            self._published, self._published_at = held, now

    def withdraw(self) -> None:
        if self.gpu is not None:
            self.gpu.folder.withdraw(self.gpu.index, os.getpid())

    def oom_figures(self, message: str) -> MemoryFigures:
        """The memory figures of the OOM that just happened."""
        others = {"others_before": self.others_before, "others_at_oom": self.others_bytes()}
        if self.emulated is not None and self.emulated.last_oom is not None:
            info = self.emulated.last_oom
            return MemoryFigures(
                requested=info.requested,
                allocated=info.allocated,
                reserved=info.reserved,
                free=info.free,
                total=info.total,
                breakdown=dict(info.breakdown),
                **others,
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
                **others,
            )
        return MemoryFigures(requested=requested_bytes(message), **others)

