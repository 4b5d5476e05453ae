"""A built-in job's training metrics for experiment trackers (train.log_with): at each optimizer
step the loss, learning rate, samples/s and device memory of its metrics.jsonl line, and a text
entry at the step where the attempt started, its plan changed or it ran out of memory, so that
a user sees on the usual chart where the ladder acted.

They go through accelerate's trackers (accelerate.tracking) without an Accelerator, whose
process-wide state the runner avoids (jobs/training.py): each tracker is made here, on rank 0
only, and asked to log on its own process (``main_process_only`` off: accelerate would ask its
process-wide state which process is the main one).

TensorBoard's run is WORKDIR/tensorboard/JOB_NAME/: every attempt adds its own events file there,
at the job's global step, so the curves go on across attempts. Each attempt's writer purges
what an earlier one logged after the step this one starts from (the steps after the checkpoint
it resumed from, trained again now), as TensorBoard does for a restarted TensorFlow job.

Writing metrics never ends a run: a tracker that fails is named once on the attempt's output,
with the error, and left out from then on.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from oomguard.strategies.doctor import describe_oom
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan

# Where the job's TensorBoard runs go, in its workdir.
TENSORBOARD_DIR = "tensorboard"
# The file that keeps the MLflow run's id, so that every attempt logs into the same run.
MLFLOW_RUN_ID_FILE = "mlflow_run_id"

# Scalars per step: the tag and the metrics.jsonl key it is read from (memory in MiB: bytes
# do not read on a chart, and a tracker stores scalars as 32-bit floats).
STEP_SCALARS: tuple[tuple[str, str], ...] = (
    ("train/loss", "loss"),
    ("train/learning_rate", "learning_rate"),
    ("train/samples_per_s", "samples_per_s"),
)
MEMORY_SCALARS: tuple[tuple[str, str], ...] = (
    ("memory/peak_allocated_mib", "peak_bytes"),
    ("memory/peak_reserved_mib", "reserved_bytes"),
    ("memory/cap_mib", "capacity_bytes"),
)
# Text entries, one tag each: a tag holds at most one entry per step (TensorBoard keeps the
# last of a step), so what happened at one step in one tag is joined into one entry.
ATTEMPT_TAG = "oomguard/attempt"
PLAN_TAG = "oomguard/plan"
OOM_TAG = "oomguard/oom"

Say = Callable[[str], None]


class TrainingMetrics:
    """The trackers of one attempt, opened at its first entry; a no-op without any."""

    def __init__(self, names: Sequence[str], workdir: Path, job_name: str, attempt_number: int, say: Say) -> None:
        self.names = tuple(names)
        self.workdir = workdir
        self.job_name = job_name
        self.attempt_number = attempt_number
        self.say = say
        self.trackers: dict[str, Any] | None = None  # None: not opened yet
        # The plan changes (AttemptRun.recoveries) already written.
        self.changes_written = 0
        # Text entries not written yet, by (step, tag): joined into one entry per step and tag.
        self.pending_text: dict[tuple[int, str], list[str]] = {}

    @classmethod
    def for_attempt(cls, log_with: Sequence[str], workdir: Path, job_name: str, attempt_number: int, main: bool, say: Say) -> TrainingMetrics:
        """Rank 0's trackers (the ranks train one model: one of them writes its metrics)."""
        return cls(log_with if main else (), workdir, job_name, attempt_number, say)

    # -- what the training loop reports ----------------------------------------------------

    def attempt_started(self, step: int, plan: Plan, resumed: bool, changes: Sequence[Mapping[str, Any]]) -> None:
        """The attempt starts training at ``step`` under ``plan`` (after the probe and any step
        up at the start, each in ``changes``)."""
        if not self.names:
            return
        self._open(step)
        where = f"resumed from the checkpoint at step {step}" if resumed else f"from step {step}, no checkpoint"
        self._add_text(step, ATTEMPT_TAG, f"attempt {self.attempt_number} starts with plan {plan.short()} ({where})")
        self._add_changes(changes)
        self._write_text()

    def step(self, record: Mapping[str, Any], changes: Sequence[Mapping[str, Any]]) -> None:
        """An optimizer step's metrics.jsonl ``record``, and the plan changes made before it."""
        if not self.names:
            return
        step = int(record["step"])
        self._open(step - 1)
        self._add_changes(changes)
        self._write_text()
        values = {tag: float(record[key]) for tag, key in STEP_SCALARS if record.get(key) is not None}
        values.update({tag: record[key] / 2**20 for tag, key in MEMORY_SCALARS if record.get(key) is not None})
        self._log(values, step)

    def attempt_ended(self, outcome: Outcome, changes: Sequence[Mapping[str, Any]]) -> None:
        """The plan changes not written yet, and the OOM that ended the attempt (an OOM answered
        in the process is written with its change)."""
        if not self.names:
            return
        self._open(outcome.step or 0)
        self._add_changes(changes)
        if outcome.kind == "oom":
            self._add_text(outcome.step or 0, OOM_TAG, describe_oom(outcome))
        self._write_text()

    def close(self) -> None:
        for name, tracker in list((self.trackers or {}).items()):
            self._guarded(name, tracker.finish)
        self.trackers = {}

    # -- text entries ----------------------------------------------------------------------

    def _add_changes(self, changes: Sequence[Mapping[str, Any]]) -> None:
        for change in changes[self.changes_written:]:
            step = int(change["step"])
            if isinstance(change.get("oom"), str):
                self._add_text(step, OOM_TAG, change["oom"])
            self._add_text(step, PLAN_TAG, describe_change(change))
        self.changes_written = len(changes)

    def _add_text(self, step: int, tag: str, text: str) -> None:
        self.pending_text.setdefault((step, tag), []).append(text)

    def _write_text(self) -> None:
        pending, self.pending_text = self.pending_text, {}
        for (step, tag), texts in sorted(pending.items()):
            # Markdown: a blank line keeps two entries of one step apart.
            self._log({tag: "\n\n".join(texts)}, step)

    # -- the trackers ----------------------------------------------------------------------

    def _open(self, start_step: int) -> None:
        """Open the trackers for an attempt that trains from ``start_step`` on (once)."""
        if self.trackers is not None:
            return
        self.trackers = {}
        for name in self.names:
            tracker = self._guarded(name, lambda: _open_tracker(name, self.workdir, self.job_name, start_step))
            if tracker is not None:
                self.trackers[name] = tracker

    def _log(self, values: dict[str, Any], step: int) -> None:
        if not values:
            return
        for name, tracker in list((self.trackers or {}).items()):
            self._guarded(name, lambda: tracker.log(values, step=step))

    def _guarded(self, name: str, call: Callable[[], Any]) -> Any:
        """``call``'s result; when it fails, the tracker is named once with the error and left
        out for the rest of the attempt (None)."""
        try:
            return call()
        except Exception as error:  # noqa: BLE001 - a tracker's failure must never end the training
            if self.trackers is not None:
                self.trackers.pop(name, None)
            self.say(f"metrics: the {name} tracker failed ({type(error).__name__}: {error}); training goes on without it")
            return None


def describe_change(change: Mapping[str, Any]) -> str:
    """A plan change (an AttemptRun.recoveries entry) as one line: the plans and why."""
    before = Plan.from_dict(change["from"]).short()
    if "bucket" in change:
        width, height = change["bucket"]
        return f"plan {before} stays; bucket {width}x{height} at micro-batch {change['bucket_micro_batch']}: {change['reason']}"
    return f"plan {before} -> {Plan.from_dict(change['to']).short()}: {change['reason']}"


def _open_tracker(name: str, workdir: Path, job_name: str, start_step: int) -> Any:
    """Start accelerate's tracker ``name`` for this job (train.log_with's names: jobs/spec/trackers.py)."""
    from accelerate import tracking

    _log_without_accelerate_state(tracking)
    if name == "tensorboard":
        # purge_step: what an earlier attempt logged from the first step this one trains on
        # was not kept (it resumes from a checkpoint before it): TensorBoard drops it.
        tracker = tracking.TensorBoardTracker(job_name, workdir / TENSORBOARD_DIR, purge_step=start_step + 1)
    elif name == "wandb":
        # One W&B run for all attempts of the job: an id of its workdir, resumed when it exists.
        tracker = tracking.WandBTracker(job_name, name=job_name, id=_run_id(workdir), resume="allow", dir=str(workdir))
    elif name == "mlflow":
        run_id_file = workdir / MLFLOW_RUN_ID_FILE
        run_id = run_id_file.read_text().strip() if run_id_file.exists() else None
        tracker = tracking.MLflowTracker(experiment_name=job_name, run_name=job_name, run_id=run_id or None)
    else:
        raise ValueError(f"unknown tracker {name!r} (train.log_with is checked against jobs/spec/trackers.py)")
    tracker.main_process_only = False  # only rank 0 makes trackers; accelerate must not ask its state
    tracker.start()
    if name == "mlflow" and not run_id_file.exists():
        run_id_file.write_text(tracker.active_run.info.run_id + "\n")
    return tracker


def _run_id(workdir: Path) -> str:
    """A tracker's run id that is the same for every attempt of the job: its workdir's."""
    return hashlib.sha256(str(workdir.resolve()).encode()).hexdigest()[:16]


class _StatelessLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger for accelerate.tracking's debug lines and warnings that works without
    accelerate's process-wide state: accelerate.logging's raises RuntimeError without it."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("accelerate.tracking"), {})
        self.warned: set[str] = set()

    def warning_once(self, message: str, *args: Any, **kwargs: Any) -> None:
        if message not in self.warned:
            self.warned.add(message)
            self.warning(message, *args, **kwargs)


def _log_without_accelerate_state(tracking: Any) -> None:
    # The trackers log through the module's ``logger``, looked up at each call.
    if not isinstance(tracking.logger, _StatelessLogger):
        tracking.logger = _StatelessLogger()
