"""The static consumers of device memory for one shape of plan: parameters, gradients,
optimizer state, autocast's casts, the frozen parts and the average of the trained weights, from what the rungs that are on do to
them (their MemoryTerms) and what a run measured. The memory model (memory_model.py) adds the
activations, which grow with the micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from oomguard.strategies import rungs
from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs.base import MemoryTerms

# Bytes of optimizer state per byte of trainable parameters of the plain plan: AdamW keeps two
# fp32 moments (a rung's terms may say otherwise).
ADAMW_STATE_PER_PARAMETER_BYTE = 2.0


def terms_of(plan: Plan) -> list[MemoryTerms]:
    """The memory terms of the rungs ``plan`` has on, in ladder order."""
    return [terms for r in rungs.ladder() if (terms := r.memory(plan)) is not None]


@dataclass(frozen=True)
class StaticBytes:
    """The consumers that do not grow with the micro-batch, for one shape."""

    parameters: float
    gradients: float
    optimizer_state: float
    # Extra bytes a half-precision step keeps (autocast's low-precision weight copies).
    casts: float = 0.0
    # Frozen parts beside the trained model (a text-to-image job's VAE and text encoders).
    frozen: float = 0.0
    # The average of the trained weights (train.ema), when it is on the device.
    ema: float = 0.0

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state + self.casts + self.frozen + self.ema


def first_given(values: Iterable[float | None]) -> float | None:
    return next((value for value in values if value is not None), None)


def full_parameter_bytes(shape: Plan, static: dict[str, int]) -> float | None:
    """The bytes the whole model's parameters take in full precision, from what a run of
    ``shape`` measured (a sharded run says so itself: its ranks hold shards)."""
    if WHOLE_MODEL_BYTES in static:
        return float(static[WHOLE_MODEL_BYTES])
    parameters = static.get("parameters")
    if parameters is None:
        return None
    terms = terms_of(shape)
    adapter_share = first_given(t.adapter_share for t in terms)
    share = math.prod(t.parameter_share for t in terms)
    if adapter_share is not None:
        base_share = first_given(t.base_share for t in terms)
        share *= adapter_share + (base_share if base_share is not None else 1.0)
    return parameters / share


# A sharded run's measurement names the whole model's parameter bytes under this key (its
# "parameters" are this rank's shards, wherever they are).
WHOLE_MODEL_BYTES = "whole_model"


# A measurement's static bytes name each frozen part's full-precision size under this prefix
# ("frozen_size_vae"), whether or not the part was on the device.
FROZEN_SIZE_PREFIX = "frozen_size_"


def frozen_sizes(static: dict[str, int]) -> dict[str, float]:
    """The frozen parts' full-precision bytes a measurement's static bytes name, by part."""
    return {key[len(FROZEN_SIZE_PREFIX):]: float(value) for key, value in static.items() if key.startswith(FROZEN_SIZE_PREFIX)}


# A measurement's static bytes name the size of the average of the trained weights (train.ema)
# under this key, wherever the average was.
EMA_SIZE = "ema_size"


def frozen_on_device(shape: Plan, sizes: dict[str, float]) -> float:
    """The bytes of the frozen parts ``shape`` keeps on the device: the parts no rung of it
    drops, scaled by its rungs' frozen_scale."""
    terms = terms_of(shape)
    dropped = {part for t in terms for part in t.frozen_dropped}
    return sum(size for part, size in sizes.items() if part not in dropped) * math.prod(t.frozen_scale for t in terms)


def static_bytes(
    shape: Plan, full_parameters: float, frozen: dict[str, float] | None = None, trained_share: float = 1.0, ema: float = 0.0,
    measured: dict[str, int] | None = None,
) -> StaticBytes:
    """What parameters, gradients, optimizer state, the frozen parts (``frozen``: each part's
    full-precision bytes) and the average of the trained weights (``ema``: its bytes) of
    ``shape`` take on the device. ``trained_share``: the share of the model's parameters the
    job itself trains (a text-to-image LoRA job's adapters: a few per cent), when no rung froze
    them. The average is of the job's own trained weights, whatever a rung trains instead.
    ``measured``: a run's static figures, where a rung's terms find the bytes it keeps on the
    host (MemoryTerms.state_on_host_key)."""
    terms = terms_of(shape)
    adapter_share = first_given(t.adapter_share for t in terms)
    if adapter_share is None:
        # No rung froze anything, so nothing is quantized either.
        parameters = full_parameters
        trainable = full_parameters * trained_share
    else:
        trainable = full_parameters * adapter_share
        base_share = first_given(t.base_share for t in terms)
        parameters = full_parameters * (base_share if base_share is not None else 1.0) + trainable
    per_byte = first_given(t.optimizer_bytes_per_byte for t in terms)
    on_device = all(t.optimizer_on_device for t in terms)
    optimizer = trainable * (per_byte if per_byte is not None else ADAMW_STATE_PER_PARAMETER_BYTE) if on_device else 0.0
    casts = parameters * sum(t.cast_share for t in terms)
    kept = 1.0 - on_host_share(terms, full_parameters, measured or {})
    # Sharding: each rank keeps its share of each (1.0 without); layer offload keeps a share of
    # all three on the host.
    return StaticBytes(
        parameters=parameters * math.prod(t.parameter_share for t in terms) * kept,
        gradients=trainable * math.prod(t.gradient_share for t in terms) * kept,
        optimizer_state=optimizer * math.prod(t.optimizer_share for t in terms) * kept,
        casts=casts,
        frozen=frozen_on_device(shape, frozen or {}),
        ema=ema if all(t.ema_on_device for t in terms) else 0.0,
    )


def on_host_share(terms: list[MemoryTerms], full_parameters: float, measured: dict[str, int]) -> float:
    """The share of the model's weights (with their gradients and optimizer state) that the
    rungs of ``terms`` keep in host memory: what a run measured for it, else the rung's estimate."""
    share = 0.0
    for t in terms:
        key = t.state_on_host_key
        if key is not None and key in measured and full_parameters > 0:
            share += measured[key] / full_parameters
        else:
            share += t.state_on_host
    return min(1.0, max(0.0, share))
