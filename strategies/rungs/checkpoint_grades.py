"""What the checkpointing rungs share (checkpoint_ff, checkpoint_alternate, checkpointing): one
grade of activation checkpointing per plan, from the cheapest to the most thorough, and how a
built model is put at a grade.

| grade       | rung                  | recomputed in backward                         |
|-------------|-----------------------|------------------------------------------------|
| none        |                       | nothing                                        |
| ff          | checkpoint_ff         | the transformer blocks' feed-forward layers    |
| alternate   | checkpoint_alternate  | every second checkpointable block              |
| blocks      | checkpointing         | every checkpointable block                     |

All exact: recomputation repeats the same arithmetic. A plan has one grade: each rung's step
goes only deeper and turns the shallower grades off, so the planner sees each grade as one
shape and picks the cheapest that fits (a job that needs 5% less memory need not pay for whole
blocks). Whole blocks keep the Plan field ``gradient_checkpointing`` (what stored plans and
command jobs' ``--gradient_checkpointing`` have always meant); the partial grades are kept in
``Plan.extra``. Keeping the saved inputs of checkpointed blocks in host memory is the
``activation_offload`` rung, which combines with any grade.

A *checkpointable block* is what diffusers checkpoints when a model's
``enable_gradient_checkpointing()`` is called: each module with a ``gradient_checkpointing``
flag (a UNet's down, mid and up blocks and their transformer models). The feed-forward layers
are diffusers' ``FeedForward`` modules (and transformers' ``*MLP``): a UNet2DModel has none, so
checkpoint_ff needs the job feature "feed_forward".
"""

from __future__ import annotations

from typing import Any, Literal

from oomguard.strategies.plan import Plan

Grade = Literal["none", "ff", "alternate", "blocks"]
GRADES: tuple[Grade, ...] = ("none", "ff", "alternate", "blocks")
# Where each partial grade is kept in Plan.extra; "blocks" is the Plan field.
KNOBS: dict[Grade, str] = {"ff": "checkpointed_feed_forward", "alternate": "checkpointed_alternate_blocks"}
BLOCKS_FIELD = "gradient_checkpointing"
WHAT: dict[Grade, str] = {
    "none": "no activation checkpointing",
    "ff": "checkpointing the feed-forward layers",
    "alternate": "checkpointing every second block",
    "blocks": "checkpointing every block",
}
# The instance attribute that marks a module whose forward this module wrapped (and holds the
# class's forward, which deleting the instance attribute brings back).
_WRAPPED = "_oomguard_checkpointed"


def grade(plan: Plan) -> Grade:
    """The plan's checkpointing grade (the deepest one on)."""
    if plan.gradient_checkpointing:
        return "blocks"
    for name in ("alternate", "ff"):
        if plan.extra_value(KNOBS[name], False):
            return name
    return "none"


def with_grade(plan: Plan, wanted: Grade) -> Plan:
    """``plan`` at grade ``wanted``, every other grade's knob off."""
    plan = plan.replace(gradient_checkpointing=wanted == "blocks")
    for name, knob in KNOBS.items():
        plan = plan.with_extra(knob, name == wanted, False)
    return plan


def step_to(plan: Plan, wanted: Grade) -> Plan | None:
    """The step of the rung of grade ``wanted``: only deeper than the plan's grade."""
    if GRADES.index(grade(plan)) >= GRADES.index(wanted):
        return None
    return with_grade(plan, wanted)


def describe(new: Plan, of: Grade, says: str) -> str:
    """What a change that touched grade ``of``'s knob did: ``says`` when the new plan is at
    that grade, else which grade replaced it."""
    now = grade(new)
    if now == of:
        return says
    return f"{WHAT[of]} off ({WHAT[now]})"


# -- the built model ----------------------------------------------------------------------


def configure(plan: Plan, model: Any) -> None:
    """Put ``model`` at the plan's grade, whatever grade it was at (a runner stepping up or down
    in process switches the model it switched before)."""
    wanted = grade(plan)
    _unwrap_feed_forwards(model)
    if wanted == "blocks":
        _enable_blocks(model)
        return
    _disable_blocks(model)
    if wanted == "alternate":
        blocks = checkpointable_blocks(model)
        if not blocks:
            raise ValueError(f"{type(model).__name__} has no checkpointable blocks (modules with a gradient_checkpointing flag): {WHAT[wanted]} cannot apply")
        _enable_blocks(model)
        for block in blocks[1::2]:
            block.gradient_checkpointing = False
    elif wanted == "ff":
        feed_forwards = feed_forward_layers(model)
        if not feed_forwards:
            raise ValueError(f"{type(model).__name__} has no feed-forward layers: {WHAT[wanted]} cannot apply (take checkpoint_alternate or checkpointing)")
        for module in feed_forwards:
            _wrap(module)


def checkpointable_blocks(model: Any) -> list[Any]:
    """The model's modules with diffusers' ``gradient_checkpointing`` flag, in module order
    (the model itself left out: its own flag checkpoints nothing in a UNet)."""
    return [m for m in model.modules() if m is not model and hasattr(m, "gradient_checkpointing") and not callable(m.gradient_checkpointing)]


def feed_forward_layers(model: Any) -> list[Any]:
    """The model's feed-forward layers: diffusers' FeedForward, transformers' *MLP modules."""
    return [m for m in model.modules() if type(m).__name__ == "FeedForward" or type(m).__name__.endswith("MLP")]


def _enable_blocks(model: Any) -> None:
    if hasattr(model, "enable_gradient_checkpointing"):
        model.enable_gradient_checkpointing()
    else:
        model.gradient_checkpointing_enable()


def _disable_blocks(model: Any) -> None:
    if not getattr(model, "is_gradient_checkpointing", False):
        return
    if hasattr(model, "disable_gradient_checkpointing"):
        model.disable_gradient_checkpointing()
    else:
        model.gradient_checkpointing_disable()


def _wrap(module: Any) -> None:
    """Run ``module``'s forward under non-reentrant checkpointing while gradients are on."""
    import torch
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed
    setattr(module, _WRAPPED, True)


def _unwrap_feed_forwards(model: Any) -> None:
    for module in model.modules():
        if module.__dict__.get(_WRAPPED):
            del module.forward
            del module.__dict__[_WRAPPED]


# -- the rungs ---------------------------------------------------------------------------


def grade_rung(name: str, of: Grade, *, terms: Any, says: str, label: str, **fields: Any) -> Any:
    """The Rung of grade ``of``: named ``name``, with memory ``terms`` (MemoryTerms) while the
    plan is at that grade; ``says`` what a step to it does, ``label`` its part of Plan.short.
    Every grade switches in a running process; the model is put at the plan's grade by one
    configure hook (the checkpointing rung's), so ``fields`` adds the rest of a rung's own."""
    from oomguard.strategies.rungs.base import Rung

    knob = BLOCKS_FIELD if of == "blocks" else KNOBS[of]
    return Rung(
        name=name,
        exact=True,
        needs_restart=False,
        step=lambda plan: step_to(plan, of),
        describe=lambda old, new: describe(new, of, says),
        knob=knob,
        default=False,
        shrinks=frozenset({"activations"}),
        activations_only=True,
        memory=lambda plan: terms if grade(plan) == of else None,
        label=lambda plan: label if grade(plan) == of else None,
        **fields,
    )
