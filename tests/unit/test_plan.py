import dataclasses
import json

import pytest

from oomguard.strategies.plan import EXPANDABLE_SEGMENTS, Plan

# (batch_size, micro_batch, world_size)
SHAPES = [
    (1, 1, 1),
    (16, 16, 1),
    (16, 8, 1),
    (16, 5, 1),
    (16, 1, 1),
    (10, 4, 1),
    (10, 3, 1),
    (10, 7, 1),
    (7, 2, 1),
    (8, 4, 2),
    (12, 5, 2),
    (12, 4, 3),
    (12, 1, 4),
    (24, 5, 4),
    (64, 3, 8),
]


@pytest.mark.parametrize(("batch_size", "micro_batch", "world_size"), SHAPES)
def test_micro_batch_sizes_cover_the_per_rank_batch(batch_size, micro_batch, world_size):
    plan = Plan(batch_size=batch_size, micro_batch=micro_batch, world_size=world_size)
    sizes = plan.micro_batch_sizes()
    assert sum(sizes) == plan.per_rank_batch == batch_size // world_size
    assert len(sizes) == plan.grad_accum
    assert all(1 <= size <= micro_batch for size in sizes)
    # Only the last slice may be smaller.
    assert all(size == micro_batch for size in sizes[:-1])
    # The whole batch over all ranks is covered.
    assert sum(sizes) * world_size == batch_size


@pytest.mark.parametrize(
    ("batch_size", "micro_batch", "world_size", "sizes", "grad_accum"),
    [
        (10, 4, 1, [4, 4, 2], 3),
        (10, 3, 1, [3, 3, 3, 1], 4),
        (10, 5, 1, [5, 5], 2),
        (10, 10, 1, [10], 1),
        (10, 1, 1, [1] * 10, 10),
        (16, 8, 1, [8, 8], 2),
        (16, 6, 1, [6, 6, 4], 3),
        (12, 5, 2, [5, 1], 2),
        (12, 3, 2, [3, 3], 2),
        (12, 6, 2, [6], 1),
    ],
)
def test_uneven_and_even_splits(batch_size, micro_batch, world_size, sizes, grad_accum):
    plan = Plan(batch_size=batch_size, micro_batch=micro_batch, world_size=world_size)
    assert plan.micro_batch_sizes() == sizes
    assert plan.grad_accum == grad_accum


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0, "micro_batch": 1}, "batch_size and world_size must be >= 1"),
        ({"batch_size": -4, "micro_batch": 1}, "batch_size and world_size must be >= 1"),
        ({"batch_size": 4, "micro_batch": 1, "world_size": 0}, "batch_size and world_size must be >= 1"),
        ({"batch_size": 4, "micro_batch": 1, "world_size": -1}, "batch_size and world_size must be >= 1"),
        ({"batch_size": 10, "micro_batch": 1, "world_size": 3}, "not divisible by world_size 3"),
        ({"batch_size": 4, "micro_batch": 0}, r"micro_batch 0 must be in 1\.\.4"),
        ({"batch_size": 4, "micro_batch": -2}, r"micro_batch -2 must be in 1\.\.4"),
        ({"batch_size": 4, "micro_batch": 5}, r"micro_batch 5 must be in 1\.\.4"),
        # micro_batch is bounded by the per-rank batch, not the global one
        ({"batch_size": 8, "micro_batch": 8, "world_size": 2}, r"micro_batch 8 must be in 1\.\.4"),
    ],
)
def test_invalid_plans_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Plan(**kwargs)


def test_replace_validates_too():
    plan = Plan(batch_size=8, micro_batch=8)
    with pytest.raises(ValueError, match="micro_batch 0"):
        plan.replace(micro_batch=0)
    with pytest.raises(ValueError, match="not divisible"):
        plan.replace(world_size=3)


def test_replace_returns_a_new_plan_and_leaves_the_old_one_alone():
    plan = Plan(batch_size=8, micro_batch=8)
    before = dataclasses.asdict(plan)
    changed = plan.replace(micro_batch=2, gradient_checkpointing=True)
    assert changed is not plan
    assert (changed.micro_batch, changed.gradient_checkpointing) == (2, True)
    assert dataclasses.asdict(plan) == before


def test_plan_is_frozen_and_hashable():
    plan = Plan(batch_size=8, micro_batch=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.micro_batch = 2  # type: ignore[misc]
    assert plan == Plan(batch_size=8, micro_batch=4)
    assert hash(plan) == hash(Plan(batch_size=8, micro_batch=4))
    assert len({plan, Plan(batch_size=8, micro_batch=4), plan.replace(micro_batch=2)}) == 2


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        ((16,), {}, Plan(batch_size=16, micro_batch=16)),
        ((16,), {"mixed_precision": "bf16"}, Plan(batch_size=16, micro_batch=16, mixed_precision="bf16")),
        ((16,), {"micro_batch": 4}, Plan(batch_size=16, micro_batch=4)),
        ((1,), {}, Plan(batch_size=1, micro_batch=1)),
    ],
)
def test_initial(args, kwargs, expected):
    plan = Plan.initial(*args, **kwargs)
    assert plan == expected
    assert not plan.allocator and not plan.gradient_checkpointing
    assert (plan.attention, plan.offload, plan.optimizer) == ("default", "none", "adamw")


ROUND_TRIP_PLANS = [
    Plan(batch_size=16, micro_batch=16),
    Plan(batch_size=10, micro_batch=3),
    Plan(batch_size=12, micro_batch=5, world_size=2),
    Plan(batch_size=16, micro_batch=1, allocator=EXPANDABLE_SEGMENTS, gradient_checkpointing=True),
    # A knob of a rung that Plan has no field for.
    Plan(batch_size=8, micro_batch=2, extra=(("tiling", 2), ("dummy", "on"))),
    Plan(
        batch_size=32,
        micro_batch=4,
        world_size=4,
        allocator=EXPANDABLE_SEGMENTS,
        gradient_checkpointing=True,
        attention="sliced",
        offload="optimizer",
        mixed_precision="bf16",
        optimizer="adamw8bit",
        lora_rank=16,
        base_quantization="nf4",
    ),
    Plan(batch_size=24, micro_batch=4, world_size=2, even_slices=True),
]


@pytest.mark.parametrize("plan", ROUND_TRIP_PLANS, ids=lambda p: p.short())
def test_to_dict_from_dict_round_trip(plan):
    data = plan.to_dict()
    assert data["grad_accum"] == plan.grad_accum
    # extra is written only when it holds something, so that stored plans read as before.
    assert {f.name for f in dataclasses.fields(Plan)} - {"extra"} <= set(data)
    assert ("extra" in data) == bool(plan.extra)
    assert Plan.from_dict(data) == plan
    # ... also through JSON, the way the store and the checkpoint manifest keep it.
    assert Plan.from_dict(json.loads(json.dumps(data))) == plan


def test_a_plan_without_extra_knobs_writes_the_keys_it_always_wrote():
    assert set(Plan(batch_size=8, micro_batch=2).to_dict()) == {
        "batch_size", "micro_batch", "world_size", "allocator", "gradient_checkpointing", "attention", "offload",
        "mixed_precision", "optimizer", "lora_rank", "base_quantization", "even_slices", "grad_accum",
    }


def test_extra_knobs_are_kept_sorted_and_hashable():
    a = Plan(batch_size=8, micro_batch=2, extra=(("b", 1), ("a", 2)))
    b = Plan(batch_size=8, micro_batch=2).with_extra("a", 2, None).with_extra("b", 1, None)
    assert a == b and hash(a) == hash(b) and a.extra == (("a", 2), ("b", 1))
    assert a.extra_value("a", None) == 2 and a.extra_value("c", "none") == "none"
    # Back at its default, a knob leaves extra: the plan equals one that never turned it.
    assert b.with_extra("a", None, None).with_extra("b", None, None) == Plan(batch_size=8, micro_batch=2)


def test_from_dict_ignores_derived_and_unknown_keys():
    data = {"batch_size": 8, "micro_batch": 3, "grad_accum": 99, "from_a_newer_version": True}
    assert Plan.from_dict(data) == Plan(batch_size=8, micro_batch=3)


def test_from_dict_validates():
    with pytest.raises(ValueError, match="micro_batch 9"):
        Plan.from_dict({"batch_size": 8, "micro_batch": 9})


@pytest.mark.parametrize(
    ("plan", "expected"),
    [
        (Plan(batch_size=16, micro_batch=16), "mb=16x1"),
        (Plan(batch_size=16, micro_batch=4), "mb=4x4"),
        (Plan(batch_size=10, micro_batch=3), "mb=3x4"),
        (Plan(batch_size=12, micro_batch=5, world_size=2), "mb=5x2 2 processes"),
        (Plan(batch_size=16, micro_batch=16, allocator=EXPANDABLE_SEGMENTS), "mb=16x1 expandable"),
        (Plan(batch_size=16, micro_batch=2, gradient_checkpointing=True), "mb=2x8 ckpt"),
        (Plan(batch_size=4, micro_batch=4, attention="sliced"), "mb=4x1 attn=sliced"),
        (Plan(batch_size=4, micro_batch=4, offload="params"), "mb=4x1 offload=params"),
        (Plan(batch_size=4, micro_batch=4, mixed_precision="fp16"), "mb=4x1 fp16"),
        (Plan(batch_size=4, micro_batch=4, optimizer="adamw8bit"), "mb=4x1 adamw8bit"),
        (Plan(batch_size=4, micro_batch=4, lora_rank=8), "mb=4x1 lora=8"),
        (Plan(batch_size=4, micro_batch=4, lora_rank=8, base_quantization="int8"), "mb=4x1 lora=8 base=int8"),
        (ROUND_TRIP_PLANS[-2], "mb=4x2 4 processes expandable ckpt attn=sliced offload=optimizer bf16 adamw8bit lora=16 base=nf4"),
    ],
)
def test_short(plan, expected):
    assert plan.short() == expected


def test_short_tells_apart_the_plans_a_ladder_walks_through():
    plans = [
        Plan(batch_size=16, micro_batch=16),
        Plan(batch_size=16, micro_batch=16, allocator=EXPANDABLE_SEGMENTS),
        Plan(batch_size=16, micro_batch=8, allocator=EXPANDABLE_SEGMENTS),
        Plan(batch_size=16, micro_batch=8, allocator=EXPANDABLE_SEGMENTS, gradient_checkpointing=True),
    ]
    assert len({p.short() for p in plans}) == len(plans)
    assert all("\n" not in p.short() for p in plans)


def test_even_slices_only_take_micro_batches_that_divide_each_ranks_batch():
    plan = Plan.initial(24, world_size=2, even_slices=True)
    assert (plan.micro_batch, plan.grad_accum) == (12, 1)
    assert plan.micro_batch_choices() == [1, 2, 3, 4, 6, 12]
    with pytest.raises(ValueError, match="must divide the per-rank batch 12"):
        plan.replace(micro_batch=5)
    # A trainer that weighs slices takes any size, but only the smallest one for each number of
    # slices is worth trying (12 in slices of 5 is three slices, like 4, with a higher peak).
    assert Plan.initial(24, world_size=2).micro_batch_choices() == [1, 2, 3, 4, 6, 12]
    assert Plan.initial(16).micro_batch_choices() == [1, 2, 3, 4, 6, 8, 16]
    assert Plan.initial(100).micro_batch_choices()[-5:] == [20, 25, 34, 50, 100]
    assert len(Plan.initial(4096).micro_batch_choices()) == 127  # about 2 * sqrt(4096), not 4096
