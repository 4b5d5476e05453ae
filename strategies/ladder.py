"""The ladder: the rungs in the order the doctor tries them, cheapest and most faithful first."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oomguard.strategies import (
    allocator,
    attention,
    base_quantization,
    checkpointing,
    lora,
    micro_batch,
    offload,
    optimizer_8bit,
    precision,
)
from oomguard.strategies.names import RUNG_NAMES
from oomguard.strategies.plan import Plan
from oomguard.strategies.rung import Rung

# Rungs that have code. A name in RUNG_NAMES without an entry here is accepted in job files but
# never taken; the doctor's report says so.
IMPLEMENTED: dict[str, Rung] = {
    r.name: r
    for r in (
        allocator.RUNG,
        micro_batch.RUNG,
        checkpointing.RUNG,
        attention.RUNG,
        offload.RUNG,
        precision.RUNG,
        optimizer_8bit.RUNG,
        lora.RUNG,
        base_quantization.RUNG,
    )
}

ORDER: tuple[Rung, ...] = tuple(IMPLEMENTED[name] for name in RUNG_NAMES if name in IMPLEMENTED)


def rung(name: str) -> Rung | None:
    return IMPLEMENTED.get(name)


def process_environment(plan: Plan, env: Mapping[str, str]) -> dict[str, str]:
    """The environment an attempt under ``plan`` runs with."""
    result = dict(env)
    for r in ORDER:
        result = r.environment(plan, result)
    return result


def configure_model(plan: Plan, model: Any) -> None:
    """Apply every rung's model-side knob for ``plan``."""
    for r in ORDER:
        r.configure_model(plan, model)
