"""Rung `checkpointing`: gradient (activation) checkpointing of every block, the deepest grade
(strategies/rungs/checkpoint_grades.py).

Exact: activations are recomputed in backward instead of stored, trading about a third more
compute for most of the activation memory. Its configure hook puts the model at whatever
grade the plan has (the partial grades' rungs have none of their own).
"""

from __future__ import annotations

from oomguard.strategies.rungs import checkpoint_grades
from oomguard.strategies.rungs.base import CommandSide, MemoryTerms, WhenKey

# Measured on the built-in UNet trainer under the emulated device (tests/unit/test_memory_model.py
# and tests/integration/test_rung_memory.py hold the measurements these are rounded from).
TERMS = MemoryTerms(activation=0.62, time=1.15)

RUNG = checkpoint_grades.grade_rung(
    "checkpointing",
    "blocks",
    terms=TERMS,
    says="turn on gradient checkpointing (recompute activations in backward, ~30% more compute)",
    label="ckpt",
    configure_model=checkpoint_grades.configure,
    # A script's --gradient_checkpointing checkpoints its whole blocks: the partial grades are
    # the built-in trainers' only.
    command=CommandSide(
        when=WhenKey("gradient_checkpointing", "gradient checkpointing is on", listed=0),
        needs=("when:gradient_checkpointing",),
    ),
)
