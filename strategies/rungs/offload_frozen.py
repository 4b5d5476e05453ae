"""Rung `offload_frozen`: the frozen parts (VAE encoder, text encoders) live in host memory
and visit the device only to encode a micro-batch, then leave it before the UNet runs.

Exact: the same weights compute the same encodings; only where they wait between uses
changes. Costs a host-to-device copy of the frozen weights per micro-batch.
"""

from __future__ import annotations

from oomguard.strategies.rungs.base import MemoryTerms
from oomguard.strategies.rungs.frozen_switch import switch_rung

TERMS = MemoryTerms(frozen_dropped=frozenset({"vae", "text"}), time=1.1)

RUNG = switch_rung(
    "offload_frozen",
    exact=True,
    effect="on_host",
    label="frozen=host",
    change="keep the frozen VAE and text encoders in host memory, on the device only while they encode (exact)",
    terms=TERMS,
    shrinks=frozenset({"frozen"}),
)
