"""Rung `checkpoint_alternate`: recompute every second checkpointable block in backward, the
grade between the feed-forward layers and every block (strategies/rungs/checkpoint_grades.py).

Exact. About half of whole-block checkpointing's saving for about half its recomputation, so a
job a little over its cap pays a little. The blocks of a UNet differ in size (the
full-resolution ones hold the most activations): what a run measures replaces the estimate.
Measured under the emulated device (tests/integration/test_checkpoint_grades.py): 0.78 of the
activation peak on a small UNet2DModel, 0.54 on a small text-to-image UNet; the estimate is
the first, so that a plan predicted to fit does (an OOM costs more than a slower plan).
"""

from __future__ import annotations

from oomguard.strategies.rungs import checkpoint_grades
from oomguard.strategies.rungs.base import MemoryTerms

TERMS = MemoryTerms(activation=0.8, time=1.07)

RUNG = checkpoint_grades.grade_rung(
    "checkpoint_alternate",
    "alternate",
    terms=TERMS,
    says="recompute every second block in backward (exact; about half of whole-block checkpointing's cost)",
    label="ckpt=1/2",
)
