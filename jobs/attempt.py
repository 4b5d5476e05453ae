"""The files of one attempt directory, shared by the daemon (writer of attempt.json) and the
runner (writer of the rest). No torch here: the daemon imports it.

    attempt.json    what to run: the job, the plan, the workdir, the emulated memory cap
    outcome.json    how it ended (strategies.outcome.Outcome)
    heartbeat.json  the latest step, loss, samples/s and memory, rewritten about once a second
    metrics.jsonl   one line per optimizer step
    output.log      the runner's stdout and stderr
    schedules.json  a command job's learning-rate schedules (jobs/bootstrap/oomguard_accelerate.py)
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from oomguard.jobs.spec import JobSpec
from oomguard.strategies.outcome import Phase
from oomguard.strategies.plan import Plan

CONFIG = "attempt.json"
OUTCOME = "outcome.json"
HEARTBEAT = "heartbeat.json"
METRICS = "metrics.jsonl"
LOG = "output.log"
SCHEDULES = "schedules.json"


@dataclass(frozen=True)
class AttemptConfig:
    job: JobSpec
    plan: Plan
    number: int
    workdir: Path
    # A CapSchedule's text (e.g. "48MiB" or "64MiB,40MiB@15"), or None for the real device.
    emulate_device_memory: str | None = None
    # Measure before training (the job's first attempt, when its ladder.probe is on).
    probe: bool = False
    # Take the rungs that need no restart inside the process after an OOM in forward or
    # backward. Off only for benchmarks that time one fixed plan.
    recover_in_process: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job.to_dict(),
            "plan": self.plan.to_dict(),
            "number": self.number,
            "workdir": str(self.workdir),
            "emulate_device_memory": self.emulate_device_memory,
            "probe": self.probe,
            "recover_in_process": self.recover_in_process,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttemptConfig:
        return cls(
            job=JobSpec.from_dict(data["job"]),
            plan=Plan.from_dict(data["plan"]),
            number=int(data["number"]),
            workdir=Path(data["workdir"]),
            emulate_device_memory=data.get("emulate_device_memory"),
            probe=bool(data.get("probe", False)),
            recover_in_process=bool(data.get("recover_in_process", True)),
        )

    def write(self, attempt_dir: Path) -> None:
        attempt_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(attempt_dir / CONFIG, self.to_dict())

    @classmethod
    def read(cls, attempt_dir: Path) -> AttemptConfig:
        return cls.from_dict(json.loads((attempt_dir / CONFIG).read_text()))


def write_json_atomic(path: Path, data: Any, mode: int | None = None) -> None:
    """Readers (the daemon, `oomguard show`) see the old file or the new one, never half.
    ``mode``: the file's permissions whatever the writer's umask (others must read it)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data, indent=2))
    if mode is not None:
        temporary.chmod(mode)
    temporary.replace(path)


# Larger than any attempt file oomguard writes; a bigger one is not ours to parse.
MAX_JSON_BYTES = 16 * 2**20


def open_regular(path: Path) -> BinaryIO:
    """Open a file for reading the way a daemon running as root must open files in a user's
    folder: never through a symbolic link (the user could point it anywhere), and only a
    regular file (a FIFO would block the daemon, a device might never end). OSError otherwise."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    handle = os.fdopen(descriptor, "rb")
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        handle.close()
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return handle


def read_json(path: Path) -> Any | None:
    """The JSON in ``path``; None when it is missing, unreadable, not a regular file or not
    (yet) whole JSON: callers treat all of these as "nothing reported"."""
    try:
        with open_regular(path) as handle:
            data = handle.read(MAX_JSON_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_JSON_BYTES:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


@dataclass
class Control:
    """Shared between the training loop and the runner's SIGTERM handler."""

    stop_requested: bool = False
    phase: Phase = "setup"
