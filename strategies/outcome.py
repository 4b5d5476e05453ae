"""What an attempt ended with. The runner writes it as outcome.json; the doctor reads it."""

from __future__ import annotations

import dataclasses
import re
import signal
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from oomguard.strategies.memory_model import Measurement
from oomguard.strategies.plan import Plan

# "time_limit": stopped before a batch scheduler's time limit (after a checkpoint when it had
# one to make), to go on in the next attempt with the same plan. "disk_full": a write (a
# checkpoint, the metrics, the final model) found no room, or would not have: the job waits for
# space (disk_path, disk_needed, disk_free) and goes on from its last verified checkpoint.
# "replan": the runner ended the attempt just after a checkpoint to go on under ``next_plan``,
# which needs a new process (a step back up, or back from one that did not hold:
# strategies/step_up_history.py).
OutcomeKind = Literal["finished", "oom", "host_oom", "diverged", "crashed", "cancelled", "interrupted", "time_limit", "disk_full", "replan"]
Phase = Literal["setup", "data", "forward", "backward", "optimizer", "checkpoint", "sampling"]

# The runner's exit codes. They are documented in the README; the daemon trusts outcome.json
# first and falls back to these when the runner died before writing it.
EXIT_FINISHED = 0
EXIT_CRASHED = 1
EXIT_USAGE = 2
EXIT_OOM = 3
EXIT_DIVERGED = 4
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: stopped on request after a checkpoint; run it again
EXIT_TIME_LIMIT = 76  # stopped on SIGUSR1 (a cluster's time limit is near) after a checkpoint
# The disk was full. Not read back from a bare exit status (KIND_BY_EXIT_CODE): a command job's
# script may exit 5 for reasons of its own; the runner's outcome.json says it.
EXIT_DISK_FULL = 5
# To go on under another plan in a new process ("replan"). Not read back from a bare exit status
# either: only the runner's outcome.json names the plan.
EXIT_REPLAN = 77

# The kinds whose one-line summary follows the kind wherever an attempt's end is shown (an OOM
# is described from its figures instead; a finish or an interruption needs no words).
SUMMED_UP_KINDS: tuple[OutcomeKind, ...] = ("crashed", "host_oom", "diverged", "time_limit", "cancelled", "disk_full", "replan")

KIND_BY_EXIT_CODE: dict[int, OutcomeKind] = {
    EXIT_FINISHED: "finished",
    EXIT_OOM: "oom",
    EXIT_DIVERGED: "diverged",
    EXIT_INTERRUPTED: "interrupted",
    EXIT_TIME_LIMIT: "time_limit",
}


@dataclass(frozen=True)
class MemoryFigures:
    """Device memory at the moment of an OOM, in bytes (None where unknown)."""

    requested: int | None = None
    allocated: int | None = None
    reserved: int | None = None
    free: int | None = None
    total: int | None = None
    # Bytes per consumer (parameters, gradients, optimizer_state, activations) when known.
    breakdown: dict[str, int] = field(default_factory=dict)
    # How many times the CUDA caching allocator freed its cache and retried during the
    # attempt and then fitted the request (num_alloc_retries less num_ooms: c10 counts an OOM's
    # own flush as a retry), when known.
    alloc_retries: int | None = None
    # What the other processes on the same GPU held when this attempt began training and at
    # the OOM (NVML, or the emulated GPU's files), when known: the evidence for contention.
    others_before: int | None = None
    others_at_oom: int | None = None

    @property
    def room(self) -> int | None:
        """The device memory the process could have had: what was free and what it held itself
        (reserved), within the total; None where unknown. Less than the total when other
        processes held some: a script's OOM names the card's total as its capacity."""
        if self.free is None or self.reserved is None:
            return None
        return min(self.free + self.reserved, self.total) if self.total is not None else self.free + self.reserved

    @property
    def reserved_unallocated(self) -> int | None:
        if self.reserved is None or self.allocated is None:
            return None
        return self.reserved - self.allocated

    def dominant_consumer(self) -> str | None:
        if not self.breakdown:
            return None
        return max(self.breakdown, key=lambda name: self.breakdown[name])

    def measurement(self, plan: Plan, step: int, static: dict[str, int] | None = None) -> Measurement:
        """This OOM as the memory model reads it: ``plan`` needed more than the bytes in use
        plus the failed request, at the capacity of the moment."""
        return Measurement(
            plan=plan,
            fits=False,
            peak_bytes=(self.allocated or 0) + (self.requested or 0),
            capacity=self.total,
            static=static or {},
            step=step,
        )


@dataclass(frozen=True)
class Outcome:
    kind: OutcomeKind
    # Optimizer steps completed (and kept in the newest checkpoint or final model) when it ended.
    step: int = 0
    phase: Phase | None = None
    memory: MemoryFigures | None = None
    message: str = ""
    traceback_tail: str = ""
    exit_code: int | None = None
    # Step of the checkpoint the attempt resumed from (None: it started from scratch).
    resumed_from: int | None = None
    # The plan in force when the attempt ended: a probe or an in-process recovery may have
    # changed the one it started with (None: unchanged, or a runner that died first).
    plan: Plan | None = None
    # What the attempt measured, per plan it ran (probe steps included), for the memory model.
    measurements: tuple[Measurement, ...] = ()
    # Rungs taken inside the process, in order: {"step", "from", "to", "rungs", "reason"}.
    recoveries: tuple[dict[str, Any], ...] = ()
    # Limits a batch scheduler ended the attempt at: the host memory it was given (sbatch
    # --mem, bytes) when it ran out of it, and its time limit (seconds) when that passed
    # without a checkpoint made in the attempt. None: no such limit ended it.
    host_memory_limit: int | None = None
    time_limit_without_checkpoint: int | None = None
    # The state a batch scheduler ended the attempt in, when that decided its outcome
    # ("NODE_FAIL", "OUT_OF_MEMORY", ...; None: it did not, or none ran it).
    scheduler_state: str | None = None
    # A full disk ("disk_full"): the path that had no room, the bytes free there that the write
    # needed (None: unknown, e.g. a command job's own write) and the bytes that were free.
    disk_path: str | None = None
    disk_needed: int | None = None
    disk_free: int | None = None
    # The job's disk budget ([resources] disk) when it, not the disk, had no room: disk_free is
    # then what was left of it.
    disk_budget: int | None = None
    # "replan": the plan the next attempt runs under.
    next_plan: Plan | None = None
    # An OOM in a step of a job whose steps differ in size (aspect-ratio buckets): the
    # micro-batch in flight as (samples, height, width) in pixels; None where all are alike.
    batch_shape: tuple[int, int, int] | None = None

    @property
    def moved(self) -> bool:
        """The attempt trained a step past the checkpoint it resumed from (or past step 0)."""
        return self.step > (self.resumed_from or 0)

    @property
    def error_line(self) -> str | None:
        """The exception the attempt died of, as its traceback's last line names it (e.g.
        "FileNotFoundError: [Errno 2] No such file or directory: 'x.csv'"), when its report
        names one: the runner's message, else the end of its traceback or log."""
        return exception_line(self.message) or exception_line(self.traceback_tail)

    @property
    def summary(self) -> str:
        """What the attempt ended with, in one line for people: for a crash, its exception line
        (what its owner has to fix); otherwise, or without one, the first line of its message."""
        if self.kind == "crashed" and self.error_line:
            return self.error_line
        lines = self.message.strip().splitlines()
        return lines[0].strip() if lines else ""

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["plan"] = self.plan.to_dict() if self.plan is not None else None
        data["next_plan"] = self.next_plan.to_dict() if self.next_plan is not None else None
        data["measurements"] = [m.to_dict() for m in self.measurements]
        data["recoveries"] = list(self.recoveries)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Outcome:
        """The outcome in ``data`` (outcome.json, which the job's owner may write anything
        into, or the store). Keys this version does not know (written by a newer runner, or
        kept in the store across a downgrade) are ignored, as Plan.from_dict does, rather than
        crash the daemon; a known key of the wrong type or an unknown kind or phase raises
        TypeError or ValueError: a kind, a phase or a step is never text of the user's own,
        and the daemon's sentences quote them."""
        if not isinstance(data, dict):
            raise TypeError(f"an outcome is a JSON object, not {type(data).__name__}")
        _check_types(data)
        memory = data.get("memory")
        if memory:
            memory = MemoryFigures(**_known(MemoryFigures, memory))
        plan, next_plan = data.get("plan"), data.get("next_plan")
        return cls(
            **{
                **_known(cls, data),
                "memory": memory or None,
                "plan": Plan.from_dict(plan) if plan else None,
                "next_plan": Plan.from_dict(next_plan) if next_plan else None,
                "measurements": tuple(Measurement.from_dict(m) for m in data.get("measurements") or ()),
                "recoveries": tuple(data.get("recoveries") or ()),
                "batch_shape": tuple(data["batch_shape"]) if data.get("batch_shape") else None,
            }
        )

    @classmethod
    def from_exit_status(cls, returncode: int) -> Outcome:
        """For a runner that ended without writing outcome.json (killed, or died hard)."""
        if returncode < 0:
            try:
                name = signal.Signals(-returncode).name
            except ValueError:
                name = str(-returncode)
            return cls(kind="crashed", message=f"the runner was killed by {name} before it could report", exit_code=returncode)
        kind = KIND_BY_EXIT_CODE.get(returncode, "crashed")
        return cls(kind=kind, message=f"the runner exited with code {returncode} without writing outcome.json", exit_code=returncode)


# A line that names an exception, as the last line of a Python traceback does: "KeyError: 'a'",
# "torch.OutOfMemoryError: CUDA out of memory. ...", "KeyboardInterrupt".
_EXCEPTION = re.compile(r"(?:[A-Za-z_][\w.]*)?(?:Error|Exception|Interrupt|Exit)(?::.*)?")
# Errors printed without a traceback: the interpreter refusing to start a script, and argparse
# refusing a script's arguments ("train.py: error: unrecognized arguments: --lr").
_UNTRACED_ERROR = re.compile(r"\S*python[\d.]*: (?:can't open file |No module named |Error while finding module )|\S+: error: \S")
# Launchers re-reporting that their child failed (accelerate's CalledProcessError, torchrun's
# ChildFailedError, multiprocessing's): never the cause, which their child printed before.
_LAUNCHER_REPORT = re.compile(r"CalledProcessError|ChildFailedError|ProcessRaisedException|ProcessExitedException")
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")
_TRACEBACK = "Traceback (most recent call last):"


def exception_line(text: str) -> str | None:
    """The last error ``text`` names (a traceback, a runner's message, or the end of a log): the
    line that ends its last traceback, or any line shaped like an exception ("KeyError: 'a'"), or
    an error printed without one (_UNTRACED_ERROR); a launcher's re-report of its child's failure
    is passed over for the child's own error. None when the text names no error."""
    found = None
    in_traceback = False
    for raw in text.splitlines():
        line = _RANK_PREFIX.sub("", raw).rstrip()
        if line.startswith(_TRACEBACK):
            in_traceback = True
            continue
        # A traceback's frames are indented; its first line that is not ends it, whatever the
        # exception is called.
        ends_traceback = in_traceback and line[:1] not in ("", " ", "\t")
        in_traceback = in_traceback and not ends_traceback
        named = ends_traceback or _EXCEPTION.fullmatch(line) or _UNTRACED_ERROR.match(line)
        if named and not _LAUNCHER_REPORT.search(line):
            found = line.strip()
    return found


_KINDS = get_args(OutcomeKind)
_PHASES = get_args(Phase)


def _shown(value: Any) -> str:
    """A value of the wrong type or an unknown name, quoted safely in one short piece."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_types(data: dict[str, Any]) -> None:
    """TypeError or ValueError for an outcome's known key that holds what it never may."""
    if data.get("kind") not in _KINDS:
        raise ValueError(f"unknown kind {_shown(data.get('kind'))} (known: {', '.join(_KINDS)})")
    if data.get("phase") is not None and data.get("phase") not in _PHASES:
        raise ValueError(f"unknown phase {_shown(data.get('phase'))} (known: {', '.join(_PHASES)})")
    for key in ("step", "exit_code", "resumed_from", "host_memory_limit", "time_limit_without_checkpoint", "disk_needed", "disk_free", "disk_budget"):
        if data.get(key) is not None and not _is_int(data[key]):
            raise TypeError(f"{key} must be an integer, not {_shown(data[key])}")
    shape = data.get("batch_shape")
    if shape is not None and not (isinstance(shape, (list, tuple)) and len(shape) == 3 and all(_is_int(n) and n > 0 for n in shape)):
        raise TypeError(f"batch_shape must be three positive integers (samples, height, width), not {_shown(shape)}")
    for key in ("host_memory_limit", "time_limit_without_checkpoint"):
        if data.get(key) is not None and data[key] <= 0:
            raise ValueError(f"{key} must be positive, not {_shown(data[key])}")
    if data.get("scheduler_state") is not None and not (isinstance(data["scheduler_state"], str) and _WORD.fullmatch(data["scheduler_state"])):
        raise ValueError(f"scheduler_state must be a state's name, not {_shown(data['scheduler_state'])}")
    for key in ("disk_needed", "disk_free", "disk_budget"):
        if data.get(key) is not None and data[key] < 0:
            raise ValueError(f"{key} must be bytes (0 or more), not {_shown(data[key])}")
    path = data.get("disk_path")
    # A path the daemon quotes and measures (os.statvfs): text of one line, of a sane length.
    if path is not None and not (isinstance(path, str) and 0 < len(path) <= 4096 and "\0" not in path and "\n" not in path):
        raise ValueError(f"disk_path must be a path, not {_shown(path)}")
    if "step" in data and data["step"] is None:
        raise TypeError("step must be an integer, not None")
    for key in ("message", "traceback_tail"):
        if key in data and not isinstance(data[key], str):
            raise TypeError(f"{key} must be a string, not {type(data[key]).__name__}")
    memory = data.get("memory")
    if memory:
        if not isinstance(memory, dict):
            raise TypeError(f"memory must be an object, not {type(memory).__name__}")
        for key in {f.name for f in dataclasses.fields(MemoryFigures)} - {"breakdown"}:
            if memory.get(key) is not None and not _is_number(memory[key]):
                raise TypeError(f"memory.{key} must be a number (bytes), not {_shown(memory[key])}")
        breakdown = memory.get("breakdown")
        if breakdown is not None and (
            not isinstance(breakdown, dict)
            or not all(isinstance(k, str) and _WORD.fullmatch(k) and _is_number(v) for k, v in breakdown.items())
        ):
            raise TypeError("memory.breakdown must map consumer names (words) to numbers (bytes)")
    for key in ("measurements", "recoveries"):
        items = data.get(key)
        if items is not None and (not isinstance(items, (list, tuple)) or not all(isinstance(item, dict) for item in items)):
            raise TypeError(f"{key} must be a list of objects")
    _check_plan(data.get("plan"), "plan")
    _check_plan(data.get("next_plan"), "next_plan")
    for number, measurement in enumerate(data.get("measurements") or (), 1):
        _check_plan(measurement.get("plan"), f"measurements[{number}].plan")


# A consumer's name, a plan's knob value: a word, never text of the user's own (the doctor's
# report quotes them, one per line).
_WORD = re.compile(r"[\w.:=+-]*")


def _check_plan(plan: Any, where: str) -> None:
    if plan is None:
        return
    if not isinstance(plan, dict):
        raise TypeError(f"{where} must be an object, not {type(plan).__name__}")
    for key, value in plan.items():
        if isinstance(value, str) and not _WORD.fullmatch(value):
            raise ValueError(f"{where}.{key} is not a plan's value: {_shown(value)}")


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}
