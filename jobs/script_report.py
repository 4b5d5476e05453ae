"""What a command job's script reported through the bootstrap (jobs/bootstrap/oomguard_progress.py):
its optimizer steps in metrics.jsonl and its last heartbeat, read back by the daemon when the
attempt ends. No torch here: the daemon imports it.

From them the daemon knows, for a script as for the built-in trainer, the step it reached and
the step it resumed from, what its plan measured (the steady peak and what stays on the device
between steps, for the memory model) and, at the end, whether the job reached its target: all
its optimizer steps, and the learning rate its first attempt's schedule gives there.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomguard.jobs.attempt import HEARTBEAT, METRICS, SCHEDULES, AttemptFiles, attempt_files
from oomguard.strategies.memory_model import Measurement
from oomguard.strategies.oom_text import read_tail
from oomguard.strategies.plan import Plan

# The bytes of metrics.jsonl read back (its end): ~300 bytes a step.
METRICS_TAIL_BYTES = 4 * 2**20
# Learning rates closer than this (relative, or absolute near zero) are the same.
LR_TOLERANCE = 1e-6


@dataclass(frozen=True)
class ScriptReport:
    step: int | None = None  # the job's last optimizer step the script completed
    resumed_from: int | None = None
    steps_in_process: int = 0
    measurement: Measurement | None = None  # None: fewer than two steps to measure
    final_lr: float | None = None
    expected_final_lr: float | None = None  # None: the schedule was not visible
    samples: int | None = None

    def end_state(self, max_steps: int) -> EndState:
        return EndState(
            steps=self.step or 0, max_steps=max_steps, final_lr=self.final_lr, expected_final_lr=self.expected_final_lr, samples=self.samples
        )


@dataclass(frozen=True)
class EndState:
    """A finished command job against its target."""

    steps: int
    max_steps: int
    final_lr: float | None
    expected_final_lr: float | None
    samples: int | None

    @property
    def lr_checked(self) -> bool:
        return self.final_lr is not None and self.expected_final_lr is not None

    @property
    def differences(self) -> list[str]:
        found = []
        if self.steps != self.max_steps:
            found.append(f"it ended at optimizer step {self.steps}, not at the job's {self.max_steps} ([train] max_steps)")
        if self.lr_checked and not _same_lr(self.final_lr, self.expected_final_lr):  # type: ignore[arg-type]
            found.append(f"its final learning rate is {self.final_lr:.6g}, where its first attempt's schedule ends at {self.expected_final_lr:.6g}")
        return found

    def describe(self) -> str:
        if self.differences:
            return "the end state differs from the target: " + "; ".join(self.differences)
        parts = [f"{self.steps}/{self.max_steps} optimizer steps"]
        if self.samples is not None:
            parts.append(f"{self.samples} samples")
        parts.append(f"final learning rate {self.final_lr:.6g} as scheduled" if self.lr_checked else "final learning rate not checked (its schedule is not visible to oomguard)")
        return "end state as planned: " + ", ".join(parts)


def _same_lr(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=LR_TOLERANCE, abs_tol=LR_TOLERANCE * 1e-3)


def read_script_report(attempt_dir: Path | AttemptFiles, plan: Plan) -> ScriptReport:
    """What the script's bootstrap reported in ``attempt_dir`` under ``plan`` (empty when it
    reported nothing: not a Python script, or it died before its first step). The daemon passes
    the AttemptFiles it opened as the job's owner's (jobs/attempt.py)."""
    files = attempt_files(attempt_dir)
    records = step_records(files)
    heartbeat = files.read_json(HEARTBEAT)
    heartbeat = heartbeat if isinstance(heartbeat, dict) else {}
    last = records[-1] if records else heartbeat
    step = _int(last.get("step"))
    resumed_from = _int(heartbeat.get("resumed_from"))
    return ScriptReport(
        step=step if step is not None else resumed_from,
        resumed_from=resumed_from,
        steps_in_process=len(records),
        measurement=_measurement(records, plan),
        final_lr=_float(heartbeat.get("final_lr")),
        expected_final_lr=_float(heartbeat.get("expected_final_lr")),
        samples=_int(last.get("samples")),
    )


def _measurement(records: list[dict[str, Any]], plan: Plan) -> Measurement | None:
    """The plan's steady peak: the first step of a process also creates the optimizer state
    and times the start-up, so it is left out, as the built-in runner leaves it out."""
    steady = [r for r in records[1:] if _int(r.get("peak_bytes")) is not None]
    if not steady:
        return None
    rates = [r["samples_per_s"] for r in steady if _float(r.get("samples_per_s"))]
    resident = [_int(r.get("resident_bytes")) for r in steady]
    return Measurement(
        plan=plan,
        fits=True,
        peak_bytes=max(_int(r["peak_bytes"]) or 0 for r in steady),
        capacity=_int(steady[-1].get("capacity_bytes")),
        samples_per_s=statistics.median(rates) if rates else None,
        # What stays on the device between steps: the part of the peak that does not grow
        # with the micro-batch (memory_model.Line.fixed for this plan's shape).
        static={"resident": max(r for r in resident if r is not None)} if any(r is not None for r in resident) else {},
        step=_int(steady[-1].get("step")),
        reserved_bytes=max(reserved) if (reserved := [v for r in steady if (v := _int(r.get("reserved_bytes"))) is not None]) else None,
    )


def step_records(files: AttemptFiles, tail_bytes: int = METRICS_TAIL_BYTES) -> list[dict[str, Any]]:
    """The step records of metrics.jsonl's last ``tail_bytes``, in order (a line cut by the
    tail or being written is left out)."""
    try:
        with files.open(METRICS) as handle:
            text = read_tail(handle, tail_bytes)
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # the cut first line of the tail, or a line being written
        if isinstance(record, dict) and _int(record.get("step")) is not None:
            records.append(record)
    return records


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


def first_schedules(attempt_dirs: list[Path] | list[AttemptFiles]) -> list[Any] | None:
    """The learning-rate schedules the job's earliest attempt that built any was built with
    (``attempt_dirs`` in order): every later attempt builds the same (oomguard_accelerate.py)."""
    for attempt_dir in attempt_dirs:
        schedules = attempt_files(attempt_dir).read_json(SCHEDULES)
        if isinstance(schedules, list) and schedules:
            return schedules
    return None
