"""The text-to-image job kind (``trainer = "text_to_image"``): [data], a folder of captioned
images, and [model], the local diffusers pipeline folder to fine-tune and how (the whole UNet,
or LoRA adapters on it), each a frozen dataclass with the parser of its table.

At submit the pipeline folder's layout is checked (the parts a Stable Diffusion pipeline has,
SD 1.x/2.x or SDXL, each with its config), the resolution against the UNet's and the VAE's
downsampling, and the captions of the folder's first images (jobs/captions.py); the runner
reads every caption again, and every image, before it trains.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from oomguard.jobs.captions import CaptionError, captioned_images
from oomguard.jobs.spec.reader import ReadContext, Section, describe_value, render_value, resolve_path

Method = Literal["full", "lora"]
METHODS: tuple[str, ...] = ("full", "lora")
# The attention projections diffusers' train_text_to_image_lora.py adapts.
DEFAULT_TARGET_MODULES: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0")
DEFAULT_LORA_RANK = 4
# Images whose captions intake reads at submit; the runner reads all of them.
CAPTIONS_CHECKED_AT_SUBMIT = 2000

# The parts of a pipeline folder, with the config file each must hold.
SD_PARTS: dict[str, str] = {
    "unet": "config.json",
    "vae": "config.json",
    "text_encoder": "config.json",
    "tokenizer": "tokenizer_config.json",
    "scheduler": "scheduler_config.json",
}
SDXL_PARTS: dict[str, str] = {"text_encoder_2": "config.json", "tokenizer_2": "tokenizer_config.json"}


@dataclass(frozen=True)
class CaptionedDataSpec:
    """A folder of images with captions, and how each image becomes a training sample: its
    shorter side resized to ``resolution``, then cropped square (in the centre, or at a place
    drawn per step) and flipped left-right half of the time when ``random_flip``. With
    ``buckets``, resized and cropped to its aspect-ratio bucket instead (jobs/buckets.py), at
    its own size when smaller than the resolution's area and ``bucket_no_upscale``."""

    source: str
    resolution: int
    center_crop: bool = True
    random_flip: bool = False
    caption_column: str = "text"
    buckets: bool = False
    bucket_no_upscale: bool = False

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "source": self.source, "resolution": self.resolution, "center_crop": self.center_crop, "random_flip": self.random_flip,
            "caption_column": self.caption_column,
        }
        # Only when on: a job stored before buckets existed reads back unchanged.
        if self.buckets:
            data.update(buckets=True, bucket_no_upscale=self.bucket_no_upscale)
        return data


@dataclass(frozen=True)
class PipelineSpec:
    """The pipeline folder to fine-tune and the method: ``full`` trains every UNet weight;
    ``lora`` trains rank-``lora_rank`` adapters (scale ``lora_alpha / lora_rank``) on the
    ``target_modules`` of a frozen UNet, through peft."""

    path: str
    method: Method = "full"
    lora_rank: int = DEFAULT_LORA_RANK
    lora_alpha: float | None = None
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules))

    @property
    def trains_adapters(self) -> bool:
        """method = "lora": adapters train on a frozen UNet, and they are what is saved."""
        return self.method == "lora"

    @property
    def alpha(self) -> float:
        """LoRA's alpha; the rank when not given (scale 1), as diffusers' script does."""
        return float(self.lora_alpha) if self.lora_alpha is not None else float(self.lora_rank)

    def to_dict(self) -> dict[str, Any]:
        # The LoRA keys only with method = "lora": a job file of a full fine-tune may not hold
        # them, and parse(to_dict()) must give the spec back.
        if not self.trains_adapters:
            return {"path": self.path, "method": self.method}
        return {
            "path": self.path, "method": self.method, "lora_rank": self.lora_rank, "lora_alpha": self.lora_alpha,
            "target_modules": list(self.target_modules),
        }

    @classmethod
    def load(cls, stored: Mapping[str, Any]) -> PipelineSpec:
        values = {k: v for k, v in stored.items() if v is not None and k in ("path", "method", "lora_rank", "lora_alpha", "target_modules")}
        return cls(**values)


def load_data(stored: Mapping[str, Any]) -> CaptionedDataSpec:
    """A stored [data] of this kind, rebuilt without validation (it was validated at intake)."""
    names = ("source", "resolution", "center_crop", "random_flip", "caption_column", "buckets", "bucket_no_upscale")
    return CaptionedDataSpec(**{k: v for k, v in stored.items() if k in names and v is not None})


def parse_data(ctx: ReadContext, s: Section) -> CaptionedDataSpec:
    folder = resolve_path(ctx, s.str("source"), s.key("source"))
    resolution = s.int("resolution", minimum=8)
    center_crop = s.bool("center_crop", default=True)
    random_flip = s.bool("random_flip", default=False)
    caption_column = s.str("caption_column", default="text")
    buckets = s.bool("buckets", default=False)
    no_upscale = s.bool("bucket_no_upscale", default=False)
    if no_upscale and not buckets:
        raise s.fail("bucket_no_upscale", "is for aspect-ratio buckets; add data.buckets = true, or remove it")
    if ctx.check_files:
        _check_captions(s, folder, caption_column)
    return CaptionedDataSpec(str(folder), resolution, center_crop, random_flip, caption_column, buckets, no_upscale)


def _check_captions(s: Section, folder: Path, caption_column: str) -> None:
    where = "(expected a folder of images with captions: metadata.jsonl or a .txt beside each image)"
    try:
        if not folder.is_dir():
            problem = "does not exist" if not folder.exists() else "is not a folder"
            raise s.fail("source", f"{folder} {problem} {where}")
        captioned_images(folder, caption_column, limit=CAPTIONS_CHECKED_AT_SUBMIT)
    except CaptionError as error:
        raise s.fail("source", str(error)) from None
    except OSError as error:
        raise s.fail("source", f"cannot read {render_value(str(getattr(error, 'filename', None) or folder))}: {error.strerror or error}; "
                               "give a folder you can read (the job runs as you)") from None


def parse_model(ctx: ReadContext, s: Section, resolution: int) -> PipelineSpec:
    """[model]: the pipeline folder (its layout checked when files are looked at), the method
    and, for LoRA, its rank, alpha and target modules."""
    folder = resolve_path(ctx, s.str("path"), s.key("path"))
    method = s.choice("method", METHODS, default="full")
    lora_keys = [k for k in ("lora_rank", "lora_alpha", "target_modules") if s.has(k)]
    if method == "full" and lora_keys:
        raise s.fail(lora_keys[0], 'is for method = "lora"; remove it, or set model.method = "lora"')
    rank = s.int("lora_rank", minimum=1, maximum=1024, default=DEFAULT_LORA_RANK)
    alpha = s.number("lora_alpha", gt=0.0, default=None)
    targets = _target_modules(s)
    if ctx.check_files:
        _check_pipeline_folder(ctx, s, folder, resolution)
    return PipelineSpec(str(folder), method, rank, alpha, targets)


def _target_modules(s: Section) -> tuple[str, ...]:
    value = s.get("target_modules", list(DEFAULT_TARGET_MODULES))
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        shown = render_value(value) if isinstance(value, list) else describe_value(value)
        raise s.fail("target_modules", f'expected a non-empty list of module names such as ["to_q", "to_k", "to_v", "to_out.0"], found {shown}')
    return tuple(value)


def _check_pipeline_folder(ctx: ReadContext, s: Section, folder: Path, resolution: int) -> None:
    """The folder holds a Stable Diffusion pipeline as save_pretrained writes it, and the
    resolution goes through its VAE and UNet."""
    how = "(a diffusers pipeline folder, as StableDiffusionPipeline.save_pretrained writes it: unet/ vae/ text_encoder/ tokenizer/ scheduler/)"
    if not folder.is_dir():
        raise s.fail("path", f"{folder} {'does not exist' if not folder.exists() else 'is not a folder'} {how}")
    parts = dict(SD_PARTS)
    if (folder / "text_encoder_2").exists() or (folder / "tokenizer_2").exists():
        parts.update(SDXL_PARTS)  # SDXL: both second parts, or neither
    for part in parts:
        if not (folder / part).is_dir():
            raise s.fail("path", f"{folder} has no {part}/ folder {how}")
    for part, config in parts.items():
        if not (folder / part / config).is_file():
            raise s.fail("path", f"{folder / part} has no {config}: the part is incomplete; save the pipeline again with save_pretrained")
    factor = downsampling(_config(s, folder / "vae" / "config.json"), _config(s, folder / "unet" / "config.json"))
    if resolution % factor:
        raise ctx.fail(
            "data.resolution",
            f"{resolution} is not divisible by {factor} (the VAE and then the UNet halve the image "
            f"{factor.bit_length() - 1} times in all); use a multiple of {factor}",
        )


def downsampling(vae: Mapping[str, Any], unet: Mapping[str, Any]) -> int:
    """How many times smaller the UNet's deepest features are than the image: the VAE and then
    the UNet halve it once per block after the first (every side must be a multiple)."""
    return 2 ** (len(vae.get("block_out_channels", [0])) - 1) * 2 ** (len(unet.get("block_out_channels", [0])) - 1)


def _config(s: Section, path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise s.fail("path", f"cannot read {path}: {error}; save the pipeline again with save_pretrained") from None
    if not isinstance(config, dict):
        raise s.fail("path", f"{path} is not a JSON object; save the pipeline again with save_pretrained")
    return config
