"""Rung `cache_text`: encode every caption once with the frozen text encoder(s), keep the
embeddings on disk beside the checkpoints, and train from them with the encoders off the device.

Exact: a caption's embedding does not depend on the step (no caption dropout, no random
truncation). The cache is keyed by the tokenizers' and encoders' files and the captions
(jobs/encoding_cache.py), so an edited caption or another encoder makes a new one.
"""

from __future__ import annotations

from oomguard.strategies.rungs.base import MemoryTerms
from oomguard.strategies.rungs.frozen_switch import switch_rung

# Time neutral, as for cache_latents: steps save the encode, the start pays it once per caption.
TERMS = MemoryTerms(frozen_dropped=frozenset({"text"}))

RUNG = switch_rung(
    "cache_text",
    exact=True,
    effect="text_cached",
    label="text=cached",
    change="encode every caption once and train from the cached embeddings (the text encoders leave the device; exact)",
    terms=TERMS,
    shrinks=frozenset({"frozen"}),
)
