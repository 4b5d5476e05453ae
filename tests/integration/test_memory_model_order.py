"""The memory model answers the same in every process.

Where two measured shapes are equally near a plan that was not measured, the model borrows
one of them; it used to take whichever a set gave first, and a set of Plans is ordered by
their hashes, which differ between processes (hash(None) is an address in Python 3.11). Two
daemons, or a daemon and its restart, then predicted different peaks and speeds from the
same measurements. Now the first measured of them is borrowed."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
from oomguard.strategies.memory_model import MemoryModel, Measurement
from oomguard.strategies.plan import Plan

base = Plan.initial(8)
ckpt = base.replace(gradient_checkpointing=True)
sliced = base.replace(attention="sliced")
measurements = []
# Two shapes, each at two micro-batches (a line each), of different slopes and speeds; the
# plan asked about, checkpointing and sliced attention together, is one knob from each.
for shape, fixed, per_sample, seconds in ((sliced, 10_000_000, 3_000_000, 0.02), (ckpt, 12_000_000, 1_000_000, 0.05)):
    for micro in (2, 4):
        plan = shape.replace(micro_batch=micro)
        measurements.append(Measurement(plan=plan, fits=True, peak_bytes=fixed + per_sample * micro, samples_per_s=micro / (seconds * micro)))
model = MemoryModel(measurements)
both = base.replace(gradient_checkpointing=True, attention="sliced")
for micro in (1, 2, 4, 8):
    plan = both.replace(micro_batch=micro)
    print(micro, model.predicted_peak(plan), model.expected_samples_per_s(plan))
"""


def test_two_processes_borrow_the_same_shape_for_a_plan_between_two() -> None:
    answers = {
        subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=60).stdout
        for _ in range(6)
    }
    assert len(answers) == 1, answers
    (answer,) = answers
    assert "None" not in answer, answer  # the model did predict (from a borrowed shape)
