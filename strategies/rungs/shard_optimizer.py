"""Rung `shard_optimizer`: shard the optimizer state and the gradients across the job's ranks
(ZeRO-2-like, FSDP2 `fully_shard` with `reshard_after_forward=False`).

Exact: every rank computes the same AdamW update on its shard of every tensor, and the
gradients are averaged across ranks as data parallelism averages them (reduce-scatter instead of
all-reduce), so the trajectory is data parallelism's up to the order of float additions. Each
rank keeps 1/N of the optimizer state and gradients; the parameters are gathered for a step.
The model is sharded when the process starts, so it takes a new attempt.
"""

from __future__ import annotations

from typing import Any

from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs import sharding
from oomguard.strategies.rungs.base import MemoryTerms, Rung

LEVEL: sharding.Level = "optimizer"


def step(plan: Plan) -> Plan | None:
    return sharding.step_to(plan, LEVEL)


def describe(old: Plan, new: Plan) -> str:
    if sharding.level(new) == LEVEL:
        return f"shard the optimizer state and gradients across the {new.world_size} processes (exact)"
    return f"{sharding.WHAT[LEVEL]} off (replaced by {sharding.WHAT[sharding.level(new)]})" if sharding.level(new) != "none" else f"{sharding.WHAT[LEVEL]} off"


def memory(plan: Plan) -> MemoryTerms | None:
    return sharding.terms(plan, LEVEL, time=1.03)


def label(plan: Plan) -> str | None:
    return "shard_optimizer" if sharding.level(plan) == LEVEL else None


def shard_model(plan: Plan, model: Any, mesh: Any) -> str | None:
    return sharding.shard(plan, model, LEVEL, mesh)


RUNG = Rung(
    name="shard_optimizer",
    exact=True,
    needs_restart=True,
    step=step,
    describe=describe,
    knob=sharding.KNOBS[LEVEL],
    default=False,
    shrinks=frozenset({"optimizer_state", "gradients"}),
    memory=memory,
    label=label,
    conflict=sharding.conflict,
    shard_model=shard_model,
    needs=frozenset({"full_model", "shardable"}),
)
