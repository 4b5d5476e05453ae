"""Rung `ema_offload`: keep the average of the trained weights (train.ema) in host memory and
update it there, as diffusers' scripts do with --offload_ema.

Exact: the same fp32 elementwise update (jobs/ema.py) runs on a host copy of each trained
weight instead of beside it, so the average and the weights trained are those of the plan
without it. It frees one fp32 copy of the trained weights on the device and costs a
device-to-host copy of them per step. The average is placed when the process starts, so it
takes a new attempt.
"""

from __future__ import annotations

from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs.base import MemoryTerms, Rung

NAME = "ema_offload"
TERMS = MemoryTerms(ema_on_device=False, time=1.05)


def on(plan: Plan) -> bool:
    return bool(plan.extra_value(NAME, False))


def step(plan: Plan) -> Plan | None:
    return None if on(plan) else plan.with_extra(NAME, True, False)


RUNG = Rung(
    name=NAME,
    exact=True,
    needs_restart=True,
    step=step,
    describe=lambda old, new: "keep the EMA of the weights in host memory and update it there (exact; a copy of the weights to the host per step)",
    knob=NAME,
    default=False,
    shrinks=frozenset({"ema"}),
    on=on,
    memory=lambda plan: TERMS if on(plan) else None,
    label=lambda plan: "ema=host" if on(plan) else None,
    ema_on_host=on,
    needs=frozenset({"ema"}),
)
