"""The GPU monitor: samples every GPU into the store, for `oomguard gpus`, reports and the
record of what the neighbours did. Samples are bounded per GPU (Store.add_gpu_samples thins
the older half when there are too many), so a daemon that runs for months keeps a small file.
"""

from __future__ import annotations

import json
import time

from oomguard.daemon.gpus import GpuSource, GpuState
from oomguard.daemon.store import Store

SAMPLE_SECONDS = 5.0
KEEP_PER_GPU = 5000


class GpuMonitor:
    def __init__(self, source: GpuSource, store: Store, *, every_seconds: float = SAMPLE_SECONDS, keep_per_gpu: int = KEEP_PER_GPU) -> None:
        self.source = source
        self.store = store
        self.every_seconds = every_seconds
        self.keep_per_gpu = keep_per_gpu
        self._last = 0.0
        self.latest: list[GpuState] = []

    def read(self) -> list[GpuState]:
        """The GPUs now (also what the scheduler places by)."""
        self.latest = self.source.read()
        return self.latest

    def tick(self) -> None:
        now = time.monotonic()
        if now - self._last < self.every_seconds:
            return
        self._last = now
        states = self.read()
        self.store.add_gpu_samples(time.time(), [sample_row(state) for state in states], self.keep_per_gpu)


def sample_row(state: GpuState) -> dict[str, object]:
    processes = [{"pid": p.pid, "used": p.used_bytes} for p in state.processes]
    return {"gpu": state.index, "name": state.name, "total": state.total, "used": state.used, "processes": json.dumps(processes)}
