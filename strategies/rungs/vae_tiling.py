"""Rung `vae_tiling`: the VAE encodes each image in overlapping tiles (diffusers'
``enable_tiling``), so its activations are one tile's.

Approximate: tiles are blended where they overlap, and each tile's group norms see only the
tile, so the latents differ from the whole image's. Only for images larger than the VAE's tile
size (its ``sample_size``, 512 px for SD 1.5); below that it changes nothing.
"""

from __future__ import annotations

from oomguard.strategies.rungs.base import MemoryTerms
from oomguard.strategies.rungs.frozen_switch import switch_rung

TERMS = MemoryTerms(activation=0.95, time=1.05)

RUNG = switch_rung(
    "vae_tiling",
    exact=False,
    effect="encode_tiled",
    label="vae=tiled",
    change="encode images in overlapping tiles with the VAE (its activations for one tile only; approximate at the seams)",
    terms=TERMS,
    shrinks=frozenset({"activations"}),
    activations_only=True,
)
