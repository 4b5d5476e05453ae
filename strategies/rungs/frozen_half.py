"""Rung `frozen_half`: the frozen parts' weights in 16 bits (bf16 where the device has it,
else fp16; the VAE stays in bf16 or fp32, since SDXL's VAE overflows in fp16).

Approximate: the encodings are computed at lower precision. Halves the frozen weights.
"""

from __future__ import annotations

from oomguard.strategies.rungs.base import MemoryTerms
from oomguard.strategies.rungs.frozen_switch import switch_rung

TERMS = MemoryTerms(frozen_scale=0.5, time=0.95)

RUNG = switch_rung(
    "frozen_half",
    exact=False,
    effect="half",
    label="frozen=16bit",
    change="store the frozen VAE and text encoders in 16 bits (half their memory; approximate)",
    terms=TERMS,
    shrinks=frozenset({"frozen"}),
)
