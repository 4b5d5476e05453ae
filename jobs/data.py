"""Training images and the order they are drawn in.

The order depends only on (seed, epoch), and a step's samples only on (seed, step), so a run
that resumes at step k, or splits its batch differently, sees exactly the same samples.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
SYNTHETIC_PREFIX = "synthetic:"


class ImageSource:
    """A fixed list of images, each loaded on demand as a (3, R, R) float tensor in [-1, 1]."""

    def __init__(self, source: str, resolution: int) -> None:
        self.resolution = resolution
        if source.startswith(SYNTHETIC_PREFIX):
            self._count = int(source[len(SYNTHETIC_PREFIX):])
            self._paths: list[Path] = []
        else:
            self._paths = sorted(p for p in Path(source).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
            self._count = len(self._paths)
            if not self._paths:
                raise ValueError(f"no images ({', '.join(IMAGE_SUFFIXES)}) under {source}")

    def __len__(self) -> int:
        return self._count

    def load(self, indices: list[int]) -> torch.Tensor:
        return torch.stack([self._synthetic(i) if not self._paths else self._from_file(i) for i in indices])

    def _synthetic(self, index: int) -> torch.Tensor:
        # Smooth colour fields: a few random low-resolution values upsampled, so the images
        # have structure a UNet can learn, and each index always gives the same image.
        generator = torch.Generator().manual_seed(1_000_003 * (index + 1))
        coarse = torch.rand((1, 3, 4, 4), generator=generator) * 2 - 1
        image = torch.nn.functional.interpolate(coarse, size=(self.resolution, self.resolution), mode="bilinear", align_corners=False)
        return image[0].clamp(-1, 1)

    def _from_file(self, index: int) -> torch.Tensor:
        from PIL import Image

        with Image.open(self._paths[index]) as opened:
            image = opened.convert("RGB")
        # Resize the shorter side to the resolution, then crop the centre.
        scale = self.resolution / min(image.size)
        size = (max(self.resolution, round(image.width * scale)), max(self.resolution, round(image.height * scale)))
        image = image.resize(size, Image.Resampling.BICUBIC)
        left, top = (image.width - self.resolution) // 2, (image.height - self.resolution) // 2
        image = image.crop((left, top, left + self.resolution, top + self.resolution))
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        pixels = pixels.view(self.resolution, self.resolution, 3).permute(2, 0, 1).float()
        return pixels / 127.5 - 1


class SampleOrder:
    """Which sample indices a global step uses: epoch e is a permutation seeded by (seed, e),
    and step s takes positions s*B .. s*B+B-1 of the concatenated epochs."""

    def __init__(self, num_items: int, seed: int) -> None:
        self.num_items = num_items
        self.seed = seed

    @functools.lru_cache(maxsize=4)
    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(step_seed(self.seed, epoch) ^ 0x5EED)
        return torch.randperm(self.num_items, generator=generator).tolist()

    def indices(self, step: int, batch_size: int) -> list[int]:
        start = step * batch_size
        return [
            self._permutation(position // self.num_items)[position % self.num_items]
            for position in range(start, start + batch_size)
        ]


def step_seed(seed: int, step: int) -> int:
    """One 63-bit seed from (seed, step), distinct for distinct pairs in practice."""
    return (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator for the noise, timesteps and flips of one global step."""
    return torch.Generator().manual_seed(step_seed(seed, step))
