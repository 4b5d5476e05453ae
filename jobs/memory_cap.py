"""The runner's one view of device memory (``DeviceMemory``), opened from the attempt's
DeviceSpec by ``open_device_memory``. Three implementations:

- ``CudaMemory``: a real card; peaks from torch.cuda, and an emulated capacity becomes a
  per-process memory fraction, so the OOMs are PyTorch's own.
- ``EmulatedMemory``: no CUDA, but a capacity or an emulated GPU: the emulated device
  (jobs/device_memory.py) counts real tensors and raises PyTorch's OOM at the capacity.
- ``HostMemory``: no CUDA and nothing emulated: nothing to measure and no capacity.

A capacity is a CapSchedule, so it may change at given steps (another process taking memory).
On an emulated GPU (jobs/emulated_gpus.py) the capacity is the card's total less what the
other processes on it hold, read at every step; the runner publishes what it holds itself.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Mapping

import torch

from oomguard.jobs.device import DeviceSpec
from oomguard.jobs.device_memory import EmulatedDevice, limit_cuda_memory
from oomguard.jobs.emulated_allocator import AllocatorEmulation
from oomguard.jobs.emulated_gpus import AssignedGpu, emulated_capacity
from oomguard.jobs.sizes import CapSchedule
from oomguard.strategies.oom_figures import requested_bytes
from oomguard.strategies.outcome import MemoryFigures

GroupsFn = Callable[[], Mapping[str, Iterable[torch.Tensor | None]]]


def open_device_memory(spec: DeviceSpec, device: torch.device, groups: GroupsFn | None = None, gpu: AssignedGpu | None = None) -> DeviceMemory:
    """The device memory ``spec`` describes, on ``device``. ``groups`` names the tensors for
    an emulated OOM's breakdown; ``gpu`` is the emulated GPU the runner was placed on, if any
    (ignored on a CUDA machine: a real card is real, and so is its allocator)."""
    if device.type == "cuda":
        return CudaMemory(device, spec.emulated_capacity)
    if spec.emulated_capacity is not None or gpu is not None:
        return EmulatedMemory(spec.emulated_capacity, gpu, groups, spec.allocator)
    return HostMemory()


class DeviceMemory:
    """What the runner asks of device memory. Use as a context manager around training.

    The measuring methods answer None where nothing is known; ``track``, ``move_in``,
    ``paused``, ``publish`` and ``withdraw`` do nothing where there is nothing to count."""

    def __init__(self) -> None:
        # The least the other processes on the GPU held at a step start in this process: the
        # baseline a neighbour's growth is measured from. Taken from the third step start on:
        # on a real GPU this process's own memory outside the caching allocator (the CUDA
        # context, library workspaces) appears during its first steps and would read as growth.
        self.others_before: int | None = None
        self._step_starts = 0

    def __enter__(self) -> DeviceMemory:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def begin_step(self, step: int) -> None:
        """Apply the capacity for ``step`` (the schedule's, and the emulated GPU's room now)."""
        self._step_starts += 1
        others = self.others_bytes() if self._step_starts > 2 else None
        if others is not None:
            self.others_before = others if self.others_before is None else min(self.others_before, others)
        self._apply_capacity(step)

    def _apply_capacity(self, step: int) -> None:
        return None

    def capacity(self) -> int | None:
        return None

    def track(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count tensors made outside the tracker (loaded checkpoints) as on the device."""

    def move_in(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count tensors that the runner built on the host and just moved to the device; an
        OOM when they do not fit, as ``.to(device)`` raises on a GPU."""

    def move_out(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Stop counting tensors the runner moved back to the host."""

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of a device tensor, which the device no longer holds once ``tensor``
        dies (rung activation_offload). Here the device is the host: the tensor itself."""
        return tensor

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A host copy (``to_host``) back on ``device``."""
        return host

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Host-side work (loading images, writing checkpoints) that a GPU run does off the card."""
        return contextlib.nullcontext()

    def live_bytes(self) -> int | None:
        return None

    def peak_bytes(self) -> int | None:
        """The most bytes allocated since ``reset_peak`` (torch.cuda.max_memory_allocated)."""
        return None

    def peak_reserved(self) -> int | None:
        """The most bytes the allocator held from the card since ``reset_peak``
        (torch.cuda.max_memory_reserved): what a plan needs of a card. None: the same as
        ``peak_bytes`` (the exact emulation) or nothing known."""
        return None

    def reset_peak(self) -> None:
        return None

    def empty_cache(self) -> None:
        """Give the allocator's cached blocks back to the card (torch.cuda.empty_cache)."""

    def others_bytes(self) -> int | None:
        """What the other processes on this GPU hold now (None: not known here)."""
        return None

    def publish(self, *, force: bool = False) -> None:
        """Tell an emulated GPU what this process holds."""

    def withdraw(self) -> None:
        """Tell an emulated GPU this process holds nothing any more."""

    def oom_figures(self, message: str) -> MemoryFigures:
        """The memory figures of the OOM that just happened."""
        return MemoryFigures(requested=requested_bytes(message), **self._others())

    def _others(self) -> dict[str, int | None]:
        return {"others_before": self.others_before, "others_at_oom": self.others_bytes()}


def retries_that_fitted(stats: Mapping[str, int]) -> int | None:
    """How often the caching allocator flushed its cache and then fitted the request, from
    torch.cuda.memory_stats: ``num_alloc_retries`` counts every malloc that reached the flush,
    the ones that then ran out of memory too (c10 counts the retry before it knows), so each
    OOM is one of them (``num_ooms``)."""
    retries = stats.get("num_alloc_retries")
    return None if retries is None else max(retries - stats.get("num_ooms", 0), 0)


class HostMemory(DeviceMemory):
    """Training on the host with no capacity set: nothing to measure, nothing to refuse."""


class CudaMemory(DeviceMemory):
    """A real CUDA device, measured with torch.cuda; a capacity schedule caps it with a
    per-process memory fraction."""

    def __init__(self, device: torch.device, schedule: CapSchedule | None = None) -> None:
        super().__init__()
        self.device = device
        self.schedule = schedule
        # The cap now in force (set_per_process_memory_fraction), if any.
        self.limit: int | None = None

    def _apply_capacity(self, step: int) -> None:
        if self.schedule is None:
            return
        limit = self.schedule.limit_at(step)
        self.limit = limit
        if limit is not None:
            limit_cuda_memory(limit, self.device.index or 0)
        else:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device.index or 0)

    def capacity(self) -> int | None:
        # What this process can have now: the free memory and what it holds already
        # (neighbours' memory is not ours to plan with), within the cap if one is set.
        free, _ = torch.cuda.mem_get_info(self.device)
        available = free + torch.cuda.memory_reserved(self.device)
        return min(available, self.limit) if self.limit is not None else available

    def live_bytes(self) -> int | None:
        return torch.cuda.memory_allocated(self.device)

    def peak_bytes(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device)

    def peak_reserved(self) -> int | None:
        return torch.cuda.max_memory_reserved(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def others_bytes(self) -> int | None:
        # Everything on the card that is not in our caching allocator (our CUDA context
        # counts too, but it does not grow, and growth is what matters).
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free - torch.cuda.memory_reserved(self.device)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        # Pinned: the copies back can run without a staging buffer (as save_on_cpu does).
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
        host.copy_(tensor)
        return host

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host.to(device, non_blocking=True)

    def oom_figures(self, message: str) -> MemoryFigures:
        free, _ = torch.cuda.mem_get_info(self.device)
        return MemoryFigures(
            requested=requested_bytes(message),
            allocated=torch.cuda.memory_allocated(self.device),
            reserved=torch.cuda.memory_reserved(self.device),
            free=free,
            total=self.capacity(),
            # Counted since the process started: the runner is one attempt.
            alloc_retries=retries_that_fitted(torch.cuda.memory_stats(self.device)),
            **self._others(),
        )


class EmulatedMemory(DeviceMemory):
    """The emulated device: counts the live bytes of real tensors and raises PyTorch's OOM at
    the capacity, the schedule's within an emulated GPU's room (either may be None). With
    ``allocator`` (--emulate-allocator caching), PyTorch's caching allocator is emulated too:
    the capacity bounds what it reserves, and its non-PyTorch overhead takes room on a GPU."""

    def __init__(
        self, schedule: CapSchedule | None, gpu: AssignedGpu | None = None, groups: GroupsFn | None = None,
        allocator: AllocatorEmulation | None = None,
    ) -> None:
        super().__init__()
        self.schedule = schedule
        # An emulated GPU shared with other processes.
        self.gpu = gpu
        self._published: int | None = None
        self._published_at = 0.0
        index = gpu.index if gpu is not None else 0
        self.emulated = EmulatedDevice(capacity=None, device_index=index, groups=groups, allocator=allocator)
        self._apply_capacity(0)

    def __enter__(self) -> EmulatedMemory:
        self.emulated.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.emulated.__exit__(*exc_info)

    def _apply_capacity(self, step: int) -> None:
        overhead = self.emulated.overhead
        self.emulated.capacity = emulated_capacity(self.schedule, self.gpu, step, overhead)
        if self.gpu is not None and self.emulated.caching:
            self.emulated.card = self.gpu.card(os.getpid())

    def capacity(self) -> int | None:
        return self.emulated.capacity

    def track(self, tensors: Iterable[torch.Tensor | None]) -> None:
        self.emulated.track(t for t in tensors if t is not None)

    def move_in(self, tensors: Iterable[torch.Tensor | None]) -> None:
        self.emulated.move_in(tensors)

    def move_out(self, tensors: Iterable[torch.Tensor | None]) -> None:
        self.emulated.move_out(tensors)

    def paused(self) -> contextlib.AbstractContextManager[None]:
        return self.emulated.paused()

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        # The copy is made outside the count: it is host memory.
        with self.emulated.paused():
            return tensor.detach().clone()

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        # Counted: the copy coming back takes device memory again.
        return host.clone()

    def live_bytes(self) -> int | None:
        return self.emulated.live_bytes

    def peak_bytes(self) -> int | None:
        return self.emulated.peak_allocated_bytes

    def peak_reserved(self) -> int | None:
        return self.emulated.peak_reserved_bytes if self.emulated.caching else None

    def reset_peak(self) -> None:
        self.emulated.reset_peak()

    def empty_cache(self) -> None:
        self.emulated.empty_cache()

    def others_bytes(self) -> int | None:
        if self.gpu is None:
            return None
        return self.gpu.folder.used_by_others(self.gpu.index, os.getpid())

    def publish(self, *, force: bool = False) -> None:
        """Tell the emulated GPU what this process holds: the last step's peak, as a caching
        allocator keeps it reserved (with the caching allocator emulated: what it reserved at
        most, and the process's non-PyTorch memory). Written when it changes, at most twice a
        second."""
        if self.gpu is None:
            return
        held = self.emulated.peak_reserved_bytes + self.emulated.overhead
        now = time.monotonic()
        if held != self._published and (force or now - self._published_at >= 0.5):
            self.gpu.folder.publish(self.gpu.index, os.getpid(), held, "runner")
            self._published, self._published_at = held, now

    def withdraw(self) -> None:
        if self.gpu is not None:
            self.gpu.folder.withdraw(self.gpu.index, os.getpid())

    def oom_figures(self, message: str) -> MemoryFigures:
        info = self.emulated.last_oom
        if info is None:  # not the emulated device's refusal
            return super().oom_figures(message)
        return MemoryFigures(
            requested=info.requested,
            allocated=info.allocated,
            reserved=info.reserved,
            free=info.free,
            # What PyTorch could have had (as CudaMemory.capacity): the card less the
            # process's non-PyTorch memory, within the limit.
            total=self.capacity() if self.emulated.caching else info.total,
            breakdown=dict(info.breakdown),
            alloc_retries=retries_that_fitted(info.alloc_stats) if info.alloc_stats is not None else None,
            **self._others(),
        )
