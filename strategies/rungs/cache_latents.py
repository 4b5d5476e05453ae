"""Rung `cache_latents`: encode every training image once with the VAE, keep the latents on
disk beside the checkpoints, and train from them with the VAE off the device.

Exact: a step's latents are the VAE posterior's sample with the step's own noise, from the
posterior's moments (mean and log-variance), which are what the cache holds; with random flips
both flips of every image are cached. It needs every image to become the same sample each
time it is drawn (``data.center_crop = true``, the default): a random crop cannot be cached.
The cache is keyed by the VAE's files, the images (path, size, modification time) and the
preprocessing, so a changed input makes a new one (jobs/encoding_cache.py).
"""

from __future__ import annotations

from oomguard.strategies.rungs.base import MemoryTerms
from oomguard.strategies.rungs.frozen_switch import switch_rung

# No VAE weights on the device, and no VAE encode in a step (its activations there come before
# the UNet's and are smaller at training resolutions, so the peak line barely moves). Time: a
# step saves its encode, the attempt's start pays one per image and flip; neutral, so that a
# job that fits without the cache is not made to build one.
TERMS = MemoryTerms(frozen_dropped=frozenset({"vae"}))

RUNG = switch_rung(
    "cache_latents",
    exact=True,
    effect="latents_cached",
    label="latents=cached",
    change="encode every image once and train from the cached latents (the VAE leaves the device; exact)",
    terms=TERMS,
    shrinks=frozenset({"frozen"}),
    needs=frozenset({"frozen_parts", "fixed_crops"}),
)
