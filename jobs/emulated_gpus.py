"""Emulated GPUs: what the daemon's scheduler and monitor see on a machine without one.

``oomguard daemon --emulate-gpus 2x64MiB`` makes a folder that stands in for the driver's
view of the cards. Every process that "uses" an emulated GPU (a runner, or a neighbour
started with ``oomguard neighbour``) writes how many bytes it holds into a file of its own;
the monitor adds them up as NVML adds up the processes on a card::

    STATE/emulated-gpus/gpus.json          [{"index": 0, "total": 67108864}, ...]
    STATE/emulated-gpus/0/<pid>.json       {"pid": 123, "bytes": 41943040, "what": "runner"}

A runner placed on an emulated GPU gets the folder in $OOMGUARD_EMULATED_GPUS and the GPU in
$CUDA_VISIBLE_DEVICES; its device capacity is the card's total less what the other processes
on it hold, read again at every step, so a neighbour's spike makes it run out of memory the
way a real card would. The files of processes that have ended are ignored (and removed by
the monitor). No torch here: the daemon and the CLI import it.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from oomguard.jobs.attempt import read_json, write_json_atomic
from oomguard.jobs.sizes import CapSchedule
from oomguard.strategies.units import format_torch_size, parse_size

EMULATED_GPUS_ENV = "OOMGUARD_EMULATED_GPUS"
_SPEC = re.compile(r"^\s*(\d+)\s*x\s*(\S+)\s*$")


@dataclass(frozen=True)
class EmulatedGpu:
    index: int
    total: int

    @property
    def name(self) -> str:
        return f"emulated {format_torch_size(self.total)}"


@dataclass(frozen=True)
class EmulatedProcess:
    pid: int
    used_bytes: int
    what: str  # "runner", "neighbour", ...


def parse_gpus(text: str) -> tuple[EmulatedGpu, ...]:
    """``"2x64MiB"`` or ``"64MiB,48MiB"`` (cards of different sizes)."""
    form = "expected COUNTxSIZE (e.g. 2x64MiB) or sizes separated by commas (e.g. 64MiB,48MiB)"
    match = _SPEC.match(text)
    try:
        if match:
            count, size = int(match.group(1)), parse_size(match.group(2))
            if not 1 <= count <= 64:
                raise ValueError(f"{count} GPUs: between 1 and 64, please")
            sizes = [size] * count
        else:
            sizes = [parse_size(part) for part in text.split(",")]
    except ValueError as error:
        raise ValueError(f"not an emulated GPU list: {text!r} ({error}; {form})") from None
    return tuple(EmulatedGpu(index, total) for index, total in enumerate(sizes))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


class EmulatedGpuFolder:
    def __init__(self, root: Path) -> None:
        self.root = root

    def create(self, gpus: tuple[EmulatedGpu, ...]) -> EmulatedGpuFolder:
        self.root.mkdir(parents=True, exist_ok=True)
        for gpu in gpus:
            folder = self.root / str(gpu.index)
            folder.mkdir(exist_ok=True)
            # Runners of every user write their usage here (sticky: nobody removes another's).
            folder.chmod(0o1777)
        write_json_atomic(self.root / "gpus.json", [{"index": g.index, "total": g.total} for g in gpus], mode=0o644)
        return self

    def gpus(self) -> tuple[EmulatedGpu, ...]:
        try:
            data = json.loads((self.root / "gpus.json").read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.root} holds no emulated GPUs (no gpus.json); start the daemon with --emulate-gpus") from None
        return tuple(EmulatedGpu(int(entry["index"]), int(entry["total"])) for entry in data)

    def gpu(self, index: int) -> EmulatedGpu:
        for gpu in self.gpus():
            if gpu.index == index:
                return gpu
        raise ValueError(f"no emulated GPU {index} in {self.root}")

    def processes(self, index: int, *, prune: bool = False) -> list[EmulatedProcess]:
        found: list[EmulatedProcess] = []
        for path in sorted((self.root / str(index)).glob("*.json")):
            # Anyone may write here (the folder is 1777): read regular files only, and only
            # whole numbers that make sense.
            data = read_json(path)
            if not isinstance(data, dict):
                continue  # being replaced right now, or not ours
            pid, used = data.get("pid"), data.get("bytes", 0)
            if not (isinstance(pid, int) and pid > 0 and isinstance(used, int) and used >= 0):
                continue
            if not _alive(pid):
                if prune:
                    path.unlink(missing_ok=True)
                continue
            found.append(EmulatedProcess(pid, used, str(data.get("what", ""))))
        return found

    def used_by_others(self, index: int, pid: int) -> int:
        return sum(p.used_bytes for p in self.processes(index) if p.pid != pid)

    def publish(self, index: int, pid: int, used_bytes: int, what: str) -> None:
        """Say how much this process holds on the GPU now."""
        # Readable by everyone: other users' runners subtract it from their room.
        write_json_atomic(self.root / str(index) / f"{pid}.json", {"pid": pid, "bytes": int(used_bytes), "what": what, "at": time.time()}, mode=0o644)

    def withdraw(self, index: int, pid: int) -> None:
        (self.root / str(index) / f"{pid}.json").unlink(missing_ok=True)


@dataclass(frozen=True)
class AssignedGpu:
    """The emulated GPU a runner was placed on (from its environment), or None."""

    folder: EmulatedGpuFolder
    index: int

    @classmethod
    def from_environment(cls, env: dict[str, str] | os._Environ[str] = os.environ) -> AssignedGpu | None:
        root = env.get(EMULATED_GPUS_ENV)
        if not root:
            return None
        # One process per GPU (a built-in job's ranks, accelerate's or torchrun's processes):
        # LOCAL_RANK picks this process's GPU among those the attempt was placed on.
        visible = [index.strip() for index in env.get("CUDA_VISIBLE_DEVICES", "0").split(",")]
        local_rank = int(env.get("LOCAL_RANK", "0") or 0)
        return cls(EmulatedGpuFolder(Path(root)), int(visible[local_rank % len(visible)] or 0))

    def card(self, pid: int) -> tuple[int, int]:
        """The card's total and what every process on it but ``pid`` holds now (bytes)."""
        return self.folder.gpu(self.index).total, self.folder.used_by_others(self.index, pid)

    def capacity_for(self, pid: int) -> int:
        """The card's total less what every other process on it holds now."""
        return max(self.folder.gpu(self.index).total - self.folder.used_by_others(self.index, pid), 1)


def emulated_capacity(schedule: CapSchedule | None, gpu: AssignedGpu | None, step: int, overhead: int = 0) -> int | None:
    """The emulated capacity at ``step``: the schedule's, within the GPU's room now less the
    process's ``overhead`` of non-PyTorch memory (None: no cap). The runner and the bootstrap
    of command jobs both take it from here."""
    limits = [schedule.limit_at(step)] if schedule is not None else []
    if gpu is not None:
        limits.append(max(gpu.capacity_for(os.getpid()) - overhead, 1))
    known = [limit for limit in limits if limit is not None]
    return min(known) if known else None
