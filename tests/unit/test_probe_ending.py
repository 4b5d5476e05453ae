"""Where the probe starts once it may measure no more (jobs/probe.py, _out_of_measurements):
a plan the memory model says fits with its margins when it beats the fastest one measured,
else that one, else the doctor decides from the OOMs."""

from __future__ import annotations

from oomguard.jobs.probe import _out_of_measurements
from oomguard.strategies import planner
from oomguard.strategies.memory_model import Measurement
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan

MiB = 2**20
ORIGIN = Plan.initial(8)
CAPACITY = 16 * MiB
# Weights 2 MiB, gradients 2 MiB, AdamW's moments 4 MiB: 8 MiB before any activation.
STATIC = {"parameters": 2 * MiB, "trainable": 2 * MiB, "optimizer_state": 4 * MiB}
CANDIDATES = planner.candidate_plans(ORIGIN, ("micro_batch",))


def ran(micro_batch: int, peak_mib: float) -> Measurement:
    return Measurement(
        plan=ORIGIN.replace(micro_batch=micro_batch), fits=True, peak_bytes=int(peak_mib * MiB), capacity=CAPACITY,
        samples_per_s=10.0 * micro_batch, static=STATIC, step=0,
    )


def ran_out(micro_batch: int) -> Measurement:
    return Measurement(plan=ORIGIN.replace(micro_batch=micro_batch), fits=False, peak_bytes=CAPACITY + 1, capacity=CAPACITY, step=0)


def test_a_plan_the_model_says_fits_beats_the_micro_batch_of_one_measured_to_learn_the_line():
    # 8 MiB static + 1 MiB per sample: micro-batch 4 takes 12 MiB, within 16 MiB less 8 %.
    result = _out_of_measurements(ORIGIN, ORIGIN, CANDIDATES, [ran_out(8), ran(1, 9)], CAPACITY, None)
    assert result.plan.micro_batch == 4 and result.failure is None
    assert "(out of measurements)" in result.reason


def test_without_a_better_prediction_the_fastest_plan_measured_is_the_start():
    # 3 MiB per sample: micro-batch 2 (14 MiB) is the largest the model allows, and it ran.
    result = _out_of_measurements(ORIGIN, ORIGIN, CANDIDATES, [ran_out(8), ran(1, 11), ran(2, 14)], CAPACITY, None)
    assert result.plan.micro_batch == 2 and result.reason.endswith("the fastest plan measured")


def test_with_nothing_measured_to_fit_the_doctor_decides_from_the_last_oom():
    last = Outcome(kind="oom", step=0, phase="forward", message="out of memory")
    result = _out_of_measurements(ORIGIN, ORIGIN, CANDIDATES, [ran_out(8), ran_out(1)], CAPACITY, last)
    assert result.plan == ORIGIN and result.failure is last
    assert "the doctor decides" in result.reason
