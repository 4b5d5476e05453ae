"""What the three sharding rungs share (shard_optimizer, shard_params, shard_offload): one
sharding level per plan, its memory terms per rank, the rungs it cannot run with, and how a
built model is sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

A plan has at most one sharding rung on: each step turns the deeper level on and the others
off, so one level is one plan. Sharding needs two or more ranks (``Plan.world_size``): on one
rank there is nothing to share the state with.

Bytes per rank, as shares of the whole model's (N ranks; ZeRO's accounting):

| level      | parameters                | gradients            | optimizer state |
|------------|---------------------------|----------------------|-----------------|
| none (DDP) | 1                         | 1                    | 1               |
| optimizer  | 1/N + 1 (gathered) + unit | 1/N                  | 1/N             |
| params     | 1/N + two units           | 1/N + two units      | 1/N             |
| host       | 1/N + two units           | 1/N + unit           | 0 (host)        |

ZeRO's accounting leaves out what FSDP holds while it talks: the all-gather's output for the
unit being gathered (and, resharding after forward, the next one, prefetched), and a unit's
unsharded gradients before its reduce-scatter (the gathered model's own gradients cover them
where the whole model stays gathered). Measured per rank on a 32/64-channel UNet
(bench/multi_gpu_pairs.py, 2026-12-07, the emulation counting DTensor shards), the table
without them fell short by 0.33-0.37 of the model's parameters (optimizer), 0.57-0.59
(params) and 0.8-1.1 (host, where the shards' device copies for the collectives stay too), on
2 and 4 ranks: a sharded plan chosen on that prediction ran out of memory as it was measured,
which ends the attempt (an OOM inside the collectives cannot be agreed on). With these terms
the predictions there are within 3 % of the measured peaks or above them; the probe measures a
sharding level only where these say it fits with the margins (jobs/probe.py).

"optimizer" (shard_optimizer) keeps every unit's gathered parameters from forward to backward
(``reshard_after_forward=False``), so the whole model is on each rank during a step, beside
its shards; "params" (shard_params) gathers one unit at a time and frees it after use; "host" (shard_offload) keeps the shards in host memory. A *unit* is what FSDP
gathers at once: one top-level block of the model. ``UNIT_SHARE`` is an estimate (two of
about eight blocks in flight); what a run measures replaces it in the memory model.
"""

from __future__ import annotations

from typing import Any, Literal

from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs.base import CommandSide, Consumer, MemoryTerms, Rung, WhenKey

Level = Literal["none", "optimizer", "params", "host"]
LEVELS: tuple[Level, ...] = ("none", "optimizer", "params", "host")
# The knob of each level's rung, in Plan.extra (Plan has no field for them).
KNOBS: dict[Level, str] = {"optimizer": "sharded_optimizer", "params": "sharded_params", "host": "sharded_on_host"}
# What each level shards, for messages.
WHAT: dict[Level, str] = {
    "optimizer": "sharding the optimizer state", "params": "sharding the parameters", "host": "keeping the shards on the host",
}
# The share of the model's parameters FSDP holds gathered at once (see the module's notes).
UNIT_SHARE = 0.25


def level(plan: Plan) -> Level:
    """The plan's sharding level (the deepest sharding rung that is on)."""
    for name in reversed(LEVELS[1:]):
        if plan.extra_value(KNOBS[name], False):
            return name
    return "none"


def with_level(plan: Plan, wanted: Level) -> Plan:
    """``plan`` at sharding level ``wanted``, every other sharding knob off."""
    for name, knob in KNOBS.items():
        plan = plan.with_extra(knob, name == wanted, False)
    return plan


def step_to(plan: Plan, wanted: Level) -> Plan | None:
    """The step of the rung of level ``wanted``: only deeper than the plan's level, only with
    two or more ranks, and never into a combination the sharded model cannot run."""
    if plan.world_size < 2 or LEVELS.index(level(plan)) >= LEVELS.index(wanted):
        return None
    new = with_level(plan, wanted)
    return new if conflict(new) is None else None


def conflict(plan: Plan) -> str | None:
    """Why ``plan``'s sharding cannot run with the rest of it, or None: the host-offloaded and
    8-bit optimizers keep their own per-tensor state (not shards), LoRA and a quantized base
    change which weights exist."""
    sharded = level(plan)
    if sharded == "none":
        return None
    if plan.world_size < 2:
        return f"{WHAT[sharded]} needs 2 or more processes; the plan has 1"
    if plan.offload != "none":
        return f"{WHAT[sharded]} cannot run with the host-offloaded optimizer: keeping the shards on the host is its sharded form"
    if plan.optimizer != "adamw":
        return f"{WHAT[sharded]} cannot run with the {plan.optimizer} optimizer: its state is not sharded"
    if plan.lora_rank is not None or plan.base_quantization is not None:
        return f"{WHAT[sharded]} cannot run with LoRA or a quantized base: it shards the whole model's weights"
    return None


def terms(plan: Plan, of: Level, time: float) -> MemoryTerms | None:
    """The memory terms of level ``of`` when it is the plan's, per rank."""
    if level(plan) != of:
        return None
    ranks = plan.world_size
    if of == "optimizer":
        # The sharded gradients fill as the gathered blocks are freed in backward: no unit more.
        return MemoryTerms(time=time, parameter_share=1 / ranks + 1 + UNIT_SHARE, gradient_share=1 / ranks, optimizer_share=1 / ranks)
    if of == "params":
        return MemoryTerms(
            time=time, parameter_share=1 / ranks + 2 * UNIT_SHARE, gradient_share=1 / ranks + 2 * UNIT_SHARE, optimizer_share=1 / ranks,
        )
    return MemoryTerms(time=time, parameter_share=1 / ranks + 2 * UNIT_SHARE, gradient_share=1 / ranks + UNIT_SHARE, optimizer_on_device=False)


def shard(plan: Plan, model: Any, of: Level, mesh: Any) -> str | None:
    """Shard ``model`` (built on the host) across ``mesh`` with FSDP2 when ``of`` is the plan's
    level: each top-level block is a unit, then the model itself; FSDP moves each rank's
    shards to its device, or keeps them in host memory. Where the shards are, or None."""
    if level(plan) != of:
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": of != "optimizer"}
    if of == "host":
        # Pinned host memory needs a CUDA device; on a CPU-only machine it cannot be pinned.
        import torch

        options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for unit in units(model):
        fully_shard(unit, **options)
    fully_shard(model, **options)
    return "host" if of == "host" else "device"


def units(model: Any) -> list[Any]:
    """The blocks FSDP gathers one at a time: the entries of the model's top-level module lists
    (a diffusers UNet's down, mid and up blocks; a transformer's blocks); a model without any
    is one unit."""
    import torch

    found = []
    for child in model.children():
        if isinstance(child, torch.nn.ModuleList):
            found.extend(child)
        elif any(p.requires_grad for p in child.parameters()) and any(True for _ in child.children()):
            found.append(child)
    return found


def level_rung(name: str, of: Level, *, time: float, shrinks: frozenset[Consumer], says: str, listed: int) -> Rung:
    """The Rung of sharding level ``of``: named ``name``, its steps ``time`` slower, shrinking
    ``shrinks``; ``says`` what it does, for events ("{ranks}" is the number of processes). A
    command job takes it through its [command.when] key of the same name (the arguments that
    turn the script's own sharding on, e.g. an accelerate config with FSDP), ``listed`` among
    the keys."""

    def describe(old: Plan, new: Plan) -> str:
        if level(new) == of:
            return says.format(ranks=new.world_size)
        return f"{WHAT[of]} off (replaced by {WHAT[level(new)]})" if level(new) != "none" else f"{WHAT[of]} off"

    return Rung(
        name=name,
        exact=True,
        needs_restart=True,
        step=lambda plan: step_to(plan, of),
        describe=describe,
        knob=KNOBS[of],
        default=False,
        shrinks=shrinks,
        memory=lambda plan: terms(plan, of, time=time),
        label=lambda plan: name if level(plan) == of else None,
        conflict=conflict,
        shard_model=lambda plan, model, mesh: shard(plan, model, of, mesh),
        needs=frozenset({"full_model", "shardable"}),
        command=CommandSide(when=WhenKey(name, f"{WHAT[of]} across the processes", listed=listed), needs=(f"when:{name}",)),
    )
