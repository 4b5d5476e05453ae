"""Faults injected on purpose, for `make faults` (bench/faults.py) and its reduced set in the
tests; never set in normal use. The other faults those inject come from outside (SIGKILL, a
damaged checkpoint file, a full disk): this one happens inside the training step.

``OOMGUARD_INJECT_FAULT=nan_under_reduced_precision@K``: after the K-th optimizer step a
process trains under reduced precision (the plan's mixed_precision is not "no"), one weight
becomes NaN, as when half precision overflows and the optimizer writes inf back: the next
step's loss is NaN, and a checkpoint written at that step holds NaN weights.

``OOMGUARD_INJECT_FAULT=slow_steps@SECONDS``: every optimizer step takes SECONDS longer (a
sleep), so that a test of a cluster's time limit knows how long its training takes however
busy the machine is.

``OOMGUARD_INJECT_FAULT=leak_per_step@BYTES``: every optimizer step keeps BYTES more on the
device (a tensor appended to a list, as a callback that keeps each step's outputs would), so
that the daemon's creep watch has a leak to find before it ends in an OOM.

The runner (jobs/run.py) asks ``injected_fault()`` once at start and, only when the variable
is set, hands the fault to the training loop as its after-step hook: the hook runs after the
step is counted and before it is reported or checkpointed.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

INJECT_FAULT_ENV = "OOMGUARD_INJECT_FAULT"
NAN_UNDER_REDUCED_PRECISION = "nan_under_reduced_precision"
SLOW_STEPS = "slow_steps"
LEAK_PER_STEP = "leak_per_step"


@dataclass
class NanUnderReducedPrecision:
    """Turns a weight into NaN after the ``at``-th step this process trains under reduced precision."""

    at: int
    steps_under_reduced_precision: int = 0

    def __call__(self, training: Any, step: int) -> None:
        if training.plan.mixed_precision == "no":
            return
        self.steps_under_reduced_precision += 1
        if self.steps_under_reduced_precision == self.at:
            import torch

            print(f"oomguard fault injection: NaN weights after step {step} under {training.plan.mixed_precision}", flush=True)
            with torch.no_grad():
                next(iter(training.model.parameters())).fill_(float("nan"))


@dataclass
class SlowSteps:
    """Sleeps ``seconds`` after every step."""

    seconds: float

    def __call__(self, training: Any, step: int) -> None:
        time.sleep(self.seconds)


@dataclass
class LeakPerStep:
    """Keeps ``nbytes`` more on the training's device after every step."""

    nbytes: int
    kept: list[Any] = field(default_factory=list)

    def __call__(self, training: Any, step: int) -> None:
        import torch

        self.kept.append(torch.zeros(max(1, self.nbytes // 4), dtype=torch.float32, device=training.device))


def injected_fault(env: Mapping[str, str] = os.environ) -> NanUnderReducedPrecision | SlowSteps | LeakPerStep | None:
    """The fault $OOMGUARD_INJECT_FAULT asks for, as an after-step hook; None when it asks for none."""
    name, _, at = env.get(INJECT_FAULT_ENV, "").partition("@")
    if name == NAN_UNDER_REDUCED_PRECISION and at.isdigit():
        return NanUnderReducedPrecision(int(at))
    if name == SLOW_STEPS and re.fullmatch(r"\d+(\.\d+)?", at):
        return SlowSteps(float(at))
    if name == LEAK_PER_STEP and at.isdigit():
        return LeakPerStep(int(at))
    return None
