"""The memory model and the planner: peaks and speeds from measurements, and the plan chosen."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from oomguard.strategies import planner
from oomguard.strategies.doctor import decide, decide_in_process
from oomguard.strategies.decision import GiveUp, NextPlan, PastAttempt
from oomguard.strategies.memory_model import MARGIN_MEASURED, Measurement, MemoryModel, shape_of
from oomguard.strategies.outcome import MemoryFigures, Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.policy import Policy
from oomguard.strategies.rungs import checkpointing, exact_names, names, usable_by

# The rungs a job of the unconditional trainer can take (the frozen-part rungs are a
# text-to-image job's: JobSpec.features).
UNCONDITIONAL = frozenset({"full_model"})
RUNG_NAMES, EXACT_RUNG_NAMES = usable_by(UNCONDITIONAL), usable_by(UNCONDITIONAL, exact_names())

MiB = 2**20
BATCH = 16
BASE = Plan.initial(BATCH)
# A model of 4 MiB of parameters: static = params + grads + 2x AdamW moments = 16 MiB.
STATIC = {"parameters": 4 * MiB, "trainable": 4 * MiB, "optimizer_state": 8 * MiB}
PER_SAMPLE = 5 * MiB
TRANSIENT = 1 * MiB


def peak(micro_batch: int, per_sample: float = PER_SAMPLE) -> int:
    return int(16 * MiB + TRANSIENT + per_sample * micro_batch)


def ran(plan: Plan, *, samples_per_s: float | None = None, per_sample: float = PER_SAMPLE) -> Measurement:
    return Measurement(plan=plan, fits=True, peak_bytes=peak(plan.micro_batch, per_sample), capacity=1000 * MiB, samples_per_s=samples_per_s, static=STATIC)


def step_time(micro_batch: int, per_micro: float = 0.05, per_sample: float = 0.01, factor: float = 1.0) -> float:
    plan = BASE.replace(micro_batch=micro_batch)
    return (plan.grad_accum * per_micro + BATCH * per_sample) * factor


def timed(micro_batch: int, **kwargs: float) -> Measurement:
    return ran(BASE.replace(micro_batch=micro_batch), samples_per_s=BATCH / step_time(micro_batch, **kwargs))


# ----------------------------------------------------------------------------- peaks


def test_two_sizes_give_the_line_and_it_predicts_the_others():
    model = MemoryModel([ran(BASE.replace(micro_batch=1)), ran(BASE.replace(micro_batch=4))])
    line = model.line(BASE)
    assert line is not None and line.measured
    assert line.per_sample == pytest.approx(PER_SAMPLE)
    for size in (2, 8, 16):
        assert model.predicted_peak(BASE.replace(micro_batch=size)) == pytest.approx(peak(size), rel=1e-6)


def test_one_size_and_the_static_bytes_give_a_line_that_errs_high():
    model = MemoryModel([ran(BASE.replace(micro_batch=1))])
    predicted = model.predicted_peak(BASE.replace(micro_batch=8))
    # The transient is counted per sample: larger micro-batches are overestimated, never under.
    assert peak(8) <= predicted <= peak(8) + 8 * TRANSIENT


def test_a_scripts_bytes_held_between_steps_give_the_line_and_its_first_oom_lands_on_a_plan_that_fits():
    # A command job's script reports no parameters, only what stays on its device between steps
    # (jobs/script_report.py); with it, one measured size gives the line.
    script = Plan.initial(128, even_slices=True)
    resident, per_sample = 400 * 2**10, 1.5 * 2**10
    ran_big = Measurement(plan=script, fits=True, peak_bytes=int(resident + 128 * per_sample), capacity=64 * MiB, static={"resident": resident})
    line = MemoryModel([ran_big]).line(script)
    assert line is not None and line.measured and line.fixed == resident and line.per_sample == pytest.approx(per_sample)
    cap = 560 * 2**10
    figures = MemoryFigures(requested=24 * 2**10, allocated=538 * 2**10, total=cap)
    oom = Outcome(kind="oom", step=7, memory=figures, message="CUDA out of memory", measurements=(ran_big, figures.measurement(script, 7)))
    decision = decide(oom, script, [], Policy())
    assert isinstance(decision, NextPlan) and decision.rung == "micro_batch"
    assert 128 % decision.plan.micro_batch == 0 and resident + decision.plan.micro_batch * per_sample <= cap
    assert decision.plan.micro_batch >= 32  # a jump, not one halving per attempt to a size far below


def test_an_oom_steepens_a_line_that_said_it_would_fit():
    optimistic = ran(BASE.replace(micro_batch=1), per_sample=PER_SAMPLE / 2)
    oom = Measurement(plan=BASE.replace(micro_batch=8), fits=False, peak_bytes=peak(8), capacity=peak(8) - 1, static=STATIC)
    model = MemoryModel([optimistic, oom])
    assert model.predicted_peak(BASE.replace(micro_batch=8)) >= peak(8)


def test_other_shapes_are_predicted_from_the_knobs():
    model = MemoryModel([ran(BASE.replace(micro_batch=1)), ran(BASE.replace(micro_batch=2))])
    checkpointed = model.line(BASE.replace(gradient_checkpointing=True))
    assert checkpointed is not None and not checkpointed.measured
    assert checkpointed.per_sample == pytest.approx(PER_SAMPLE * checkpointing.TERMS.activation)
    offloaded = model.line(BASE.replace(offload="optimizer"))
    assert offloaded.fixed == pytest.approx(model.line(BASE).fixed - STATIC["optimizer_state"])


def test_without_any_measurement_nothing_is_claimed():
    assert MemoryModel([]).fits(BASE, 100 * MiB) is None


def test_fits_keeps_a_margin_and_never_trusts_a_plan_that_ran_out_at_this_capacity():
    model = MemoryModel([ran(BASE.replace(micro_batch=1)), ran(BASE.replace(micro_batch=4))])
    exact = peak(4)
    assert model.fits(BASE.replace(micro_batch=4), int(exact / (1 - MARGIN_MEASURED)) + 1)
    assert not model.fits(BASE.replace(micro_batch=4), exact)
    oom = Measurement(plan=BASE.replace(micro_batch=2), fits=False, peak_bytes=peak(2), capacity=200 * MiB)
    model = MemoryModel([ran(BASE.replace(micro_batch=1)), oom])
    assert model.fits(BASE.replace(micro_batch=2), 150 * MiB) is False  # ran out with more
    assert model.fits(BASE.replace(micro_batch=2), 300 * MiB)  # more room now than then


def test_a_caching_allocators_reserve_is_in_the_lines_so_it_stays_out_of_the_margin():
    """Where the runs reported what the allocator reserved, the lines are fitted to it (the
    reserve grows with the micro-batch: 1.06x at 1, 1.38x at 12 on conv32 under caching/1024),
    and a plan that ran is judged by its reserved peak."""
    def reserving(micro_batch: int) -> Measurement:
        m = ran(BASE.replace(micro_batch=micro_batch))
        return dataclasses.replace(m, reserved_bytes=int(m.peak_bytes * 1.25))

    plain = MemoryModel([ran(BASE.replace(micro_batch=1)), ran(BASE.replace(micro_batch=4))])
    caching = MemoryModel([reserving(1), reserving(4)])
    capacity = int(peak(8) / (1 - MARGIN_MEASURED)) + 1  # room for micro-batch 8's allocated bytes
    assert plain.fits(BASE.replace(micro_batch=8), capacity)
    assert not caching.fits(BASE.replace(micro_batch=8), capacity)
    assert caching.fits(BASE.replace(micro_batch=8), int(capacity * 1.25) + 1)
    assert caching.predicted_peak(BASE.replace(micro_batch=8)) == pytest.approx(1.25 * peak(8), rel=1e-6)
    # A plan that ran: its own reserved peak, with the small margin of a plan that ran.
    assert not caching.fits(BASE.replace(micro_batch=4), peak(4) + MiB)
    assert caching.fits(BASE.replace(micro_batch=4), int(peak(4) * 1.25 / 0.97) + 1)
    choice = planner.choose(BASE, [BASE.replace(micro_batch=m) for m in (16, 8, 4, 2, 1)], caching, capacity)
    assert choice is not None and choice.plan.micro_batch < 8
    # Without reserved figures (the exact emulation) nothing changes.
    assert plain.predicted_peak(BASE.replace(micro_batch=8)) == pytest.approx(peak(8), rel=1e-6)


def test_measurements_round_trip():
    m = ran(BASE.replace(micro_batch=3), samples_per_s=12.5)
    assert Measurement.from_dict(m.to_dict()) == m


# ----------------------------------------------------------------------------- speed


def test_speed_is_measured_for_a_plan_that_ran_and_predicted_for_others():
    model = MemoryModel([timed(1), timed(2)])
    assert model.expected_samples_per_s(BASE.replace(micro_batch=1)) == pytest.approx(BATCH / step_time(1))
    for size in (4, 8, 16):
        assert model.expected_samples_per_s(BASE.replace(micro_batch=size)) == pytest.approx(BATCH / step_time(size), rel=1e-6)


# ----------------------------------------------------------------------------- planner


def test_candidates_cover_every_micro_batch_worth_trying_of_every_reachable_shape():
    plans = planner.candidate_plans(BASE, ("micro_batch", "checkpointing"))
    assert {p.micro_batch for p in plans} == set(BASE.micro_batch_choices()) == {1, 2, 3, 4, 6, 8, 16}
    assert len(plans) == 2 * len(BASE.micro_batch_choices())
    assert len(planner.candidate_plans(BASE, ("checkpointing",))) == 2
    in_process = planner.candidate_plans(BASE, ("micro_batch", "checkpointing", "allocator"), restart=False)
    assert {p.allocator for p in in_process} == {""}


def test_the_planner_takes_the_fastest_plan_that_fits_not_the_smallest_step():
    # Checkpointing at a micro-batch over 7 beats micro-batch 7 without it when a step's fixed
    # cost per micro-batch dominates.
    measurements = [timed(1, per_micro=0.1, per_sample=0.001), timed(2, per_micro=0.1, per_sample=0.001)]
    model = MemoryModel(measurements)
    capacity = int(peak(7) / (1 - 0.1))
    candidates = planner.candidate_plans(BASE, ("micro_batch", "checkpointing"))
    choice = planner.choose(BASE, candidates, model, capacity)
    assert choice is not None
    assert choice.plan.gradient_checkpointing and choice.plan.micro_batch > 7, choice
    # Without checkpointing allowed: as few slices as the largest micro-batch that fits
    # needs, each as small as that number of slices allows (the lowest peak at that speed).
    choice = planner.choose(BASE, planner.candidate_plans(BASE, ("micro_batch",)), model, capacity)
    largest = max(size for size in range(1, BATCH + 1) if model.fits(BASE.replace(micro_batch=size), capacity))
    slices = math.ceil(BATCH / largest)  # every size, not only those the planner weighs
    assert (largest, slices) == (7, 3)
    assert choice.plan == BASE.replace(micro_batch=math.ceil(BATCH / slices))


def test_an_exact_plan_wins_over_a_faster_approximate_one():
    start = BASE
    exact = BASE.replace(micro_batch=4)
    approximate = BASE.replace(micro_batch=4, mixed_precision="bf16")
    assert planner.faithfulness(start, exact) == 0
    assert planner.faithfulness(start, approximate) > 0
    assert planner.rungs_between(start, approximate) == ("micro_batch", "precision")


# ----------------------------------------------------------------------------- doctor with numbers


def oom_at(plan: Plan, capacity: int, step: int = 3) -> Outcome:
    figures = MemoryFigures(requested=PER_SAMPLE, allocated=capacity - PER_SAMPLE // 2, reserved=capacity - PER_SAMPLE // 2, total=capacity, breakdown={"activations": capacity // 2})
    oom = Measurement(plan=plan, fits=False, peak_bytes=capacity + PER_SAMPLE // 2, capacity=capacity, static=STATIC, step=step)
    return Outcome(kind="oom", step=step, phase="forward", memory=figures, plan=plan, measurements=(oom,))


def test_the_doctor_jumps_straight_to_the_fewest_slices_that_fit():
    capacity = int(peak(5) / (1 - MARGIN_MEASURED)) + 1
    measured = Outcome(kind="interrupted", plan=BASE, measurements=(ran(BASE.replace(micro_batch=1)), ran(BASE.replace(micro_batch=2))))
    outcome = oom_at(BASE, capacity)
    history = [PastAttempt(BASE, measured), PastAttempt(BASE, outcome)]
    decision = decide(outcome, BASE, history, Policy(allow=("micro_batch",), initial=BASE))
    assert isinstance(decision, NextPlan)
    # Micro-batch 5 is the largest that fits; 4 takes as many slices (four) with a lower peak.
    assert decision.plan.micro_batch == 4 and decision.plan.grad_accum == 4, decision
    assert "predicted peak" in decision.reason


def test_in_process_takes_only_rungs_that_need_no_restart():
    capacity = 30 * MiB  # below the static bytes + one sample with or without checkpointing
    measurements = [ran(BASE.replace(micro_batch=1)), ran(BASE.replace(micro_batch=2))]
    everything = Policy(allow=("allocator", "micro_batch", "checkpointing", "offload"), initial=BASE)
    decision = decide_in_process(BASE, measurements, everything, capacity)
    assert decision is None or decision.plan.offload == "none"
    decision = decide_in_process(BASE, measurements, everything, 60 * MiB)
    assert isinstance(decision, NextPlan) and decision.plan.micro_batch < BATCH and decision.plan.offload == "none"


def test_shape_of_ignores_micro_batch_and_allocator():
    assert shape_of(BASE.replace(micro_batch=3, allocator="expandable_segments:True")) == shape_of(BASE)


def _decide_at(capacity: int, allow: tuple[str, ...]):
    measured = Outcome(kind="interrupted", plan=BASE, measurements=(ran(BASE.replace(micro_batch=1)), ran(BASE.replace(micro_batch=2))))
    outcome = oom_at(BASE.replace(micro_batch=1), capacity)
    history = [PastAttempt(BASE, measured), PastAttempt(BASE.replace(micro_batch=1), outcome)]
    return decide(outcome, BASE.replace(micro_batch=1), history, Policy(allow=allow, initial=BASE))


def test_optimizer_state_dominates_the_exact_answer_is_offload():
    # 16 MiB of static bytes (half of it AdamW state), 5 MiB a sample: micro-batch 1 needs 22.
    decision = _decide_at(20 * MiB, EXACT_RUNG_NAMES)
    assert isinstance(decision, NextPlan) and decision.plan.offload == "optimizer", decision
    assert decision.plan.optimizer == "adamw" and decision.plan.lora_rank is None


def test_without_offload_the_8bit_optimizer_when_allowed():
    decision = _decide_at(20 * MiB, ("micro_batch", "checkpointing", "optimizer_8bit"))
    assert isinstance(decision, NextPlan) and decision.plan.optimizer == "adamw8bit", decision


def test_when_only_a_rung_not_allowed_would_fit_the_report_names_it():
    decision = _decide_at(20 * MiB, ("micro_batch", "checkpointing"))
    assert isinstance(decision, GiveUp), decision
    assert "offload" in decision.reason and "not allowed" in decision.reason
    (line,) = [line for line in decision.report.splitlines() if "[ladder] allow = " in line]
    allow = json.loads(line.split("allow = ", 1)[1])
    assert allow[:2] == ["micro_batch", "checkpointing"] and "offload" in allow, line
    # Only the rungs the fitting plan needs are suggested, not every rung there is.
    assert "lora" not in allow and "precision" not in allow


def test_parameters_gradients_and_state_together_lead_to_lora_when_allowed():
    # 9 MiB: parameters and gradients alone take 8, whatever the exact rungs do to the rest.
    decision = _decide_at(9 * MiB, RUNG_NAMES)
    assert isinstance(decision, NextPlan) and decision.plan.lora_rank is not None, decision
    # The least invasive approximate rung that fits: no quantized base when LoRA is enough.
    assert decision.plan.base_quantization is None


def test_a_noisy_timing_never_makes_more_slices_look_faster():
    # Micro-batch 16 happened to be timed while the machine was busy: slower per sample than 1.
    slow_full = ran(BASE, samples_per_s=5.0)
    fast_single = ran(BASE.replace(micro_batch=1), samples_per_s=6.0)
    model = MemoryModel([fast_single, slow_full])
    speeds = [model.expected_samples_per_s(BASE.replace(micro_batch=size)) for size in (1, 2, 4, 8, 16)]
    assert speeds == sorted(speeds)
    choice = planner.choose(BASE, planner.candidate_plans(BASE, ("micro_batch",)), model, 1000 * MiB)
    assert choice is not None and choice.plan == BASE


def test_a_shape_timed_at_one_size_borrows_the_split_of_a_shape_timed_at_two():
    base = [timed(1, per_micro=0.1, per_sample=0.001), timed(2, per_micro=0.1, per_sample=0.001)]
    checkpointed = BASE.replace(micro_batch=1, gradient_checkpointing=True)
    slower = 1.2  # checkpointing measured 20 % slower at micro-batch 1
    ckpt_one = ran(checkpointed, samples_per_s=BATCH / step_time(1, per_micro=0.1, per_sample=0.001, factor=slower))
    model = MemoryModel([*base, ckpt_one])
    expected = BATCH / step_time(16, per_micro=0.1, per_sample=0.001, factor=slower)
    assert model.expected_samples_per_s(checkpointed.replace(micro_batch=16)) == pytest.approx(expected, rel=1e-6)


def test_the_optimistic_speed_of_a_shape_timed_once_reads_its_extra_time_as_fixed_cost():
    # Checkpointing on a small model: its recomputation is launches, a fixed 0.05 s per
    # micro-batch, so it is far slower at micro-batch 1 and nearly as fast at 16.
    base = [timed(1, per_micro=0.05, per_sample=0.01), timed(4, per_micro=0.05, per_sample=0.01)]
    checkpointed = BASE.replace(micro_batch=1, gradient_checkpointing=True)
    ckpt_one = ran(checkpointed, samples_per_s=BATCH / step_time(1, per_micro=0.1, per_sample=0.01))
    model = MemoryModel([*base, ckpt_one])
    whole = checkpointed.replace(micro_batch=16)
    scaled = BATCH / step_time(16, per_micro=0.05, per_sample=0.01, factor=0.11 / 0.06)
    assert model.expected_samples_per_s(whole) == pytest.approx(scaled, rel=1e-6)
    assert model.expected_samples_per_s(whole, optimistic=True) == pytest.approx(BATCH / step_time(16, per_micro=0.1, per_sample=0.01), rel=1e-6)
    # The probe's hopeful choice among plans not measured: micro-batch 16 with checkpointing,
    # which the expected speed ranks below micro-batch 4 without it (measured).
    not_ran = [p for p in planner.candidate_plans(BASE, ("micro_batch", "checkpointing")) if p not in {m.plan for m in model.measurements}]
    hopeful = planner.choose(BASE, [p for p in not_ran if p.gradient_checkpointing], model, 1000 * MiB, optimistic=True, optimistic_speed=True)
    assert hopeful is not None and hopeful.plan == whole
    four = BASE.replace(micro_batch=4)
    assert planner.rank(model, BASE, whole) > planner.rank(model, BASE, four)
    assert planner.rank(model, BASE, whole, optimistic=True) < planner.rank(model, BASE, four)
    # A shape that is faster per sample than its reference keeps the scaled reading.
    quick = ran(checkpointed, samples_per_s=BATCH / step_time(1, per_micro=0.05, per_sample=0.01, factor=0.5))
    quick_model = MemoryModel([*base, quick])
    assert quick_model.expected_samples_per_s(whole, optimistic=True) == pytest.approx(quick_model.expected_samples_per_s(whole), rel=1e-9)


def one_size(plan: Plan, peak_bytes: int, static: dict[str, int]) -> Measurement:
    return Measurement(plan=plan, fits=True, peak_bytes=peak_bytes, capacity=1024 * MiB, samples_per_s=10.0, static=static)


def test_a_rungs_activation_factor_is_learnt_from_two_lines_that_differ_in_it_alone():
    # 16 MiB of static bytes (4 of weights, 4 of gradients, 8 of AdamW state); 8 MiB per sample
    # plain, 2 MiB with checkpointing: it keeps a quarter here, not the 62 % its terms say (a
    # Stable Diffusion UNet keeps about a third).
    static = {"parameters": 4 * MiB, "trainable": 4 * MiB, "optimizer_state": 8 * MiB}
    start = Plan.initial(8).replace(micro_batch=1)
    ckpt = start.replace(gradient_checkpointing=True)
    attention = start.replace(attention="sliced")
    # Attention checkpointing keeps 6 of the 8 MiB per sample; measured before checkpointing.
    model = MemoryModel([one_size(start, 24 * MiB, static), one_size(attention, 22 * MiB, static), one_size(ckpt, 18 * MiB, static)])
    assert model.predicted_peak(ckpt.replace(micro_batch=8)) == pytest.approx(16 * MiB + 8 * 2 * MiB)
    # Both rungs: carried over from the attention line (the first measured of the nearest) with
    # checkpointing's learnt factor, a quarter, not the 62 % of its terms.
    assert model.predicted_peak(ckpt.replace(attention="sliced", micro_batch=8)) == pytest.approx(16 * MiB + 8 * 6 * MiB * 0.25)


def test_a_job_that_trains_a_share_of_its_parameters_keeps_gradients_and_state_for_that_share():
    # A text-to-image LoRA job: 100 MiB of UNet, 2 MiB of it adapters.
    static = {"parameters": 100 * MiB, "trainable": 2 * MiB, "optimizer_state": 4 * MiB}
    start = Plan.initial(8).replace(micro_batch=1)
    model = MemoryModel([one_size(start, 110 * MiB, static)])
    # parameters + the adapters' gradients and AdamW state: 106 MiB; 4 MiB per sample.
    assert model.predicted_peak(start.replace(micro_batch=2)) == pytest.approx(106 * MiB + 2 * 4 * MiB)
