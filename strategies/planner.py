"""The planner: among the plans a job's allowed rungs can reach, the one to run next.

Faithful first, then fast: a plan that needs no approximate rung always wins over one that
does; among plans equally faithful, the one with the best expected samples/s wins, among
those the memory model says fit the device with a margin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from oomguard.strategies import rungs
from oomguard.strategies.memory_model import MemoryModel, time_factor
from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs.base import Rung
from oomguard.strategies.units import format_bytes


@dataclass(frozen=True)
class Choice:
    plan: Plan
    rungs: tuple[str, ...]  # the rungs by which it differs from the plan it replaces
    predicted_peak: float | None
    expected_samples_per_s: float | None

    def summary(self, capacity: int) -> str:
        text = f"[{self.plan.short()}]"
        if self.predicted_peak is not None:
            text += f" predicted peak {format_bytes(int(self.predicted_peak))} of {format_bytes(capacity)}"
        if self.expected_samples_per_s is not None:
            text += f", ~{self.expected_samples_per_s:.1f} samples/s"
        return text


def rungs_between(old: Plan, new: Plan) -> tuple[str, ...]:
    """The rungs (ladder order) whose knobs differ between two plans."""
    return tuple(r.name for r in rungs.ladder() if r.get(old) != r.get(new) and (r.is_on(old) or r.is_on(new)))


def _changed(r: Rung, old: Plan, new: Plan) -> bool:
    """Whether rung ``r`` differs between two plans: its knob does, and it is on in one of them
    (rungs that share a knob, optimizer_8bit and optimizer_4bit, each own one value of it).
    Written out in rungs_between, which the planner asks of every candidate."""
    return r.get(old) != r.get(new) and (r.is_on(old) or r.is_on(new))


def with_process_settings(plan: Plan, source: Plan) -> Plan:
    """``plan`` with ``source``'s process settings (the process rungs: the allocator), which a
    change of plan keeps (a cure for fragmentation is never undone by the planner)."""
    for rung in rungs.ladder():
        if rung.role == "process":
            plan = rung.set(plan, rung.get(source))
    return plan


def describe_change(old: Plan, new: Plan) -> str:
    """What changed from ``old`` to ``new``, in words, rung by rung (ladder order)."""
    return "; ".join(r.describe(old, new) for r in rungs.ladder() if _changed(r, old, new))


def candidate_plans(start: Plan, allow: Iterable[str], *, restart: bool = True) -> list[Plan]:
    """Every plan reachable from ``start`` by allowed rungs: the shapes their steps reach, each
    with every value of the allowed batch rungs (the micro-batch sizes worth trying). Process
    rungs (the allocator) are the doctor's answer to fragmentation, never a candidate; chained
    rungs (Rung.chained) come in ladder order, each after the ones before it.

    ``restart=False`` keeps to rungs that take effect inside a running process.
    """
    allowed = set(allow)
    usable = [r for r in rungs.ladder() if r.name in allowed and (restart or not r.needs_restart)]
    chain = [r for r in usable if r.chained]
    shapes = {start}
    frontier = [start]
    while frontier:
        plan = frontier.pop()
        for r in usable:
            if r.role != "shape":
                continue
            if r.chained and not all(earlier.is_on(plan) for earlier in chain[: chain.index(r)]):
                continue
            new = r.step(plan)
            # A shape no runner can run is not walked on from either: steps only turn knobs on
            # or deeper, so nothing beyond it resolves its conflict that another path misses
            # (and the layer offload grades would multiply such dead ends).
            if new is not None and new not in shapes and rungs.conflict(new) is None:
                shapes.add(new)
                frontier.append(new)
    # A combination the runner cannot run (sharding with LoRA, say) is no candidate; nor is a
    # micro-batch a shape cannot run at (the optimizer step in backward: one slice only). The
    # shapes are sifted first: far fewer than their plans.
    plans = {plan for plan in shapes if rungs.conflict(plan) is None}
    for r in usable:
        if r.role == "batch" and r.choices is not None:
            values = list(r.choices(start))
            plans = {r.set(plan, value) for plan in plans for value in values}
    return sorted((plan for plan in plans if rungs.conflict(plan) is None), key=_order)


_PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(Plan))


def _order(plan: Plan) -> tuple[str, ...]:
    """A fixed order of candidates (ties in the ranking go to the first)."""
    return tuple(str(getattr(plan, name)) for name in _PLAN_FIELDS)


def faithfulness(start: Plan, plan: Plan) -> int:
    """0 for a plan that only takes exact rungs; else 1 + the ladder position of its most
    invasive approximate rung (precision < 8-bit optimizer < LoRA < quantized base)."""
    approximate = [index for index, r in enumerate(rungs.ladder()) if not r.exact and _changed(r, start, plan)]
    return 1 + max(approximate) if approximate else 0


def rank(model: MemoryModel, start: Plan, plan: Plan, *, optimistic: bool = False) -> tuple[float, ...]:
    """Sort key of plans that fit: smaller is better. ``optimistic``: with the speed the
    plan could have (MemoryModel.expected_samples_per_s)."""
    speed = model.expected_samples_per_s(plan, optimistic=optimistic)
    peak = model.predicted_peak(plan)
    # Without timings, fewer micro-batches are faster, then the rungs' own time factors (a
    # probe that measured only OOMs must not pick the slowest sharding level for its lower
    # peak). Between plans equally fast (e.g. micro-batch 8 and 9 of 16 both take two
    # slices), the lower peak keeps more margin.
    return (
        faithfulness(start, plan),
        -(speed if speed is not None else 0.0),
        plan.grad_accum,
        time_factor(plan) if speed is None else 0.0,
        peak if peak is not None else 0.0,
        len(rungs_between(start, plan)),
    )


def choose(
    start: Plan,
    candidates: Iterable[Plan],
    model: MemoryModel,
    capacity: int,
    *,
    optimistic: bool = False,
    optimistic_speed: bool = False,
) -> Choice | None:
    """The most faithful, then fastest, candidate the model says fits; None if none does
    (or the model knows too little to say). ``optimistic``: could fit at all;
    ``optimistic_speed``: ranked at the speed it could have (the probe's questions before
    it measures a plan; an attempt is ranked at the speed expected)."""
    fitting = [plan for plan in candidates if model.fits(plan, capacity, optimistic=optimistic)]
    if not fitting:
        return None

    best = min(fitting, key=lambda plan: rank(model, start, plan, optimistic=optimistic_speed))
    return Choice(
        plan=best,
        rungs=rungs_between(start, best),
        predicted_peak=model.predicted_peak(best),
        expected_samples_per_s=model.expected_samples_per_s(best, optimistic=optimistic_speed),
    )
