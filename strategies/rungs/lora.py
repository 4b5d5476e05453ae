"""Rung `lora`: freeze the model and train low-rank adapters (LoRA) instead.

Not exact: it changes what is trained. The base weights are frozen at the values they had
when the rung was taken; each adapted layer learns a rank-r update B @ A (B starts at zero, so
the model's output is unchanged at that moment). Gradients and optimizer state then exist
only for the adapters. The final model is the base with the adapters merged in.

DEFAULT_LORA_RANK = 16: the rank most diffusion LoRA recipes use for UNets of a few hundred
channels; at 320-1280 channels it trains 1-10 % of each layer's weights, small enough to free
nearly all gradient and optimizer memory and large enough to follow a full fine-tune on
small data sets. (On a toy UNet of 32-64 channels it is a third to a half of the weights.)
The model is built when the process starts, so it takes a new attempt.
"""

from __future__ import annotations

from typing import Any

from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs.base import CommandSide, MemoryTerms, Placeholder, Rung, WhenKey

DEFAULT_LORA_RANK = 16
# The adapters' parameters as a share of the base model's (rank 16 on a small UNet; an
# overestimate on big models, which errs towards fitting).
TERMS = MemoryTerms(activation=1.05, time=0.9, adapter_share=0.1)


def step(plan: Plan) -> Plan | None:
    if plan.lora_rank is not None:
        return None
    return plan.replace(lora_rank=DEFAULT_LORA_RANK)


def describe(old: Plan, new: Plan) -> str:
    return (
        f"freeze the model and train rank-{new.lora_rank} LoRA adapters "
        "(gradients and optimizer state for the adapters only; changes what is trained)"
    )


def adapt_model(plan: Plan, model: Any, seed: int) -> bool:
    """Freeze the model and inject the adapters (jobs/adapters.py)."""
    if plan.lora_rank is None:
        return False
    import torch

    from oomguard.jobs.adapters import apply_lora

    # The adapters' A matrices are random: the same seed gives the same adapters.
    torch.manual_seed(seed)
    apply_lora(model, plan.lora_rank)
    return True


def memory(plan: Plan) -> MemoryTerms | None:
    return TERMS if plan.lora_rank is not None else None


def label(plan: Plan) -> str | None:
    return f"lora={plan.lora_rank}" if plan.lora_rank is not None else None


def command_values(plan: Plan) -> dict[str, str]:
    return {"lora_rank": str(plan.lora_rank or 0)}


RUNG = Rung(
    name="lora",
    exact=False,
    needs_restart=True,
    step=step,
    describe=describe,
    knob="lora_rank",
    default=None,
    shrinks=frozenset({"optimizer_state", "gradients", "parameters"}),
    memory=memory,
    label=label,
    adapt_model=adapt_model,
    needs=frozenset({"full_model"}),
    command=CommandSide(
        placeholders=(Placeholder("lora_rank", "the LoRA rank (only with [command.when] lora)", listed=6),),
        when=WhenKey("lora", "LoRA adapters are trained (with {lora_rank})", listed=4),
        needs=("when:lora",),
        values=command_values,
    ),
)
