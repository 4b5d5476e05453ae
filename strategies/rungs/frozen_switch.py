"""The shape of the frozen-part rungs: each turns one switch (a bool knob kept in
``Plan.extra``) that sets one field of FrozenHandling, the effect the text-to-image trainer
reads. Each rung's own module says what it does, whether it is exact and what it saves;
this builds the Rung from that.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs.base import Consumer, FrozenHandling, MemoryTerms, Rung

Effect = Literal["latents_cached", "text_cached", "on_host", "encode_sliced", "encode_tiled", "half"]


def switch_rung(
    name: str,
    *,
    exact: bool,
    effect: Effect,
    label: str,
    change: str,
    terms: MemoryTerms,
    shrinks: frozenset[Consumer],
    needs: frozenset[str] = frozenset({"frozen_parts"}),
    activations_only: bool = False,
) -> Rung:
    """A rung whose knob ``name`` is False until taken, and True turns FrozenHandling.``effect``
    on. ``change`` says in words what taking it does (events and notifications). It takes a new
    process: the trainer places its frozen parts, and builds caches, as an attempt starts."""

    def is_on(plan: Plan) -> bool:
        return bool(plan.extra_value(name, False))

    def step(plan: Plan) -> Plan | None:
        return None if is_on(plan) else plan.with_extra(name, True, False)

    def frozen(plan: Plan, handling: FrozenHandling) -> FrozenHandling:
        return dataclasses.replace(handling, **{effect: True}) if is_on(plan) else handling

    return Rung(
        name=name,
        exact=exact,
        needs_restart=True,
        step=step,
        describe=lambda old, new: change,
        knob=name,
        default=False,
        shrinks=shrinks,
        activations_only=activations_only,
        memory=lambda plan: terms if is_on(plan) else None,
        label=lambda plan: label if is_on(plan) else None,
        frozen=frozen,
        needs=needs,
        chained=True,
    )
