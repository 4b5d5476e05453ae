"""Rung `micro_batch`: halve the micro-batch and accumulate gradients over more slices.

Exact: the effective batch is kept, and the trainer weights each slice's loss by its share of
samples, so uneven splits (16 -> 6, 6, 4 never happens here, but 10 -> 5, 5 -> 3, 3, 3, 1 does)
give the same gradient up to float rounding. A script that cannot weigh slices (a command job:
``--train_batch_size`` x ``--gradient_accumulation_steps`` samples) gets only micro-batches that
divide its batch (``Plan.even_slices``): 12 -> 6 -> 3 -> 2 -> 1.
"""

from __future__ import annotations

from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs.base import CommandSide, Placeholder, Rung


def step(plan: Plan) -> Plan | None:
    if plan.micro_batch <= 1:
        return None
    # Half (rounded up), or for a plan of even slices the largest divisor of the batch below it.
    smaller = [size for size in plan.micro_batch_choices() if size <= (plan.micro_batch + 1) // 2]
    return plan.replace(micro_batch=smaller[-1])


def describe(old: Plan, new: Plan) -> str:
    return (
        f"micro-batch {old.micro_batch} -> {new.micro_batch}, gradient accumulation "
        f"{old.grad_accum} -> {new.grad_accum} (effective batch {new.batch_size} kept)"
    )


def choices(start: Plan) -> list[int]:
    return start.micro_batch_choices()


def command_values(plan: Plan) -> dict[str, str]:
    return {"micro_batch": str(plan.micro_batch), "grad_accum": str(plan.grad_accum)}


RUNG = Rung(
    name="micro_batch",
    exact=True,
    needs_restart=False,
    step=step,
    describe=describe,
    knob="micro_batch",
    # The micro-batch a shape's memory line starts from (Plan.short shows it first, itself).
    default=1,
    role="batch",
    shrinks=frozenset({"activations"}),
    activations_only=True,
    choices=choices,
    command=CommandSide(
        placeholders=(
            Placeholder("micro_batch", "samples per forward/backward on each process", listed=0),
            Placeholder("grad_accum", "micro-batches accumulated per optimizer step", listed=1),
        ),
        needs=("{micro_batch}", "{grad_accum}"),
        values=command_values,
    ),
)
