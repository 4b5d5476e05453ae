"""Rung `checkpointing`: gradient (activation) checkpointing.

Exact: activations are recomputed in backward instead of stored, trading about a third more
compute for most of the activation memory.
"""

from __future__ import annotations

from typing import Any

from oomguard.strategies.plan import Plan
from oomguard.strategies.rung import Rung


def step(plan: Plan) -> Plan | None:
    if plan.gradient_checkpointing:
        return None
    return plan.replace(gradient_checkpointing=True)


def describe(old: Plan, new: Plan) -> str:
    return "turn on gradient checkpointing (recompute activations in backward, ~30% more compute)"


def configure_model(plan: Plan, model: Any) -> None:
    """Diffusers models switch it on with their own method; others through torch's helper."""
    if not plan.gradient_checkpointing:
        return
    if hasattr(model, "enable_gradient_checkpointing"):
        model.enable_gradient_checkpointing()
    else:
        model.gradient_checkpointing_enable()


RUNG = Rung(
    name="checkpointing",
    exact=True,
    needs_restart=False,
    step=step,
    describe=describe,
    configure_model=configure_model,
)
