"""The built-in `unconditional` trainer: DDPM on a diffusers UNet2DModel.

Everything random about a step is drawn for the whole effective batch from a generator
seeded by (seed, step) and then sliced, so the loss trajectory does not depend on how the
batch is split into micro-batches (the determinism contract in DESIGN.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from oomguard.jobs.data import ImageSource, SampleOrder, step_generator
from oomguard.jobs.memory_cap import DeviceMemory
from oomguard.jobs.spec import JobSpec
from oomguard.strategies.plan import Plan


@dataclass(frozen=True)
class StepInputs:
    """Host-side tensors for one whole effective batch."""

    images: torch.Tensor
    noise: torch.Tensor
    timesteps: torch.Tensor

    @property
    def size(self) -> int:
        return self.images.shape[0]


class UnconditionalTrainer:
    """The Trainer (jobs/trainers/base.py) of jobs with ``trainer = "unconditional"``."""

    def __init__(self, job: JobSpec) -> None:
        from diffusers import DDPMScheduler

        self.job = job
        self.images = ImageSource(job.data.source, job.data.resolution)
        self.order = SampleOrder(len(self.images), job.train.seed)
        self.noise_scheduler = DDPMScheduler(num_train_timesteps=job.train.num_train_timesteps)

    def build_model(self) -> torch.nn.Module:
        from diffusers import UNet2DModel

        # Seeded here so that every attempt builds the same initial weights.
        torch.manual_seed(self.job.train.seed)
        return UNet2DModel(sample_size=self.job.data.resolution, **self.job.model.kwargs())

    def zero_gradient_parameters(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        """Parameters whose gradient is zero in exact arithmetic.

        The key bias of softmax attention adds the same amount q.b to every score of a row,
        which softmax ignores; its computed gradient is pure rounding noise, and Adam scales
        noise up to full-size steps. Different micro-batch splits round differently, so left
        alone these biases would drift apart (~lr per step). Zeroing their gradient is what
        exact arithmetic gives, and makes every split train the same weights.
        """
        return [p for name, p in model.named_parameters() if name.endswith("to_k.bias")]

    def step_inputs(self, step: int) -> StepInputs:
        batch = self.job.train.batch_size
        images = self.images.load(self.order.indices(step, batch))
        generator = step_generator(self.job.train.seed, step)
        noise = torch.randn(images.shape, generator=generator)
        timesteps = torch.randint(0, self.noise_scheduler.config.num_train_timesteps, (batch,), generator=generator)
        if self.job.data.random_flip:
            flip = torch.rand((batch,), generator=generator) < 0.5
            images = torch.where(flip[:, None, None, None], images.flip(-1), images)
        return StepInputs(images=images, noise=noise, timesteps=timesteps)

    def slice_loss(self, model: torch.nn.Module, inputs: StepInputs, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """Mean loss over samples start..stop-1 of the step's batch."""
        # copy=True: on the CPU .to() would otherwise return a view of the host batch, which
        # the emulated device would not count; on a GPU it is the host-to-device copy anyway.
        clean = inputs.images[start:stop].to(device, copy=True)
        noise = inputs.noise[start:stop].to(device, copy=True)
        timesteps = inputs.timesteps[start:stop].to(device, copy=True)
        noisy = self.noise_scheduler.add_noise(clean, noise, timesteps)
        prediction = model(noisy, timesteps).sample
        return F.mse_loss(prediction.float(), noise.float())

    def save_final(self, model: torch.nn.Module, directory: Path) -> None:
        model.save_pretrained(directory)

    def place_frozen(self, plan: Plan, device: torch.device, memory: DeviceMemory) -> None:
        """The UNet is all there is: nothing frozen."""

    def frozen_tensors(self) -> list[torch.Tensor]:
        return []

    def frozen_sizes(self) -> dict[str, int]:
        return {}

    # Every step's batch is the resolution's square.
    def step_bucket(self, step: int) -> None:
        return None

    def heaviest_step(self) -> int:
        return 0


def make_trainer(job: JobSpec, workdir: Path | None = None) -> UnconditionalTrainer:
    return UnconditionalTrainer(job)
