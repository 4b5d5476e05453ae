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
from typing import TYPE_CHECKING, Any

import torch

from oomguard.jobs.memory_cap import DeviceMemory
from oomguard.jobs.optimizers import device_state_tensors
from oomguard.jobs.spec import JobSpec

if TYPE_CHECKING:
    from oomguard.jobs.trainers.text_to_image import TextToImageTrainer

SAMPLES_FOLDER = "samples"
# Classifier-free guidance of the samples (diffusers' default).
GUIDANCE = 7.5


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
    """Renders a text-to-image job's samples at its sampling steps (jobs/loop.py makes one for a
    job with train.sample_every_steps)."""

    def __init__(self, job: JobSpec, trainer: TextToImageTrainer, workdir: Path, say: Callable[[str], None]) -> None:
        self.train = job.train
        self.trainer = trainer
        self.folder = workdir / SAMPLES_FOLDER
        self.say = say
        self.level = 0

    def due(self, step: int) -> bool:
        return step % self.train.sample_every_steps == 0

    def render(self, training: Any, step: int, memory: DeviceMemory) -> list[Path]:
        """The samples of ``step``, written; [] when every setting ran out of memory."""
        from oomguard.jobs.step_oom import free

        while True:
            settings = LADDER[self.level]
            try:
                return self._render(training, step, memory, settings)
            except torch.OutOfMemoryError as error:
                ran_out = str(error).splitlines()[0]
            # Out of the except block: the traceback, and the tensors it holds, are gone.
            free(memory)
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
            images = render_samples(
                self.trainer, training.model, prompts, self.train.sample_inference_steps, self.train.seed, batch, settings.vae_tiled, training.device, memory,
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


@torch.no_grad()
def render_samples(
    trainer: TextToImageTrainer, model: torch.nn.Module, prompts: tuple[str, ...], inference_steps: int, seed: int, batch: int,
    vae_tiled: bool, device: torch.device, memory: DeviceMemory,
) -> torch.Tensor:
    """Images (N, 3, H, W) in [0, 1], on the host, of ``prompts`` by the model being trained
    (its trainer's frozen parts, scheduler config and latent size): DDIM, classifier-free
    guidance against the empty prompt (SDXL: against zeros, as its pipeline), ``batch`` prompts
    at a time. Each prompt's starting noise is drawn from seed + its index, so how many go at
    once changes nothing but the rounding."""
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler.from_config(trainer.noise_scheduler.config)
    size = trainer.job.data.resolution // trainer.vae_factor
    rendered = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(prompts), batch):
            chunk = prompts[start:start + batch]
            # The prompts, then as many empty prompts (the unconditional half).
            ids = [t.to(device, copy=True) for t in trainer.frozen.tokenize([*chunk, *[""] * len(chunk)])]
            hidden, pooled = trainer.frozen.encode_text(ids)
            hidden = hidden.float()
            added = None
            if trainer.sdxl:
                # SDXL's pipeline guides against zeros, not the empty prompt's embeddings
                # (its force_zeros_for_empty_prompt).
                hidden[len(chunk):] = 0
                pooled = pooled.float()
                pooled[len(chunk):] = 0
                resolution = trainer.job.data.resolution
                time_ids = torch.tensor([[resolution, resolution, 0, 0, resolution, resolution]], dtype=torch.float32).to(device, copy=True)
                added = {"text_embeds": pooled, "time_ids": time_ids.repeat(2 * len(chunk), 1)}
            noise = [
                torch.randn((1, trainer.latent_channels, size, size), generator=torch.Generator().manual_seed(seed + start + i))
                for i in range(len(chunk))
            ]
            latents = torch.cat(noise).to(device, copy=True) * scheduler.init_noise_sigma
            scheduler.set_timesteps(inference_steps)
            for t in scheduler.timesteps:
                doubled = scheduler.scale_model_input(torch.cat([latents, latents]), t)
                conditional, unconditional = model(doubled, t, hidden, added_cond_kwargs=added, return_dict=False)[0].chunk(2)
                guided = unconditional + GUIDANCE * (conditional - unconditional)
                latents = scheduler.step(guided, t, latents).prev_sample
            images = trainer.frozen.decode_latents(latents, tiled=vae_tiled)
            with memory.paused():  # host copies, which the emulated device must not count
                rendered.append(images.to("cpu", copy=True))
            del images, latents
    finally:
        model.train(was_training)
    return torch.cat(rendered)
