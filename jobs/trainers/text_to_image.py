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

The VAE and the text encoders are frozen (jobs/frozen_parts.py: where they are under a plan).
With the rungs cache_latents and cache_text their encodings are computed once, at the start of
the attempt, and read from disk in each step (jobs/encoding_cache.py).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from oomguard.jobs.buckets import Bucket, BucketedOrder, cover
from oomguard.jobs.captions import captioned_images
from oomguard.jobs.data import SampleOrder, step_generator
from oomguard.jobs.encoding_cache import CACHE_FOLDER, EncodingCache, encoded_in_chunks, folder_digest, key_of
from oomguard.jobs.frozen_parts import FrozenParts
from oomguard.jobs.memory_cap import DeviceMemory
from oomguard.jobs.spec import JobSpec
from oomguard.jobs.spec.text_to_image import downsampling
from oomguard.strategies import rungs
from oomguard.strategies.plan import Plan


class DataError(ValueError):
    """An image of the job's data folder that cannot be trained on; the text names it."""


@dataclass(frozen=True)
class TextImageInputs:
    """Host-side tensors for one whole effective batch. The images come as pixels, or as the
    VAE posterior's cached moments; the captions as token ids (one tensor per tokenizer), or
    as cached embeddings (``pooled_embeds`` and ``time_ids``: SDXL's added conditioning)."""

    pixels: torch.Tensor | None
    moments: torch.Tensor | None
    input_ids: list[torch.Tensor] | None
    prompt_embeds: torch.Tensor | None
    pooled_embeds: torch.Tensor | None
    time_ids: torch.Tensor | None
    posterior_noise: torch.Tensor
    noise: torch.Tensor
    timesteps: torch.Tensor

    @property
    def size(self) -> int:
        return self.noise.shape[0]


@dataclass(frozen=True)
class Geometry:
    """Where one sample comes from in its image: the image's size, the size it is resized to
    (width, height), the crop's top-left corner in the resized image and the crop's size (the
    resolution's square, or the image's bucket)."""

    original_size: tuple[int, int]
    resized: tuple[int, int]
    crop_top_left: tuple[int, int]
    target: Bucket


class TextToImageTrainer:
    """The Trainer (jobs/trainers/base.py) of jobs with ``trainer = "text_to_image"``."""

    def __init__(self, job: JobSpec, workdir: Path | None = None) -> None:
        from diffusers import DDPMScheduler

        self.job = job
        self.pipeline_path = Path(job.model.path)
        self.frozen = FrozenParts(self.pipeline_path)
        self.sdxl = self.frozen.sdxl
        self.images = captioned_images(Path(job.data.source), job.data.caption_column)
        self.sizes = _image_sizes(self.images)
        self.order = SampleOrder(len(self.images), job.train.seed)
        self.captions = sorted({image.caption for image in self.images})
        self.caption_index = {caption: index for index, caption in enumerate(self.captions)}
        self.noise_scheduler = DDPMScheduler.from_pretrained(str(self.pipeline_path), subfolder="scheduler")
        vae = self.frozen.vae.config
        self.latent_channels = vae.latent_channels
        self.vae_factor = 2 ** (len(vae.block_out_channels) - 1)
        # Aspect-ratio buckets: each image's training size; every step draws from one bucket.
        self.bucketed: BucketedOrder | None = None
        if job.data.buckets:
            data = job.data
            self.bucketed = BucketedOrder.of(self.sizes, data.resolution, self._size_step(), data.bucket_no_upscale, job.train.batch_size, job.train.seed)
            if (repeats := self.bucketed.repeats()) is not None:
                print(repeats, flush=True)
        # A test's or a benchmark's trainer has no workdir: its caches live as long as it does.
        self.cache_dir = workdir / CACHE_FOLDER if workdir is not None else Path(tempfile.mkdtemp(prefix="oomguard-cache-"))
        self.latent_cache: EncodingCache | None = None
        self.text_cache: EncodingCache | None = None
        self._digests: dict[str, str] = {}

    def _size_step(self) -> int:
        """The multiple every side must be."""
        unet = json.loads((self.pipeline_path / "unet" / "config.json").read_text(encoding="utf-8"))
        return downsampling(self.frozen.vae.config, unet)

    def _target(self, index: int) -> Bucket:
        """The size image ``index`` is trained at."""
        if self.bucketed is not None:
            return self.bucketed.image_buckets[index]
        return Bucket(self.job.data.resolution, self.job.data.resolution)

    def step_bucket(self, step: int) -> Bucket | None:
        """The bucket step ``step`` trains on (None: every step has the resolution's square)."""
        return self.bucketed.batch(step)[0] if self.bucketed is not None else None

    def heaviest_step(self) -> int:
        """A step whose batch has the most pixels: the probe measures there."""
        return self.bucketed.first_step_of(self.bucketed.largest()) if self.bucketed is not None else 0

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

    def place_frozen(self, plan: Plan, device: torch.device, memory: DeviceMemory) -> None:
        """The frozen parts where the plan wants them, and the caches it reads built (with the
        device holding only the frozen parts when the attempt starts)."""
        handling = rungs.frozen_handling(plan)
        self.frozen.place(handling, device, memory)
        self.latent_cache = self._latents(plan.micro_batch, device, memory) if handling.latents_cached else None
        self.text_cache = self._text_embeddings(plan.micro_batch, device, memory) if handling.text_cached else None

    def frozen_tensors(self) -> list[torch.Tensor]:
        return self.frozen.on_device()

    def frozen_sizes(self) -> dict[str, int]:
        return self.frozen.sizes()

    def _digest(self, *parts: str) -> str:
        """A digest of the pipeline's ``parts`` folders (config, weights, vocabulary)."""
        name = "+".join(parts)
        if name not in self._digests:
            self._digests[name] = key_of({part: folder_digest(self.pipeline_path / part) for part in parts})
        return self._digests[name]

    def _latents(self, chunk: int, device: torch.device, memory: DeviceMemory) -> EncodingCache:
        """The cache of every image's posterior moments (both flips with random_flip), built
        when it does not exist yet."""
        data = self.job.data
        flips = (False, True) if data.random_flip else (False,)
        images = [(str(image.path), image.path.stat().st_size, image.path.stat().st_mtime_ns) for image in self.images]
        targets = [str(self._target(index)) for index in range(len(self.images))]
        key = key_of({
            "vae": self._digest("vae"), "dtype": str(self.frozen.dtype("vae")), "tiled": self.frozen.handling.encode_tiled,
            "images": images, "resolution": data.resolution, "flips": flips, **({"buckets": targets} if self.bucketed else {}),
        })
        cache = EncodingCache(self.cache_dir, "latents", key)
        if not cache.exists():
            # Encoded a size at a time: a chunk stacks images of one size.
            by_size: dict[str, list[tuple[int, bool]]] = {}
            for index in range(len(self.images)):
                by_size.setdefault(targets[index], []).extend((index, flip) for flip in flips)

            def encode(batch: list[tuple[int, bool]]) -> torch.Tensor:
                with memory.paused():
                    pixels = torch.stack([self._pixels(index, self._geometry(index, flip, None), flip) for index, flip in batch])
                return self.frozen.encode_images(pixels.to(device, copy=True))

            encoded: dict[str, torch.Tensor] = {}
            for items in by_size.values():
                encoded.update(encoded_in_chunks("cache_latents: encoded", items, chunk, encode, memory, lambda item: f"{item[0]}:{int(item[1])}"))
            cache.write(encoded)
        return cache

    def _text_embeddings(self, chunk: int, device: torch.device, memory: DeviceMemory) -> EncodingCache:
        """The cache of every caption's embeddings (and SDXL's pooled ones), built when it does
        not exist yet."""
        parts = ("tokenizer", "text_encoder", *(("tokenizer_2", "text_encoder_2") if self.sdxl else ()))
        key = key_of({"encoders": self._digest(*parts), "dtype": str(self.frozen.dtype("text")), "captions": self.captions})
        cache = EncodingCache(self.cache_dir, "text", key)
        if not cache.exists():

            def encode(batch: list[int]) -> torch.Tensor:
                ids = [t.to(device, copy=True) for t in self.frozen.tokenize([self.captions[index] for index in batch])]
                hidden, pooled = self.frozen.encode_text(ids)
                # One tensor per caption: the pooled embeddings ride along, flattened after the hidden states.
                return hidden.flatten(1) if pooled is None else torch.cat([hidden.flatten(1), pooled], dim=1)

            cache.write(encoded_in_chunks("cache_text: encoded", list(range(len(self.captions))), chunk, encode, memory, str))
        return cache

    # -- a step ------------------------------------------------------------------------------

    def step_inputs(self, step: int) -> TextImageInputs:
        batch, data = self.job.train.batch_size, self.job.data
        if self.bucketed is not None:
            size, indices = self.bucketed.batch(step)
        else:
            size, indices = Bucket(data.resolution, data.resolution), self.order.indices(step, batch)
        generator = step_generator(self.job.train.seed, step)
        latent_shape = (batch, self.latent_channels, size.height // self.vae_factor, size.width // self.vae_factor)
        # The draws in a fixed order, each for the whole batch.
        noise = torch.randn(latent_shape, generator=generator)
        timesteps = torch.randint(0, self.noise_scheduler.config.num_train_timesteps, (batch,), generator=generator)
        posterior_noise = torch.randn(latent_shape, generator=generator)
        flips = [data.random_flip and bool(flip) for flip in torch.rand((batch,), generator=generator) < 0.5]
        corners = torch.rand((batch, 2), generator=generator)
        offsets = torch.randn((batch, self.latent_channels, 1, 1), generator=generator)
        if self.job.train.noise_offset:
            noise = noise + self.job.train.noise_offset * offsets
        geometries = [self._geometry(i, flip, None if data.center_crop else (float(y), float(x))) for i, flip, (y, x) in zip(indices, flips, corners)]
        pixels = moments = None
        if self.latent_cache is not None:
            moments = torch.stack([self.latent_cache.get(f"{i}:{int(flip)}") for i, flip in zip(indices, flips)])
        else:
            pixels = torch.stack([self._pixels(i, geometry, flip) for i, geometry, flip in zip(indices, geometries, flips)])
        captions = [self.images[i].caption for i in indices]
        input_ids = prompt_embeds = pooled = None
        if self.text_cache is not None:
            prompt_embeds, pooled = self._cached_text(captions)
        else:
            input_ids = self.frozen.tokenize(captions)
        time_ids = None
        if self.sdxl:
            time_ids = torch.tensor([[*g.original_size, *g.crop_top_left, g.target.height, g.target.width] for g in geometries], dtype=torch.float32)
        return TextImageInputs(pixels, moments, input_ids, prompt_embeds, pooled, time_ids, posterior_noise, noise, timesteps)

    def _cached_text(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.text_cache is not None
        rows = torch.stack([self.text_cache.get(str(self.caption_index[caption])) for caption in captions])
        hidden_size = self._text_hidden_size
        tokens = self.frozen.tokenizers[0].model_max_length
        hidden = rows[:, : tokens * hidden_size].view(len(captions), tokens, hidden_size)
        return hidden, (rows[:, tokens * hidden_size:] if self.sdxl else None)

    @property
    def _text_hidden_size(self) -> int:
        """The width of a caption's embedding: both encoders' side by side for SDXL."""
        return sum(encoder.config.hidden_size for encoder in self.frozen.text_encoders) if self.sdxl else self.frozen.text_encoders[0].config.hidden_size

    def _geometry(self, index: int, flip: bool, corner: tuple[float, float] | None) -> Geometry:
        """The scripts' transforms, as numbers: resized to cover the target (the shorter side to
        the resolution, without buckets), (flipped,) then the target cropped in the centre or at
        ``corner`` (fractions of the room there is)."""
        target = self._target(index)
        height, width = self.sizes[index]
        resized = cover((height, width), target)
        if corner is None:
            top, left = int(round((resized[1] - target.height) / 2.0)), int(round((resized[0] - target.width) / 2.0))
        else:
            top, left = int(corner[0] * (resized[1] - target.height + 1)), int(corner[1] * (resized[0] - target.width + 1))
        return Geometry((height, width), resized, (top, left), target)

    def _pixels(self, index: int, geometry: Geometry, flip: bool) -> torch.Tensor:
        """Image ``index`` as ``geometry`` says (bilinear resize, flip, crop), in [-1, 1]."""
        from PIL import Image

        path, target = self.images[index].path, geometry.target
        try:
            with Image.open(path) as opened:
                image = opened.convert("RGB")
        except (OSError, ValueError, Image.DecompressionBombError) as error:
            raise DataError(f"data: image {path} does not decode ({error}): replace it or remove it (and its caption) from the folder") from None
        image = image.resize(geometry.resized, Image.Resampling.BILINEAR)
        if flip:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        top, left = geometry.crop_top_left
        image = image.crop((left, top, left + target.width, top + target.height))
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(target.height, target.width, 3).permute(2, 0, 1).float()
        return pixels / 127.5 - 1

    def slice_loss(self, model: torch.nn.Module, inputs: TextImageInputs, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """Mean loss over samples start..stop-1 of the step's batch."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        def part(tensor: torch.Tensor) -> torch.Tensor:
            # copy=True: on the CPU .to() would otherwise return a view of the host batch,
            # which the emulated device would not count.
            return tensor[start:stop].to(device, copy=True)

        with torch.no_grad():
            moments = part(inputs.moments) if inputs.moments is not None else self.frozen.encode_images(part(inputs.pixels))
            # The posterior's sample, with noise drawn for the whole batch (latent_dist.sample
            # would draw it per slice).
            posterior = DiagonalGaussianDistribution(moments)
            latents = (posterior.mean + posterior.std * part(inputs.posterior_noise)) * self.frozen.vae.config.scaling_factor
            if inputs.prompt_embeds is not None:
                hidden = part(inputs.prompt_embeds)
                pooled = part(inputs.pooled_embeds) if inputs.pooled_embeds is not None else None
            else:
                hidden, pooled = self.frozen.encode_text([part(ids) for ids in inputs.input_ids])
        added = {"text_embeds": pooled, "time_ids": part(inputs.time_ids)} if self.sdxl else None
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
        # The frozen parts come from the base folder as they are there (training never
        # changes them; a rung may have cast or moved the copies here).
        pipeline = self.pipeline_class().from_pretrained(str(self.pipeline_path), unet=model)
        pipeline.save_pretrained(str(directory))


def _image_sizes(images: list[Any]) -> list[tuple[int, int]]:
    """Every image's (height, width), read from its header: a file that is not an image fails
    here, at the start, rather than some steps in (a file damaged further in fails when it is
    loaded)."""
    from PIL import Image

    sizes = []
    for image in images:
        try:
            with Image.open(image.path) as opened:
                sizes.append((opened.height, opened.width))
        except (OSError, ValueError, Image.DecompressionBombError) as error:
            raise DataError(f"data: {image.path} is not an image that can be read ({error}): replace it or remove it (and its caption)") from None
    return sizes


def make_trainer(job: JobSpec, workdir: Path | None = None) -> TextToImageTrainer:
    return TextToImageTrainer(job, workdir)
