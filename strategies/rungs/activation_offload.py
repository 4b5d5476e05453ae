"""Rung `activation_offload`: keep what forward saves for backward in host memory (autograd's
saved-tensor hooks, as ``torch.autograd.graph.save_on_cpu``), the last exact activation rung.

Exact: each saved tensor is copied to the host when forward saves it and back when backward
needs it; the values are the same. The device then holds a step's working set (the tensors an
op is using, the gradients flowing back) instead of every activation of every layer. With a
checkpointing grade on, what is saved are the checkpointed blocks' inputs: whole blocks with
their inputs on the host is the deepest activation saving there is. Each saved byte crosses
to the host and back once per micro-batch: on a GPU that is PCIe traffic (pinned memory, so it
overlaps little with compute in this simple form); the estimate below is a guess that a run's
timing replaces. Parameters stay where they are: the hooks skip tensors that share a weight's
storage.
"""

from __future__ import annotations

from typing import Any

from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs.base import MemoryTerms, Rung

KNOB = "activations_on_host"
TERMS = MemoryTerms(activation=0.35, time=1.3)


def step(plan: Plan) -> Plan | None:
    if plan.extra_value(KNOB, False):
        return None
    return plan.with_extra(KNOB, True, False)


def describe(old: Plan, new: Plan) -> str:
    if new.extra_value(KNOB, False):
        return "keep the activations saved for backward in host memory (exact; each crosses to the host and back)"
    return "activations saved for backward back on the device"


def saved_activations(plan: Plan, memory: Any, model: Any) -> Any:
    if not plan.extra_value(KNOB, False):
        return None
    from oomguard.jobs.host_activations import HostActivations

    return HostActivations(memory, model)


RUNG = Rung(
    name="activation_offload",
    exact=True,
    needs_restart=False,
    step=step,
    describe=describe,
    knob=KNOB,
    default=False,
    shrinks=frozenset({"activations"}),
    activations_only=True,
    memory=lambda plan: TERMS if plan.extra_value(KNOB, False) else None,
    label=lambda plan: "acts=host" if plan.extra_value(KNOB, False) else None,
    saved_activations=saved_activations,
)
