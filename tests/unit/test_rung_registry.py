"""A rung is one module and one registry line: a rung declared here alone (its knob kept in
Plan.extra, since Plan has no field for it) is taken up by the planner, the doctor, the memory
model, Plan.short and command jobs, none of which is edited for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.jobs.command import render
from oomguard.jobs.spec.command import CommandSpec, check, exposed_rungs
from oomguard.jobs.spec.keys import when_keys
from oomguard.strategies import planner, rungs
from oomguard.strategies.doctor import decide
from oomguard.strategies.decision import NextPlan, PastAttempt
from oomguard.strategies.memory_model import Measurement, MemoryModel
from oomguard.strategies.outcome import MemoryFigures, Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.policy import Policy
from oomguard.strategies.rungs.base import CommandSide, MemoryTerms, Rung, WhenKey

MiB = 2**20

# ---- the dummy rung's module ---------------------------------------------------------------

KNOB, OFF, ON = "dummy", "off", "on"
TERMS = MemoryTerms(activation=0.5, time=1.25)


def step(plan: Plan) -> Plan | None:
    if plan.extra_value(KNOB, OFF) == ON:
        return None
    return plan.with_extra(KNOB, ON, OFF)


def describe(old: Plan, new: Plan) -> str:
    return "halve the activations the dummy way"


def memory(plan: Plan) -> MemoryTerms | None:
    return TERMS if plan.extra_value(KNOB, OFF) == ON else None


def label(plan: Plan) -> str | None:
    return "dummy" if plan.extra_value(KNOB, OFF) == ON else None


DUMMY = Rung(
    name="dummy",
    exact=True,
    needs_restart=False,
    step=step,
    describe=describe,
    knob=KNOB,
    default=OFF,
    shrinks=frozenset({"activations"}),
    memory=memory,
    label=label,
    command=CommandSide(when=WhenKey("dummy_mode", "the dummy rung is on", listed=9), needs=("when:dummy_mode",)),
)

# ---- the registry line ---------------------------------------------------------------------


@pytest.fixture
def dummy():
    with rungs.register(DUMMY) as rung:
        yield rung


START = Plan.initial(16)
TAKEN = START.with_extra(KNOB, ON, OFF)


def test_registering_puts_the_rung_on_the_ladder_for_the_block_only():
    with rungs.register(DUMMY, after="attention"):
        assert rungs.names().index("dummy") == rungs.names().index("attention") + 1
        assert rungs.rung("dummy") is DUMMY and "dummy" in rungs.exact_names()
    assert rungs.rung("dummy") is None and "dummy" not in rungs.names()


def test_a_name_is_registered_once(dummy):
    with pytest.raises(ValueError, match="already"), rungs.register(DUMMY):
        pass


def test_the_planner_reaches_plans_with_the_rung(dummy):
    candidates = planner.candidate_plans(START, ["micro_batch", "dummy"])
    assert TAKEN in candidates and TAKEN.replace(micro_batch=4) in candidates
    assert planner.rungs_between(START, TAKEN) == ("dummy",)
    assert planner.describe_change(START, TAKEN) == "halve the activations the dummy way"
    assert planner.faithfulness(START, TAKEN) == 0  # an exact rung
    # Without the rung allowed, no plan turns its knob.
    assert all(not p.extra for p in planner.candidate_plans(START, ["micro_batch"]))


def ran(plan: Plan, micro_batch: int) -> Measurement:
    plan = plan.replace(micro_batch=micro_batch)
    static = {"parameters": 4 * MiB, "trainable": 4 * MiB, "optimizer_state": 8 * MiB}
    return Measurement(plan=plan, fits=True, peak_bytes=17 * MiB + 5 * MiB * micro_batch, capacity=100 * MiB, static=static)


def test_the_memory_model_applies_the_rungs_terms(dummy):
    model = MemoryModel([ran(START, 1), ran(START, 4)])
    # Fixed part: 16 MiB static + 1 MiB transient; activations 5 MiB a sample, halved.
    assert model.predicted_peak(TAKEN.replace(micro_batch=4)) == pytest.approx(17 * MiB + 4 * 2.5 * MiB)
    assert model.predicted_peak(START.replace(micro_batch=4)) == pytest.approx(17 * MiB + 4 * 5 * MiB)


def oom(total: int | None, measurements: tuple[Measurement, ...] = ()) -> Outcome:
    memory = MemoryFigures(requested=8 * MiB, allocated=90 * MiB, reserved=90 * MiB, free=0, total=total, breakdown={"activations": 60 * MiB})
    return Outcome(kind="oom", step=3, phase="backward", memory=memory, message="CUDA out of memory.", measurements=measurements)


def test_the_doctor_walks_to_the_rung_without_numbers(dummy):
    outcome = oom(total=None)
    decision = decide(outcome, START, [PastAttempt(START, outcome)], Policy(allow=("dummy",), initial=START))
    assert isinstance(decision, NextPlan)
    assert (decision.plan, decision.rung) == (TAKEN, "dummy")
    assert decision.reason.endswith("-> halve the activations the dummy way")


def test_the_doctor_plans_with_the_rung_by_numbers(dummy):
    # The whole batch of 16 needs 17 + 80 MiB; with the rung 17 + 40 MiB, which fits 80 MiB
    # with the margin of a prediction carried over from another shape (15 %).
    outcome = oom(total=80 * MiB, measurements=(ran(START, 1), ran(START, 4)))
    policy = Policy(allow=("dummy",), initial=START)
    decision = decide(outcome, START, [PastAttempt(START, outcome)], policy)
    assert isinstance(decision, NextPlan)
    assert decision.rung == "dummy" and decision.plan == TAKEN
    assert "[mb=16x1 dummy]" in decision.reason


def test_the_doctors_report_names_the_rung_as_one_to_allow(dummy):
    outcome = oom(total=None)
    history = [PastAttempt(START, outcome)]
    decision = decide(outcome, START, history, Policy(allow=(), initial=START))
    assert "dummy" in decision.report.splitlines()[-2]  # Rungs this job does not allow: ...


def test_plan_short_and_command_jobs_take_the_rung(dummy):
    assert TAKEN.short() == "mb=16x1 dummy"
    assert list(when_keys())[-1] == "dummy_mode"
    command = CommandSpec(argv=("python3", "train.py", "--bs={micro_batch}", "--accum={grad_accum}"), when=(("dummy_mode", ("--dummy",)),))
    check(command)
    assert "dummy" in exposed_rungs(command)
    assert render(command, TAKEN, Path("/w"), 1)[0][-1] == "--dummy"
    assert "--dummy" not in render(command, START, Path("/w"), 1)[0]
