"""The frozen parts of a Stable Diffusion pipeline that training runs beside the UNet: the VAE's
encoder and the text encoder(s), and where they are under a plan.

Where is what the frozen-part rungs decide (strategies.rungs.frozen_handling): on the device
between steps (the default, as diffusers' scripts keep them), in host memory visiting the
device only to encode (``on_host``), or not needed at all because their encodings are cached
(``latents_cached``, ``text_cached``); in fp32 or 16 bits (``half``); the VAE encoding whole
images, one image at a time (``encode_sliced``) or in tiles (``encode_tiled``).

The VAE's decoder turns latents back into images, which training never does: it stays in host
memory whatever the plan (in SD 1.5 it holds 60 % of the VAE's weights).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from oomguard.jobs.memory_cap import DeviceMemory
from oomguard.strategies.rungs.base import FrozenHandling

HOST = torch.device("cpu")


class FrozenParts:
    """The tokenizers, text encoders and VAE of the pipeline in ``path`` (SDXL when it has a
    second text encoder), frozen, in fp32, in host memory until placed."""

    def __init__(self, path: Path) -> None:
        from diffusers import AutoencoderKL
        from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

        self.path = path
        self.sdxl = (path / "text_encoder_2").is_dir()
        self.tokenizers = [CLIPTokenizer.from_pretrained(str(path), subfolder="tokenizer")]
        self.text_encoders: list[torch.nn.Module] = [CLIPTextModel.from_pretrained(str(path), subfolder="text_encoder")]
        if self.sdxl:
            self.tokenizers.append(CLIPTokenizer.from_pretrained(str(path), subfolder="tokenizer_2"))
            self.text_encoders.append(CLIPTextModelWithProjection.from_pretrained(str(path), subfolder="text_encoder_2"))
        self.vae = AutoencoderKL.from_pretrained(str(path), subfolder="vae")
        for module in (self.vae, *self.text_encoders):
            module.requires_grad_(False)
            module.eval()
            module.float()
        self.handling = FrozenHandling()
        self.device = HOST
        self.memory: DeviceMemory | None = None

    # -- what there is -------------------------------------------------------------------

    def modules(self, part: str) -> list[torch.nn.Module]:
        """The modules of ``part`` ("vae": the encoder half; "text": the text encoders)."""
        if part == "vae":
            return [m for m in (self.vae.encoder, self.vae.quant_conv) if m is not None]
        return list(self.text_encoders)

    @staticmethod
    def _tensors(modules: list[torch.nn.Module]) -> list[torch.Tensor]:
        return [t for module in modules for t in (*module.parameters(), *module.buffers())]

    def sizes(self) -> dict[str, int]:
        """Each part's bytes with its weights in fp32, wherever it is (the memory model's frozen
        sizes); integer buffers (position ids) as they are."""

        def fp32_bytes(t: torch.Tensor) -> int:
            return t.numel() * (4 if t.is_floating_point() else t.element_size())

        return {part: sum(fp32_bytes(t) for t in self._tensors(self.modules(part))) for part in ("vae", "text")}

    def resident(self, part: str) -> bool:
        """Whether ``part`` stays on the device between steps under the current handling."""
        cached = self.handling.latents_cached if part == "vae" else self.handling.text_cached
        return not cached and not self.handling.on_host

    def on_device(self) -> list[torch.Tensor]:
        return self._tensors([m for part in ("vae", "text") if self.resident(part) for m in self.modules(part)])

    # -- placing them ----------------------------------------------------------------------

    def dtype(self, part: str) -> torch.dtype:
        """fp32, or under ``half`` bf16 where the device computes it, else fp16 for the text
        encoders and fp32 for the VAE (SDXL's VAE overflows in fp16)."""
        if not self.handling.half:
            return torch.float32
        if self.device.type == "cpu" or torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float16 if part == "text" else torch.float32

    def place(self, handling: FrozenHandling, device: torch.device, memory: DeviceMemory) -> None:
        """Put every part where ``handling`` wants it (idempotent)."""
        self.handling, self.device, self.memory = handling, device, memory
        for part in ("vae", "text"):
            modules = self.modules(part)
            memory.move_out(self._tensors(modules))
            for module in modules:
                module.to(dtype=self.dtype(part))
                module.to(device if self.resident(part) else HOST)
            if self.resident(part):
                memory.move_in(self._tensors(modules))
        # diffusers reads these flags in AutoencoderKL.encode.
        self.vae.use_slicing = handling.encode_sliced
        self.vae.use_tiling = handling.encode_tiled

    @contextmanager
    def visiting(self, part: str) -> Iterator[None]:
        """``part`` on the device for the block, when it lives in host memory between uses."""
        if self.resident(part) or self.memory is None:
            yield
            return
        modules = self.modules(part)
        for module in modules:
            module.to(self.device)
        self.memory.move_in(self._tensors(modules))
        try:
            yield
        finally:
            self.memory.move_out(self._tensors(modules))
            for module in modules:
                module.to(HOST)

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor, *, tiled: bool = False) -> torch.Tensor:
        """Images in [0, 1] from latents as the UNet sees them (scaled), by the VAE's decoder in
        fp32, which visits the device for it (training never needs it there); ``tiled``: in
        overlapping tiles, one image at a time (diffusers' tiling and slicing)."""
        modules = [m for m in (self.vae.decoder, self.vae.post_quant_conv) if m is not None]
        tiling, slicing = self.vae.use_tiling, self.vae.use_slicing
        try:
            for module in modules:
                module.to(self.device)
            if self.memory is not None:
                self.memory.move_in(self._tensors(modules))
            self.vae.use_tiling = self.vae.use_slicing = tiled
            # fp32 whatever the training autocasts to: SD's and SDXL's VAEs overflow in fp16.
            with torch.autocast(self.device.type, enabled=False):
                images = self.vae.decode(latents.float() / self.vae.config.scaling_factor).sample
        finally:
            self.vae.use_tiling, self.vae.use_slicing = tiling, slicing
            if self.memory is not None:
                self.memory.move_out(self._tensors(modules))
            for module in modules:
                module.to(HOST)
        return (images.float() / 2 + 0.5).clamp(0, 1)

    # -- encoding ------------------------------------------------------------------------

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """The VAE posterior's moments (mean and log-variance, channels concatenated), in fp32."""
        with self.visiting("vae"):
            return self.vae.encode(pixels.to(self.dtype("vae"))).latent_dist.parameters.float()

    @torch.no_grad()
    def encode_text(self, ids: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The UNet's encoder_hidden_states for the token ids of each tokenizer, and SDXL's
        pooled text embeddings (None for SD), in fp32. SDXL takes both encoders' penultimate
        hidden states side by side and the last one's projected, pooled output."""
        with self.visiting("text"):
            if not self.sdxl:
                return self.text_encoders[0](ids[0], return_dict=False)[0].float(), None
            hidden_states, pooled = [], None
            for encoder, encoder_ids in zip(self.text_encoders, ids):
                output = encoder(encoder_ids, output_hidden_states=True, return_dict=False)
                pooled = output[0]
                hidden_states.append(output[-1][-2])
            assert pooled is not None
            return torch.cat(hidden_states, dim=-1).float(), pooled.float()

    def tokenize(self, captions: list[str]) -> list[torch.Tensor]:
        """Each tokenizer's ids of ``captions``, padded and cut to its model_max_length."""
        return [
            tokenizer(captions, max_length=tokenizer.model_max_length, padding="max_length", truncation=True, return_tensors="pt").input_ids
            for tokenizer in self.tokenizers
        ]
