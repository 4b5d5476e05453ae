"""Rung `shard_optimizer`: shard the optimizer state and the gradients across the job's ranks
(ZeRO-2-like, FSDP2 `fully_shard` with `reshard_after_forward=False`).

Exact: every rank computes the same AdamW update on its shard of every tensor, and the
gradients are averaged across ranks as data parallelism averages them (reduce-scatter instead of
all-reduce), so the trajectory is data parallelism's up to the order of float additions. Each
rank keeps 1/N of the optimizer state and gradients; the parameters are gathered for a step.
The model is sharded when the process starts, so it takes a new attempt.
"""

from __future__ import annotations

from oomguard.strategies.rungs import sharding

RUNG = sharding.level_rung(
    "shard_optimizer",
    "optimizer",
    time=1.03,
    shrinks=frozenset({"optimizer_state", "gradients"}),
    listed=5,
    says="shard the optimizer state and gradients across the {ranks} processes (exact)",
)
