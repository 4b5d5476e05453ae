"""Rung `layer_offload`: keep a fraction of the model's blocks in host memory (their weights,
gradients and optimizer state), each block streamed to the device just before it runs and
dropped after (jobs/layer_offload.py).

Exact: the same weights take part in the same arithmetic; only where they rest between uses
changes (the host runs the offloaded blocks' AdamW update, torch's fused CPU kernel, as rung
`offload` does). Graded: ``offload_fraction`` is 0.25, 0.5, 0.75 or 1.0 of the blocks' weights,
largest blocks first, and each step takes the next fraction, so the planner weighs every grade
as its own plan and takes the least that fits (every fraction costs copies each step).

Which models gain: the blocks hold nearly all of a model's weights, so the saving is that share
of the weights, gradients and optimizer state (4 bytes of state per weight byte with AdamW,
less the block on the device at a time). A transformer fine-tuned at a small micro-batch spends
most of its memory there (published: a Flux LoRA from ~24 to 8 GB by swapping blocks); a UNet at
large micro-batches spends most of it on activations, which stay. The memory model reads the
bytes each grade keeps off the device from the run's measurement (``measured_key``), so it
predicts each job's saving from its own model.

Not on several processes (the sharding rungs keep the state off the device there: shard_offload
is the same idea across ranks), nor with rungs that change the optimizer's or the weights' form
(see ``conflict``). A command job never takes it. Takes a new attempt.
"""

from __future__ import annotations

from typing import Any

from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs import fused_backward
from oomguard.strategies.rungs.base import MemoryTerms, Rung

KNOB = "offload_fraction"
FRACTIONS: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
# Until a run measured the model: blocks hold about this share of a diffusers model's weights
# (UNet2DModel 32/64 channels: 0.97; a small DiT: 0.98), less one block gathered at a time.
BLOCK_SHARE = 0.85
# Steps slower per unit of the fraction: each step copies the offloaded weights to the device
# twice (forward, and again for backward) and their gradients back, and the host runs their
# AdamW update. Rung offload's 1.1 pays for two copies of every weight and the host's update
# of all of them; three copies and the update of a fraction f, priced alike, make 1 + 0.15 f
# (the copies overlap the blocks' compute, so this errs slow). A measured run of the plan
# replaces it; on this project's CPU "device" the copies cost nothing.
HOST_COST = 0.15


def fraction(plan: Plan) -> float:
    return float(plan.extra_value(KNOB, 0.0))


def on(plan: Plan) -> bool:
    return fraction(plan) > 0


def measured_key(share: float) -> str:
    """The key of a measurement's static bytes that holds the weight bytes fraction ``share``
    keeps off the device (the runner writes one for every fraction, whatever the plan)."""
    return f"held_on_host_{share:g}"


def step(plan: Plan) -> Plan | None:
    current = fraction(plan)
    deeper = [f for f in FRACTIONS if f > current]
    if not deeper:
        return None
    new = plan.with_extra(KNOB, deeper[0], 0.0)
    return new if conflict(new) is None else None


def describe(old: Plan, new: Plan) -> str:
    if not on(new):
        return "all blocks on the device again"
    return f"keep {fraction(new):.0%} of the blocks' weights, gradients and optimizer state in host memory, streamed in as each block runs (exact; slower steps)"


def conflict(plan: Plan) -> str | None:
    if not on(plan):
        return None
    if plan.world_size > 1:
        return f"layer offload needs one process; the plan has {plan.world_size} (shard_offload keeps the state on the host across processes)"
    if plan.offload != "none":
        return "layer offload cannot run with the host-offloaded optimizer: the offloaded blocks' optimizer state is on the host already (take one or the other)"
    if plan.optimizer != "adamw":
        return f"layer offload runs torch's AdamW on the host for the offloaded blocks; the {plan.optimizer} optimizer cannot update them"
    if plan.mixed_precision == "fp16":
        return "layer offload cannot run with fp16's loss scaler, which unscales the host and device gradients as one set"
    if plan.lora_rank is not None or plan.base_quantization is not None:
        return "layer offload cannot run with LoRA or a quantized base: it streams the whole model's own weights"
    if fused_backward.on(plan):
        return "layer offload cannot run with the optimizer step in backward: the offloaded blocks are updated on the host after backward"
    return None


def memory(plan: Plan) -> MemoryTerms | None:
    share = fraction(plan)
    if share <= 0:
        return None
    return MemoryTerms(time=1 + HOST_COST * share, state_on_host=BLOCK_SHARE * share, state_on_host_key=measured_key(share))


def keep_on_host(plan: Plan, model: Any, device: Any, memory: Any) -> bool:
    if not on(plan):
        return False
    from oomguard.jobs.layer_offload import offload_blocks

    offload_blocks(model, fraction(plan), device, memory)
    return True


def place_optimizer(plan: Plan, params: list[Any], make: Any, memory: Any) -> Any:
    if not on(plan):
        return None
    from oomguard.jobs.layer_offload import LayerOffloadOptimizer

    return LayerOffloadOptimizer(params, make, memory)


RUNG = Rung(
    name="layer_offload",
    exact=True,
    needs_restart=True,
    step=step,
    describe=describe,
    knob=KNOB,
    default=0.0,
    shrinks=frozenset({"parameters", "gradients", "optimizer_state"}),
    on=on,
    memory=memory,
    label=lambda plan: f"layers@host={fraction(plan):g}" if on(plan) else None,
    conflict=conflict,
    keep_on_host=keep_on_host,
    place_optimizer=place_optimizer,
    # It wraps a built-in trainer's whole model (not an average of its weights: train.ema).
    needs=frozenset({"full_model", "shardable"}),
)
