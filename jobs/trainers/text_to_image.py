"""The built-in `text_to_image` trainer: fine-tune a Stable Diffusion pipeline's UNet (SD 1.x/2.x
or SDXL) on captioned images, the whole UNet or LoRA adapters on it.

It does what diffusers' examples/text_to_image scripts do (train_text_to_image.py, its _lora
and _sdxl variants): the VAE encodes each image to latents scaled by its scaling factor, the
text encoder(s) encode the tokenized caption, noise is added at a random timestep and the
UNet learns the noise (or the velocity, for a v-prediction scheduler), optionally with offset
noise and Min-SNR weighting. SDXL takes both encoders' penultimate hidden states side by side,
the second one's pooled projection and the six size numbers (original size, crop corner,
target size) as added conditioning.

What differs is what oomguard's determinism contract needs: every random draw of a step (the
noise, the timesteps, the noise of the VAE posterior's sample, the flips, the crop corners,
the offset noise) is made for the whole effective batch from a generator seeded by (seed,
step) and then sliced, so a run whose batch is split differently, or that resumes, trains
the same weights.

The VAE and the text encoders are frozen: their weights sit on the device beside the UNet (the
memory model's "frozen" consumer), and only what training uses goes there. The VAE's decoder
turns latents back into images, which training never does, so it stays in host memory (in SD
1.5 it is 60 % of the VAE's weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from oomguard.jobs.captions import captioned_images
from oomguard.jobs.data import SampleOrder, step_generator
from oomguard.jobs.memory_cap import DeviceMemory
from oomguard.jobs.spec import JobSpec
from oomguard.strategies.plan import Plan


class DataError(ValueError):
    """An image of the job's data folder that cannot be trained on; the text names it."""


@dataclass(frozen=True)
class TextImageInputs:
    """Host-side tensors for one whole effective batch (``time_ids`` and ``input_ids_2``: SDXL)."""

    pixels: torch.Tensor
    input_ids: torch.Tensor
    input_ids_2: torch.Tensor | None
    time_ids: torch.Tensor | None
    posterior_noise: torch.Tensor
    noise: torch.Tensor
    timesteps: torch.Tensor

    @property
    def size(self) -> int:
        return self.pixels.shape[0]


@dataclass(frozen=True)
class Sample:
    """One preprocessed image, and what SDXL's added conditioning says about it."""

    pixels: torch.Tensor
    original_size: tuple[int, int]
    crop_top_left: tuple[int, int]


class TextToImageTrainer:
    """The Trainer (jobs/trainers/base.py) of jobs with ``trainer = "text_to_image"``."""

    def __init__(self, job: JobSpec) -> None:
        from diffusers import AutoencoderKL, DDPMScheduler
        from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

        self.job = job
        self.pipeline_path = Path(job.model.path)
        self.sdxl = (self.pipeline_path / "text_encoder_2").is_dir()
        self.images = captioned_images(Path(job.data.source), job.data.caption_column)
        _check_images_open(self.images)
        self.order = SampleOrder(len(self.images), job.train.seed)
        path = str(self.pipeline_path)
        self.tokenizers = [CLIPTokenizer.from_pretrained(path, subfolder="tokenizer")]
        self.text_encoders: list[torch.nn.Module] = [CLIPTextModel.from_pretrained(path, subfolder="text_encoder")]
        if self.sdxl:
            self.tokenizers.append(CLIPTokenizer.from_pretrained(path, subfolder="tokenizer_2"))
            self.text_encoders.append(CLIPTextModelWithProjection.from_pretrained(path, subfolder="text_encoder_2"))
        self.vae = AutoencoderKL.from_pretrained(path, subfolder="vae")
        for part in (self.vae, *self.text_encoders):
            part.requires_grad_(False)
            part.eval()
        self.noise_scheduler = DDPMScheduler.from_pretrained(path, subfolder="scheduler")
        self.latent_channels = self.vae.config.latent_channels
        self.latent_size = job.data.resolution // 2 ** (len(self.vae.config.block_out_channels) - 1)

    # -- the model ---------------------------------------------------------------------------

    def build_model(self) -> torch.nn.Module:
        from diffusers import UNet2DConditionModel

        unet = UNet2DConditionModel.from_pretrained(str(self.pipeline_path), subfolder="unet")
        if self.job.model.trains_adapters:
            self._add_lora(unet)
        return unet

    def _add_lora(self, unet: torch.nn.Module) -> None:
        """Freeze the UNet and add the job's adapters, as train_text_to_image_lora.py does;
        lora_A is drawn from torch's generator, seeded here, so every build is the same."""
        from peft import LoraConfig

        model = self.job.model
        unet.requires_grad_(False)
        torch.manual_seed(self.job.train.seed)
        config = LoraConfig(r=model.lora_rank, lora_alpha=model.alpha, init_lora_weights="gaussian", target_modules=list(model.target_modules))
        try:
            unet.add_adapter(config)
        except ValueError as error:
            if "not found" not in str(error) and "Target modules" not in str(error):
                raise
            raise ValueError(
                f"model.target_modules: {list(model.target_modules)} names no module of the UNet in {self.pipeline_path / 'unet'} "
                f'(its attention projections are "to_q", "to_k", "to_v", "to_out.0"); peft said: {error}'
            ) from None

    def zero_gradient_parameters(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        """A key bias of softmax attention gets a gradient that is rounding noise (see the
        unconditional trainer); Stable Diffusion's attention has none, others may."""
        return [p for name, p in model.named_parameters() if name.endswith("to_k.bias") and p.requires_grad]

    # -- frozen parts ------------------------------------------------------------------------

    def _on_device(self) -> list[torch.nn.Module]:
        """The frozen modules training runs: the VAE's encoder half and the text encoders."""
        return [self.vae.encoder, self.vae.quant_conv, *self.text_encoders]

    def place_frozen(self, plan: Plan, device: torch.device, memory: DeviceMemory) -> None:
        for module in self._on_device():
            module.to(device)
        memory.move_in(self.frozen_tensors())

    def frozen_tensors(self) -> list[torch.Tensor]:
        return [t for module in self._on_device() for t in (*module.parameters(), *module.buffers())]

    # -- a step ------------------------------------------------------------------------------

    def step_inputs(self, step: int) -> TextImageInputs:
        batch, data = self.job.train.batch_size, self.job.data
        indices = self.order.indices(step, batch)
        generator = step_generator(self.job.train.seed, step)
        latent_shape = (batch, self.latent_channels, self.latent_size, self.latent_size)
        # The draws in a fixed order, each for the whole batch.
        noise = torch.randn(latent_shape, generator=generator)
        timesteps = torch.randint(0, self.noise_scheduler.config.num_train_timesteps, (batch,), generator=generator)
        posterior_noise = torch.randn(latent_shape, generator=generator)
        flips = torch.rand((batch,), generator=generator) < 0.5
        corners = torch.rand((batch, 2), generator=generator)
        offsets = torch.randn((batch, self.latent_channels, 1, 1), generator=generator)
        if self.job.train.noise_offset:
            noise = noise + self.job.train.noise_offset * offsets
        samples = [
            self._sample(index, flip=data.random_flip and bool(flip), corner=None if data.center_crop else (float(y), float(x)))
            for index, flip, (y, x) in zip(indices, flips, corners)
        ]
        captions = [self.images[index].caption for index in indices]
        time_ids = None
        if self.sdxl:
            time_ids = torch.tensor([[*s.original_size, *s.crop_top_left, data.resolution, data.resolution] for s in samples], dtype=torch.float32)
        return TextImageInputs(
            pixels=torch.stack([s.pixels for s in samples]),
            input_ids=self._tokenize(0, captions),
            input_ids_2=self._tokenize(1, captions) if self.sdxl else None,
            time_ids=time_ids,
            posterior_noise=posterior_noise,
            noise=noise,
            timesteps=timesteps,
        )

    def _tokenize(self, which: int, captions: list[str]) -> torch.Tensor:
        tokenizer = self.tokenizers[which]
        return tokenizer(captions, max_length=tokenizer.model_max_length, padding="max_length", truncation=True, return_tensors="pt").input_ids

    def _sample(self, index: int, *, flip: bool, corner: tuple[float, float] | None) -> Sample:
        """Image ``index`` as the scripts' transforms make it: the shorter side resized to the
        resolution (bilinear), flipped, then cropped square in the centre or at ``corner``
        (fractions of the room there is), and scaled to [-1, 1]."""
        from PIL import Image

        path, size = self.images[index].path, self.job.data.resolution
        try:
            with Image.open(path) as opened:
                image = opened.convert("RGB")
        except (OSError, ValueError, Image.DecompressionBombError) as error:
            raise DataError(f"data: image {path} does not decode ({error}): replace it or remove it (and its caption) from the folder") from None
        original = (image.height, image.width)
        short, long = sorted(image.size)
        scaled_long = int(size * long / short)
        image = image.resize((size, scaled_long) if image.width <= image.height else (scaled_long, size), Image.Resampling.BILINEAR)
        if flip:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if corner is None:
            top, left = int(round((image.height - size) / 2.0)), int(round((image.width - size) / 2.0))
        else:
            top, left = int(corner[0] * (image.height - size + 1)), int(corner[1] * (image.width - size + 1))
        image = image.crop((left, top, left + size, top + size))
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(size, size, 3).permute(2, 0, 1).float()
        return Sample(pixels / 127.5 - 1, original, (top, left))

    def slice_loss(self, model: torch.nn.Module, inputs: TextImageInputs, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """Mean loss over samples start..stop-1 of the step's batch."""

        def part(tensor: torch.Tensor) -> torch.Tensor:
            # copy=True: on the CPU .to() would otherwise return a view of the host batch,
            # which the emulated device would not count.
            return tensor[start:stop].to(device, copy=True)

        with torch.no_grad():
            posterior = self.vae.encode(part(inputs.pixels)).latent_dist
            # The posterior's sample, with noise drawn for the whole batch (latent_dist.sample
            # would draw it per slice).
            latents = (posterior.mean + posterior.std * part(inputs.posterior_noise)) * self.vae.config.scaling_factor
            hidden, added = self._encode_text(inputs, part)
        noise, timesteps = part(inputs.noise), part(inputs.timesteps)
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        if self.noise_scheduler.config.prediction_type == "v_prediction":
            target = self.noise_scheduler.get_velocity(latents, noise, timesteps)
        else:
            target = noise
        prediction = model(noisy, timesteps, hidden, added_cond_kwargs=added, return_dict=False)[0]
        loss = F.mse_loss(prediction.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
        if self.job.train.snr_gamma is not None:
            loss = loss * self._snr_weights(timesteps)
        return loss.mean()

    def _encode_text(self, inputs: TextImageInputs, part: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """The UNet's encoder_hidden_states, and SDXL's added conditioning (None for SD)."""
        if not self.sdxl:
            return self.text_encoders[0](part(inputs.input_ids), return_dict=False)[0], None
        hidden_states, pooled = [], None
        for encoder, ids in zip(self.text_encoders, (inputs.input_ids, inputs.input_ids_2)):
            output = encoder(part(ids), output_hidden_states=True, return_dict=False)
            pooled = output[0]  # the last encoder's projected, pooled output is SDXL's text_embeds
            hidden_states.append(output[-1][-2])
        assert inputs.time_ids is not None and pooled is not None
        return torch.cat(hidden_states, dim=-1), {"text_embeds": pooled, "time_ids": part(inputs.time_ids)}

    def _snr_weights(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Min-SNR weighting (Hang et al. 2023), as the scripts compute it: min(SNR, gamma) / SNR
        for epsilon, / (SNR + 1) for v-prediction."""
        from diffusers.training_utils import compute_snr

        snr = compute_snr(self.noise_scheduler, timesteps)
        weights = torch.clamp(snr, max=self.job.train.snr_gamma)
        if self.noise_scheduler.config.prediction_type == "v_prediction":
            return weights / (snr + 1)
        return weights / snr

    # -- the end -----------------------------------------------------------------------------

    def pipeline_class(self) -> Any:
        from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

        return StableDiffusionXLPipeline if self.sdxl else StableDiffusionPipeline

    def save_final(self, model: torch.nn.Module, directory: Path) -> None:
        """LoRA: the adapters as pytorch_lora_weights.safetensors, for pipeline.load_lora_weights.
        Full: the whole pipeline folder with the trained UNet, for from_pretrained."""
        if self.job.model.trains_adapters:
            from diffusers.utils import convert_state_dict_to_diffusers
            from peft.utils import get_peft_model_state_dict

            layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(model))
            self.pipeline_class().save_lora_weights(save_directory=str(directory), unet_lora_layers=layers, safe_serialization=True)
            return
        parts: dict[str, Any] = {"unet": model, "vae": self.vae, "text_encoder": self.text_encoders[0], "tokenizer": self.tokenizers[0]}
        if self.sdxl:
            parts.update(text_encoder_2=self.text_encoders[1], tokenizer_2=self.tokenizers[1])
        pipeline = self.pipeline_class().from_pretrained(str(self.pipeline_path), **parts)
        pipeline.save_pretrained(str(directory))


def _check_images_open(images: list[Any]) -> None:
    """Every image's header reads as an image: a file that is not one fails here, at the
    start, rather than some steps in (a file damaged further in fails when it is loaded)."""
    from PIL import Image

    for image in images:
        try:
            with Image.open(image.path):
                pass
        except (OSError, ValueError, Image.DecompressionBombError) as error:
            raise DataError(f"data: {image.path} is not an image that can be read ({error}): replace it or remove it (and its caption)") from None


def make_trainer(job: JobSpec) -> TextToImageTrainer:
    return TextToImageTrainer(job)
