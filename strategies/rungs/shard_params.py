"""Rung `shard_params`: shard the parameters too (ZeRO-3-like, FSDP2 `fully_shard` with
`reshard_after_forward=True`): each block's weights are gathered for its forward and again for
its backward and freed after use.

Exact, as shard_optimizer. Each rank keeps 1/N of parameters, gradients and optimizer state,
plus the block being gathered; the gathers cost time. Takes a new attempt.
"""

from __future__ import annotations

from typing import Any

from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs import sharding
from oomguard.strategies.rungs.base import MemoryTerms, Rung

LEVEL: sharding.Level = "params"


def step(plan: Plan) -> Plan | None:
    return sharding.step_to(plan, LEVEL)


def describe(old: Plan, new: Plan) -> str:
    if sharding.level(new) == LEVEL:
        return f"shard parameters, gradients and optimizer state across the {new.world_size} processes (exact; each block gathered when used)"
    return f"{sharding.WHAT[LEVEL]} off (replaced by {sharding.WHAT[sharding.level(new)]})" if sharding.level(new) != "none" else f"{sharding.WHAT[LEVEL]} off"


def memory(plan: Plan) -> MemoryTerms | None:
    return sharding.terms(plan, LEVEL, time=1.08)


def label(plan: Plan) -> str | None:
    return "shard_params" if sharding.level(plan) == LEVEL else None


def shard_model(plan: Plan, model: Any, mesh: Any) -> str | None:
    return sharding.shard(plan, model, LEVEL, mesh)


RUNG = Rung(
    name="shard_params",
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
