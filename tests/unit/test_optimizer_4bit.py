"""The optimizer_4bit rung as Plan steps: after the 8-bit rung on the ladder, on the same knob
(one optimizer per plan), its labels and memory terms, and the rungs that refuse it."""

from __future__ import annotations

import pytest

from oomguard.strategies import planner, rungs
from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs import fused_backward, optimizer_4bit, optimizer_8bit, shard_optimizer

BASE = Plan.initial(4)
EIGHT = BASE.replace(optimizer="adamw8bit")
FOUR = BASE.replace(optimizer="adamw4bit")


def test_it_is_on_the_ladder_right_after_the_8bit_rung_and_approximate():
    names = rungs.names()
    assert names.index("optimizer_4bit") == names.index("optimizer_8bit") + 1
    assert rungs.rung("optimizer_4bit") is optimizer_4bit.RUNG
    assert "optimizer_4bit" not in rungs.exact_names()
    assert optimizer_4bit.RUNG.needs_restart and optimizer_4bit.RUNG.shrinks == frozenset({"optimizer_state"})
    assert optimizer_4bit.RUNG.command is None  # diffusers' scripts have no 4-bit flag


@pytest.mark.parametrize(("plan", "stepped"), [(BASE, FOUR), (EIGHT, FOUR), (FOUR, None)], ids=["adamw", "8bit", "4bit"])
def test_its_step_comes_from_adamw_or_8bit(plan, stepped):
    assert optimizer_4bit.RUNG.step(plan) == stepped


def test_each_optimizer_rung_is_on_for_its_own_value_only():
    assert [(optimizer_8bit.RUNG.is_on(p), optimizer_4bit.RUNG.is_on(p)) for p in (BASE, EIGHT, FOUR)] == [(False, False), (True, False), (False, True)]
    # One label each: "adamw4bit" once in the summary, never next to "adamw8bit".
    assert FOUR.short().split().count("adamw4bit") == 1 and "adamw8bit" not in FOUR.short()
    assert EIGHT.short().split().count("adamw8bit") == 1 and "adamw4bit" not in EIGHT.short()


def test_memory_terms_halve_the_8bit_rungs_state():
    terms = optimizer_4bit.RUNG.memory(FOUR)
    assert terms is not None and terms.optimizer_bytes_per_byte == pytest.approx(0.28)
    assert terms.optimizer_bytes_per_byte < 0.6 * optimizer_8bit.RUNG.memory(EIGHT).optimizer_bytes_per_byte
    assert optimizer_4bit.RUNG.memory(EIGHT) is None and optimizer_8bit.RUNG.memory(FOUR) is None


def test_a_change_names_the_optimizer_rungs_that_changed():
    assert planner.rungs_between(BASE, EIGHT) == ("optimizer_8bit",)
    assert planner.rungs_between(BASE, FOUR) == ("optimizer_4bit",)
    assert planner.rungs_between(EIGHT, FOUR) == ("optimizer_8bit", "optimizer_4bit")
    assert planner.describe_change(EIGHT, FOUR) == "8-bit AdamW moments off (adamw4bit); " + optimizer_4bit.describe(EIGHT, FOUR)
    assert "4-bit AdamW moments off (adamw)" == planner.describe_change(FOUR, BASE)


def test_4bit_is_less_faithful_than_8bit():
    assert 0 < planner.faithfulness(BASE, EIGHT) < planner.faithfulness(BASE, FOUR) < planner.faithfulness(BASE, BASE.replace(lora_rank=16))


def test_the_planner_offers_both_optimizers_but_never_4bit_with_offload():
    plans = planner.candidate_plans(BASE, ("optimizer_8bit", "optimizer_4bit", "offload"))
    assert {(p.optimizer, p.offload) for p in plans} == {
        ("adamw", "none"), ("adamw8bit", "none"), ("adamw4bit", "none"), ("adamw", "optimizer"), ("adamw8bit", "optimizer"),
    }
    assert {p.optimizer for p in planner.candidate_plans(BASE, ("optimizer_4bit",))} == {"adamw", "adamw4bit"}


def test_it_conflicts_with_offload_and_the_rungs_that_run_torchs_adamw_refuse_it():
    assert rungs.conflict(FOUR) is None
    assert rungs.conflict(FOUR.replace(mixed_precision="bf16", lora_rank=4, base_quantization="nf4")) is None
    assert "host-offloaded optimizer" in rungs.conflict(FOUR.replace(offload="optimizer"))
    assert rungs.conflict(EIGHT.replace(offload="optimizer")) is None
    assert "AdamW on the device" in rungs.conflict(fused_backward.step(FOUR))
    # The sharding rungs never step into it, and refuse it where a plan has both.
    two = Plan.initial(4, world_size=2)
    assert shard_optimizer.RUNG.step(two.replace(optimizer="adamw4bit")) is None
    assert optimizer_4bit.step(shard_optimizer.RUNG.step(two)) is not None
    assert "adamw4bit optimizer" in rungs.conflict(optimizer_4bit.step(shard_optimizer.RUNG.step(two)))
