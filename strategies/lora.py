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

from oomguard.strategies.plan import Plan
from oomguard.strategies.rung import Rung

DEFAULT_LORA_RANK = 16


def step(plan: Plan) -> Plan | None:
    if plan.lora_rank is not None:
        return None
    return plan.replace(lora_rank=DEFAULT_LORA_RANK)


def describe(old: Plan, new: Plan) -> str:
    return (
        f"freeze the model and train rank-{new.lora_rank} LoRA adapters "
        "(gradients and optimizer state for the adapters only; changes what is trained)"
    )


RUNG = Rung(name="lora", exact=False, needs_restart=True, step=step, describe=describe)
