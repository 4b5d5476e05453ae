"""The layer_offload rung as Plan steps, memory terms and planner choices: each fraction of the
blocks kept on the host is a plan of its own, the memory model predicts each from the bytes a
run measured for it, and a model whose weights dominate gains more than one whose activations do."""

from __future__ import annotations

import pytest

from oomguard.strategies import planner, rungs
from oomguard.strategies.memory_model import Measurement, MemoryModel
from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs import fused_backward, layer_offload

MiB = 2**20
BASE = Plan.initial(4, micro_batch=1)
GRADES = {f: BASE.with_extra(layer_offload.KNOB, f, 0.0) for f in layer_offload.FRACTIONS}


def static(weights: int, held_share: float) -> dict[str, int]:
    """A plain run's static figures: ``weights`` bytes of trained weights, of which each
    fraction keeps ``held_share`` of its fraction on the host."""
    held = {layer_offload.measured_key(f): int(weights * held_share * f) for f in layer_offload.FRACTIONS}
    return {"parameters": weights, "trainable": weights, "optimizer_state": 2 * weights, **held}


def test_each_step_takes_the_next_fraction_and_the_last_has_none():
    plan, seen = BASE, []
    while (plan := layer_offload.step(plan)) is not None:
        seen.append(layer_offload.fraction(plan))
    assert seen == list(layer_offload.FRACTIONS)
    assert layer_offload.RUNG.is_on(GRADES[0.25]) and not layer_offload.RUNG.is_on(BASE)
    # A plan that never took it equals one stepped back to its default.
    assert GRADES[0.5].with_extra(layer_offload.KNOB, 0.0, 0.0) == BASE


def test_labels_and_descriptions_say_the_fraction():
    assert GRADES[0.5].short() == "mb=1x4 layers@host=0.5"
    assert "50% of the blocks" in layer_offload.describe(BASE, GRADES[0.5])
    assert layer_offload.describe(GRADES[0.5], BASE) == "all blocks on the device again"


def test_it_sits_after_fused_backward_needs_a_whole_model_and_is_exact():
    names = rungs.names()
    assert names.index("layer_offload") == names.index("fused_backward") + 1
    assert "layer_offload" in rungs.exact_names()
    assert "layer_offload" in rungs.usable_by(frozenset({"full_model", "shardable"}))
    # A job with train.ema (no "shardable") or one that trains adapters (no "full_model") does not.
    assert "layer_offload" not in rungs.usable_by(frozenset({"full_model", "ema"}))
    assert "layer_offload" not in rungs.usable_by(frozenset({"frozen_parts", "shardable"}))
    assert layer_offload.RUNG.needs_restart and layer_offload.RUNG.command is None


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda p: p.replace(offload="optimizer"), "host-offloaded optimizer"),
        (lambda p: p.replace(optimizer="adamw8bit"), "adamw8bit optimizer"),
        (lambda p: p.replace(mixed_precision="fp16"), "loss scaler"),
        (lambda p: p.replace(lora_rank=4), "LoRA or a quantized base"),
        (lambda p: p.replace(base_quantization="nf4", lora_rank=4), "LoRA or a quantized base"),
        (lambda p: p.replace(micro_batch=4).with_extra(fused_backward.KNOB, True, False), "optimizer step in backward"),
    ],
)
def test_its_conflicts_name_the_problem(change, says):
    plan = change(GRADES[0.5])
    reason = rungs.conflict(plan)
    assert reason is not None and says in reason, reason
    # The planner never steps into one.
    assert layer_offload.step(change(BASE)) is None


def test_one_process_only():
    two = Plan.initial(4, world_size=2)
    assert layer_offload.step(two) is None
    reason = rungs.conflict(two.with_extra(layer_offload.KNOB, 0.5, 0.0))
    assert reason is not None and "one process" in reason and "shard_offload" in reason
    assert not any(layer_offload.RUNG.is_on(p) for p in planner.candidate_plans(two, ("micro_batch", "checkpointing", "layer_offload", "shard_params")))


def test_bf16_and_checkpointing_combine_with_it():
    plan = GRADES[1.0].replace(mixed_precision="bf16", gradient_checkpointing=True)
    assert rungs.conflict(plan) is None


def test_terms_scale_with_the_fraction_and_name_their_measured_key():
    quarter, whole = layer_offload.memory(GRADES[0.25]), layer_offload.memory(GRADES[1.0])
    assert quarter.state_on_host < whole.state_on_host <= 1.0
    assert 1.0 < quarter.time < whole.time
    assert whole.state_on_host_key == layer_offload.measured_key(1.0) == "held_on_host_1"
    assert layer_offload.memory(BASE) is None


def predicted_statics(held_share: float, weights: int = 8 * MiB) -> dict[float, float]:
    plain = Measurement(plan=BASE, fits=True, peak_bytes=4 * weights + MiB, static=static(weights, held_share), samples_per_s=4.0)
    model = MemoryModel([plain])
    return {f: model.predicted_peak(plan) for f, plan in GRADES.items()}


def test_the_prediction_follows_what_the_model_keeps_in_its_blocks():
    # Weights, gradients and AdamW state: 4 bytes per weight byte leave with the blocks.
    transformer = predicted_statics(held_share=0.95)
    few_in_blocks = predicted_statics(held_share=0.3)
    plain = 4 * 8 * MiB + MiB
    for f in layer_offload.FRACTIONS:
        assert transformer[f] == pytest.approx(plain - 4 * 8 * MiB * 0.95 * f, rel=1e-6)
        assert few_in_blocks[f] == pytest.approx(plain - 4 * 8 * MiB * 0.3 * f, rel=1e-6)
    # Without a measured figure, the rung's estimate.
    model = MemoryModel([Measurement(plan=BASE, fits=True, peak_bytes=plain, static={"parameters": 8 * MiB, "trainable": 8 * MiB})])
    assert model.predicted_peak(GRADES[1.0]) == pytest.approx(plain - 4 * 8 * MiB * layer_offload.BLOCK_SHARE, rel=1e-6)


@pytest.mark.parametrize(("capacity", "fraction"), [(24 * MiB, 0.5), (13 * MiB, 0.75)])
def test_the_planner_takes_the_least_fraction_that_fits_when_weights_dominate(capacity, fraction):
    # 8 MiB of weights (32 MiB of state with AdamW) and 1 MiB of activations a sample, at
    # micro-batch 1 (the job's batch is 4). The optimizer offload frees 16 MiB
    # (it fits 24 MiB, not 13); half the blocks on the host free ~15 MiB for fewer copies.
    weights = 8 * MiB
    plain = Measurement(plan=BASE, fits=False, peak_bytes=4 * weights + MiB, capacity=capacity, static=static(weights, 0.95))
    model = MemoryModel([plain])
    choice = planner.choose(BASE, planner.candidate_plans(BASE, ("layer_offload", "offload")), model, capacity)
    assert choice is not None and choice.plan == GRADES[fraction], choice
    assert choice.rungs == ("layer_offload",)


def test_activations_dominate_a_unet_at_a_large_micro_batch_and_the_saving_is_small():
    # The same weights at micro-batch 4 with 16 MiB of activations a sample: every fraction
    # together frees what a smaller micro-batch frees many times over.
    weights = 8 * MiB
    four = Plan.initial(4)
    measured = Measurement(plan=four, fits=True, peak_bytes=4 * weights + 64 * MiB, static=static(weights, 0.95), samples_per_s=4.0)
    model = MemoryModel([measured])
    offloaded = four.with_extra(layer_offload.KNOB, 1.0, 0.0)
    saving = model.predicted_peak(four) - model.predicted_peak(offloaded)
    assert saving / model.predicted_peak(four) < 0.35
    choice = planner.choose(four, planner.candidate_plans(four, ("micro_batch", "layer_offload")), model, 70 * MiB)
    assert choice is not None and not layer_offload.RUNG.is_on(choice.plan) and choice.plan.micro_batch < 4, choice
