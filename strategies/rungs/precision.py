"""Rung `precision`: train under bf16 mixed precision.

Not exact: matmuls and convolutions run in bf16 under autocast (the weights, their gradients
and the optimizer stay fp32), so the loss curve follows the fp32 one only approximately.
Activations saved for backward are mostly bf16, about half their fp32 size. A job that
already runs in bf16 or fp16 has nothing more here. The runner resolves "bf16" per device (a
GPU without bf16 gets fp16 with a gradient scaler). The Accelerator's precision is fixed when
it is built, so it takes a new attempt.
"""

from __future__ import annotations

from typing import Any

from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs.base import CommandSide, MemoryTerms, Placeholder, Rung

# Activations about 0.6 of fp32; autocast keeps a half-size copy of the weights it casts.
TERMS = MemoryTerms(activation=0.6, time=1.0, cast_share=0.5)


def step(plan: Plan) -> Plan | None:
    if plan.mixed_precision != "no":
        return None
    return plan.replace(mixed_precision="bf16")


def describe(old: Plan, new: Plan) -> str:
    return "train in bf16 mixed precision (about half the activation memory; not exact)"


def autocast_dtype(plan: Plan, device: Any) -> Any:
    """The dtype the device really runs the plan's precision in (jobs/precision.py), or None."""
    import torch

    from oomguard.jobs.precision import resolve_mixed_precision

    return {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}[resolve_mixed_precision(plan.mixed_precision, device)]


def memory(plan: Plan) -> MemoryTerms | None:
    # A job that starts in bf16 or fp16 has these terms too: they follow the plan, not the rung.
    return TERMS if plan.mixed_precision != "no" else None


def label(plan: Plan) -> str | None:
    return plan.mixed_precision if plan.mixed_precision != "no" else None


def command_values(plan: Plan) -> dict[str, str]:
    return {"mixed_precision": plan.mixed_precision}


RUNG = Rung(
    name="precision",
    exact=False,
    needs_restart=True,
    step=step,
    describe=describe,
    knob="mixed_precision",
    default="no",
    shrinks=frozenset({"activations"}),
    memory=memory,
    label=label,
    autocast_dtype=autocast_dtype,
    command=CommandSide(
        placeholders=(Placeholder("mixed_precision", "no, bf16 or fp16", listed=4),),
        needs=("{mixed_precision}",),
        values=command_values,
    ),
)
