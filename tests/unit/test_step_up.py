"""Stepping back up (strategies/step_up.py): the plan a job stepped down from, once the room is
back by the measurements and ranked above where it is (planner.choose); never one that ran out of memory with
that much room; and tries spaced 1, 2, 4, ... checkpoint boundaries after one that failed."""

from __future__ import annotations

from oomguard.strategies.memory_model import Measurement
from oomguard.strategies.plan import Plan
from oomguard.strategies.step_up import MOST_BACK_OFF, BackOff, in_process_reach, step_up

MiB = 2**20
FULL = Plan.initial(16)
HALF = FULL.replace(micro_batch=8)  # grad_accum follows: 2
STATIC = {"parameters": 4 * MiB, "trainable": 4 * MiB, "optimizer_state": 8 * MiB}


def ran(plan: Plan, peak_mib: float, samples_per_s: float) -> Measurement:
    return Measurement(plan=plan, fits=True, peak_bytes=int(peak_mib * MiB), capacity=1000 * MiB, samples_per_s=samples_per_s, static=STATIC)


def ran_out(plan: Plan, capacity_mib: float) -> Measurement:
    return Measurement(plan=plan, fits=False, peak_bytes=int(capacity_mib * MiB) + 1, capacity=int(capacity_mib * MiB), static=STATIC)


MEASURED = [ran(FULL, 100, samples_per_s=200.0), ran(HALF, 60, samples_per_s=150.0), ran_out(FULL, 80)]


def test_back_up_to_the_faster_plan_once_its_measured_peak_fits_with_the_margin() -> None:
    up = step_up(HALF, [FULL], MEASURED, capacity=120 * MiB)
    assert up is not None and up.plan == FULL
    assert up.reason.startswith("stepped back up to [mb=16x1] (~200.0 samples/s): 120.0 MiB of room again")


def test_no_step_up_while_the_room_is_short_unknown_or_the_plan_failed_with_as_much() -> None:
    assert step_up(HALF, [FULL], MEASURED, capacity=102 * MiB) is None  # 100 MiB with a plan that ran's 3 % margin does not fit
    assert step_up(HALF, [FULL], MEASURED, capacity=104 * MiB) is not None
    assert step_up(HALF, [FULL], MEASURED, capacity=None) is None
    assert step_up(HALF, [FULL], MEASURED, capacity=80 * MiB) is None
    assert step_up(HALF, [FULL], [*MEASURED, ran_out(FULL, 150)], capacity=120 * MiB) is None  # ran out with more room than now
    assert step_up(HALF, [], MEASURED, capacity=500 * MiB) is None  # nothing it stepped down from


def test_only_plans_a_running_process_can_switch_to() -> None:
    offloaded = HALF.replace(offload="optimizer")
    assert in_process_reach(HALF, FULL.replace(gradient_checkpointing=True)) and not in_process_reach(offloaded, HALF)
    assert step_up(offloaded, [HALF], [*MEASURED, ran(offloaded, 40, samples_per_s=90.0)], capacity=500 * MiB) is None


def test_the_wait_after_a_step_up_that_did_not_hold_doubles_up_to_a_bound() -> None:
    back_off = BackOff()
    assert back_off.ready()  # the first try comes at the first boundary with room
    waits = [back_off.failed() for _ in range(9)]
    assert waits == [1, 2, 4, 8, 16, 32, MOST_BACK_OFF, MOST_BACK_OFF, MOST_BACK_OFF]
    back_off = BackOff()
    back_off.failed()
    back_off.failed()  # waits 2 boundaries
    assert [back_off.ready() for _ in range(3)] == [False, False, True]
