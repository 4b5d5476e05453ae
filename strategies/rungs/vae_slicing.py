"""Rung `vae_slicing`: the VAE encodes a micro-batch one image at a time (diffusers'
``enable_slicing``), so its activations are one image's, not the micro-batch's.

Exact: each image's encoding is computed alone either way (convolutions and group norms are
per image). It matters at high resolution, where the VAE's full-resolution activations can
outgrow the UNet's on latents a 64th of the size.
"""

from __future__ import annotations

from oomguard.strategies.rungs.base import MemoryTerms
from oomguard.strategies.rungs.frozen_switch import switch_rung

TERMS = MemoryTerms(activation=0.97, time=1.02)

RUNG = switch_rung(
    "vae_slicing",
    exact=True,
    effect="encode_sliced",
    label="vae=sliced",
    change="encode images one at a time with the VAE (its activations for one image only; exact)",
    terms=TERMS,
    shrinks=frozenset({"activations"}),
    activations_only=True,
)
