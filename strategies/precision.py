"""Rung `precision`: train under bf16 mixed precision.

Not exact: matmuls and convolutions run in bf16 under autocast (the weights, their gradients
and the optimizer stay fp32), so the loss curve follows the fp32 one only approximately.
Activations saved for backward are mostly bf16, about half their fp32 size. A job that
already runs in bf16 or fp16 has nothing more here. The runner resolves "bf16" per device (a
GPU without bf16 gets fp16 with a gradient scaler). The Accelerator's precision is fixed when
it is built, so it takes a new attempt.
"""

from __future__ import annotations

from oomguard.strategies.plan import Plan
from oomguard.strategies.rung import Rung


def step(plan: Plan) -> Plan | None:
    if plan.mixed_precision != "no":
        return None
    return plan.replace(mixed_precision="bf16")


def describe(old: Plan, new: Plan) -> str:
    return "train in bf16 mixed precision (about half the activation memory; not exact)"


RUNG = Rung(name="precision", exact=False, needs_restart=True, step=step, describe=describe)
