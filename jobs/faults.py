"""Faults injected on purpose, for `make faults` (bench/faults.py) and its reduced set in the
tests; never set in normal use. The other faults those inject come from outside (SIGKILL, a
damaged checkpoint file, a full disk): this one happens inside the training step.

``OOMGUARD_INJECT_FAULT=nan_under_reduced_precision@K``: after the K-th optimizer step a
process trains under reduced precision (the plan's mixed_precision is not "no"), one weight
becomes NaN, as when half precision overflows and the optimizer writes inf back: the next
step's loss is NaN, and a checkpoint written at that step holds NaN weights.
"""

from __future__ import annotations

import os
from typing import Any

import torch

INJECT_FAULT_ENV = "OOMGUARD_INJECT_FAULT"
NAN_UNDER_REDUCED_PRECISION = "nan_under_reduced_precision"

_steps_under_reduced_precision = [0]


def _injected() -> tuple[str, int] | None:
    text = os.environ.get(INJECT_FAULT_ENV, "")
    name, _, at = text.partition("@")
    if name != NAN_UNDER_REDUCED_PRECISION or not at.isdigit():
        return None
    return name, int(at)


def after_step(training: Any, step: int) -> None:
    """Called by the runner after each optimizer step."""
    fault = _injected()
    if fault is None or training.plan.mixed_precision == "no":
        return
    _steps_under_reduced_precision[0] += 1
    if _steps_under_reduced_precision[0] == fault[1]:
        print(f"oomguard fault injection: NaN weights after step {step} under {training.plan.mixed_precision}", flush=True)
        with torch.no_grad():
            next(iter(training.model.parameters())).fill_(float("nan"))
