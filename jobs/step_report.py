"""What the built-in runner writes after each optimizer step (jobs/loop.py): a line of
metrics.jsonl, the same figures for the job's experiment trackers (jobs/tracking.py), and at
most once a second the heartbeat the daemon reads while the attempt runs (with the rungs the
runner took so far, and where its checkpoints stand)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard.jobs.attempt import HEARTBEAT, write_json_atomic
from oomguard.jobs.memory_cap import DeviceMemory
from oomguard.jobs.tracking import TrainingMetrics


@dataclass
class Progress:
    """Where the attempt stands: its step, its last checkpoint's, the one it resumed from."""

    step: int = 0
    last_checkpoint: int | None = None
    resumed_from: int | None = None
    last_heartbeat: float = field(default=0.0)


def report_step(
    attempt_dir: Path,
    metrics: Any,
    progress: Progress,
    max_steps: int,
    loss: float,
    learning_rate: float,
    samples_per_s: float,
    memory: DeviceMemory,
    plan: str,
    recoveries: list[dict[str, Any]],
    trackers: TrainingMetrics,
) -> None:
    record = {
        "step": progress.step,
        "max_steps": max_steps,
        "loss": loss,
        # The rate the next step trains at (diffusers' scripts log the scheduler's last one).
        "learning_rate": learning_rate,
        "samples_per_s": samples_per_s,
        "peak_bytes": memory.peak_bytes(),
        # What the caching allocator held at most (None where it is what was allocated).
        "reserved_bytes": memory.peak_reserved(),
        "capacity_bytes": memory.capacity(),
        "plan": plan,
        "time": time.time(),
    }
    metrics.write(json.dumps(record) + "\n")
    metrics.flush()
    trackers.step(record, recoveries)
    now = time.monotonic()
    # The heartbeat is a small file rewritten at most once a second (and on the last step).
    # It carries the rungs the runner took so far, which the daemon reports while it runs.
    if now - progress.last_heartbeat >= 1.0 or progress.step == max_steps:
        # For a daemon that finds it killed without a report (a time limit): did it checkpoint?
        checkpoints = {"last_checkpoint": progress.last_checkpoint, "resumed_from": progress.resumed_from}
        write_json_atomic(attempt_dir / HEARTBEAT, {**record, "recoveries": recoveries, **checkpoints})
        progress.last_heartbeat = now
        print(f"step {progress.step}/{max_steps} loss {loss:.5f} {samples_per_s:.1f} samples/s", flush=True)
