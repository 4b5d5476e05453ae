import dataclasses
from importlib import metadata

import pytest

from oomguard.strategies import rungs
from oomguard.strategies.plan import EXPANDABLE_SEGMENTS, Plan
from oomguard.strategies.rungs import allocator, checkpoint_grades, checkpointing, exact_names, micro_batch, names

RUNG_NAMES, EXACT_RUNG_NAMES = names(), exact_names()

NEW, OLD = "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"


def walk(step, plan):
    """Every plan a rung steps through from ``plan`` until it has nothing more to give."""
    plans = [plan]
    while (plan := step(plan)) is not None:
        plans.append(plan)
        assert len(plans) < 100, "a rung must run out"
    return plans


# Rung modules ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "name", "needs_restart"),
    [
        (allocator, "allocator", True),
        (micro_batch, "micro_batch", False),
        (checkpointing, "checkpointing", False),
    ],
)
def test_rung_name_and_flags(module, name, needs_restart):
    rung = module.RUNG
    assert rung.name == name
    assert rung.exact is True
    assert rung.exact == (name in EXACT_RUNG_NAMES)
    assert rung.needs_restart is needs_restart
    assert name in RUNG_NAMES
    assert rungs.rung(name) is rung


def test_every_rung_name_has_code_in_ladder_order():
    assert [r.name for r in rungs.ladder()] == list(RUNG_NAMES)
    assert {r.name for r in rungs.ladder() if r.exact} == set(EXACT_RUNG_NAMES)


@pytest.mark.parametrize("name", ["nope", "Micro_batch", ""])
def test_unknown_rungs_are_not_found(name):
    assert rungs.rung(name) is None


@pytest.mark.parametrize(
    ("batch_size", "world_size", "start", "expected"),
    [
        (16, 1, 16, [16, 8, 4, 2, 1]),
        (10, 1, 10, [10, 5, 3, 2, 1]),
        (7, 1, 7, [7, 4, 2, 1]),
        (3, 1, 3, [3, 2, 1]),
        (2, 1, 2, [2, 1]),
        (1, 1, 1, [1]),
        (12, 1, 12, [12, 6, 3, 2, 1]),
        (100, 1, 100, [100, 50, 25, 13, 7, 4, 2, 1]),
        (16, 1, 6, [6, 3, 2, 1]),
        # micro-batches are per rank
        (16, 2, 8, [8, 4, 2, 1]),
        (12, 2, 6, [6, 3, 2, 1]),
    ],
)
def test_micro_batch_steps(batch_size, world_size, start, expected):
    plans = walk(micro_batch.step, Plan(batch_size=batch_size, micro_batch=start, world_size=world_size))
    assert [p.micro_batch for p in plans] == expected
    assert micro_batch.step(plans[-1]) is None
    for plan in plans:
        assert (plan.batch_size, plan.world_size) == (batch_size, world_size)
        assert sum(plan.micro_batch_sizes()) * world_size == batch_size
    # grad_accum never goes down while the micro-batch shrinks
    assert [p.grad_accum for p in plans] == sorted(p.grad_accum for p in plans)


@pytest.mark.parametrize(
    ("batch_size", "world_size", "expected"),
    [
        (100, 1, [100, 50, 25, 10, 5, 2, 1]),
        (7, 1, [7, 1]),
        (24, 2, [12, 6, 3, 2, 1]),
        (1024, 2, [512, 256, 128, 64, 32, 16, 8, 4, 2, 1]),
    ],
)
def test_micro_batch_steps_for_even_slices_keep_the_batch_exact(batch_size, world_size, expected):
    # A script runs micro_batch x grad_accum samples per process: no smaller last slice.
    plans = walk(micro_batch.step, Plan.initial(batch_size, world_size=world_size, even_slices=True))
    assert [p.micro_batch for p in plans] == expected
    for plan in plans:
        assert plan.micro_batch * plan.grad_accum * world_size == batch_size


def test_micro_batch_describe_names_both_sides():
    old = Plan(batch_size=10, micro_batch=5)
    new = micro_batch.step(old)
    text = micro_batch.describe(old, new)
    assert text == "micro-batch 5 -> 3, gradient accumulation 2 -> 4 (effective batch 10 kept)"


@pytest.mark.parametrize(
    ("module", "field", "before", "after"),
    [
        (allocator, "allocator", "", EXPANDABLE_SEGMENTS),
        (checkpointing, "gradient_checkpointing", False, True),
    ],
)
def test_switch_rungs_step_once(module, field, before, after):
    plan = Plan(batch_size=8, micro_batch=4, **{field: before})
    stepped = module.RUNG.step(plan)
    assert getattr(stepped, field) == after
    assert stepped == plan.replace(**{field: after})
    assert module.RUNG.step(stepped) is None
    assert walk(module.RUNG.step, plan) == [plan, stepped]
    assert module.RUNG.describe(plan, stepped)


OTHER_KNOBS = dict(
    attention="sliced",
    offload="optimizer",
    mixed_precision="bf16",
    optimizer="adamw8bit",
    lora_rank=4,
    base_quantization="int8",
)


@pytest.mark.parametrize("module", [allocator, micro_batch, checkpointing])
@pytest.mark.parametrize(
    "plan",
    [
        Plan(batch_size=16, micro_batch=16),
        Plan(batch_size=10, micro_batch=5, world_size=2, **OTHER_KNOBS),
        Plan(batch_size=16, micro_batch=1, allocator=EXPANDABLE_SEGMENTS, gradient_checkpointing=True),
    ],
)
def test_steps_are_pure_and_change_only_their_knob(module, plan):
    fields = {"allocator": {"allocator"}, "micro_batch": {"micro_batch"}, "checkpointing": {"gradient_checkpointing"}}
    before = dataclasses.asdict(plan)
    first = module.RUNG.step(plan)
    assert dataclasses.asdict(plan) == before
    assert module.RUNG.step(plan) == first  # same input, same output
    if first is not None:
        assert first != plan
        changed = {k for k, v in dataclasses.asdict(first).items() if before[k] != v}
        assert changed == fields[module.RUNG.name]


# Allocator environment --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "variable"),
    [
        ((1, 13), OLD),
        ((2, 4), OLD),
        ((2, 8), OLD),
        ((2, 9), NEW),
        ((2, 10), NEW),
        ((2, 13), NEW),
        ((3, 0), NEW),
        (None, NEW),
    ],
)
def test_variable_for(version, variable):
    assert allocator.variable_for(version) == variable


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2.9.0", (2, 9)),
        ("2.9.0+cu128", (2, 9)),
        ("2.10.1+cpu", (2, 10)),
        ("2.8.0a0+gitabcdef", (2, 8)),
        ("2.9.0.dev20250101", (2, 9)),
        ("3.0", (3, 0)),
        ("2", None),
        ("two.nine", None),
    ],
)
def test_installed_torch_version_parses_the_distribution_version(monkeypatch, text, expected):
    monkeypatch.setattr(allocator.metadata, "version", lambda name: text)
    assert allocator.installed_torch_version() == expected


def test_installed_torch_version_without_torch(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(allocator.metadata, "version", missing)
    assert allocator.installed_torch_version() is None


def test_installed_torch_version_matches_torch():
    import torch

    major, minor = torch.__version__.split(".")[:2]
    assert allocator.installed_torch_version() == (int(major), int(minor))


WITH = Plan(batch_size=8, micro_batch=8, allocator=EXPANDABLE_SEGMENTS)
WITHOUT = Plan(batch_size=8, micro_batch=8)
VERSIONS = [pytest.param((2, 8), id="torch2.8"), pytest.param((2, 9), id="torch2.9"), pytest.param((2, 13), id="torch2.13")]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    ("plan", "env", "expected"),
    [
        # nothing asked, nothing set
        (WITHOUT, {}, None),
        (WITHOUT, {OLD: ""}, None),
        (WITHOUT, {NEW: " , "}, None),
        # ours alone
        (WITH, {}, "expandable_segments:True"),
        # the user's options are kept, in either variable, and ours added last
        (WITH, {OLD: "max_split_size_mb:128"}, "max_split_size_mb:128,expandable_segments:True"),
        (WITH, {NEW: "max_split_size_mb:128"}, "max_split_size_mb:128,expandable_segments:True"),
        (WITHOUT, {OLD: "max_split_size_mb:128"}, "max_split_size_mb:128"),
        (WITHOUT, {NEW: "max_split_size_mb:128"}, "max_split_size_mb:128"),
        # both variables merged into one, without duplicates
        (
            WITH,
            {OLD: "max_split_size_mb:128", NEW: "garbage_collection_threshold:0.6"},
            "max_split_size_mb:128,garbage_collection_threshold:0.6,expandable_segments:True",
        ),
        (
            WITHOUT,
            {OLD: "max_split_size_mb:128,roundup_power2_divisions:4", NEW: "max_split_size_mb:128"},
            "max_split_size_mb:128,roundup_power2_divisions:4",
        ),
        # never two expandable_segments
        (WITH, {OLD: "expandable_segments:True"}, "expandable_segments:True"),
        (WITH, {NEW: "expandable_segments:True", OLD: "expandable_segments:True"}, "expandable_segments:True"),
        (WITH, {NEW: "expandable_segments:False"}, "expandable_segments:True"),
        (WITH, {OLD: "expandable_segments:True,max_split_size_mb:64"}, "max_split_size_mb:64,expandable_segments:True"),
        # the user's own choice stands when the plan does not ask for it
        (WITHOUT, {OLD: "expandable_segments:True"}, "expandable_segments:True"),
        (WITHOUT, {NEW: "expandable_segments:False"}, "expandable_segments:False"),
        # stray spaces and empty items are cleaned
        (WITH, {OLD: " max_split_size_mb:128 ,, "}, "max_split_size_mb:128,expandable_segments:True"),
    ],
)
def test_allocator_environment(version, plan, env, expected):
    original = dict(env)
    env = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "1", **env}
    result = allocator.environment(plan, env, version=version)
    chosen = allocator.variable_for(version)
    other = OLD if chosen == NEW else NEW
    assert other not in result, "never both variables"
    assert result.get(chosen) == expected
    assert result["PATH"] == "/usr/bin" and result["CUDA_VISIBLE_DEVICES"] == "1"
    assert set(result) - {chosen} == {"PATH", "CUDA_VISIBLE_DEVICES"}
    assert {k: v for k, v in env.items() if k in (OLD, NEW)} == original, "the input mapping is not changed"
    if expected is not None:
        assert result[chosen].count("expandable_segments") <= 1
    # applying it again changes nothing
    assert allocator.environment(plan, result, version=version) == result


def test_allocator_environment_uses_the_installed_torch_when_no_version_is_given():
    chosen = allocator.variable_for(allocator.installed_torch_version())
    result = allocator.environment(WITH, {OLD: "max_split_size_mb:32", NEW: "max_split_size_mb:32"})
    assert result == {chosen: "max_split_size_mb:32,expandable_segments:True"}


# The ladder as a whole --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("plan", "env", "expected"),
    [
        (WITHOUT, {"HOME": "/home/a"}, {"HOME": "/home/a"}),
        (WITH, {"HOME": "/home/a"}, {"HOME": "/home/a", "@": "expandable_segments:True"}),
        (WITH, {OLD: "max_split_size_mb:64"}, {"@": "max_split_size_mb:64,expandable_segments:True"}),
        (WITHOUT, {NEW: "max_split_size_mb:64", OLD: "max_split_size_mb:64"}, {"@": "max_split_size_mb:64"}),
        (
            Plan(batch_size=8, micro_batch=1, allocator=EXPANDABLE_SEGMENTS, gradient_checkpointing=True),
            {},
            {"@": "expandable_segments:True"},
        ),
    ],
)
def test_process_environment(plan, env, expected):
    chosen = allocator.variable_for(allocator.installed_torch_version())
    expected = {(chosen if k == "@" else k): v for k, v in expected.items()}
    before = dict(env)
    assert rungs.process_environment(plan, env) == expected
    assert env == before


# Model side -------------------------------------------------------------------------------


@pytest.fixture
def one_thread():
    """A tiny model trains fastest on one thread, and far faster on a busy machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_unet():
    from diffusers import UNet2DModel

    return UNet2DModel(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )


@pytest.mark.parametrize("configure", [checkpoint_grades.configure, checkpointing.RUNG.configure_model, rungs.configure_model])
@pytest.mark.parametrize("on", [True, False])
def test_configure_model_turns_gradient_checkpointing_on(configure, on):
    model = tiny_unet()
    assert not model.is_gradient_checkpointing
    configure(Plan(batch_size=4, micro_batch=4, gradient_checkpointing=on), model)
    assert model.is_gradient_checkpointing is on


@pytest.mark.parametrize("module", [allocator, micro_batch])
def test_rungs_without_a_model_side_leave_the_model_alone(module):
    model = tiny_unet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    module.RUNG.configure_model(Plan(batch_size=4, micro_batch=1, allocator=EXPANDABLE_SEGMENTS, gradient_checkpointing=True), model)
    assert not model.is_gradient_checkpointing
    assert all((before[k] == v).all() for k, v in model.state_dict().items())


def test_checkpointing_is_exact_on_a_real_unet(one_thread):
    """The rung is exact: the same loss and gradients, with activations recomputed in backward."""
    import torch

    def loss_and_grads(on):
        torch.manual_seed(0)
        model = tiny_unet().train()
        checkpointing.RUNG.configure_model(Plan(batch_size=2, micro_batch=2, gradient_checkpointing=on), model)
        generator = torch.Generator().manual_seed(1)
        sample = torch.randn(2, 3, 16, 16, generator=generator)
        loss = model(sample, torch.tensor([3, 700])).sample.square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    plain_loss, plain_grads = loss_and_grads(False)
    ckpt_loss, ckpt_grads = loss_and_grads(True)
    torch.testing.assert_close(ckpt_loss, plain_loss)
    assert len(ckpt_grads) == len(plain_grads)
    for a, b in zip(ckpt_grads, plain_grads):
        torch.testing.assert_close(a, b)


# Declarations -----------------------------------------------------------------------------


@pytest.mark.parametrize("rung", rungs.ladder(), ids=lambda r: r.name)
def test_a_rungs_step_turns_its_declared_knob_and_only_that(rung):
    start = Plan.initial(16)
    if rung.step(start) is None:  # sharding: only with several processes
        start = Plan.initial(16, world_size=2)
    if rung.step(start) is None:  # base quantization: only under LoRA
        start = start.replace(lora_rank=16)
    new = rung.step(start)
    assert new is not None
    assert rung.get(new) != rung.get(start)
    assert rung.set(new, rung.get(start)) == start
    # A knob Plan has no field for is kept in Plan.extra.
    field = rung.knob if rung.knob in {f.name for f in dataclasses.fields(Plan)} else "extra"
    assert {f.name for f in dataclasses.fields(Plan) if getattr(new, f.name) != getattr(start, f.name)} == {field}
    # Once taken, a rung other than the batch one says so in the plan's one line.
    assert (rung.label(new) is not None) == (rung.role != "batch")
    assert (rung.choices is not None) == (rung.role == "batch")


def test_the_process_and_batch_rungs():
    assert [r.name for r in rungs.ladder() if r.role == "process"] == ["allocator"]
    assert [r.name for r in rungs.ladder() if r.cures_fragmentation] == ["allocator"]
    assert [r.name for r in rungs.ladder() if r.role == "batch"] == ["micro_batch"]
