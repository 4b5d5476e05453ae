"""Emulated device memory inside a user's script, without changing the script.

A command job's Python processes start with jobs/bootstrap/ first on PYTHONPATH; its
sitecustomize calls :func:`install_when_torch_loads` when a capacity is set. The first
``import torch`` of the script then also enters an :class:`EmulatedDevice` for the main
thread, so the script's tensors count against the capacity and running out raises PyTorch's
own ``torch.OutOfMemoryError`` with the CUDA allocator's wording, which the daemon reads from
the log as it reads a real one. Nothing of torch is imported before the script imports it.

The capacity follows the job's schedule (``64MiB,3MiB@5``) counted in optimizer steps *of this
process* (a global optimizer-step hook counts them: the script's own step numbering is not
known here), within the emulated GPU's room when the process starts.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
from typing import Any, NoReturn

from oomguard.jobs.emulated_gpus import AssignedGpu, emulated_capacity
from oomguard.jobs.sizes import EMULATE_DEVICE_MEMORY_ENV, CapSchedule

# The exit status of a process whose emulated capacity could not be applied (EX_SOFTWARE).
EXIT_NOT_APPLIED = 70

# Kept for the life of the process: the mode stays entered until the interpreter exits.
_DEVICE: list[Any] = []


def _schedule() -> CapSchedule | None:
    text = os.environ.get(EMULATE_DEVICE_MEMORY_ENV)
    return CapSchedule.parse(text) if text else None


def capacity_from_environment(steps_done: int = 0) -> int | None:
    return emulated_capacity(_schedule(), AssignedGpu.from_environment(), steps_done)


def enter_emulated_device(capacity: int) -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from oomguard.jobs.device_memory import EmulatedDevice

    gpu = AssignedGpu.from_environment()
    device = EmulatedDevice(capacity=capacity, device_index=gpu.index if gpu else 0, count_moves=True)
    device.__enter__()
    _DEVICE.append(device)
    steps = [0]

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        steps[0] += 1
        device.capacity = capacity_from_environment(steps[0])

    schedule = _schedule()
    if schedule is not None and len(schedule.entries) > 1:  # the capacity changes at some step
        register_optimizer_step_post_hook(after_step)


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps torch's own loader so that the device is entered once
    torch has finished loading.

    It stays first on sys.meta_path until torch has really been executed: libraries probe
    for torch with ``importlib.util.find_spec("torch")`` before (or instead of) importing it
    (datasets, transformers, accelerate's ``is_*_available``), and every spec it hands out
    carries the wrapped loader, so torch loaded through any of them, by ``import`` or by
    ``module_from_spec`` and ``exec_module``, enters the device."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "torch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module  # type: ignore[attr-defined]

        def exec_module(module: Any) -> None:
            original(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            if threading.current_thread() is not threading.main_thread():
                # A dispatch mode is entered per thread: entered here, it would leave the
                # script's main thread (where it trains) unguarded.
                refuse(f"torch was first imported in thread {threading.current_thread().name!r}, not the main "
                       "thread; import torch in the main thread first (e.g. at the top of the script)")
            enter_emulated_device(self.capacity)

        # PathFinder makes a new loader for every spec: wrapping it touches no one else's.
        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def refuse(reason: str) -> NoReturn:
    """End the process at once when the emulated capacity cannot be applied: a script that ran
    on unguarded would never run out of memory and its job would look as if it fit. The line
    has the form of an exception line, for the daemon to quote as how the attempt ended."""
    sys.stderr.write(f"RuntimeError: oomguard could not apply the emulated device memory: {reason}\n")
    sys.stderr.flush()
    os._exit(EXIT_NOT_APPLIED)


def install_when_torch_loads() -> None:
    capacity = capacity_from_environment()
    if capacity is None:
        return
    if "torch" in sys.modules:
        enter_emulated_device(capacity)
    else:
        sys.meta_path.insert(0, _AfterTorch(capacity))
