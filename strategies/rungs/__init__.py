"""The ladder: the registry of rungs, in the order the doctor tries them, cheapest and most
faithful first. Each rung lives in its own module (base.py says what one declares); adding a
rung is one new module and one line in ``_LADDER``.

Job files' ``ladder.allow`` lists these names; the exact ones are what a job allows when its
file says nothing. Everything else (the planner, the doctor, the memory model, Plan.short,
command jobs) reads the registry through the functions below.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs import (
    allocator,
    activation_offload,
    attention,
    base_quantization,
    cache_latents,
    cache_text,
    checkpoint_alternate,
    checkpoint_ff,
    checkpointing,
    ema_offload,
    frozen_half,
    fused_backward,
    layer_offload,
    lora,
    micro_batch,
    offload,
    offload_frozen,
    optimizer_4bit,
    optimizer_8bit,
    precision,
    shard_offload,
    shard_optimizer,
    shard_params,
    vae_slicing,
    vae_tiling,
)
from oomguard.strategies.rungs.base import FrozenHandling, MakeOptimizer, Rung, all_on_device, no_conflict, not_sharded

# The order is the ladder's. The caches come first: exact, and they make steps faster. The
# approximate rungs go from the least invasive (the frozen encoders' precision) to the most.
# The checkpointing grades go from the cheapest recomputation to the most; activations kept on
# the host and the optimizer step inside backward (no full set of gradients) are the last
# exact answers on one device without a new optimizer placement. Layer offload (a fraction of
# the blocks' weights, gradients and optimizer state on the host, graded) follows them: one
# process's answer to a model whose state dominates.
# Sharding (exact, for jobs on two or more processes) comes before the offloads: it frees the
# same state without the host's copies and updates; keeping the shards on the host
# (shard_offload) is the slowest exact rung.
_LADDER: tuple[Rung, ...] = (
    allocator.RUNG,
    cache_text.RUNG,
    cache_latents.RUNG,
    micro_batch.RUNG,
    checkpoint_ff.RUNG,
    checkpoint_alternate.RUNG,
    checkpointing.RUNG,
    attention.RUNG,
    activation_offload.RUNG,
    fused_backward.RUNG,
    layer_offload.RUNG,
    shard_optimizer.RUNG,
    shard_params.RUNG,
    vae_slicing.RUNG,
    ema_offload.RUNG,
    offload_frozen.RUNG,
    offload.RUNG,
    shard_offload.RUNG,
    vae_tiling.RUNG,
    frozen_half.RUNG,
    precision.RUNG,
    optimizer_8bit.RUNG,
    optimizer_4bit.RUNG,
    lora.RUNG,
    base_quantization.RUNG,
)


def ladder() -> tuple[Rung, ...]:
    return _LADDER


def names() -> tuple[str, ...]:
    """Every rung name, in ladder order."""
    return tuple(r.name for r in _LADDER)


def exact_names() -> tuple[str, ...]:
    """The rungs that keep the training trajectory (same weights up to float rounding)."""
    return tuple(r.name for r in _LADDER if r.exact)


def usable_by(features: frozenset[str], allow: Iterable[str] | None = None) -> tuple[str, ...]:
    """The rungs of ``allow`` (in its order; all, in ladder order, when None) whose needs a job
    offering ``features`` meets (Rung.needs, JobSpec.features)."""
    names_given = tuple(allow) if allow is not None else names()
    return tuple(name for name in names_given if (r := rung(name)) is not None and r.needs <= features)


def rung(name: str) -> Rung | None:
    return next((r for r in _LADDER if r.name == name), None)


@contextmanager
def register(new: Rung, *, after: str | None = None) -> Iterator[Rung]:
    """Put ``new`` on the ladder (last, or right after the rung ``after``) for the duration of
    the block: what a test does to add a rung without editing this module."""
    global _LADDER
    if rung(new.name) is not None:
        raise ValueError(f"a rung named {new.name!r} is on the ladder already")
    before = _LADDER
    position = len(before) if after is None else [r.name for r in before].index(after) + 1
    _LADDER = (*before[:position], new, *before[position:])
    try:
        yield new
    finally:
        _LADDER = before


def process_environment(plan: Plan, env: Mapping[str, str]) -> dict[str, str]:
    """The environment an attempt under ``plan`` runs with."""
    result = dict(env)
    for r in _LADDER:
        result = r.environment(plan, result)
    return result


def configure_model(plan: Plan, model: Any) -> None:
    """Apply every rung's model-side knob for ``plan``."""
    for r in _LADDER:
        r.configure_model(plan, model)


def adapt_model(plan: Plan, model: Any, seed: int) -> bool:
    """Apply every rung's change to a freshly built model on the host, in ladder order; True
    when one froze the model's own weights (only what a rung added is trained)."""
    froze = False
    for r in _LADDER:
        froze = r.adapt_model(plan, model, seed) or froze
    return froze


def make_optimizer(plan: Plan, params: list[Any], lr: float, weight_decay: float, fused: bool | None) -> Any:
    """The first rung's optimizer for ``plan`` over ``params``, or None (torch's AdamW)."""
    for r in _LADDER:
        optimizer = r.make_optimizer(plan, params, lr, weight_decay, fused)
        if optimizer is not None:
            return optimizer
    return None


def place_optimizer(plan: Plan, params: list[Any], make: MakeOptimizer, memory: Any) -> Any:
    """The first rung's optimizer kept away from the parameters' device, or None."""
    for r in _LADDER:
        optimizer = r.place_optimizer(plan, params, make, memory)
        if optimizer is not None:
            return optimizer
    return None


def autocast_dtype(plan: Plan, device: Any) -> Any:
    """The torch dtype to autocast to on ``device`` under ``plan``, or None (full precision)."""
    for r in _LADDER:
        dtype = r.autocast_dtype(plan, device)
        if dtype is not None:
            return dtype
    return None


def saved_activations(plan: Plan, memory: Any, model: Any) -> Any:
    """The context the forward of ``model`` runs under: the first rung's saved-tensor hooks
    for ``plan``, or a context that changes nothing."""
    for r in _LADDER:
        hooks = r.saved_activations(plan, memory, model)
        if hooks is not None:
            return hooks
    return nullcontext()


def conflict(plan: Plan) -> str | None:
    """Why ``plan`` combines rungs that cannot run together, or None. (The planner asks it of
    every candidate: the rungs without a conflict hook are passed over first.)"""
    return next((reason for r in _LADDER if r.conflict is not no_conflict and r.is_on(plan) and (reason := r.conflict(plan)) is not None), None)


def shard_model(plan: Plan, model: Any, mesh: Any) -> str | None:
    """Shard ``model`` across ``mesh`` as ``plan``'s sharding rung says; where the shards live
    ("device", "host"), or None when the plan shards nothing."""
    return next((where for r in _LADDER if (where := r.shard_model(plan, model, mesh)) is not None), None)


def keep_on_host(plan: Plan, model: Any, device: Any, memory: Any) -> bool:
    """Move ``model`` (built on the host, one process) to ``device`` keeping part of it in host
    memory, as a rung of ``plan`` says; False when no rung does (the caller moves it)."""
    return any(r.keep_on_host(plan, model, device, memory) for r in _LADDER if r.keep_on_host is not all_on_device)


def sharded(plan: Plan) -> bool:
    """Whether ``plan`` shards the model across its processes (a rung that shards is on)."""
    return any(r.shard_model is not not_sharded and r.is_on(plan) for r in _LADDER)


def ema_on_host(plan: Plan) -> bool:
    """Whether the average of the trained weights (train.ema) lives in host memory under ``plan``."""
    return any(r.ema_on_host(plan) for r in _LADDER)


def frozen_handling(plan: Plan) -> FrozenHandling:
    """What the frozen parts of a trainer that has some do under ``plan``."""
    handling = FrozenHandling()
    for r in _LADDER:
        handling = r.frozen(plan, handling)
    return handling
