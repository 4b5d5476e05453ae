"""The frozen-part rungs of a text-to-image job: what each does to the trainer's frozen parts,
where each sits in the memory model, how the planner walks them, and which jobs get them."""

from __future__ import annotations

import pytest

from oomguard.strategies import planner, rungs
from oomguard.strategies.doctor import NextPlan, PastAttempt, decide
from oomguard.strategies.memory_model import Measurement, MemoryModel
from oomguard.strategies.outcome import MemoryFigures, Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.policy import Policy
from oomguard.strategies.rungs.base import FrozenHandling

MiB = 2**20
FROZEN_RUNGS = ("cache_text", "cache_latents", "vae_slicing", "offload_frozen", "vae_tiling", "frozen_half")
TEXT_TO_IMAGE = frozenset({"full_model", "frozen_parts", "fixed_crops"})
START = Plan.initial(4)


def taken(*names: str) -> Plan:
    plan = START
    for name in names:
        step = rungs.rung(name).step(plan)
        assert step is not None
        plan = step
    return plan


def test_the_frozen_rungs_are_a_text_to_image_jobs_and_the_caches_need_fixed_crops():
    assert [r.name for r in rungs.ladder() if "frozen_parts" in r.needs] == list(FROZEN_RUNGS)
    assert not set(FROZEN_RUNGS) & set(rungs.usable_by(frozenset({"full_model"})))
    random_crops = rungs.usable_by(frozenset({"full_model", "frozen_parts"}))
    assert "cache_latents" not in random_crops and "cache_text" in random_crops
    assert {r.name for r in rungs.ladder() if not r.exact} >= {"vae_tiling", "frozen_half"}
    assert {"cache_text", "cache_latents", "vae_slicing", "offload_frozen"} <= set(rungs.exact_names())


@pytest.mark.parametrize(
    ("name", "effect"),
    [
        ("cache_text", "text_cached"), ("cache_latents", "latents_cached"), ("vae_slicing", "encode_sliced"),
        ("offload_frozen", "on_host"), ("vae_tiling", "encode_tiled"), ("frozen_half", "half"),
    ],
)
def test_each_rung_turns_on_its_own_effect_only(name, effect):
    assert rungs.frozen_handling(START) == FrozenHandling()
    assert rungs.frozen_handling(taken(name)) == FrozenHandling(**{effect: True})
    assert rungs.rung(name).label(taken(name)) in taken(name).short()


def test_a_stored_plan_with_frozen_rungs_comes_back_equal():
    plan = taken("cache_text", "cache_latents", "frozen_half")
    assert Plan.from_dict(plan.to_dict()) == plan
    assert plan.to_dict()["extra"] == {"cache_latents": True, "cache_text": True, "frozen_half": True}


def measured(plan: Plan, peak: int) -> Measurement:
    static = {
        "parameters": 10 * MiB, "trainable": 10 * MiB, "optimizer_state": 20 * MiB, "frozen": 60 * MiB,
        "frozen_size_vae": 20 * MiB, "frozen_size_text": 40 * MiB,
    }
    return Measurement(plan=plan, fits=True, peak_bytes=peak, capacity=1024 * MiB, samples_per_s=10.0, static=static)


def test_the_memory_model_drops_or_halves_the_frozen_parts_each_plan_keeps():
    model = MemoryModel([measured(START, 120 * MiB), measured(START.replace(micro_batch=2), 110 * MiB)])
    plain = model.predicted_peak(START)
    assert plain == pytest.approx(120 * MiB)
    assert plain - model.predicted_peak(taken("cache_text")) == pytest.approx(40 * MiB)
    assert plain - model.predicted_peak(taken("cache_text", "cache_latents")) == pytest.approx(60 * MiB)
    assert plain - model.predicted_peak(taken("offload_frozen")) == pytest.approx(60 * MiB)
    assert plain - model.predicted_peak(taken("frozen_half")) == pytest.approx(30 * MiB)
    assert plain - model.predicted_peak(taken("cache_text", "frozen_half")) == pytest.approx(40 * MiB + 10 * MiB)


def test_the_planner_walks_the_frozen_rungs_as_one_chain():
    candidates = planner.candidate_plans(START, ("micro_batch", *FROZEN_RUNGS))
    frozen_taken = {tuple(n for n in planner.rungs_between(START, p) if n in FROZEN_RUNGS) for p in candidates}
    assert frozen_taken == {FROZEN_RUNGS[:n] for n in range(len(FROZEN_RUNGS) + 1)}
    assert len(candidates) == 7 * len(START.micro_batch_choices())
    # A rung the job may not take is left out of the chain, not an end to it.
    without_latents = {planner.rungs_between(START, p) for p in planner.candidate_plans(START, ("cache_text", "vae_slicing"))}
    assert without_latents == {(), ("cache_text",), ("cache_text", "vae_slicing")}


def test_an_oom_where_the_frozen_parts_dominate_caches_them_rather_than_shrink_the_batch():
    runs = (measured(START, 120 * MiB), measured(START.replace(micro_batch=2), 110 * MiB))
    figures = MemoryFigures(requested=8 * MiB, allocated=96 * MiB, reserved=96 * MiB, free=0, total=100 * MiB, breakdown={"frozen": 60 * MiB})
    outcome = Outcome(kind="oom", step=3, phase="forward", memory=figures, message="out of memory", measurements=runs)
    allow = rungs.usable_by(TEXT_TO_IMAGE, rungs.exact_names())
    decision = decide(outcome, START, [PastAttempt(START, outcome)], Policy(allow=allow, usable=allow, initial=START))
    assert isinstance(decision, NextPlan)
    assert decision.plan.micro_batch == 4 and rungs.frozen_handling(decision.plan).text_cached
    assert "cache_text" in decision.rung
