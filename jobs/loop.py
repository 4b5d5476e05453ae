"""The training loop every built-in trainer runs under: resume, train under the attempt's Plan,
checkpoint, report, and turn each way of ending into an Outcome.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from oomguard.jobs import checkpoints
from oomguard.jobs.attempt import HEARTBEAT, METRICS, AttemptConfig, Control, write_json_atomic
from oomguard.jobs.memory_cap import DeviceMemory
from oomguard.jobs.sizes import EMULATE_DEVICE_MEMORY_ENV, CapSchedule
from oomguard.jobs.trainers.unconditional import make_trainer
from oomguard.strategies import ladder
from oomguard.strategies.outcome import Outcome

TRAINER_STATE = "trainer_state.json"


@dataclass
class Progress:
    step: int = 0
    last_checkpoint: int | None = None
    resumed_from: int | None = None
    last_heartbeat: float = field(default=0.0)


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


def train(config: AttemptConfig, attempt_dir: Path, control: Control) -> Outcome:
    """Run the attempt to its end and say how it ended (an OOM is an Outcome, not an exception)."""
    from accelerate import Accelerator
    from diffusers.optimization import get_scheduler

    job, plan = config.job, config.plan
    device = pick_device()
    # The attempt's own setting first; the variable also covers a runner started by hand.
    cap_text = config.emulate_device_memory or os.environ.get(EMULATE_DEVICE_MEMORY_ENV)
    schedule = CapSchedule.parse(cap_text) if cap_text else None
    trainer = make_trainer(job)
    progress = Progress()
    model: torch.nn.Module | None = None
    optimizer: Any = None

    def groups() -> dict[str, list[torch.Tensor]]:
        if model is None:
            return {}
        return {
            "parameters": list(model.parameters()),
            "gradients": [p.grad for p in model.parameters() if p.grad is not None],
            "optimizer_state": optimizer_tensors(optimizer) if optimizer is not None else [],
        }

    memory = DeviceMemory(schedule, device, groups)

    def oom_outcome(error: torch.OutOfMemoryError) -> Outcome:
        return Outcome(
            kind="oom",
            step=progress.step,
            phase=control.phase,
            memory=memory.oom_figures(str(error)),
            message=str(error),
            resumed_from=progress.resumed_from,
        )

    metrics = (attempt_dir / METRICS).open("a")
    oom: Outcome | None = None
    try:
        with memory:
            accelerator = Accelerator(mixed_precision=plan.mixed_precision, cpu=device.type == "cpu")
            model = trainer.build_model().to(device)
            ladder.configure_model(plan, model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=job.train.learning_rate, weight_decay=job.train.weight_decay)
            lr_scheduler = get_scheduler(
                "constant_with_warmup", optimizer=optimizer, num_warmup_steps=job.train.lr_warmup_steps
            )
            model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)

            checkpoints_dir = config.workdir / "checkpoints"
            latest = checkpoints.latest_valid(checkpoints_dir, warn=lambda text: print(text, flush=True))
            if latest is not None:
                with memory.paused():
                    accelerator.load_state(str(latest.path))
                memory.track([*model.parameters(), *optimizer_tensors(optimizer)])
                progress.step = progress.last_checkpoint = progress.resumed_from = latest.step
                print(f"resumed from checkpoint at step {latest.step} ({latest.path.name})", flush=True)
            else:
                print("no checkpoint: starting at step 0", flush=True)

            def save_checkpoint() -> None:
                control.phase = "checkpoint"
                with memory.paused():

                    def write_state(directory: Path) -> None:
                        accelerator.save_state(str(directory))
                        (directory / TRAINER_STATE).write_text(json.dumps({"step": progress.step, "job": job.name}))

                    saved = checkpoints.save(checkpoints_dir, progress.step, plan.to_dict(), write_state, job.train.keep_checkpoints)
                progress.last_checkpoint = progress.step
                print(f"checkpoint at step {progress.step} ({saved.path.name})", flush=True)

            last_checkpoint_time = time.monotonic()
            while progress.step < job.train.max_steps:
                if control.stop_requested:
                    # Nothing to keep before the first step: the next attempt starts over.
                    if progress.last_checkpoint != progress.step and progress.step > 0:
                        save_checkpoint()
                    return Outcome(kind="interrupted", step=progress.step, message="stopped on request (SIGTERM) after a checkpoint", resumed_from=progress.resumed_from)
                memory.begin_step(progress.step)
                memory.reset_peak()
                started = time.perf_counter()
                try:
                    loss = _one_step(trainer, model, optimizer, lr_scheduler, accelerator, plan, progress.step, device, memory, control)
                except torch.OutOfMemoryError as error:
                    # Keep only numbers and text: the traceback holds the step's tensors, and
                    # they must be freed before anything else is allocated.
                    oom = oom_outcome(error)
                if oom is not None:
                    optimizer.zero_grad(set_to_none=True)
                    # The state is consistent unless the OOM hit inside optimizer.step, where
                    # parameters may be half updated: then the last checkpoint stands.
                    if oom.phase != "optimizer" and progress.last_checkpoint != progress.step and progress.step > 0:
                        save_checkpoint()
                    return oom
                if not math.isfinite(loss):
                    return Outcome(kind="diverged", step=progress.step, phase="forward", message=f"loss is {loss} at step {progress.step}", resumed_from=progress.resumed_from)
                seconds = time.perf_counter() - started
                progress.step += 1
                _report(attempt_dir, metrics, progress, job.train.max_steps, loss, job.train.batch_size / seconds, memory, plan.short())
                due_by_steps = progress.step % job.train.checkpoint_every_steps == 0
                every_seconds = job.train.checkpoint_every_seconds
                due_by_time = every_seconds is not None and time.monotonic() - last_checkpoint_time >= every_seconds
                if (due_by_steps or due_by_time) and progress.step < job.train.max_steps:
                    save_checkpoint()
                    last_checkpoint_time = time.monotonic()

            control.phase = "checkpoint"
            with memory.paused():
                _save_final(trainer, accelerator.unwrap_model(model), config.workdir / "final")
            print(f"finished: {progress.step} steps; final model in {config.workdir / 'final'}", flush=True)
            return Outcome(kind="finished", step=progress.step, resumed_from=progress.resumed_from)
    except torch.OutOfMemoryError as error:
        # Out of memory outside a training step: the model or a loaded checkpoint does not fit
        # (phase "setup"). Still an OOM for the doctor, not a crash to retry unchanged.
        return oom_outcome(error)
    finally:
        metrics.close()


def _one_step(trainer: Any, model: Any, optimizer: Any, lr_scheduler: Any, accelerator: Any, plan: Any, step: int, device: torch.device, memory: DeviceMemory, control: Control) -> float:
    """One optimizer step over the whole effective batch, in micro-batches. Returns its loss."""
    control.phase = "data"
    with memory.paused():
        inputs = trainer.step_inputs(step)
    model.train()
    total = 0.0
    start = 0
    for size in plan.micro_batch_sizes():
        control.phase = "forward"
        with accelerator.autocast():
            loss = trainer.slice_loss(model, inputs, start, start + size, device)
        # Weight by the slice's share of samples: the sum of the slices' gradients is then
        # the gradient of the whole batch's mean loss, however the batch was split.
        weighted = loss * (size / inputs.size)
        control.phase = "backward"
        accelerator.backward(weighted)
        total += weighted.item()
        start += size
    for parameter in trainer.zero_gradient_parameters(model):
        if parameter.grad is not None:
            parameter.grad.zero_()
    control.phase = "optimizer"
    optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def _report(attempt_dir: Path, metrics: Any, progress: Progress, max_steps: int, loss: float, samples_per_s: float, memory: DeviceMemory, plan: str) -> None:
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
    if now - progress.last_heartbeat >= 1.0 or progress.step == max_steps:
        write_json_atomic(attempt_dir / HEARTBEAT, record)
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
