"""Rung `fused_backward`: the optimizer step runs inside backward, each parameter updated as
soon as its gradient is complete and the gradient freed (jobs/fused_backward.py).

Exact: AdamW's update per tensor, the same arithmetic as one step over the model. No step
holds a gradient for every weight: for a full fine-tune at micro-batch 1, where the model's
state dominates, that is a quarter of AdamW's static memory (weights 1, gradients 1, moments
2), at the cost of one small optimizer launch per tensor. An OOM inside backward may come after
some weights were updated: the runner counts it as an OOM in the optimizer (resumed from the
last checkpoint, never retried in the process). It needs the whole batch in one
micro-batch (a gradient accumulated over slices would be stepped on after the first), so the
planner weighs it against the micro-batch rung: it wins when the static memory dominates. Not
with gradient accumulation, several processes, fp16's loss scaler (it unscales every gradient
at once), the host-offloaded or 8-bit optimizer (their own state formats), or sharding.
"""

from __future__ import annotations

from typing import Any

from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs.base import MakeOptimizer, MemoryTerms, Rung

KNOB = "optimizer_in_backward"
# The gradients backward has computed and not yet stepped on, at the step's peak: measured 0.4
# of all of them on a 32/64-channel UNet at 8 px (tests/integration/test_fused_backward.py,
# where that peak also holds activations); 0.3 of a model's whole gradients is the estimate a
# run's own measurement replaces. One optimizer launch per tensor: 15-20 % slower steps on this
# project's small UNets on the CPU (bench/results/graded_pairs.md), less where tensors are big.
TERMS = MemoryTerms(time=1.15, gradient_share=0.3)


def on(plan: Plan) -> bool:
    return bool(plan.extra_value(KNOB, False))


def step(plan: Plan) -> Plan | None:
    return None if on(plan) else plan.with_extra(KNOB, True, False)


def describe(old: Plan, new: Plan) -> str:
    if on(new):
        return "update each weight inside backward as soon as its gradient is complete (exact; no full set of gradients)"
    return "optimizer step after backward again"


def conflict(plan: Plan) -> str | None:
    if plan.grad_accum > 1:
        return f"the optimizer step in backward needs the whole batch in one micro-batch; the plan has {plan.grad_accum}"
    if plan.world_size > 1:
        return "the optimizer step in backward needs one process: the ranks average their gradients after backward"
    if plan.mixed_precision == "fp16":
        return "the optimizer step in backward cannot run with fp16's loss scaler, which unscales every gradient at once"
    if plan.offload != "none" or plan.optimizer != "adamw":
        return "the optimizer step in backward runs torch's AdamW on the device only"
    return None


def place_optimizer(plan: Plan, params: list[Any], make: MakeOptimizer, memory: Any) -> Any:
    if not on(plan):
        return None
    from oomguard.jobs.fused_backward import FusedBackwardOptimizer

    return FusedBackwardOptimizer(params, make)


RUNG = Rung(
    name="fused_backward",
    exact=True,
    needs_restart=True,
    step=step,
    describe=describe,
    knob=KNOB,
    default=False,
    shrinks=frozenset({"gradients"}),
    memory=lambda plan: TERMS if on(plan) else None,
    label=lambda plan: "fused-bwd" if on(plan) else None,
    conflict=conflict,
    place_optimizer=place_optimizer,
)
