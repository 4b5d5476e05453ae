"""The optimizer step inside backward (rung fused_backward) on a real diffusers UNet: the weights
of torch's AdamW after the same steps, a step's peak without the full set of gradients, and
checkpoints that move between the two optimizers both ways."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from oomguard.jobs.fused_backward import FusedBackwardOptimizer
from oomguard.jobs.memory_cap import EmulatedMemory
from oomguard.jobs.optimizers import build_optimizer, load_portable_state_dict, portable_state_dict
from oomguard.jobs.sizes import CapSchedule
from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs import fused_backward

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PLAIN = Plan.initial(2)
FUSED = fused_backward.step(PLAIN)
LR = 1e-2


def unet() -> torch.nn.Module:
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    return UNet2DModel(
        sample_size=8, block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=4,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range, memory: EmulatedMemory | None = None) -> list[int]:
    """Steps of batch 2 (drawn from the step number); the peak of each, where ``memory`` counts."""
    # The schedule where a resumed run takes it up.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + steps.start + step))
    peaks = []
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        sample = torch.randn(2, 3, 8, 8, generator=generator)
        if memory is not None:
            memory.reset_peak()
        F.mse_loss(model(sample, torch.tensor([10, 500])).sample, sample).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if memory is not None:
            peaks.append(memory.peak_bytes())
    return peaks


def built(plan: Plan) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = unet()
    return model, build_optimizer(plan, model, LR, 1e-2, memory=None)


def test_the_step_in_backward_trains_adamws_weights_on_less_memory():
    plain_model, plain_optimizer = built(PLAIN)
    fused_model, fused_optimizer = built(FUSED)
    assert isinstance(fused_optimizer, FusedBackwardOptimizer) and not isinstance(plain_optimizer, FusedBackwardOptimizer)
    peaks = {}
    for name, model, optimizer in (("plain", plain_model, plain_optimizer), ("fused", fused_model, fused_optimizer)):
        memory = EmulatedMemory(CapSchedule(((0, 64 << 30),)))
        with memory:
            memory.track(model.parameters())
            peaks[name] = train(model, optimizer, range(3), memory)
    for (name, a), b in zip(plain_model.named_parameters(), fused_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)
    gradients = sum(p.numel() * p.element_size() for p in plain_model.parameters())
    # From the second step on the optimizer state exists in both; the plain step also holds every
    # gradient at once, the fused one the gradients of the tensors backward has not reached.
    assert peaks["plain"][-1] - peaks["fused"][-1] > 0.5 * gradients, (peaks, gradients)
    print(f"peak of a step: {peaks['plain'][-1] / 2**20:.2f} MiB plain, {peaks['fused'][-1] / 2**20:.2f} MiB fused; gradients {gradients / 2**20:.2f} MiB")


@pytest.mark.parametrize(("first", "then"), [(FUSED, PLAIN), (PLAIN, FUSED)], ids=["fused-then-plain", "plain-then-fused"])
def test_a_checkpoint_moves_between_the_two_optimizers(first, then):
    reference_model, reference_optimizer = built(PLAIN)
    train(reference_model, reference_optimizer, range(4))

    model, optimizer = built(first)
    train(model, optimizer, range(2))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = portable_state_dict(optimizer)

    resumed_model, resumed_optimizer = built(then)
    resumed_model.load_state_dict(weights)
    load_portable_state_dict(resumed_optimizer, state)
    train(resumed_model, resumed_optimizer, range(2, 4))
    for (name, a), b in zip(reference_model.named_parameters(), resumed_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


def test_zero_gradient_parameters_are_zeroed_before_their_update():
    model, optimizer = built(FUSED)
    frozen_bias = model.conv_out.bias
    before = frozen_bias.detach().clone()
    optimizer.zero_first([frozen_bias])
    # Weight decay moves a zeroed parameter a little; a gradient left in would move it more.
    optimizer.param_groups[0]["weight_decay"] = 0.0
    train(model, optimizer, range(1))
    torch.testing.assert_close(frozen_bias.detach(), before)
