"""Rung `checkpoint_ff`: recompute only the transformer blocks' feed-forward layers in
backward, the cheapest checkpointing grade (strategies/rungs/checkpoint_grades.py).

Exact. A feed-forward layer keeps its 4x-wide hidden activations for backward and costs one
matmul pair to recompute: published figures for a transformer block put it at ~45% of the
activation memory for ~4% more time, against ~65% for ~27% for whole blocks. In a diffusion
UNet the transformer blocks are a smaller part of the activations, so it saves less there
(0.72 of the activation peak on a small text-to-image UNet, tests/integration/test_checkpoint_grades.py);
what a run measures replaces the estimate (MemoryModel's observed factors). Only models with
feed-forward layers (the job feature "feed_forward": a text-to-image UNet) take it.
"""

from __future__ import annotations

from oomguard.strategies.rungs import checkpoint_grades
from oomguard.strategies.rungs.base import MemoryTerms

TERMS = MemoryTerms(activation=0.85, time=1.04)

RUNG = checkpoint_grades.grade_rung(
    "checkpoint_ff",
    "ff",
    terms=TERMS,
    says="recompute the feed-forward layers in backward (exact; a few per cent more compute)",
    label="ckpt=ff",
    needs=frozenset({"feed_forward"}),
)
