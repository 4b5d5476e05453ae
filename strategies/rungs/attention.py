"""Rung `attention`: recompute attention in backward instead of storing its activations.

Exact: the forward is the model's own SDPA processor, run again in backward (float rounding
aside, the same numbers). No new process is needed: the processors are switched on the model.

Why not diffusers' ``SlicedAttnProcessor``: it saves memory in *inference* only. Measured on
the quickstart UNet (block_out_channels [32, 64], attention in a down, the mid and an up
block: four attention layers at 16x16), 32x32 images, micro-batch 8, one forward + backward
under the emulated device; time is the best of three on one CPU thread:

    ==========================================  ==========  ===========
    attention processor                         peak (MiB)  fwd+bwd (s)
    ==========================================  ==========  ===========
    AttnProcessor2_0 (SDPA, as built)           72.6        0.184
    AttnProcessor (vanilla)                     144.9       0.242
    SlicedAttnProcessor (diffusers, slice 1)    136.3       0.289
    this rung: SDPA under checkpoint            58.3        0.219
    gradient checkpointing rung                 47.8        0.211
    gradient checkpointing + this rung          33.6        0.224
    ==========================================  ==========  ===========

SDPA (flash / memory-efficient kernels, on CPU too) never materialises the attention
probabilities, so slicing queries or heads has nothing left to save; diffusers' sliced
processor keeps every slice's probabilities for backward and is worse than SDPA. What an
attention block still keeps for backward is its group-norm output, q, k, v, the SDPA output
and log-sum-exp and the output projection's input: about seven tensors the size of the
block's input. This rung runs each diffusers ``Attention`` module's processor under
``torch.utils.checkpoint`` (non-reentrant), so only the block's input is kept and the rest is
recomputed, one block at a time, in backward: selective activation checkpointing of the
attention blocks. It saves 14.3 MiB (20 %) of the peak above, and 30 % on top of the
``checkpointing`` rung (diffusers' gradient checkpointing of UNet2DModel checkpoints the
ResNets but calls attention plainly), for one extra attention forward per block (here 6-19 %
of a step; less where convolutions dominate). Running it in batch slices, each checkpointed,
saved 1 MiB more for 30 % more time, so it is not done. The saving grows with the token count.

The plan value is called "sliced" (fixed by the Plan's vocabulary); what it does is the above.
"""

from __future__ import annotations

from typing import Any

from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs.base import CommandSide, MemoryTerms, Placeholder, Rung, WhenKey

# Measured as checkpointing's TERMS are (tests/integration/test_rung_memory.py).
TERMS = MemoryTerms(activation=0.9, time=1.1)


class CheckpointedAttention:
    """A diffusers attention processor that runs ``inner`` under activation checkpointing.

    Without gradients (inference, evaluation) it calls ``inner`` directly. The signature names
    ``temb`` like diffusers' own processors, so Attention passes it without a warning.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(
        self,
        attn: Any,
        hidden_states: Any,
        encoder_hidden_states: Any = None,
        attention_mask: Any = None,
        temb: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        import torch
        from torch.utils.checkpoint import checkpoint

        if temb is not None:
            kwargs["temb"] = temb
        if not torch.is_grad_enabled():
            return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
        return checkpoint(
            self.inner, attn, hidden_states, encoder_hidden_states, attention_mask, *args, use_reentrant=False, **kwargs
        )


def step(plan: Plan) -> Plan | None:
    if plan.attention != "default":
        return None
    return plan.replace(attention="sliced")


def describe(old: Plan, new: Plan) -> str:
    return (
        "recompute attention blocks in backward instead of storing their activations "
        "(SDPA under activation checkpointing; exact, about one extra attention forward)"
    )


def configure_model(plan: Plan, model: Any) -> None:
    """Wrap every diffusers ``Attention`` module's processor, or unwrap it for "default"
    (idempotent both ways). UNet2DModel has no ``set_attn_processor``: modules are visited."""
    if plan.attention == "default":
        for module in model.modules():
            processor = getattr(module, "processor", None)
            if isinstance(processor, CheckpointedAttention):
                module.set_processor(processor.inner)
        return
    from diffusers.models.attention_processor import Attention

    for module in model.modules():
        if isinstance(module, Attention) and not isinstance(module.processor, CheckpointedAttention):
            module.set_processor(CheckpointedAttention(module.processor))


def memory(plan: Plan) -> MemoryTerms | None:
    return TERMS if plan.attention == "sliced" else None


def label(plan: Plan) -> str | None:
    return f"attn={plan.attention}" if plan.attention != "default" else None


def command_values(plan: Plan) -> dict[str, str]:
    return {"attention": plan.attention}


RUNG = Rung(
    name="attention",
    exact=True,
    needs_restart=False,
    step=step,
    describe=describe,
    knob="attention",
    default="default",
    shrinks=frozenset({"activations"}),
    activations_only=True,
    memory=memory,
    label=label,
    configure_model=configure_model,
    # Job files have always called the knob `attention_slicing` (the value is "sliced").
    command=CommandSide(
        placeholders=(Placeholder("attention", "default or sliced", listed=5),),
        when=WhenKey("attention_slicing", "attention is sliced", listed=1),
        needs=("when:attention_slicing|{attention}",),
        values=command_values,
    ),
)
