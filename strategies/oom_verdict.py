"""What a job died of, as read from its error text: the ``OomVerdict`` and its kinds.

strategies/oom_text.py produces it (``read_oom``); the daemon records it and ``oomguard
diagnose`` prints it. Pure data, no parsing here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from oomguard.strategies.outcome import MemoryFigures

VerdictKind = Literal["oom", "oom_fragmentation", "oom_other_process", "host_oom", "not_oom"]
DEVICE_OOM_KINDS: tuple[VerdictKind, ...] = ("oom", "oom_fragmentation", "oom_other_process")


@dataclass(frozen=True)
class OomVerdict:
    """What a job died of, read from its error text. Sizes are bytes, None where not printed."""

    kind: VerdictKind
    device: str | None = None  # "cuda", "hip", "xpu", "mps", "xla", "cpu" (host RAM)
    gpu_index: int | None = None
    requested: int | None = None
    total: int | None = None  # device capacity
    free: int | None = None  # free on the device, as the driver reported it
    allocated: int | None = None  # by PyTorch's allocator (private pools included)
    reserved_unallocated: int | None = None
    process_in_use: int | None = None  # this process, non-PyTorch memory included
    other_processes: dict[int, int] = field(default_factory=dict)  # pid -> bytes in use
    allowed: int | None = None  # set_per_process_memory_fraction's cap, MPS's high watermark
    private_pools: int | None = None  # allocated in private pools (CUDA graphs)
    message: str = ""  # the error line(s) the verdict is read from
    reason: str = ""  # one sentence: why this verdict

    @property
    def reserved(self) -> int | None:
        if self.allocated is None or self.reserved_unallocated is None:
            return None
        return self.allocated + self.reserved_unallocated

    @property
    def is_device_oom(self) -> bool:
        return self.kind in DEVICE_OOM_KINDS

    def memory_figures(self) -> MemoryFigures:
        """The figures as the doctor reads them (reserved = allocated + reserved-but-unallocated)."""
        return MemoryFigures(
            requested=self.requested, allocated=self.allocated, reserved=self.reserved, free=self.free, total=self.total
        )

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["other_processes"] = {str(pid): used for pid, used in self.other_processes.items()}
        data["reserved"] = self.reserved
        return data
