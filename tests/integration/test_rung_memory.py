"""What each memory rung saves, measured: real training steps of a small diffusers UNet (the
quickstart's: channels 32/64, attention in the down, mid and up blocks) under the emulated
device, with and without the rung. Asserts which consumer shrinks and by how much; the time
each rung adds is only reported (a table at the end of the module).

Two workloads, as the rungs target different consumers: rungs against activations run a
micro-batch of 4 at 32x32, where activations dominate; rungs against weights, gradients and
optimizer state run a micro-batch of 1 at 16x16, where the static memory dominates (as when a
big model is fine-tuned), for two steps so that the second starts with the optimizer state.
Memory is that of the last step; time is the faster of two more steps, without the emulation.
Also: the rungs' Plan steps, and that the attention rung computes what the model computes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from oomguard.jobs.adapters import apply_lora, quantize_base
from oomguard.jobs.device_memory import EmulatedDevice
from oomguard.jobs.optimizers import build_optimizer, device_state_tensors
from oomguard.jobs.precision import resolve_mixed_precision
from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs import attention, base_quantization, checkpointing, exact_names, lora, names, offload, optimizer_8bit, precision, usable_by

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The rungs a job of the unconditional trainer can take (the frozen-part rungs are a
# text-to-image job's: JobSpec.features).
UNCONDITIONAL = frozenset({"full_model"})
RUNG_NAMES, EXACT_RUNG_NAMES = usable_by(UNCONDITIONAL), usable_by(UNCONDITIONAL, exact_names())

MiB = 2**20
UNET = dict(
    block_out_channels=[32, 64],
    layers_per_block=1,
    down_block_types=["DownBlock2D", "AttnDownBlock2D"],
    up_block_types=["AttnUpBlock2D", "UpBlock2D"],
    norm_num_groups=8,
)
BASE = Plan.initial(4)
LORA = BASE.replace(lora_rank=lora.DEFAULT_LORA_RANK)


@dataclass(frozen=True)
class Workload:
    micro_batch: int
    resolution: int
    steps: int


ACTIVATIONS = Workload(micro_batch=4, resolution=32, steps=1)
STATIC = Workload(micro_batch=1, resolution=16, steps=2)


def build_unet(plan: Plan, resolution: int = 32) -> torch.nn.Module:
    """The model as a runner would configure it for ``plan`` (seeded: every call is the same)."""
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    model = UNet2DModel(sample_size=resolution, **UNET)
    if plan.lora_rank is not None:
        apply_lora(model, plan.lora_rank)
    if plan.base_quantization is not None:
        quantize_base(model, plan.base_quantization)
    attention.configure_model(plan, model)
    checkpointing.RUNG.configure_model(plan, model)
    return model


def batch(step: int, size: int = 4, resolution: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    images = torch.randn(size, 3, resolution, resolution, generator=generator)
    noise = torch.randn(images.shape, generator=generator)
    timesteps = torch.randint(0, 1000, (size,), generator=generator)
    return images, noise, timesteps


def storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None:
            seen[id(t.untyped_storage())] = t.untyped_storage().nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class StepMemory:
    """The last training step of a workload, in bytes."""

    peak: int  # the whole step: forward, backward, optimizer
    parameters: int
    gradients: int  # at the end of backward
    optimizer_state: int  # on the device, after the step
    activations: int  # forward+backward peak above what the step started with (params, state)
    seconds: float  # a step without the emulated device
    losses: tuple[float, ...]


def measure(plan: Plan, workload: Workload) -> StepMemory:
    """Peak and consumers of a training step under ``plan`` on an unlimited emulated device,
    then the time of a step without it (the emulation costs Python work per op, which would
    penalise implementations that use more, smaller ops)."""
    model = build_unet(plan, workload.resolution)
    model.train()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=plan.mixed_precision != "no")
    device = EmulatedDevice(None)
    optimizer: torch.optim.Optimizer | None = None

    def train_step(step: int) -> float:
        images, noise, timesteps = batch(step, workload.micro_batch, workload.resolution)
        noisy = images + noise  # made on the device, like the runner's copy of the batch
        with autocast:
            prediction = model(noisy, timesteps).sample
        loss = F.mse_loss(prediction.float(), noise)
        loss.backward()
        nonlocal forward_backward_peak, gradients
        forward_backward_peak = device.peak_bytes
        gradients = storage_bytes(p.grad for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    forward_backward_peak = gradients = 0
    losses = []
    with device:
        device.track(model.parameters())
        optimizer = build_optimizer(plan, model, lr=1e-3, weight_decay=1e-2, memory=device)
        for step in range(workload.steps):
            device.reset_peak()
            start_bytes = device.live_bytes
            losses.append(train_step(step))
        memory = dict(
            peak=device.peak_bytes,
            parameters=storage_bytes(model.parameters()),
            gradients=gradients,
            optimizer_state=storage_bytes(device_state_tensors(optimizer)),
            activations=forward_backward_peak - start_bytes,
        )
    times = []
    for step in range(workload.steps, workload.steps + 2):
        started = time.perf_counter()
        train_step(step)
        times.append(time.perf_counter() - started)
    return StepMemory(**memory, seconds=min(times), losses=tuple(losses))


_measured: dict[tuple[Plan, Workload], StepMemory] = {}
_rows: list[tuple[str, StepMemory, StepMemory]] = []


def measured(plan: Plan, workload: Workload) -> StepMemory:
    if (plan, workload) not in _measured:
        _measured[plan, workload] = measure(plan, workload)
    return _measured[plan, workload]


def compare(name: str, without: Plan, with_rung: Plan, workload: Workload) -> tuple[StepMemory, StepMemory]:
    a, b = measured(without, workload), measured(with_rung, workload)
    _rows.append((name, a, b))
    return a, b


@pytest.fixture(scope="module", autouse=True)
def report(request):
    yield
    if not _rows:
        return
    lines = [
        "",
        "MiB, s/step              peak without -> with  activ.  params  grads  optim.   s/step without -> with",
    ]
    for name, a, b in _rows:
        lines.append(
            f"{name:<24} {a.peak / MiB:7.1f} -> {b.peak / MiB:7.1f}"
            f"   {(b.activations - a.activations) / MiB:+6.1f} {(b.parameters - a.parameters) / MiB:+7.1f}"
            f" {(b.gradients - a.gradients) / MiB:+6.1f} {(b.optimizer_state - a.optimizer_state) / MiB:+7.1f}"
            f"   {a.seconds:6.3f} -> {b.seconds:6.3f} ({b.seconds / a.seconds - 1:+.0%})"
        )
    # Output is captured during teardown too: shown only with the capture lifted.
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if capture is not None and reporter is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line("\n".join(lines))


# -- what each rung saves ---------------------------------------------------------------------


def test_attention_rung_saves_activations_only():
    a, b = compare("attention", BASE, attention.step(BASE), ACTIVATIONS)
    assert (b.parameters, b.gradients, b.optimizer_state) == (a.parameters, a.gradients, a.optimizer_state)
    # About seven block-sized tensors in each of the four attention blocks: 20 % here.
    assert a.activations - b.activations > 0.15 * a.activations
    assert a.peak - b.peak == a.activations - b.activations
    assert b.losses == pytest.approx(a.losses, rel=1e-5)


def test_offload_rung_moves_the_optimizer_state_off_the_device():
    a, b = compare("offload", BASE, offload.step(BASE), STATIC)
    assert a.optimizer_state >= 2 * a.parameters  # AdamW: two moments per weight
    assert b.optimizer_state == 0
    assert (b.parameters, b.gradients) == (a.parameters, a.gradients)
    assert a.peak - b.peak >= a.optimizer_state * 0.95
    assert b.losses == pytest.approx(a.losses, rel=1e-6)


def test_precision_rung_halves_activations():
    a, b = compare("precision", BASE, precision.step(BASE), ACTIVATIONS)
    assert (b.gradients, b.optimizer_state) == (a.gradients, a.optimizer_state)
    assert b.activations < 0.7 * a.activations
    assert a.peak - b.peak > 10 * MiB
    assert b.losses == pytest.approx(a.losses, rel=0.05)


def test_optimizer_8bit_rung_shrinks_the_optimizer_state():
    a, b = compare("optimizer_8bit", BASE, optimizer_8bit.step(BASE), STATIC)
    assert (b.parameters, b.gradients) == (a.parameters, a.gradients)
    assert b.optimizer_state <= 0.4 * a.optimizer_state
    assert a.peak - b.peak >= 0.5 * a.optimizer_state
    assert b.losses[0] == pytest.approx(a.losses[0])  # the first forward is before any update


def test_lora_rung_shrinks_gradients_and_optimizer_state():
    a, b = compare("lora", BASE, lora.step(BASE), STATIC)
    # The frozen base stays, the adapters add to it; what goes is the base's gradients and moments.
    assert b.parameters > a.parameters
    assert b.gradients < 0.5 * a.gradients
    assert b.optimizer_state < 0.5 * a.optimizer_state
    assert a.peak - b.peak > 2 * MiB


@pytest.mark.parametrize(("kind", "at_most"), [("int8", 0.5), ("nf4", 0.3)])
def test_base_quantization_rung_shrinks_the_frozen_base(kind, at_most):
    plan = LORA
    while plan.base_quantization != kind:
        plan = base_quantization.step(plan)
    a, b = compare(f"base_quantization {kind}", LORA, plan, STATIC)
    lora_model = build_unet(LORA, STATIC.resolution)
    adapters = storage_bytes(p for p in lora_model.parameters() if p.requires_grad)
    base_before, base_after = a.parameters - adapters, b.parameters - adapters
    assert base_after <= at_most * base_before
    assert (b.gradients, b.optimizer_state) == (a.gradients, a.optimizer_state)
    assert a.peak - b.peak >= 0.9 * (base_before - base_after)


def test_nf4_base_is_smaller_than_int8():
    int8 = measured(LORA.replace(base_quantization="int8"), STATIC)
    nf4 = measured(LORA.replace(base_quantization="nf4"), STATIC)
    assert nf4.parameters < int8.parameters


def test_every_rung_at_once_still_trains():
    plan = BASE
    for rung in (checkpointing, attention, offload, precision, optimizer_8bit, lora, base_quantization, base_quantization):
        plan = rung.RUNG.step(plan)
    assert plan.short() == "mb=4x1 ckpt attn=sliced offload=optimizer bf16 adamw8bit lora=16 base=nf4"
    result = measure(plan, STATIC)
    assert result.optimizer_state == 0
    assert all(math.isfinite(loss) for loss in result.losses)
    assert result.peak < 0.6 * measured(BASE, STATIC).peak


# -- the attention rung is exact -----------------------------------------------------------------


def test_checkpointed_attention_matches_the_default_forward_and_backward():
    default, sliced = build_unet(BASE, 16), build_unet(attention.step(BASE), 16)
    images, noise, timesteps = batch(0, 2, 16)
    grads = []
    for model in (default, sliced):
        prediction = model(images + noise, timesteps).sample
        F.mse_loss(prediction, noise).backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
        with torch.no_grad():
            assert torch.allclose(model(images, timesteps).sample, default(images, timesteps).sample, atol=1e-6)
    for name, grad in grads[0].items():
        assert torch.allclose(grads[1][name], grad, rtol=1e-5, atol=1e-7), name


def test_attention_configure_model_is_idempotent_and_reversible():
    from diffusers.models.attention_processor import Attention

    model = build_unet(BASE, 16)
    before = [type(m.processor) for m in model.modules() if isinstance(m, Attention)]
    attention.configure_model(BASE, model)
    assert [type(m.processor) for m in model.modules() if isinstance(m, Attention)] == before
    sliced = attention.step(BASE)
    attention.configure_model(sliced, model)
    attention.configure_model(sliced, model)
    processors = [m.processor for m in model.modules() if isinstance(m, Attention)]
    assert len(processors) == 4
    assert all(isinstance(p, attention.CheckpointedAttention) for p in processors)
    assert all(not isinstance(p.inner, attention.CheckpointedAttention) for p in processors)
    attention.configure_model(BASE, model)  # stepping back up restores the as-built processors
    assert [type(m.processor) for m in model.modules() if isinstance(m, Attention)] == before


# -- the rungs' Plan steps ----------------------------------------------------------------------------


def walk(step, plan):
    plans = [plan]
    while (plan := step(plan)) is not None:
        plans.append(plan)
        assert len(plans) < 10
    return plans


@pytest.mark.parametrize(
    ("module", "name", "field", "values", "restart"),
    [
        (attention, "attention", "attention", ["default", "sliced"], False),
        (offload, "offload", "offload", ["none", "optimizer"], True),
        (precision, "precision", "mixed_precision", ["no", "bf16"], True),
        (optimizer_8bit, "optimizer_8bit", "optimizer", ["adamw", "adamw8bit"], True),
        (lora, "lora", "lora_rank", [None, lora.DEFAULT_LORA_RANK], True),
    ],
)
def test_rung_steps(module, name, field, values, restart):
    rung = module.RUNG
    assert (rung.name, rung.needs_restart, rung.exact) == (name, restart, name in EXACT_RUNG_NAMES)
    assert name in RUNG_NAMES
    plans = walk(rung.step, BASE)
    assert [getattr(p, field) for p in plans] == values
    new = plans[-1]
    assert new.replace(**{field: getattr(BASE, field)}) == BASE  # nothing else changed
    assert rung.describe(BASE, new)


def test_base_quantization_steps_only_under_lora():
    rung = base_quantization.RUNG
    assert (rung.name, rung.exact, rung.needs_restart) == ("base_quantization", False, True)
    assert rung.step(BASE) is None
    assert [p.base_quantization for p in walk(rung.step, LORA)] == [None, "int8", "nf4"]
    assert "int8" in rung.describe(LORA, rung.step(LORA))


@pytest.mark.parametrize("already", ["bf16", "fp16"])
def test_precision_has_nothing_more_for_half_precision_plans(already):
    assert precision.step(BASE.replace(mixed_precision=already)) is None


def test_offload_never_produces_parameter_offload():
    assert offload.step(BASE.replace(offload="params")) is None
    assert "params" not in [p.offload for p in walk(offload.step, BASE)]


@pytest.mark.parametrize(
    ("requested", "expected"), [("no", "no"), ("bf16", "bf16"), ("fp16", "bf16")]
)
def test_mixed_precision_on_the_cpu(requested, expected):
    assert resolve_mixed_precision(requested, torch.device("cpu")) == expected


def test_mixed_precision_rejects_unknown_values():
    with pytest.raises(ValueError, match="fp8"):
        resolve_mixed_precision("fp8", torch.device("cpu"))
