"""Rung `optimizer_4bit`: AdamW with 4-bit moments (torchao's ``AdamW4bit``, jobs/optimizers.py).

Not exact, and less faithful than the 8-bit rung it follows: both moments are stored as 4-bit
codes with one fp32 scale per 128 values (torchao's block-wise 4-bit state, after "Memory
Efficient Optimizers with 4-bit States"), so the updates stray further from fp32 AdamW's (on a
19M-parameter model the weights were 1.1e-2 from AdamW's after 20 steps that moved them by up
to 1.9e-2; bitsandbytes' 8-bit: 1.0e-3; bench/quantized_optimizers.py). The optimizer state
shrinks from 8 to about 1.1 bytes per trained weight, half of the 8-bit rung's. Tensors under
4096 values (or not a multiple of 128) keep fp32 moments. The ladder goes 8-bit, then 4-bit: a
plan has one optimizer, so this step replaces the 8-bit one. The optimizer is built when the
process starts, so it takes a new attempt. Checkpoints keep torch AdamW's format, so a run
crosses this rung both ways. On the CPU its update runs eagerly (jobs/optimizers.py says why).

It combines with precision, LoRA and a quantized base. Not with the host-offloaded optimizer
(``conflict``): that state is off the device already, so 4-bit moments would save host memory
only, at 4-bit's cost in faithfulness and speed: offload with AdamW is better in every way the
planner ranks, and leaving the pair out keeps the planner's candidates to 1.25x, not 1.5x, of
those without this rung (an unconditional job at batch 4096, every rung allowed: 61,056 plans
against 48,864; 73,248 with the pair). The 8-bit optimizer with offload stays a plan, as it
always was (jobs/optimizers.py builds either quantized optimizer on the host). The rungs
that run torch's AdamW (the optimizer step in backward, layer offload) and sharding (AdamW's
state in shards) refuse it in their own ``conflict`` hooks. A command job never takes it:
diffusers' training scripts have no 4-bit optimizer flag.
"""

from __future__ import annotations

from typing import Any

from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs.base import MemoryTerms, Rung

# Optimizer state per fp32 weight byte: measured 0.266 on SD 1.5's UNet (860M parameters: the
# buffers torchao's AdamW4bit makes for every parameter, 4-bit codes, a scale per 128 values,
# fp32 moments for tensors it does not quantize; 8-bit: 0.509) and 0.267 on the 19M-parameter
# model of bench/quantized_optimizers.py; rounded up to 0.28 as the 8-bit rung's 0.55 is:
# smaller models keep more of their weights in small fp32 tensors (the tests' 45k-parameter
# UNet: 1.8). Time: torchao's compiled step took 2.2x bitsandbytes' 8-bit one on the CPU (856
# vs 387 ms for 19M parameters; eagerly, as oomguard runs it on the CPU, 2.2 s); on a GPU the
# optimizer step is a small share of a diffusion training step. An estimate that a measured run
# of the plan replaces.
TERMS = MemoryTerms(time=1.1, optimizer_bytes_per_byte=0.28)


def on(plan: Plan) -> bool:
    return plan.optimizer == "adamw4bit"


def step(plan: Plan) -> Plan | None:
    if plan.optimizer not in ("adamw", "adamw8bit"):
        return None
    return plan.replace(optimizer="adamw4bit")


def describe(old: Plan, new: Plan) -> str:
    if on(new):
        return "use 4-bit AdamW moments (optimizer state about 7x smaller than AdamW's; not exact, less faithful than 8-bit)"
    return f"4-bit AdamW moments off ({new.optimizer})"


def conflict(plan: Plan) -> str | None:
    if plan.offload != "none":
        return "4-bit AdamW cannot run with the host-offloaded optimizer: its state is off the device already, 4-bit moments would only save host memory (take one or the other)"
    return None


def make_optimizer(plan: Plan, params: list[Any], lr: float, weight_decay: float, fused: bool | None) -> Any:
    """torchao's 4-bit AdamW in torch AdamW's checkpoint format (jobs/quantized_optimizers.py), or None."""
    if not on(plan):
        return None
    from oomguard.jobs.quantized_optimizers import adamw4bit

    return adamw4bit(params, lr, weight_decay)


RUNG = Rung(
    name="optimizer_4bit",
    exact=False,
    needs_restart=True,
    step=step,
    describe=describe,
    knob="optimizer",
    default="adamw",
    shrinks=frozenset({"optimizer_state"}),
    on=on,
    memory=lambda plan: TERMS if on(plan) else None,
    label=lambda plan: plan.optimizer if on(plan) else None,
    conflict=conflict,
    make_optimizer=make_optimizer,
)
