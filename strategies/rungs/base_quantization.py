"""Rung `base_quantization`: store the frozen base weights under LoRA in int8, then NF4.

Only with LoRA (the base must be frozen). Not exact: the base layers compute with dequantized
weights, int8 with one scale per output channel, NF4 (4-bit NormalFloat) with one scale per
64 weights. Parameter memory of the quantized layers drops to about 26 % (int8) and 14 % (NF4)
of fp32; each forward and backward dequantizes one layer's weight at a time. The model is
built when the process starts, so it takes a new attempt.
"""

from __future__ import annotations

from typing import Any

from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs.base import MemoryTerms, Rung

NEXT = {None: "int8", "int8": "nf4"}
# Bytes kept per byte of a frozen fp32 base weight.
TERMS = {"int8": MemoryTerms(time=1.1, base_share=0.27), "nf4": MemoryTerms(time=1.1, base_share=0.16)}


def step(plan: Plan) -> Plan | None:
    if plan.lora_rank is None or plan.base_quantization not in NEXT:
        return None
    return plan.replace(base_quantization=NEXT[plan.base_quantization])


def describe(old: Plan, new: Plan) -> str:
    was = old.base_quantization or "fp32"
    return f"store the frozen base weights in {new.base_quantization} instead of {was} (not exact)"


def adapt_model(plan: Plan, model: Any, seed: int) -> bool:
    """Quantize the frozen base under the adapters the LoRA rung injected (jobs/adapters.py)."""
    if plan.lora_rank is None or plan.base_quantization is None:
        return False
    from oomguard.jobs.adapters import quantize_base

    quantize_base(model, plan.base_quantization)
    return False


def memory(plan: Plan) -> MemoryTerms | None:
    return TERMS[plan.base_quantization] if plan.base_quantization is not None else None


def label(plan: Plan) -> str | None:
    return f"base={plan.base_quantization}" if plan.base_quantization is not None else None


# No command side: no script option quantizes a frozen base.
RUNG = Rung(
    name="base_quantization",
    exact=False,
    needs_restart=True,
    step=step,
    describe=describe,
    knob="base_quantization",
    default=None,
    shrinks=frozenset({"parameters"}),
    memory=memory,
    label=label,
    adapt_model=adapt_model,
    needs=frozenset({"full_model"}),
)
