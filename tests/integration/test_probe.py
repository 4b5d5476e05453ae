"""The probe's building block, measure(), and the check that tells whether a process is still
fit to train after an OOM."""

from __future__ import annotations

import importlib

import torch

from oomguard.jobs.attempt import Control
from oomguard.jobs.device import DeviceSpec
from oomguard.jobs.memory_cap import open_device_memory
from oomguard.jobs.probe import measure
from oomguard.jobs.sizes import CapSchedule
from oomguard.jobs.trainers.unconditional import make_trainer
from oomguard.jobs.step_oom import LEFTOVER_TOLERANCE, unfit_to_continue
from tests.jobs_helpers import tiny_job

# Imported before any measurement: bitsandbytes logs a warning with a caught exception on
# import, and pytest keeps log records, whose traceback would keep the frames (and the model)
# of the first measurement's imports alive.
for _module in ("diffusers.optimization", "peft"):
    importlib.import_module(_module)

JOB = tiny_job("probe-test", batch_size=4)
CPU = torch.device("cpu")


def measured(plan, cap: int):
    memory = open_device_memory(DeviceSpec(CapSchedule(((0, cap),))), CPU)
    control = Control()
    with memory:
        result, oom = measure(make_trainer(JOB), JOB, plan, CPU, memory, control)
        return result, oom, control.phase, memory.live_bytes()


def test_a_plan_that_fits_reports_its_steady_peak_and_static_bytes():
    result, oom, _, left = measured(JOB.initial_plan(), 2**30)
    assert oom is None and result.fits
    static = result.static
    assert static["parameters"] == static["trainable"] > 0
    assert static["optimizer_state"] >= 2 * static["trainable"]  # two AdamW moments (and steps)
    assert result.peak_bytes > static["parameters"] * 2 + static["optimizer_state"]  # + gradients + activations
    assert result.samples_per_s and result.samples_per_s > 0
    assert left == 0


def test_an_oom_is_a_measurement_and_an_outcome():
    plan = JOB.initial_plan()
    fits, *_ = measured(plan, 2**30)
    cap = int(fits.peak_bytes * 0.5)
    result, oom, phase, left = measured(plan, cap)
    assert not result.fits and result.capacity == cap and result.peak_bytes > cap
    assert oom is not None and oom.kind == "oom" and oom.phase == phase and oom.memory.total == cap
    assert "CUDA out of memory" in oom.message
    print(f"OOM in {phase}: {left} bytes left on the device")


def test_a_process_with_memory_left_behind_is_unfit_to_continue():
    capacity = 50_000
    memory = open_device_memory(DeviceSpec(CapSchedule(((0, capacity),))), CPU)
    with memory:
        kept = torch.zeros(250)  # 1000 bytes on the emulated device
        assert unfit_to_continue(memory, baseline=1000) is None
        assert unfit_to_continue(memory, baseline=1000 - int(LEFTOVER_TOLERANCE * capacity)) is None
        assert unfit_to_continue(memory, baseline=0) == 1000
        del kept
