"""The training loop every built-in trainer runs under: resume, train under the attempt's Plan,
recover from an OOM in forward or backward inside the process, checkpoint, report, and turn
each way of ending into an Outcome.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from oomguard.jobs import checkpoints, faults, train_state
from oomguard.jobs.attempt import HEARTBEAT, METRICS, AttemptConfig, Control, write_json_atomic
from oomguard.jobs.emulated_gpus import AssignedGpu
from oomguard.jobs.memory_cap import DeviceMemory
from oomguard.jobs.probe import run_probe
from oomguard.jobs.sizes import EMULATE_DEVICE_MEMORY_ENV, CapSchedule
from oomguard.jobs.trainers.unconditional import make_trainer
from oomguard.jobs.training import Training, build_training, free, one_step, oom_measurement, unfit_to_continue
from oomguard.strategies.contention import find_contention
from oomguard.strategies.doctor import decide_in_process, describe_oom
from oomguard.strategies.memory_model import Measurement
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan

# In-process rung changes per attempt, at most (each one excludes a plan, so the ladder ends
# well before; this bounds it regardless).
MAX_RECOVERIES = 32


@dataclass
class Progress:
    step: int = 0
    last_checkpoint: int | None = None
    resumed_from: int | None = None
    last_heartbeat: float = field(default=0.0)


@dataclass
class PlanRecord:
    """Steady-state steps of one plan in this process (the first step after building an
    optimizer is not steady: its state appears only in that step)."""

    peaks: list[int] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    capacity: int | None = None
    static: dict[str, int] = field(default_factory=dict)


def train(config: AttemptConfig, attempt_dir: Path, control: Control) -> Outcome:
    """Run the attempt to its end and say how it ended (an OOM is an Outcome, not an exception)."""
    job = config.job
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    # The attempt's own setting first; the variable also covers a runner started by hand.
    cap_text = config.emulate_device_memory or os.environ.get(EMULATE_DEVICE_MEMORY_ENV)
    schedule = CapSchedule.parse(cap_text) if cap_text else None
    trainer = make_trainer(job)
    progress = Progress()
    training: Training | None = None
    plan = config.plan
    measurements: list[Measurement] = []
    records: dict[Plan, PlanRecord] = {}
    recoveries: list[dict[str, Any]] = []
    say = lambda text: print(text, flush=True)  # noqa: E731

    memory = DeviceMemory(
        schedule, device, lambda: training.device_tensors() if training is not None else {}, gpu=AssignedGpu.from_environment()
    )

    def ended(outcome: Outcome) -> Outcome:
        return dataclasses.replace(
            outcome,
            resumed_from=progress.resumed_from,
            plan=training.plan if training is not None else plan,
            measurements=tuple(measurements + _steady(records)),
            recoveries=tuple(recoveries),
        )

    def oom_outcome(error: torch.OutOfMemoryError) -> Outcome:
        figures = memory.oom_figures(str(error))
        current = training.plan if training is not None else plan
        measurements.append(oom_measurement(current, figures, training, progress.step))
        return Outcome(kind="oom", step=progress.step, phase=control.phase, memory=figures, message=str(error))

    metrics = (attempt_dir / METRICS).open("a")
    oom: Outcome | None = None
    try:
        with memory:
            checkpoints_dir = config.workdir / "checkpoints"
            latest, weights = _newest_usable(checkpoints_dir, memory, say)
            memory.begin_step(latest.step if latest is not None else 0)
            if config.probe and latest is None:
                probed = run_probe(trainer, job, plan, device, memory, control, say)
                measurements.extend(probed.measurements)
                if probed.plan != plan:
                    recoveries.append({"step": 0, "from": plan.to_dict(), "to": probed.plan.to_dict(), "reason": probed.reason})
                plan = probed.plan
                say(probed.reason)
                if probed.failure is not None:
                    return ended(probed.failure)
            control.phase = "setup"
            if latest is None:
                training = build_training(trainer, job, plan, device, memory)
                say("no checkpoint: starting at step 0")
            else:
                training = build_training(trainer, job, plan, device, memory, weights)
                del weights
                with memory.paused():
                    train_state.load_rest(
                        latest.path, optimizer=training.optimizer, lr_scheduler=training.lr_scheduler, scaler=training.scaler, plan=plan, say=say
                    )
                memory.track(training.device_tensors()["optimizer_state"])
                progress.step = progress.last_checkpoint = progress.resumed_from = latest.step
                say(f"resumed from checkpoint at step {latest.step} ({latest.path.name})")

            def save_checkpoint() -> None:
                assert training is not None
                control.phase = "checkpoint"
                current = training

                def write_state(directory: Path) -> None:
                    train_state.save(
                        directory,
                        weights=current.weights(),
                        optimizer=current.optimizer,
                        lr_scheduler=current.lr_scheduler,
                        scaler=current.scaler,
                        plan=current.plan,
                        step=progress.step,
                        job_name=job.name,
                    )

                with memory.paused():
                    saved = checkpoints.save(checkpoints_dir, progress.step, current.plan.to_dict(), write_state, job.train.keep_checkpoints)
                progress.last_checkpoint = progress.step
                say(f"checkpoint at step {progress.step} ({saved.path.name})")

            last_checkpoint_time = time.monotonic()
            steps_in_process = 0
            while progress.step < job.train.max_steps:
                if control.stop_requested:
                    # Nothing to keep before the first step: the next attempt starts over.
                    if progress.last_checkpoint != progress.step and progress.step > 0:
                        save_checkpoint()
                    return ended(Outcome(kind="interrupted", step=progress.step, message="stopped on request (SIGTERM) after a checkpoint"))
                memory.begin_step(progress.step)
                memory.reset_peak()
                try:
                    result = one_step(trainer, training, progress.step, memory, control)
                except torch.OutOfMemoryError as error:
                    # Keep only numbers and text: the traceback holds the step's tensors, and
                    # they must be freed before anything else is allocated.
                    oom = oom_outcome(error)
                if oom is not None:
                    free(training)
                    leftover = unfit_to_continue(memory, training.resident_bytes())
                    record = records.get(training.plan)
                    contention = find_contention(oom.memory, max(record.peaks) if record and record.peaks else None)
                    if contention is not None:
                        # Not the job's doing: no rung. The daemon waits for the memory to
                        # come back and runs the same plan from the checkpoint.
                        say(f"out of memory in {oom.phase} at step {progress.step}: {contention.describe()}; stopping for the daemon to wait")
                    elif leftover is not None:
                        say(f"the failed step left {leftover / 2**20:.1f} MiB behind on the device: a new process must take over")
                    elif oom.phase in ("data", "forward", "backward") and config.recover_in_process and len(recoveries) < MAX_RECOVERIES:
                        recovery = decide_in_process(training.plan, measurements + _steady(records), job.policy(), oom.memory.total if oom.memory else None)
                        if recovery is not None:
                            # Nothing of the step was applied: run the same step again.
                            recoveries.append({
                                "step": progress.step, "from": training.plan.to_dict(), "to": recovery.plan.to_dict(), "reason": recovery.reason,
                                "oom": describe_oom(oom),
                            })
                            say(f"out of memory in {oom.phase} at step {progress.step}; {recovery.reason}")
                            training.apply(recovery.plan)
                            oom = None
                            continue
                    # The state is consistent unless the OOM hit inside optimizer.step, where
                    # parameters may be half updated: then the last checkpoint stands.
                    if oom.phase != "optimizer" and progress.last_checkpoint != progress.step and progress.step > 0:
                        save_checkpoint()
                    return ended(oom)
                if not math.isfinite(result.loss):
                    return ended(Outcome(kind="diverged", step=progress.step, phase="forward", message=f"loss is {result.loss} at step {progress.step}"))
                steps_in_process += 1
                samples_per_s = job.train.batch_size / result.seconds
                if steps_in_process > 1:
                    record = records.setdefault(training.plan, PlanRecord())
                    record.peaks.append(memory.peak_bytes() or 0)
                    record.rates.append(samples_per_s)
                    record.capacity = memory.capacity()
                    record.static = training.static_bytes()
                progress.step += 1
                faults.after_step(training, progress.step)
                memory.publish()
                _report(attempt_dir, metrics, progress, job.train.max_steps, result.loss, samples_per_s, memory, training.plan.short(), recoveries)
                due_by_steps = progress.step % job.train.checkpoint_every_steps == 0
                every_seconds = job.train.checkpoint_every_seconds
                due_by_time = every_seconds is not None and time.monotonic() - last_checkpoint_time >= every_seconds
                if (due_by_steps or due_by_time) and progress.step < job.train.max_steps:
                    save_checkpoint()
                    last_checkpoint_time = time.monotonic()

            control.phase = "checkpoint"
            with memory.paused():
                _save_final(trainer, training.final_model(), config.workdir / "final")
            say(f"finished: {progress.step} steps; final model in {config.workdir / 'final'}")
            return ended(Outcome(kind="finished", step=progress.step))
    except torch.OutOfMemoryError as error:
        # Out of memory outside a training step: the model or a loaded checkpoint does not fit
        # (phase "setup"). Still an OOM for the doctor, not a crash to retry unchanged.
        oom = oom_outcome(error)
        return ended(oom)
    finally:
        memory.withdraw()
        metrics.close()


def _newest_usable(checkpoints_dir: Path, memory: DeviceMemory, say: Any) -> tuple[checkpoints.Checkpoint | None, train_state.ModelWeights | None]:
    """The newest checkpoint that verifies and whose weights are finite, with its weights: a
    run that diverged may have saved NaN weights before its loss showed it."""
    for checkpoint in checkpoints.valid_newest_first(checkpoints_dir, warn=say):
        with memory.paused():
            weights = train_state.load_weights(checkpoint.path, Plan.from_dict(checkpoint.plan))
        if train_state.finite(weights):
            return checkpoint, weights
        say(f"skipping checkpoint {checkpoint.path.name}: its weights hold NaN or inf (the run diverged before it was written)")
    return None, None


def _steady(records: dict[Plan, PlanRecord]) -> list[Measurement]:
    return [
        Measurement(plan=p, fits=True, peak_bytes=max(r.peaks), capacity=r.capacity, samples_per_s=statistics.median(r.rates), static=r.static)
        for p, r in records.items()
        if r.peaks
    ]


def _report(
    attempt_dir: Path,
    metrics: Any,
    progress: Progress,
    max_steps: int,
    loss: float,
    samples_per_s: float,
    memory: DeviceMemory,
    plan: str,
    recoveries: list[dict[str, Any]],
) -> None:
    record = {
        "step": progress.step,
        "max_steps": max_steps,
        "loss": loss,
        "samples_per_s": samples_per_s,
        "peak_bytes": memory.peak_bytes(),
        "capacity_bytes": memory.capacity(),
        "plan": plan,
        "time": time.time(),
    }
    metrics.write(json.dumps(record) + "\n")
    metrics.flush()
    now = time.monotonic()
    # The heartbeat is a small file rewritten at most once a second (and on the last step).
    # It carries the rungs the runner took so far, which the daemon reports while it runs.
    if now - progress.last_heartbeat >= 1.0 or progress.step == max_steps:
        write_json_atomic(attempt_dir / HEARTBEAT, {**record, "recoveries": recoveries})
        progress.last_heartbeat = now
        print(f"step {progress.step}/{max_steps} loss {loss:.5f} {samples_per_s:.1f} samples/s", flush=True)


def _save_final(trainer: Any, model: Any, final_dir: Path) -> None:
    """Write the final model atomically: a `final/` directory is always complete."""
    temporary = final_dir.with_name(final_dir.name + ".tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    trainer.save_final(model, temporary)
    if final_dir.exists():
        shutil.rmtree(final_dir)
    temporary.rename(final_dir)
