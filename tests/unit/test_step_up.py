"""Stepping back up (strategies/step_up.py): the plan a job stepped down from, once the room is
back by the measurements and ranked above where it is (planner.choose); never one that ran out of memory with
that much room; and tries spaced 1, 2, 4, ... checkpoint boundaries after one that failed."""

from __future__ import annotations

from oomguard.strategies.memory_model import Measurement
from oomguard.strategies.plan import Plan
from oomguard.strategies.step_up import MOST_BACK_OFF, BackOff, exact_again, in_process_reach, step_up

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


def test_a_plan_that_needs_a_new_process_is_named_as_one() -> None:
    offloaded = HALF.replace(offload="optimizer")
    assert in_process_reach(HALF, FULL.replace(gradient_checkpointing=True)) and not in_process_reach(offloaded, HALF)
    up = step_up(offloaded, [HALF], [*MEASURED, ran(offloaded, 40, samples_per_s=90.0)], capacity=500 * MiB)
    assert up is not None and up.plan == HALF and up.restart
    assert not step_up(HALF, [FULL], MEASURED, capacity=120 * MiB).restart  # type: ignore[union-attr]


def test_stepping_off_an_approximate_rung_says_the_rest_of_the_run_is_exact_again() -> None:
    eight_bit = HALF.replace(optimizer="adamw8bit")
    both = eight_bit.replace(mixed_precision="bf16")
    half_precision = HALF.replace(mixed_precision="bf16")
    measured = [*MEASURED, ran(eight_bit, 50, samples_per_s=160.0), ran(both, 40, samples_per_s=170.0), ran(half_precision, 55, 165.0)]
    # Exact before approximate: HALF is slower than the 8-bit plan, and still the step up.
    up = step_up(eight_bit, [FULL, HALF], measured, capacity=70 * MiB, origin=FULL)
    assert up is not None and up.plan == HALF and up.restart
    assert up.reason.endswith("off the approximate rung optimizer_8bit: the rest of the run is exact again")
    # The planner ranks a plan by its most invasive approximate rung: off the 8-bit optimizer,
    # bf16 kept, is a step up.
    partly = step_up(both, [half_precision], measured, capacity=70 * MiB, origin=FULL)
    assert partly is not None and partly.plan == half_precision
    assert partly.reason.endswith("off the approximate rung optimizer_8bit (precision still approximate)")
    assert exact_again(FULL, HALF, FULL) == ""


def test_a_cure_for_fragmentation_stays_whatever_plan_is_stepped_up_to() -> None:
    cured = HALF.replace(allocator="expandable_segments:True")
    up = step_up(cured, [FULL], [*MEASURED, ran(cured, 60, samples_per_s=150.0), ran(FULL.replace(allocator=cured.allocator), 100, 200.0)],
                 capacity=120 * MiB)
    assert up is not None and up.plan == FULL.replace(allocator=cured.allocator) and not up.restart


def test_a_new_attempt_waits_as_long_as_the_last_failure_said() -> None:
    assert BackOff.after_failures(0) == BackOff()
    assert (BackOff.after_failures(1).wait, BackOff.after_failures(1).next_wait) == (1, 2)
    assert (BackOff.after_failures(3).wait, BackOff.after_failures(3).next_wait) == (4, 8)
    assert BackOff.after_failures(40).wait == MOST_BACK_OFF


def test_the_wait_after_a_step_up_that_did_not_hold_doubles_up_to_a_bound() -> None:
    back_off = BackOff()
    assert back_off.ready()  # the first try comes at the first boundary with room
    waits = [back_off.failed() for _ in range(9)]
    assert waits == [1, 2, 4, 8, 16, 32, MOST_BACK_OFF, MOST_BACK_OFF, MOST_BACK_OFF]
    back_off = BackOff()
    back_off.failed()
    back_off.failed()  # waits 2 boundaries
    assert [back_off.ready() for _ in range(3)] == [False, False, True]


def test_a_plan_stepped_down_from_is_gone_back_to_if_as_faithful_whatever_speed_was_measured() -> None:
    """Speeds measured at different times differ by more than an offloaded optimizer costs on a
    CPU: an exact plan left for lack of room is gone back to whatever its measured speed."""
    offloaded = FULL.replace(offload="optimizer")
    for offloaded_rate in (195.0, 240.0, 400.0):
        up = step_up(offloaded, [FULL], [*MEASURED, ran(offloaded, 60, samples_per_s=offloaded_rate)], capacity=500 * MiB)
        assert up is not None and up.plan == FULL, offloaded_rate
    # Never to a less faithful one, however fast.
    eight_bit = FULL.replace(optimizer="adamw8bit")
    assert step_up(offloaded, [eight_bit], [*MEASURED, ran(offloaded, 60, 100.0), ran(eight_bit, 50, 900.0)], capacity=500 * MiB) is None


def test_a_job_that_stepped_down_twice_goes_back_to_the_top_and_not_round_between_the_plans_it_left() -> None:
    quarter = FULL.replace(micro_batch=4)
    measured = [*MEASURED, ran(quarter, 40, samples_per_s=100.0)]
    up = step_up(quarter, [FULL, HALF], measured, capacity=500 * MiB)
    assert up is not None and up.plan == FULL
    assert step_up(FULL, [FULL, HALF], measured, capacity=500 * MiB) is None  # HALF needs less: below
    offloaded, both = FULL.replace(offload="optimizer"), FULL.replace(offload="optimizer", optimizer="adamw8bit")
    through = [*measured, ran(offloaded, 60, 150.0), ran(both, 50, 160.0)]
    assert step_up(both, [FULL, offloaded], through, capacity=500 * MiB, origin=FULL).plan == FULL  # type: ignore[union-attr]
    assert step_up(FULL, [FULL, offloaded], through, capacity=500 * MiB, origin=FULL) is None
