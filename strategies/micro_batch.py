"""Rung `micro_batch`: halve the micro-batch and accumulate gradients over more slices.

Exact: the effective batch is kept, and the trainer weights each slice's loss by its share of
samples, so uneven splits (16 -> 6, 6, 4 never happens here, but 10 -> 5, 5 -> 3, 3, 3, 1 does)
give the same gradient up to float rounding.
"""

from __future__ import annotations

from oomguard.strategies.plan import Plan
from oomguard.strategies.rung import Rung


def step(plan: Plan) -> Plan | None:
    if plan.micro_batch <= 1:
        return None
    return plan.replace(micro_batch=(plan.micro_batch + 1) // 2)


def describe(old: Plan, new: Plan) -> str:
    return (
        f"micro-batch {old.micro_batch} -> {new.micro_batch}, gradient accumulation "
        f"{old.grad_accum} -> {new.grad_accum} (effective batch {new.batch_size} kept)"
    )


RUNG = Rung(name="micro_batch", exact=True, needs_restart=False, step=step, describe=describe)
