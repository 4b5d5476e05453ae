"""Rung `shard_offload`: shard parameters, gradients and optimizer state as shard_params, and
keep the shards in host memory (FSDP2 `CPUOffloadPolicy`): the device holds only the block
being gathered and the activations; the optimizer step runs on the host.

Exact, as shard_optimizer; the slowest sharding level (every block crosses to the device each
step). Takes a new attempt.
"""

from __future__ import annotations

from typing import Any

from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs import sharding
from oomguard.strategies.rungs.base import MemoryTerms, Rung

LEVEL: sharding.Level = "host"


def step(plan: Plan) -> Plan | None:
    return sharding.step_to(plan, LEVEL)


def describe(old: Plan, new: Plan) -> str:
    if sharding.level(new) == LEVEL:
        return f"shard parameters, gradients and optimizer state across the {new.world_size} processes and keep the shards in host memory (exact; slower steps)"
    return f"{sharding.WHAT[LEVEL]} off (replaced by {sharding.WHAT[sharding.level(new)]})" if sharding.level(new) != "none" else f"{sharding.WHAT[LEVEL]} off"


def memory(plan: Plan) -> MemoryTerms | None:
    return sharding.terms(plan, LEVEL, time=1.6)


def label(plan: Plan) -> str | None:
    return "shard_offload" if sharding.level(plan) == LEVEL else None


def shard_model(plan: Plan, model: Any, mesh: Any) -> str | None:
    return sharding.shard(plan, model, LEVEL, mesh)


RUNG = Rung(
    name="shard_offload",
    exact=True,
    needs_restart=True,
    step=step,
    describe=describe,
    knob=sharding.KNOBS[LEVEL],
    default=False,
    shrinks=frozenset({"parameters", "optimizer_state", "gradients"}),
    memory=memory,
    label=label,
    conflict=sharding.conflict,
    shard_model=shard_model,
    needs=frozenset({"full_model", "shardable"}),
)
