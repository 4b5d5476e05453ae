"""The rung names a job file may list under ``ladder.allow``, cheapest and most faithful first.

Kept apart from the rung modules so that job-file validation needs no rung code.
"""

RUNG_NAMES: tuple[str, ...] = (
    "allocator",
    "micro_batch",
    "checkpointing",
    "attention",
    "offload",
    "precision",
    "optimizer_8bit",
    "lora",
    "base_quantization",
)

# Exact rungs keep the training trajectory (same weights up to float rounding); they are
# what a job allows when its file says nothing.
EXACT_RUNG_NAMES: tuple[str, ...] = ("allocator", "micro_batch", "checkpointing", "attention", "offload")
