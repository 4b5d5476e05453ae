"""Aspect-ratio buckets ([data] buckets = true): each image is trained at the size of the
bucket whose shape is nearest its own, and every step's batch comes from one bucket, so a
batch stacks and the step's peak depends on which bucket it drew.

The buckets and the assignment follow kohya-ss sd-scripts (library/model_util.py
``make_bucket_resolutions`` and library/train_util.py ``BucketManager``), written here from
their description: sides from half to twice the resolution in steps of the pipeline's
downsampling factor, each no larger in area than the resolution's square; an image goes to
the bucket of the nearest aspect ratio. With ``bucket_no_upscale`` an image smaller than
that area keeps its own size, rounded down to the step (and one larger is scaled down to the
area first), as kohya's ``bucket_no_upscale`` does; simplified: the side to round is not
chosen by the smaller aspect error.

The order keeps oomguard's determinism contract: which images a step trains on depends only
on (seed, step). Each epoch shuffles every bucket's images and cuts them into batches (the
last one filled from the start of the same shuffle, so every batch has the job's batch size),
then shuffles the list of all buckets' batches; an epoch always has the same number of steps.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, order=True)
class Bucket:
    """One training size, in pixels."""

    width: int
    height: int

    @property
    def area(self) -> int:
        return self.width * self.height

    @property
    def ratio(self) -> float:
        return self.width / self.height

    def __str__(self) -> str:
        return f"{self.width}x{self.height}"


def bucket_sizes(resolution: int, step: int) -> list[Bucket]:
    """The buckets of a resolution: the largest square of the step, and every (w, h) and
    (h, w) with sides from half to twice the resolution and w * h no more than resolution²."""
    area = resolution * resolution
    smallest, largest = max(step, resolution // 2 // step * step), resolution * 2
    found = {Bucket(resolution // step * step, resolution // step * step)}
    for width in range(smallest, largest + 1, step):
        height = min(largest, area // width // step * step)
        if height >= smallest:
            found |= {Bucket(width, height), Bucket(height, width)}
    return sorted(found)


def assign_bucket(size: tuple[int, int], buckets: list[Bucket], resolution: int, step: int, no_upscale: bool) -> Bucket:
    """The bucket of an image of ``size`` (height, width)."""
    height, width = size
    if no_upscale and width * height <= resolution * resolution:
        return Bucket(max(step, width // step * step), max(step, height // step * step))
    if no_upscale:
        # Larger than the area: scaled down to it with its aspect ratio kept, then rounded down.
        scale = math.sqrt(resolution * resolution / (width * height))
        return Bucket(max(step, int(width * scale) // step * step), max(step, int(height * scale) // step * step))
    ratio = width / height
    return min(buckets, key=lambda bucket: (abs(bucket.ratio - ratio), -bucket.area))


def cover(size: tuple[int, int], target: Bucket) -> tuple[int, int]:
    """The (width, height) an image of ``size`` (height, width) is resized to so that it covers
    ``target`` with its aspect ratio kept: the side shorter relative to the target scaled to it
    exactly (for a square target, the shorter side to the resolution: the scripts' resize)."""
    height, width = size
    if width * target.height >= height * target.width:
        return max(target.width, int(target.height * width / height)), target.height
    return target.width, max(target.height, int(target.width * height / width))


class BucketedOrder:
    """Which bucket and which images a global step trains on (the module's docstring);
    ``image_buckets``: each image's bucket, by index."""

    def __init__(self, image_buckets: list[Bucket], batch_size: int, seed: int) -> None:
        from oomguard.jobs.data import step_seed

        self.image_buckets = image_buckets
        self.batch_size = batch_size
        self.seed = seed
        self._step_seed = step_seed
        members: dict[Bucket, list[int]] = {}
        for index, bucket in enumerate(image_buckets):
            members.setdefault(bucket, []).append(index)
        self.members = dict(sorted(members.items()))
        self.steps_per_epoch = sum(math.ceil(len(images) / batch_size) for images in self.members.values())

    @functools.lru_cache(maxsize=4)
    def _epoch(self, epoch: int) -> list[tuple[Bucket, list[int]]]:
        batches: list[tuple[Bucket, list[int]]] = []
        for number, (bucket, images) in enumerate(self.members.items()):
            generator = torch.Generator().manual_seed(self._step_seed(self.seed, epoch * 1_000_003 + number) ^ 0xB0C)
            shuffled = [images[i] for i in torch.randperm(len(images), generator=generator).tolist()]
            for start in range(0, len(shuffled), self.batch_size):
                batch = [shuffled[(start + i) % len(shuffled)] for i in range(self.batch_size)]
                batches.append((bucket, batch))
        generator = torch.Generator().manual_seed(self._step_seed(self.seed, epoch) ^ 0xB0C5)
        return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]

    def batch(self, step: int) -> tuple[Bucket, list[int]]:
        """Step ``step``'s bucket and image indices."""
        return self._epoch(step // self.steps_per_epoch)[step % self.steps_per_epoch]

    @classmethod
    def of(cls, sizes: list[tuple[int, int]], resolution: int, step: int, no_upscale: bool, batch_size: int, seed: int) -> BucketedOrder:
        """The order of images of ``sizes`` (height, width), each in its bucket."""
        buckets = bucket_sizes(resolution, step)
        return cls([assign_bucket(size, buckets, resolution, step, no_upscale) for size in sizes], batch_size, seed)

    def repeats(self) -> str | None:
        """A line for people when a bucket holds fewer images than a batch: every batch has the
        job's batch size, so its images repeat to fill one and weigh more in an epoch."""
        short = [bucket for bucket, images in self.members.items() if len(images) < self.batch_size]
        if not short:
            return None
        return (
            f"data.buckets: {len(short)} of {len(self.members)} buckets hold fewer images than train.batch_size ({self.batch_size}), "
            f"and their images repeat to fill a batch (e.g. {short[0]}); a smaller batch_size, more images of those shapes, "
            "or bucket_no_upscale = false avoids it"
        )

    def largest(self) -> Bucket:
        """The bucket of the most pixels that holds images (the widest of equals)."""
        return max(self.members, key=lambda bucket: (bucket.area, bucket.width))

    def first_step_of(self, bucket: Bucket) -> int:
        """The first step of the first epoch that trains on ``bucket``."""
        return next(step for step, (drawn, _) in enumerate(self._epoch(0)) if drawn == bucket)
