"""What device an attempt trains on: ``DeviceSpec``, the real device or one with an emulated
capacity. The daemon decides it from its own options when it starts an attempt (not when the
job is submitted), writes it into attempt.json and, for a command job, into the environment of
the user's script (the bootstrap reads OOMGUARD_EMULATE_DEVICE_MEMORY). The runner opens the
device memory it describes (jobs/memory_cap.py open_device_memory).

The emulated GPU an attempt is placed on is not part of it: like a real card, it travels in
the environment of every process of the attempt ($CUDA_VISIBLE_DEVICES and
$OOMGUARD_EMULATED_GPUS, jobs/emulated_gpus.py AssignedGpu), which the daemon's placement sets.

No torch here: the daemon and the CLI import it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from oomguard.jobs.emulated_allocator import EMULATE_ALLOCATOR_ENV, AllocatorEmulation
from oomguard.jobs.sizes import CapSchedule

# The environment variable that sets the emulated device capacity (a CapSchedule text) for
# the daemon, `oomguard run`, the runner and a command job's script, like their
# --emulate-device-memory option.
EMULATE_DEVICE_MEMORY_ENV = "OOMGUARD_EMULATE_DEVICE_MEMORY"


@dataclass(frozen=True)
class DeviceSpec:
    """The device an attempt trains on: the real one (``emulated_capacity`` None), or one whose
    capacity is emulated and follows a CapSchedule (on a CUDA machine: a cap on the real card).
    ``allocator``: how an emulated device allocates (None: exact bytes; else PyTorch's caching
    allocator, jobs/emulated_allocator.py); a real card has its own."""

    emulated_capacity: CapSchedule | None = None
    allocator: AllocatorEmulation | None = None

    @property
    def emulated(self) -> bool:
        return self.emulated_capacity is not None

    @classmethod
    def from_option(cls, text: str | None, allocator: str | None = None) -> DeviceSpec:
        """From an --emulate-device-memory value (``"48MiB"``, ``"64MiB,40MiB@15"``) or None
        (the real device), and an --emulate-allocator value (``"caching/1024"``; None or
        ``"exact"``: exact bytes). ValueError for a text that is neither."""
        return cls(CapSchedule.parse(text) if text else None, AllocatorEmulation.parse(allocator) if allocator else None)

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ) -> DeviceSpec:
        return cls.from_option(env.get(EMULATE_DEVICE_MEMORY_ENV), env.get(EMULATE_ALLOCATOR_ENV))

    def or_environment(self, env: Mapping[str, str] = os.environ) -> DeviceSpec:
        """This spec; for the real device, what the environment asks: a runner started by hand
        with $OOMGUARD_EMULATE_DEVICE_MEMORY set emulates that capacity."""
        return self if self.emulated or self.allocator is not None else DeviceSpec.from_environment(env)

    def environment(self) -> dict[str, str]:
        """The variables that tell a command job's script this device (jobs/bootstrap)."""
        env = {EMULATE_DEVICE_MEMORY_ENV: str(self.emulated_capacity)} if self.emulated_capacity is not None else {}
        if self.allocator is not None:
            env[EMULATE_ALLOCATOR_ENV] = str(self.allocator)
        return env

    def to_dict(self) -> dict[str, Any]:
        return {
            "emulated_capacity": str(self.emulated_capacity) if self.emulated_capacity is not None else None,
            "emulated_allocator": str(self.allocator) if self.allocator is not None else None,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceSpec:
        return cls.from_option(data.get("emulated_capacity"), data.get("emulated_allocator"))
