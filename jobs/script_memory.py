"""Emulated device memory inside a user's script, without changing the script.

A command job's Python processes start with jobs/bootstrap/ first on PYTHONPATH; its
sitecustomize calls :func:`install_when_torch_loads` when a capacity is set. Torch's loading,
however the script or a library first finds it (jobs/bootstrap/oomguard_imports.py), then
also enters an :class:`EmulatedDevice` for the main thread, so the script's tensors (and the
weights it sends to its device) count against the capacity and running out raises PyTorch's
own ``torch.OutOfMemoryError`` with the CUDA allocator's wording, which the daemon reads from
the log as it reads a real one. Nothing of torch is imported before the script imports it.

The capacity follows the job's schedule (``64MiB,3MiB@5``) counted in the job's optimizer
steps, across attempts: the bootstrap's step reports (oomguard_progress.py) start from the step
the script resumed from. Within the emulated GPU's room when the process starts.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, NoReturn

from oomguard.jobs.device import DeviceSpec
from oomguard.jobs.emulated_gpus import AssignedGpu, emulated_capacity
from oomguard.jobs.sizes import CapSchedule

# The exit status of a process whose emulated capacity could not be applied (EX_SOFTWARE).
EXIT_NOT_APPLIED = 70

# Kept for the life of the process: the mode stays entered until the interpreter exits.
_DEVICE: list[Any] = []


def _schedule() -> CapSchedule | None:
    # The daemon puts the attempt's DeviceSpec into the script's environment.
    return DeviceSpec.from_environment().emulated_capacity


def capacity_from_environment(steps_done: int = 0) -> int | None:
    allocator = DeviceSpec.from_environment().allocator
    overhead = allocator.overhead_bytes if allocator is not None else 0
    return emulated_capacity(_schedule(), AssignedGpu.from_environment(), steps_done, overhead)


def enter_emulated_device(capacity: int) -> None:
    import oomguard_progress

    from oomguard.jobs.device_memory import EmulatedDevice

    gpu = AssignedGpu.from_environment()
    device = EmulatedDevice(
        capacity=capacity, device_index=gpu.index if gpu else 0, count_moves=True, allocator=DeviceSpec.from_environment().allocator,
    )
    _place_on_card(device, gpu)
    device.__enter__()
    _DEVICE.append(device)
    oomguard_progress.device_memory = device

    def at_step(step: int) -> None:
        device.capacity = capacity_from_environment(step)
        _place_on_card(device, gpu)

    schedule = _schedule()
    if schedule is not None and len(schedule.entries) > 1:  # the capacity changes at some step
        oomguard_progress.on_step(at_step)


def _place_on_card(device: Any, gpu: AssignedGpu | None) -> None:
    """Tell the caching allocator's emulation the card it is on, for its OOM message."""
    if gpu is not None and device.caching:
        device.card = gpu.card(os.getpid())


def _on_torch_loaded(capacity: int) -> None:
    if threading.current_thread() is not threading.main_thread():
        # A dispatch mode is entered per thread: entered here, it would leave the script's
        # main thread (where it trains) unguarded.
        refuse(f"torch was first imported in thread {threading.current_thread().name!r}, not the main "
               "thread; import torch in the main thread first (e.g. at the top of the script)")
    try:
        enter_emulated_device(capacity)
    except Exception as error:
        refuse(f"{type(error).__name__}: {error}")


def refuse(reason: str) -> NoReturn:
    """End the process at once when the emulated capacity cannot be applied: a script that ran
    on unguarded would never run out of memory and its job would look as if it fit. The line
    has the form of an exception line, for the daemon to quote as how the attempt ended."""
    sys.stderr.write(f"RuntimeError: oomguard could not apply the emulated device memory: {reason}\n")
    sys.stderr.flush()
    os._exit(EXIT_NOT_APPLIED)


def install_when_torch_loads() -> None:
    import oomguard_imports

    capacity = capacity_from_environment()
    if capacity is None:
        return
    oomguard_imports.when_imported("torch", lambda torch: _on_torch_loaded(capacity))
