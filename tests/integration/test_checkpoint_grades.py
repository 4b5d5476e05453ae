"""The checkpointing grades and activation offload on real diffusers UNets under the emulated
device: each computes the gradients plain training computes (exact), each saves activation
memory, deeper grades more, and a model switched between grades in process is the model of
the grade it was switched to."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from oomguard.jobs.host_activations import HostActivations
from oomguard.jobs.memory_cap import EmulatedMemory
from oomguard.jobs.sizes import CapSchedule
from oomguard.strategies import rungs
from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs import activation_offload, checkpoint_grades

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = Plan.initial(4)
GRADES = {grade: checkpoint_grades.with_grade(BASE, grade) for grade in checkpoint_grades.GRADES}
OFFLOADED = activation_offload.step(BASE)


def conditional_unet() -> torch.nn.Module:
    """A text-to-image UNet: cross-attention transformer blocks, with feed-forward layers."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        block_out_channels=(16, 32), layers_per_block=1, sample_size=16, in_channels=4, out_channels=4, norm_num_groups=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=16, attention_head_dim=4,
    )


def unconditional_unet() -> torch.nn.Module:
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    return UNet2DModel(
        sample_size=16, block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=4,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )


def train_step(model: torch.nn.Module, plan: Plan, conditional: bool) -> tuple[int, dict[str, torch.Tensor]]:
    """Forward and backward of one batch under ``plan`` on an unlimited emulated device: the
    activation peak (above the weights) and the gradients."""
    generator = torch.Generator().manual_seed(1)
    memory = EmulatedMemory(CapSchedule(((0, 64 << 30),)))
    with memory:
        memory.track(model.parameters())
        model.zero_grad(set_to_none=True)
        inputs = torch.randn(4, 4 if conditional else 3, 16, 16, generator=generator)
        timesteps = torch.randint(0, 1000, (4,), generator=generator)
        target = torch.randn(inputs.shape, generator=generator)
        start = memory.live_bytes()
        memory.reset_peak()
        with rungs.saved_activations(plan, memory, model):
            if conditional:
                text = torch.randn(4, 7, 16, generator=generator)
                prediction = model(inputs, timesteps, encoder_hidden_states=text).sample
            else:
                prediction = model(inputs, timesteps).sample
        F.mse_loss(prediction, target).backward()
        peak = memory.peak_bytes() - start
    return peak, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("conditional", [True, False], ids=["text-to-image UNet", "UNet2DModel"])
def test_every_grade_is_exact_and_deeper_grades_save_more(conditional):
    model = conditional_unet() if conditional else unconditional_unet()
    peaks = {}
    plain_peak, plain = train_step(model, BASE, conditional)
    for grade, plan in GRADES.items():
        if grade == "ff" and not conditional:
            continue
        rungs.configure_model(plan, model)
        peaks[grade], gradients = train_step(model, plan, conditional)
        for name, gradient in plain.items():
            torch.testing.assert_close(gradients[name], gradient, rtol=1e-5, atol=1e-7, msg=f"{grade}: {name}")
    assert peaks["none"] == plain_peak
    # Each grade saves, and the next saves more.
    graded = [peaks[g] for g in checkpoint_grades.GRADES if g in peaks]
    assert graded == sorted(graded, reverse=True) and len(set(graded)) == len(graded), peaks


def test_activation_offload_is_exact_and_saves_most_of_the_activations():
    model = conditional_unet()
    plain_peak, plain = train_step(model, BASE, True)
    offloaded_peak, gradients = train_step(model, OFFLOADED, True)
    for name, gradient in plain.items():
        torch.testing.assert_close(gradients[name], gradient, rtol=1e-5, atol=1e-7, msg=name)
    assert offloaded_peak < 0.6 * plain_peak, (offloaded_peak, plain_peak)
    # With whole blocks checkpointed, only their inputs are saved: offloading them too saves more.
    rungs.configure_model(GRADES["blocks"], model)
    blocks_peak, _ = train_step(model, GRADES["blocks"], True)
    both = activation_offload.step(GRADES["blocks"])
    both_peak, gradients = train_step(model, both, True)
    assert both_peak < blocks_peak
    for name, gradient in plain.items():
        torch.testing.assert_close(gradients[name], gradient, rtol=1e-5, atol=1e-7, msg=name)


def test_host_activations_leave_the_weights_where_they_are():
    model = conditional_unet()
    memory = EmulatedMemory(CapSchedule(((0, 64 << 30),)))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packed_weights = []
    with memory:
        hooks = HostActivations(memory, model)
        pack = hooks.pack_hook
        for parameter in model.parameters():
            if parameter.numel() * parameter.element_size() >= 1024:
                packed_weights.append(pack(parameter))
        activation = torch.randn(64, 64)
        device, host = pack(activation)
    assert all(isinstance(p, torch.Tensor) and p.untyped_storage().data_ptr() in weights for p in packed_weights)
    assert host.untyped_storage().data_ptr() != activation.untyped_storage().data_ptr()
    assert torch.equal(host, activation)


def test_grades_switch_in_process_both_ways():
    model = conditional_unet()
    blocks = checkpoint_grades.checkpointable_blocks(model)
    feed_forwards = checkpoint_grades.feed_forward_layers(model)
    assert len(blocks) >= 4 and feed_forwards

    def state() -> tuple[list[bool], list[bool]]:
        return [b.gradient_checkpointing for b in blocks], ["forward" in f.__dict__ for f in feed_forwards]

    for grade in ("blocks", "ff", "alternate", "none", "ff", "blocks", "none"):
        rungs.configure_model(GRADES[grade], model)
        flags, wrapped = state()
        assert wrapped == [grade == "ff"] * len(feed_forwards), grade
        if grade == "blocks":
            assert all(flags)
        elif grade == "alternate":
            assert flags == [index % 2 == 0 for index in range(len(blocks))]
        else:
            assert not any(flags), grade


def test_feed_forward_grade_refuses_a_model_without_feed_forward_layers():
    model = unconditional_unet()
    with pytest.raises(ValueError, match="no feed-forward layers.*checkpoint_alternate"):
        rungs.configure_model(GRADES["ff"], model)
