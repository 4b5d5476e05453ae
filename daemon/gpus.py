"""What the GPUs hold now: per card total / used / free and the processes on it.

Two sources with one shape: NVML (nvidia-ml-py, imported as ``pynvml``) on a machine with
NVIDIA GPUs, and the emulated GPUs of jobs/emulated_gpus.py (``--emulate-gpus 2x64MiB``)
everywhere else, so that placement, contention and the monitor are tested without a card.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from oomguard.jobs.emulated_gpus import EmulatedGpuFolder, parse_gpus
from oomguard.strategies.errors import NoGpus


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int


@dataclass(frozen=True)
class GpuState:
    index: int
    name: str
    total: int
    used: int
    processes: tuple[GpuProcess, ...] = ()

    @property
    def free(self) -> int:
        return max(self.total - self.used, 0)


class GpuSource(Protocol):
    description: str
    emulated_root: Path | None  # the folder runners must be told about, for emulated GPUs

    def read(self) -> list[GpuState]: ...


class NvmlGpus:
    """The real cards, through NVML."""

    emulated_root = None

    def __init__(self) -> None:
        import pynvml

        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as error:
            raise NoGpus(f"no NVIDIA GPU found (NVML: {error})") from None
        if count == 0:
            raise NoGpus("no NVIDIA GPU found (NVML reports 0 devices)")
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self._lost: set[int] = set()
        self.description = f"{count} NVIDIA GPU(s) (NVML)"

    def read(self) -> list[GpuState]:
        """The cards that answer; one that does not (fallen off the bus, being reset) is left
        out, and said once, until it answers again."""
        nvml = self._nvml
        states = []
        for index, handle in enumerate(self._handles):
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(handle)
                name = nvml.nvmlDeviceGetName(handle)
            except nvml.NVMLError as error:
                if index not in self._lost:
                    print(f"oomguard: GPU {index} does not answer NVML ({error}); no job is placed on it until it does", flush=True)
                    self._lost.add(index)
                continue
            self._lost.discard(index)
            try:
                running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except nvml.NVMLError:
                running = []
            processes = tuple(GpuProcess(p.pid, int(p.usedGpuMemory or 0)) for p in running)
            states.append(
                GpuState(index, name.decode() if isinstance(name, bytes) else str(name), int(info.total), int(info.used), processes)
            )
        return states


class EmulatedGpus:
    """Cards that exist as files (see jobs/emulated_gpus.py)."""

    def __init__(self, root: Path, spec: str) -> None:
        gpus = parse_gpus(spec)
        self.folder = EmulatedGpuFolder(root).create(gpus)
        self.emulated_root: Path | None = root
        self.description = f"{len(gpus)} emulated GPU(s) ({spec}) in {root}"

    def read(self) -> list[GpuState]:
        states = []
        for gpu in self.folder.gpus():
            processes = tuple(GpuProcess(p.pid, p.used_bytes) for p in self.folder.processes(gpu.index, prune=True))
            states.append(GpuState(gpu.index, gpu.name, gpu.total, min(sum(p.used_bytes for p in processes), gpu.total), processes))
        return states


def open_gpus(emulate: str | None, emulated_root: Path) -> GpuSource:
    """Emulated GPUs when asked for, else NVML; raises NoGpus with what to do instead."""
    if emulate:
        return EmulatedGpus(emulated_root, emulate)
    try:
        return NvmlGpus()
    except NoGpus as error:
        raise NoGpus(f"{error}; jobs run on the CPU, one at a time (--max-parallel), or try it with --emulate-gpus 2x24GiB") from None
