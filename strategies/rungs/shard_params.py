"""Rung `shard_params`: shard the parameters too (ZeRO-3-like, FSDP2 `fully_shard` with
`reshard_after_forward=True`): each block's weights are gathered for its forward and again for
its backward and freed after use.

Exact, as shard_optimizer. Each rank keeps 1/N of parameters, gradients and optimizer state,
plus the block being gathered; the gathers cost time. Takes a new attempt.
"""

from __future__ import annotations

from oomguard.strategies.rungs import sharding

RUNG = sharding.level_rung(
    "shard_params",
    "params",
    time=1.08,
    shrinks=frozenset({"parameters", "optimizer_state", "gradients"}),
    listed=6,
    says="shard parameters, gradients and optimizer state across the {ranks} processes (exact; each block gathered when used)",
)
