"""The probe: before a job's first attempt trains, measure a few throwaway steps and start at
the fastest plan the memory model says fits.

Each measured plan gets a freshly built model (the trainer seeds it, so the real run starts
from the same weights as without a probe) and two steps: the first creates the optimizer
state, the second is measured. The first plan measured is the job's shape at micro-batch 1,
the cheapest step it has; the memory model then names the plan to try next (usually the
largest micro-batch that fits), which is measured too before it is trusted.

A job on several processes probes with all of them, in step: each plan is built and stepped on
every rank, an OOM on any rank is every rank's (jobs/step_oom.py agreed_oom), and a measurement
is the largest peak, the smallest capacity and the slowest step of the ranks, so every rank
makes the same choices. A sharded plan is measured too, but an OOM inside its collectives
cannot be agreed on: it ends the attempt (jobs/ranks.py stops the other ranks), with what the
probe measured so far in its outcome (``RankAlone.measurements``), for the doctor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from oomguard.jobs.attempt import Control
from oomguard.jobs.memory_cap import DeviceMemory
from oomguard.jobs.rank_group import PeerOutOfMemory, RankGroup
from oomguard.jobs.spec import JobSpec
from oomguard.jobs.trainers.base import Trainer
from oomguard.jobs.training import Training, build_training, one_step
from oomguard.jobs.step_oom import RankAlone, agreed_oom, free, oom_measurement, unfit_to_continue
from oomguard.strategies import planner, rungs
from oomguard.strategies.memory_model import Measurement, MemoryModel, shape_of
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.units import format_mib

# Plans measured at most; each costs two steps of a fresh model. Up to three of them may be
# calibrations (calibration_plans). A text-to-image job's shapes (the frozen-part chain, the
# EMA's place) take more: at 8, the probe ran out on micro-batch-1 steps of shapes it had to
# trust first and started at a plan 0.47-0.64 of the fastest (bench/results/ladder-t2i.md,
# 2026-12-03 18:20); each plan is one model build and two steps, once per job.
MAX_PROBED_PLANS = 16


@dataclass(frozen=True)
class ProbeResult:
    plan: Plan
    measurements: tuple[Measurement, ...]
    reason: str
    # When no plan measured fits: the last OOM, as the attempt's outcome (training it would
    # only run out of memory once more).
    failure: Outcome | None = None


def measure(
    trainer: Trainer, job: JobSpec, plan: Plan, device: torch.device, memory: DeviceMemory, control: Control, *, warm_steps: int = 1,
    ranks: RankGroup | None = None,
) -> tuple[Measurement, Outcome | None]:
    """Build ``plan`` fresh, run ``warm_steps`` unmeasured steps and one measured step; the
    OOM as an Outcome too when it did not fit (on any of ``ranks``)."""
    ranks = ranks if ranks is not None else RankGroup()
    training: Training | None = None
    ran: Measurement | None = None
    oom: Outcome | None = None
    # The batch of the most pixels (the largest aspect-ratio bucket), so that the plan chosen
    # fits every step, not only the first.
    step = trainer.heaviest_step()
    try:
        training = build_training(trainer, job, plan, device, memory, ranks=ranks)
        for _ in range(warm_steps):
            one_step(trainer, training, step, memory, control)
        memory.reset_peak()
        result = one_step(trainer, training, step, memory, control)
        reserved = memory.peak_reserved()  # None on every rank alike (the same kind of device)
        ran = Measurement(
            plan=plan,
            fits=True,
            peak_bytes=ranks.largest(memory.peak_bytes() or 0),
            reserved_bytes=ranks.largest(reserved) if reserved is not None else None,
            capacity=ranks.smallest(memory.capacity()),
            samples_per_s=plan.batch_size / ranks.longest(result.seconds),
            static=training.static_bytes(),
            step=0,
        )
    except torch.OutOfMemoryError as error:
        figures = memory.oom_figures(str(error))
        oom = Outcome(kind="oom", step=0, phase=control.phase, memory=figures, message=str(error))
    except PeerOutOfMemory:
        pass
    failure: tuple[Measurement, Outcome] | None = None
    if ran is None:
        free(memory, training)  # the failed step's gradients, before the ranks meet
        sharded = rungs.sharded(plan)
        if sharded and oom is not None:
            raise RankAlone(oom, (oom_measurement(plan, oom.memory, training, 0),))
        agreed = agreed_oom(ranks, sharded, oom)
        assert agreed is not None  # some rank failed
        failure = oom_measurement(plan, agreed.memory, training, 0), agreed
    # The model and optimizer die here (nothing returned holds a tensor).
    training = None
    free(memory)
    return (ran, None) if ran is not None else failure  # type: ignore[return-value]


def calibration_plans(first: Plan, allow: tuple[str, ...], model: MemoryModel, origin: Plan, capacity: int) -> list[Plan]:
    """The first measured plan with each allowed exact rung that only shrinks activations
    taken, one at a time: measured when the whole batch does not fit, so that the memory model
    knows what each saves on this model (MemoryModel's observed factors) before it chooses
    between them. Their factors differ between models (gradient checkpointing keeps about 62 %
    of this project's UNet2DModel's activations and about a third of a Stable Diffusion
    UNet's), and a wrong one hides the fastest plan that fits."""
    if model.fits(origin, capacity) is True:
        return []
    plans = []
    for r in rungs.ladder():
        if r.name in allow and r.exact and r.activations_only and r.role == "shape" and (step := r.step(first)) is not None:
            plans.append(step)
    # A rung that shrinks activations cannot help where the model's state alone does not fit:
    # measuring it would only be another OOM.
    return [p for p in plans if (line := model.line(p)) is None or line.fixed <= capacity]


def run_probe(
    trainer: Trainer,
    job: JobSpec,
    start: Plan,
    device: torch.device,
    memory: DeviceMemory,
    control: Control,
    say: Callable[[str], None],
    ranks: RankGroup | None = None,
) -> ProbeResult:
    ranks = ranks if ranks is not None else RankGroup()
    policy = job.policy()
    origin = (policy.initial or start).replace(allocator=start.allocator)
    capacity = ranks.smallest(memory.capacity())
    if capacity is None:
        return ProbeResult(start, (), "no memory limit known (no GPU and no emulated cap): nothing to probe against")
    candidates = planner.candidate_plans(origin, policy.allow)
    measurements: list[Measurement] = []

    def cheapest_of_its_shape(plan: Plan, failed: set[Plan]) -> Plan:
        """Trust a shape that never ran only after measuring its cheapest step."""
        if any(m.fits and shape_of(m.plan) == shape_of(plan) for m in measurements):
            return plan
        return min((p for p in candidates if shape_of(p) == shape_of(plan) and p not in failed), key=lambda p: p.micro_batch)
    last_oom: Outcome | None = None
    next_plan: Plan | None = cheapest_of_its_shape(start, set())
    calibrations: list[Plan] | None = None
    clean = memory.live_bytes() or 0
    while next_plan is not None and len(measurements) < MAX_PROBED_PLANS:
        measured, oom = _measure_after(measurements, trainer, job, next_plan, device, memory, control, ranks)
        measurements.append(measured)
        last_oom = oom or last_oom
        leftover = ranks.largest(unfit_to_continue(memory, clean) or 0) or None
        if oom is not None and leftover is not None:
            # Measuring more here would measure the leftovers too; the doctor plans the next
            # attempt, in a new process, from what was measured so far.
            say(f"probe: the failed step left {format_mib(leftover)} behind on the device; stopping here")
            return ProbeResult(start, tuple(measurements), "probe: stopped after an OOM that left memory behind", failure=oom)
        say(f"probe: [{next_plan.short()}] {_verdict(measured)} (capacity {format_mib(capacity)})")
        model = MemoryModel(measurements)
        if calibrations is None:
            calibrations = calibration_plans(measured.plan, policy.allow, model, origin, capacity)
        if calibrations:
            next_plan = calibrations.pop(0)
            continue
        failed = {m.plan for m in measurements if not m.fits}
        ran = {m.plan for m in measurements if m.fits}
        open_plans = [p for p in candidates if p not in failed]
        safe = planner.choose(origin, open_plans, model, capacity)
        # A plan that could fit and, at the speed it could have, beat the best safe one is worth a
        # step (margins are for plans nobody measured; a shape timed once may be faster larger).
        hopeful = planner.choose(origin, _worth_a_try(open_plans, measurements), model, capacity, optimistic=True, optimistic_speed=True)
        if hopeful is not None and (safe is None or planner.rank(model, origin, hopeful.plan, optimistic=True) < planner.rank(model, origin, safe.plan)):
            next_plan = cheapest_of_its_shape(hopeful.plan, failed)
        elif safe is not None and safe.plan not in ran:
            next_plan = cheapest_of_its_shape(safe.plan, failed)
        elif safe is not None:
            return ProbeResult(safe.plan, tuple(measurements), f"probe: start at {safe.summary(capacity)}")
        else:
            next_plan = None
    return _out_of_measurements(start, origin, candidates, measurements, capacity, last_oom)


def _worth_a_try(open_plans: list[Plan], measurements: list[Measurement]) -> list[Plan]:
    """The plans not run yet that the probe may measure on the chance that they fit. A sharded
    plan's OOM inside its collectives ends the attempt: one whose shape (its sharding level and
    every other knob but the micro-batch) was never seen to fit is measured only when the
    margins say it fits (the sharding terms are rough)."""
    ran = {m.plan for m in measurements if m.fits}
    fitted = {shape_of(m.plan) for m in measurements if m.fits}
    return [p for p in open_plans if p not in ran and (not rungs.sharded(p) or shape_of(p) in fitted)]


def _verdict(measured: Measurement) -> str:
    """A measured plan in the probe's words: its peak (and reserve), or that it ran out."""
    if not measured.fits:
        return "out of memory"
    reserved = f" ({format_mib(measured.reserved_bytes)} reserved)" if measured.reserved_bytes is not None else ""
    return f"peak {format_mib(measured.peak_bytes)}{reserved}"


def _measure_after(
    measurements: list[Measurement], trainer: Trainer, job: JobSpec, plan: Plan, device: torch.device, memory: DeviceMemory, control: Control,
    ranks: RankGroup,
) -> tuple[Measurement, Outcome | None]:
    """``measure``; a rank that ends alone (an OOM in a sharded plan's collectives) ends with
    every measurement so far, for the doctor."""
    try:
        return measure(trainer, job, plan, device, memory, control, ranks=ranks)
    except RankAlone as alone:
        raise RankAlone(alone.outcome, (*measurements, *alone.measurements)) from None


def _out_of_measurements(
    start: Plan, origin: Plan, candidates: list[Plan], measurements: list[Measurement], capacity: int, last_oom: Outcome | None
) -> ProbeResult:
    """Where to start once the probe may measure no more: a plan the model says fits with its
    margins, when it beats the fastest one measured (often a micro-batch of 1, measured to
    learn a shape's line); else that fastest one; else the doctor decides."""
    fitting = [m for m in measurements if m.fits]
    if not fitting:
        return ProbeResult(start, tuple(measurements), "probe: no plan measured fits; the doctor decides from the measurements", failure=last_oom)
    model = MemoryModel(measurements)
    best = min(fitting, key=lambda m: planner.rank(model, origin, m.plan))
    failed = {m.plan for m in measurements if not m.fits}
    safe = planner.choose(origin, [p for p in candidates if p not in failed], model, capacity)
    if safe is not None and planner.rank(model, origin, safe.plan) < planner.rank(model, origin, best.plan):
        return ProbeResult(safe.plan, tuple(measurements), f"probe: start at {safe.summary(capacity)} (out of measurements)")
    return ProbeResult(best.plan, tuple(measurements), f"probe: start at [{best.plan.short()}], the fastest plan measured")
