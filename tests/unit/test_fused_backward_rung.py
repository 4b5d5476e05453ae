"""The fused_backward rung as Plan steps: only with the whole batch in one micro-batch on one
process, so the planner weighs it against smaller micro-batches, never with them."""

from __future__ import annotations

from oomguard.strategies import planner, rungs
from oomguard.strategies.memory_model import Measurement, MemoryModel
from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs import fused_backward

MiB = 2**20
BASE = Plan.initial(4)
FUSED = fused_backward.step(BASE)
STATIC = {"parameters": 8 * MiB, "trainable": 8 * MiB, "optimizer_state": 16 * MiB}


def test_its_conflicts_name_the_problem():
    assert rungs.conflict(FUSED) is None
    assert "one micro-batch" in rungs.conflict(FUSED.replace(micro_batch=2))
    assert "one process" in rungs.conflict(fused_backward.step(Plan.initial(4, world_size=2)))
    assert "loss scaler" in rungs.conflict(FUSED.replace(mixed_precision="fp16"))
    assert "AdamW on the device" in rungs.conflict(FUSED.replace(offload="optimizer"))
    assert "AdamW on the device" in rungs.conflict(FUSED.replace(optimizer="adamw8bit"))


def test_the_planner_never_offers_it_with_gradient_accumulation():
    plans = planner.candidate_plans(BASE, ("micro_batch", "fused_backward"))
    fused = [p for p in plans if fused_backward.on(p)]
    assert fused == [FUSED]
    assert {p.micro_batch for p in plans if not fused_backward.on(p)} == {1, 2, 4}


def test_when_the_model_state_dominates_it_beats_smaller_micro_batches():
    # 8 MiB of weights, 8 of gradients, 16 of AdamW state, 1 MiB a sample: micro-batch 4 needs
    # 36 MiB and micro-batch 1 still 33; without the full gradients micro-batch 4 needs ~29.
    measured = Measurement(plan=BASE, fits=False, peak_bytes=36 * MiB, capacity=33 * MiB, static=STATIC)
    model = MemoryModel([measured, Measurement(plan=BASE.replace(micro_batch=1), fits=False, peak_bytes=33 * MiB, capacity=33 * MiB, static=STATIC)])
    choice = planner.choose(BASE, planner.candidate_plans(BASE, ("micro_batch", "fused_backward")), model, 36 * MiB)
    assert choice is not None and choice.plan == FUSED, choice
    assert choice.rungs == ("fused_backward",)


def test_recovery_in_process_never_slices_a_plan_that_steps_in_backward():
    from oomguard.strategies.doctor import decide_in_process
    from oomguard.strategies.policy import Policy

    # No numbers (no capacity): the fallback walks the in-process rungs; smaller slices would
    # step the optimizer once per slice, so it takes checkpointing instead.
    decision = decide_in_process(FUSED, [], Policy(allow=("micro_batch", "checkpointing")), None)
    assert decision is not None and decision.rung == "checkpointing", decision
    assert rungs.conflict(decision.plan) is None
    assert decide_in_process(FUSED, [], Policy(allow=("micro_batch",)), None) is None
