"""Rung `checkpointing`: gradient (activation) checkpointing.

Exact: activations are recomputed in backward instead of stored, trading about a third more
compute for most of the activation memory.
"""

from __future__ import annotations

from typing import Any

from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs.base import CommandSide, MemoryTerms, Rung, WhenKey

# Measured on the built-in UNet trainer under the emulated device (tests/unit/test_memory_model.py
# and tests/integration/test_rung_memory.py hold the measurements these are rounded from).
TERMS = MemoryTerms(activation=0.62, time=1.15)


def step(plan: Plan) -> Plan | None:
    if plan.gradient_checkpointing:
        return None
    return plan.replace(gradient_checkpointing=True)


def describe(old: Plan, new: Plan) -> str:
    return "turn on gradient checkpointing (recompute activations in backward, ~30% more compute)"


def configure_model(plan: Plan, model: Any) -> None:
    """On or off as the plan says: diffusers models with their own methods, transformers' with
    theirs. Off matters to a runner stepping back up (jobs/step_ups.py): the model it switches
    is the one it switched on."""
    if plan.gradient_checkpointing:
        if hasattr(model, "enable_gradient_checkpointing"):
            model.enable_gradient_checkpointing()
        else:
            model.gradient_checkpointing_enable()
    elif getattr(model, "is_gradient_checkpointing", False):
        if hasattr(model, "disable_gradient_checkpointing"):
            model.disable_gradient_checkpointing()
        else:
            model.gradient_checkpointing_disable()


def memory(plan: Plan) -> MemoryTerms | None:
    return TERMS if plan.gradient_checkpointing else None


def label(plan: Plan) -> str | None:
    return "ckpt" if plan.gradient_checkpointing else None


RUNG = Rung(
    name="checkpointing",
    exact=True,
    needs_restart=False,
    step=step,
    describe=describe,
    knob="gradient_checkpointing",
    default=False,
    shrinks=frozenset({"activations"}),
    activations_only=True,
    memory=memory,
    label=label,
    configure_model=configure_model,
    command=CommandSide(
        when=WhenKey("gradient_checkpointing", "gradient checkpointing is on", listed=0),
        needs=("when:gradient_checkpointing",),
    ),
)
