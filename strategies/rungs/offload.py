"""Rung `offload`: keep the optimizer's state in host memory and update the weights there.

Exact: the same AdamW arithmetic (the host runs torch's fused CPU kernel, which agrees with the
device's to float rounding). ZeRO-Offload style: after backward the gradients are copied to
the host, the host updates its fp32 copy of the weights and copies them back, so the device
holds only weights, gradients and activations, never the optimizer's moments (two fp32 copies
of every trained weight, for Adam 2/3 of the static memory). It costs the two copies per step
and the host's update, and 3x the trained weights' size in host memory. The optimizer is built
when the process starts, so it takes a new attempt.

"params" (parameter offload) is a value the Plan knows, but no rung step produces it yet.

torchao's ``CPUOffloadOptimizer`` does the same job, copying each gradient to the host while
backward still runs. It is not used: it runs on CUDA and XPU only (it asserts so), so it cannot
be measured on a CPU machine, and this rung switches implementations only on a measurement:
bench/gpu_check.py ``--cases offload`` times both on one GPU (results/gpu-offload.md).
"""

from __future__ import annotations

from typing import Any

from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs.base import CommandSide, MakeOptimizer, MemoryTerms, Rung, WhenKey

# The optimizer state leaves the device; the copies and the host's update cost time.
TERMS = MemoryTerms(time=1.1, optimizer_on_device=False)


def step(plan: Plan) -> Plan | None:
    if plan.offload != "none":
        return None
    return plan.replace(offload="optimizer")


def describe(old: Plan, new: Plan) -> str:
    return "keep the optimizer state in host memory and update the weights there (exact; slower steps)"


def on(plan: Plan) -> bool:
    # "params" has no step, no memory terms and no [command.when] key yet.
    return plan.offload == "optimizer"


def place_optimizer(plan: Plan, params: list[Any], make: MakeOptimizer, memory: Any) -> Any:
    """The optimizer made by ``make`` over host copies of ``params`` (jobs/optimizers.py)."""
    if plan.offload == "none":
        return None
    if not on(plan):
        # The offload rung only ever moves the optimizer state; parameter offload has no code.
        raise ValueError(f"offload {plan.offload!r} is not available: oomguard offloads the optimizer state only ('optimizer')")
    from oomguard.jobs.optimizers import HostOffloadedOptimizer

    # fused: the host runs torch's fused CPU kernel.
    return HostOffloadedOptimizer(params, lambda host: make(host, True), memory)


def memory(plan: Plan) -> MemoryTerms | None:
    return TERMS if on(plan) else None


def label(plan: Plan) -> str | None:
    return f"offload={plan.offload}" if plan.offload != "none" else None


RUNG = Rung(
    name="offload",
    exact=True,
    needs_restart=True,
    step=step,
    describe=describe,
    knob="offload",
    default="none",
    shrinks=frozenset({"optimizer_state"}),
    on=on,
    memory=memory,
    label=label,
    place_optimizer=place_optimizer,
    command=CommandSide(
        when=WhenKey("offload_optimizer", "the optimizer state is offloaded to the host", listed=3),
        needs=("when:offload_optimizer",),
    ),
)
