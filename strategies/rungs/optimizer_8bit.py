"""Rung `optimizer_8bit`: AdamW with 8-bit moments (bitsandbytes' block-wise quantized AdamW;
torchao's where bitsandbytes does not import: jobs/optimizers.py measured both).

Not exact: both moments are stored as 8-bit codes with one fp32 scale per 256 values, so the
updates differ slightly from fp32 AdamW. The optimizer state shrinks from 8 to about 2 bytes
per trained weight. Tensors under 4096 values keep fp32 moments (they are too small to
matter). The optimizer is built when the process starts, so it takes a new attempt. The next
rung, optimizer_4bit, replaces it (the same knob: one optimizer per plan).
"""

from __future__ import annotations

from typing import Any

from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs.base import CommandSide, MemoryTerms, Rung, WhenKey

# Two 8-bit moments plus block scales per trained weight: 0.55 bytes per fp32 weight byte
# (fp32 AdamW keeps 2).
TERMS = MemoryTerms(time=1.05, optimizer_bytes_per_byte=0.55)


def step(plan: Plan) -> Plan | None:
    if plan.optimizer != "adamw":
        return None
    return plan.replace(optimizer="adamw8bit")


def on(plan: Plan) -> bool:
    return plan.optimizer == "adamw8bit"


def describe(old: Plan, new: Plan) -> str:
    if on(new):
        return "use 8-bit AdamW moments (optimizer state about 4x smaller; not exact)"
    return f"8-bit AdamW moments off ({new.optimizer})"


def make_optimizer(plan: Plan, params: list[Any], lr: float, weight_decay: float, fused: bool | None) -> Any:
    """8-bit AdamW in torch AdamW's checkpoint format (jobs/quantized_optimizers.py), or None."""
    if not on(plan):
        return None
    from oomguard.jobs.quantized_optimizers import adamw8bit

    return adamw8bit(params, lr, weight_decay)


def memory(plan: Plan) -> MemoryTerms | None:
    return TERMS if on(plan) else None


def label(plan: Plan) -> str | None:
    return plan.optimizer if on(plan) else None


RUNG = Rung(
    name="optimizer_8bit",
    exact=False,
    needs_restart=True,
    step=step,
    describe=describe,
    knob="optimizer",
    default="adamw",
    shrinks=frozenset({"optimizer_state"}),
    on=on,
    memory=memory,
    label=label,
    make_optimizer=make_optimizer,
    command=CommandSide(
        when=WhenKey("optimizer_8bit", "the optimizer is 8-bit AdamW", listed=2),
        needs=("when:optimizer_8bit",),
    ),
)
