"""Samples rendered while a text-to-image job trains (train.sample_every_steps), and the memory
that phase needs, which is not the training step's: a second forward per prompt under
classifier-free guidance, and the VAE's decoder at full size, beside the optimizer state.

An OOM while sampling is never answered with a training rung: the training plan stays. The
sampler has its own settings, tried in order, each kept for the rest of the attempt once taken:

1. every prompt at once;
2. one prompt at a time;
3. and the optimizer's state in host memory while sampling (moved back after);
4. and the VAE decoding in tiles, one image at a time;

and when even the last runs out of memory, that step's samples are skipped with a warning and
training goes on. Images go to WORKDIR/samples/step-NNNNNN/NN.png.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from oomguard.jobs.memory_cap import DeviceMemory
from oomguard.jobs.optimizers import device_state_tensors
from oomguard.jobs.spec import JobSpec

SAMPLES_FOLDER = "samples"


@dataclass(frozen=True)
class SampleSettings:
    one_at_a_time: bool = False
    optimizer_on_host: bool = False
    vae_tiled: bool = False

    def describe(self) -> str:
        parts = ["one prompt at a time" if self.one_at_a_time else "every prompt at once"]
        if self.optimizer_on_host:
            parts.append("the optimizer state in host memory while sampling")
        if self.vae_tiled:
            parts.append("the VAE decoding in tiles")
        return ", ".join(parts)


LADDER = (
    SampleSettings(),
    SampleSettings(one_at_a_time=True),
    SampleSettings(one_at_a_time=True, optimizer_on_host=True),
    SampleSettings(one_at_a_time=True, optimizer_on_host=True, vae_tiled=True),
)


class StateNotRestored(RuntimeError):
    """The optimizer state could not come back to the device after sampling: not an OOM the
    sampler may step down from (its state is not whole on the device), so the attempt ends on
    it and the next resumes from the last checkpoint."""


@contextmanager
def optimizer_state_on_host(optimizer: torch.optim.Optimizer, memory: DeviceMemory) -> Iterator[None]:
    """The optimizer's state tensors that sit on the device, in host memory for the block."""
    on_device = {id(t) for t in device_state_tensors(optimizer)}
    moved: list[tuple[dict[str, Any], str, torch.device, torch.Tensor]] = []
    for state in optimizer.state.values():
        for key in list(state):
            if isinstance(state[key], torch.Tensor) and id(state[key]) in on_device:
                device = state[key].device
                # Replaced in the state: the device tensor goes with its last reference.
                state[key] = memory.to_host(state[key])
                moved.append((state, key, device, state[key]))
    del on_device
    try:
        yield
    finally:
        try:
            for state, key, device, host in moved:
                state[key] = memory.to_device(host, device)
        except torch.OutOfMemoryError as error:
            raise StateNotRestored(f"out of memory moving the optimizer state back to the device after sampling: {error}") from error


class Sampler:
    """Renders a text-to-image job's samples at its sampling steps (jobs/loop.py calls it)."""

    def __init__(self, job: JobSpec, trainer: Any, workdir: Path, say: Callable[[str], None]) -> None:
        self.train = job.train
        self.trainer = trainer
        self.folder = workdir / SAMPLES_FOLDER
        self.say = say
        self.level = 0

    def due(self, step: int) -> bool:
        every = self.train.sample_every_steps
        return every is not None and step % every == 0

    def render(self, training: Any, step: int, memory: DeviceMemory) -> list[Path]:
        """The samples of ``step``, written; [] when every setting ran out of memory."""
        from oomguard.jobs.training import free

        while True:
            settings = LADDER[self.level]
            ran_out = None
            try:
                return self._render(training, step, memory, settings)
            except torch.OutOfMemoryError as error:
                ran_out = str(error).splitlines()[0]
            # Out of the except block: the traceback, and the tensors it holds, are gone.
            free()
            if self.level + 1 == len(LADDER):
                self.say(f"sampling at step {step}: out of memory with {settings.describe()} ({ran_out}); samples skipped, training goes on")
                return []
            self.level += 1
            self.say(f"sampling at step {step}: out of memory with {settings.describe()}; now {LADDER[self.level].describe()} (the training plan stays)")

    def _render(self, training: Any, step: int, memory: DeviceMemory, settings: SampleSettings) -> list[Path]:
        prompts = self.train.sample_prompts
        batch = 1 if settings.one_at_a_time else len(prompts)
        host_state = optimizer_state_on_host(training.optimizer, memory) if settings.optimizer_on_host else nullcontext()
        with host_state, training.autocast():
            images = self.trainer.render_samples(
                training.model, prompts, self.train.sample_inference_steps, self.train.seed, batch, settings.vae_tiled, training.device, memory,
            )
        return self._write(images, step)

    def _write(self, images: torch.Tensor, step: int) -> list[Path]:
        from PIL import Image

        folder = self.folder / f"step-{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for index, image in enumerate(images):
            pixels = (image.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
            path = folder / f"{index:02d}.png"
            Image.fromarray(pixels).save(path)
            paths.append(path)
        self.say(f"samples of step {step}: {len(paths)} image(s) in {folder}")
        return paths
