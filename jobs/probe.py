"""The probe: before a job's first attempt trains, measure a few throwaway steps and start at
the fastest plan the memory model says fits.

Each measured plan gets a freshly built model (the trainer seeds it, so the real run starts
from the same weights as without a probe) and two steps: the first creates the optimizer
state, the second is measured. The first plan measured is the job's shape at micro-batch 1,
the cheapest step it has; the memory model then names the plan to try next (usually the
largest micro-batch that fits), which is measured too before it is trusted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from oomguard.jobs.attempt import Control
from oomguard.jobs.memory_cap import DeviceMemory
from oomguard.jobs.spec import JobSpec
from oomguard.jobs.training import Training, build_training, free, one_step
from oomguard.strategies import planner
from oomguard.strategies.memory_model import Measurement, MemoryModel, shape_of
from oomguard.strategies.plan import Plan

# Plans measured at most; each costs two steps of a fresh model.
MAX_PROBED_PLANS = 5


@dataclass(frozen=True)
class ProbeResult:
    plan: Plan
    measurements: tuple[Measurement, ...]
    reason: str


def measure(trainer: Any, job: JobSpec, plan: Plan, device: torch.device, memory: DeviceMemory, control: Control, *, warm_steps: int = 1) -> Measurement:
    """Build ``plan`` fresh, run ``warm_steps`` unmeasured steps and one measured step."""
    training: Training | None = None
    failure: Measurement | None = None
    try:
        training = build_training(trainer, job, plan, device, memory)
        for _ in range(warm_steps):
            one_step(trainer, training, 0, memory, control)
        memory.reset_peak()
        result = one_step(trainer, training, 0, memory, control)
        return Measurement(
            plan=plan,
            fits=True,
            peak_bytes=memory.peak_bytes() or 0,
            capacity=memory.capacity(),
            samples_per_s=plan.batch_size / result.seconds,
            static=training.static_bytes(),
            step=0,
        )
    except torch.OutOfMemoryError as error:
        figures = memory.oom_figures(str(error))
        failure = Measurement(
            plan=plan,
            fits=False,
            peak_bytes=(figures.allocated or 0) + (figures.requested or 0),
            capacity=figures.total,
            static=training.static_bytes() if training is not None else {},
            step=0,
        )
    finally:
        # The model and optimizer die here (nothing returned holds a tensor).
        training = None
        free()
    return failure


def run_probe(
    trainer: Any,
    job: JobSpec,
    start: Plan,
    device: torch.device,
    memory: DeviceMemory,
    control: Control,
    say: Callable[[str], None],
) -> ProbeResult:
    policy = job.policy()
    origin = (policy.initial or start).replace(allocator=start.allocator)
    capacity = memory.capacity()
    if capacity is None:
        return ProbeResult(start, (), "no memory limit known (no GPU and no emulated cap): nothing to probe against")
    candidates = planner.candidate_plans(origin, policy.allow)
    measurements: list[Measurement] = []
    smallest = min((p for p in candidates if shape_of(p) == shape_of(start)), key=lambda p: p.micro_batch, default=start)
    next_plan: Plan | None = smallest
    while next_plan is not None and len(measurements) < MAX_PROBED_PLANS:
        measured = measure(trainer, job, next_plan, device, memory, control)
        measurements.append(measured)
        verdict = f"peak {measured.peak_bytes / 2**20:.1f} MiB" if measured.fits else "out of memory"
        say(f"probe: [{next_plan.short()}] {verdict} (capacity {capacity / 2**20:.1f} MiB)")
        model = MemoryModel(measurements)
        failed = {m.plan for m in measurements if not m.fits}
        choice = planner.choose(origin, [p for p in candidates if p not in failed], model, capacity)
        if choice is None:
            break
        ran = {m.plan for m in measurements if m.fits}
        if choice.plan in ran:
            return ProbeResult(choice.plan, tuple(measurements), f"probe: start at {choice.summary(capacity)}")
        # Trust a plan of a shape that never ran only after measuring that shape's cheapest
        # step; trust a micro-batch only after measuring it.
        shape_ran = any(shape_of(p) == shape_of(choice.plan) for p in ran)
        next_plan = choice.plan if shape_ran else min(
            (p for p in candidates if shape_of(p) == shape_of(choice.plan) and p not in failed),
            key=lambda p: p.micro_batch,
        )
    fitting = [m for m in measurements if m.fits]
    if fitting:
        best = max(fitting, key=lambda m: (m.samples_per_s or 0.0))
        return ProbeResult(best.plan, tuple(measurements), f"probe: start at [{best.plan.short()}], the fastest plan measured")
    return ProbeResult(start, tuple(measurements), "probe: nothing measured fits; starting with the job's plan and the ladder")
