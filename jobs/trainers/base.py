"""The Trainer protocol: what a built-in trainer supplies to the runner's loop.

The loop (jobs/loop.py), the probe (jobs/probe.py) and the shared training code
(jobs/training.py) know a trainer only through this interface. What a trainer supplies is
what differs between job kinds: the model's architecture (``build_model``), the step's inputs
(``step_inputs``), the loss of a slice of them (``slice_loss``), the parameters whose gradient
is noise (``zero_gradient_parameters``), how the final model is written (``save_final``) and
the frozen parts the trained model needs beside it, such as a text-to-image job's VAE and text
encoders (``place_frozen``, ``frozen_tensors``: the memory model's "frozen" consumer).

Everything generic to diffusers training is shared and not a trainer's: the plan's rungs on
the built model and the optimizer, autocast and the grad scaler (``training.build_training``),
gradient accumulation over micro-batches weighted by their share of samples
(``training.one_step``), the state a checkpoint keeps (``Training.weights``, ``optimizer``,
``lr_scheduler``, ``scaler``) and the device memory's consumers (``Training.device_tensors``,
``static_bytes``): all of these follow from the model the trainer built.

A new kind of job is a new module under jobs/trainers/ with a ``make_trainer(job, workdir)`` and one
line in the registry (jobs/trainers/__init__.py). Importing this module imports no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from oomguard.jobs.buckets import Bucket
    from oomguard.jobs.memory_cap import DeviceMemory
    from oomguard.strategies.plan import Plan


class StepInputs(Protocol):
    """Host-side tensors for one whole effective batch, drawn once per step so that the loss
    trajectory does not depend on how the batch is split (DESIGN.md, determinism contract)."""

    @property
    def size(self) -> int:
        """The samples in the batch (each micro-batch's loss is weighted by its share)."""
        ...


class Trainer(Protocol):
    def build_model(self) -> torch.nn.Module:
        """A fresh model on the host, seeded: every call builds the same initial weights
        (attempts, the probe's plans and a resume all start from them)."""
        ...

    def zero_gradient_parameters(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        """Parameters whose gradient is zero in exact arithmetic (their computed gradient is
        rounding noise, which would make micro-batch splits drift apart); may be empty."""
        ...

    def step_inputs(self, step: int) -> StepInputs:
        """The inputs of global step ``step``, a function of (seed, step) only."""
        ...

    def slice_loss(self, model: torch.nn.Module, inputs: Any, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """Mean loss over samples start..stop-1 of ``inputs`` (what ``step_inputs`` returned),
        moved to ``device`` here."""
        ...

    def save_final(self, model: torch.nn.Module, directory: Path) -> None:
        """Write the trained model to ``directory`` (the loop makes the write atomic)."""
        ...

    def place_frozen(self, plan: Plan, device: torch.device, memory: DeviceMemory) -> None:
        """Put the frozen parts where ``plan`` wants them (on ``device``, counted by ``memory``);
        called before the probe and for every plan built, so it must be idempotent. A trainer
        without frozen parts does nothing."""
        ...

    def frozen_tensors(self) -> list[torch.Tensor]:
        """The frozen parts' tensors on the device now (empty without any)."""
        ...

    def step_bucket(self, step: int) -> Bucket | None:
        """The size (an aspect-ratio bucket) step ``step``'s batch has, when steps differ in
        size; None when every step's batch has the same shape."""
        ...

    def heaviest_step(self) -> int:
        """A step whose batch has the most pixels (0 when all are alike): the probe measures
        there, so that the plan it starts at fits every step."""
        ...

    def frozen_sizes(self) -> dict[str, int]:
        """The bytes of each frozen part in full precision, wherever it is now, by the memory
        model's part names ("vae", "text"; empty without any)."""
        ...
