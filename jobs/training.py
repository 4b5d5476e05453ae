"""One plan's training objects and one optimizer step: what the training loop and the probe
both run.

Precision is handled here with torch.autocast (and a GradScaler for fp16) rather than
accelerate's Accelerator: the Accelerator's state is a process-wide singleton whose mixed
precision cannot change once set, and the probe builds several plans in one process.
"""

from __future__ import annotations

import gc
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from oomguard.jobs.attempt import Control
from oomguard.jobs.memory_cap import DeviceMemory
from oomguard.jobs.spec import JobSpec
from oomguard.strategies import ladder
from oomguard.strategies.plan import Plan


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


@dataclass
class Training:
    """Model, optimizer and schedule under one plan. ``plan`` changes in place when the
    runner takes a rung that needs no new process."""

    plan: Plan
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    scaler: torch.amp.GradScaler | None
    autocast_dtype: torch.dtype | None
    device: torch.device

    def autocast(self) -> Any:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def device_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The consumers of device memory, for the OOM breakdown."""
        return {
            "parameters": list(self.model.parameters()),
            "gradients": [p.grad for p in self.model.parameters() if p.grad is not None],
            "optimizer_state": optimizer_tensors(self.optimizer),
        }

    def static_bytes(self) -> dict[str, int]:
        """Bytes of parameters, trainable parameters and optimizer state on the device (the
        memory model's static consumers)."""

        def total(tensors: list[torch.Tensor]) -> int:
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
            return sum(storages.values())

        trainable = [p for p in self.model.parameters() if p.requires_grad]
        return {
            "parameters": total(list(self.model.parameters())),
            "trainable": sum(p.numel() * p.element_size() for p in trainable),
            "optimizer_state": total(optimizer_tensors(self.optimizer)),
        }

    def apply(self, plan: Plan) -> None:
        """Switch to ``plan``, which differs only in knobs a running process can change."""
        ladder.configure_model(plan, self.model)
        self.plan = plan


def build_training(trainer: Any, job: JobSpec, plan: Plan, device: torch.device) -> Training:
    """Fresh model (the trainer seeds it: same initial weights every time) and optimizer."""
    from diffusers.optimization import get_scheduler

    model = trainer.build_model().to(device)
    ladder.configure_model(plan, model)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=job.train.learning_rate, weight_decay=job.train.weight_decay
    )
    lr_scheduler = get_scheduler("constant_with_warmup", optimizer=optimizer, num_warmup_steps=job.train.lr_warmup_steps)
    autocast_dtype = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}[plan.mixed_precision]
    scaler = torch.amp.GradScaler(device.type) if plan.mixed_precision == "fp16" else None
    return Training(plan, model, optimizer, lr_scheduler, scaler, autocast_dtype, device)


def free(training: Training | None = None) -> None:
    """Give memory back after an OOM or a probe: drop gradients, collect cycles, and return
    cached blocks to the device. Called outside any except block, so that the traceback and
    the tensors it holds are gone already."""
    if training is not None:
        training.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class StepResult:
    loss: float
    seconds: float


def one_step(trainer: Any, training: Training, step: int, memory: DeviceMemory, control: Control) -> StepResult:
    """One optimizer step over the whole effective batch, in micro-batches."""
    plan, model = training.plan, training.model
    started = time.perf_counter()
    control.phase = "data"
    with memory.paused():
        inputs = trainer.step_inputs(step)
    model.train()
    total = 0.0
    start = 0
    for size in plan.micro_batch_sizes():
        control.phase = "forward"
        with training.autocast():
            loss = trainer.slice_loss(model, inputs, start, start + size, training.device)
        # Weight by the slice's share of samples: the sum of the slices' gradients is then
        # the gradient of the whole batch's mean loss, however the batch was split.
        weighted = loss * (size / inputs.size)
        control.phase = "backward"
        if training.scaler is not None:
            training.scaler.scale(weighted).backward()
        else:
            weighted.backward()
        total += weighted.item()
        start += size
    for parameter in trainer.zero_gradient_parameters(model):
        if parameter.grad is not None:
            parameter.grad.zero_()
    control.phase = "optimizer"
    if training.scaler is not None:
        training.scaler.step(training.optimizer)
        training.scaler.update()
    else:
        training.optimizer.step()
    training.lr_scheduler.step()
    training.optimizer.zero_grad(set_to_none=True)
    if training.device.type == "cuda":
        torch.cuda.synchronize(training.device)
    return StepResult(loss=total, seconds=time.perf_counter() - started)
