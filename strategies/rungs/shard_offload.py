"""Rung `shard_offload`: shard parameters, gradients and optimizer state as shard_params, and
keep the shards in host memory (FSDP2 `CPUOffloadPolicy`): the device holds only the block
being gathered and the activations; the optimizer step runs on the host.

Exact, as shard_optimizer; the slowest sharding level (every block crosses to the device each
step). Takes a new attempt.
"""

from __future__ import annotations

from oomguard.strategies.rungs import sharding

RUNG = sharding.level_rung(
    "shard_offload",
    "host",
    time=1.6,
    shrinks=frozenset({"parameters", "optimizer_state", "gradients"}),
    listed=7,
    says="shard parameters, gradients and optimizer state across the {ranks} processes and keep the shards in host memory (exact; slower steps)",
)
