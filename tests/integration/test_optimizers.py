"""The optimizers a Plan builds: AdamW, 8-bit AdamW, either offloaded to the host; one
checkpoint format (torch AdamW's) for all of them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from oomguard.jobs.device_memory import EmulatedDevice
from oomguard.jobs.memory_cap import DeviceMemory, HostMemory
from oomguard.jobs.quantized_optimizers import CODES_KEY
from oomguard.jobs.optimizers import HostOffloadedOptimizer, build_optimizer, device_state_tensors, load_portable_state_dict, portable_state_dict
from oomguard.strategies.plan import Plan
from tests.integration.test_adapters import tiny_unet

PLAIN = Plan.initial(2)
OFFLOAD = PLAIN.replace(offload="optimizer")
EIGHT_BIT = PLAIN.replace(optimizer="adamw8bit")
EIGHT_BIT_OFFLOAD = EIGHT_BIT.replace(offload="optimizer")
LR, WEIGHT_DECAY = 1e-2, 1e-2
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def NoDevice() -> DeviceMemory:
    """The runner's memory view without a cap: nothing is counted."""
    return HostMemory()


def without_key_biases(model: torch.nn.Module) -> torch.nn.Module:
    """Freeze attention key biases: their gradient is rounding noise that Adam blows up (the
    trainer zeroes it), so two exact implementations would drift apart there."""
    for name, p in model.named_parameters():
        if name.endswith("to_k.bias"):
            p.requires_grad_(False)
    return model


def mlp() -> torch.nn.Module:
    """Big enough (64x100 weights) for 8-bit moments; small enough to train in milliseconds."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(100, 64), torch.nn.SiLU(), torch.nn.Linear(64, 100))


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    if isinstance(model, torch.nn.Sequential):
        x = torch.randn(16, 100, generator=generator)
        return F.mse_loss(model(x), x.flip(-1))
    x = torch.randn(2, 3, 8, 8, generator=generator)
    return F.mse_loss(model(x, torch.tensor([10, 500])).sample, x)


def train(model, optimizer, steps, start=0, scheduler=None) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        loss = loss_of(model, step)
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def warmup(optimizer):
    from diffusers.optimization import get_scheduler

    return get_scheduler("constant_with_warmup", optimizer=optimizer, num_warmup_steps=3)


def weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same_weights(a, b, rtol=1e-6, atol=1e-7):
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=name)


# -- building ---------------------------------------------------------------------------------


@pytest.mark.parametrize("plan", [PLAIN, OFFLOAD, EIGHT_BIT, EIGHT_BIT_OFFLOAD], ids=["adamw", "offload", "8bit", "8bit-offload"])
def test_optimizes_the_trainable_parameters_in_named_order(plan):
    model = tiny_unet()
    frozen = {name for name, _ in list(model.named_parameters())[:5]}
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    optimizer = build_optimizer(plan, model, LR, WEIGHT_DECAY, NoDevice())
    trainable = [p for name, p in model.named_parameters() if name not in frozen]
    assert [p for group in optimizer.param_groups for p in group["params"]] == trainable
    assert optimizer.param_groups[0]["lr"] == LR and optimizer.param_groups[0]["weight_decay"] == WEIGHT_DECAY
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert isinstance(optimizer, HostOffloadedOptimizer) == (plan.offload == "optimizer")


def test_parameter_offload_is_not_built():
    with pytest.raises(ValueError, match="offload .params. is not available"):
        build_optimizer(PLAIN.replace(offload="params"), mlp(), LR, WEIGHT_DECAY, NoDevice())


# -- offload is exact ---------------------------------------------------------------------------


def test_offloaded_adamw_trains_the_weights_adamw_trains():
    reference, offloaded = without_key_biases(tiny_unet()), without_key_biases(tiny_unet())
    plain = build_optimizer(PLAIN, reference, LR, WEIGHT_DECAY, NoDevice())
    host = build_optimizer(OFFLOAD, offloaded, LR, WEIGHT_DECAY, NoDevice())
    # The warm-up schedule changes lr every step: the host update must see it.
    assert train(reference, plain, 5, scheduler=warmup(plain)) == pytest.approx(
        train(offloaded, host, 5, scheduler=warmup(host)), rel=1e-6
    )
    assert_same_weights(weights(reference), weights(offloaded))
    assert host.param_groups[0]["lr"] == plain.param_groups[0]["lr"] == LR


def test_offloaded_state_dict_is_adamws_and_round_trips():
    reference, offloaded = without_key_biases(tiny_unet()), without_key_biases(tiny_unet())
    plain = build_optimizer(PLAIN, reference, LR, WEIGHT_DECAY, NoDevice())
    host = build_optimizer(OFFLOAD, offloaded, LR, WEIGHT_DECAY, NoDevice())
    plain_scheduler, host_scheduler = warmup(plain), warmup(host)
    train(reference, plain, 2, scheduler=plain_scheduler)
    train(offloaded, host, 2, scheduler=host_scheduler)
    a, b = portable_state_dict(plain), host.state_dict()
    assert a.keys() == b.keys()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index in a["state"]:
        assert a["state"][index].keys() == b["state"][index].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in a["state"][index].items():
            assert (b["state"][index][key].dtype, b["state"][index][key].shape) == (value.dtype, value.shape)
            torch.testing.assert_close(b["state"][index][key], value, rtol=1e-6, atol=1e-9)

    # offloaded -> plain AdamW on a copy of the offloaded run's weights, and plain -> offloaded
    crossed = copy.deepcopy(offloaded)
    crossed_plain = build_optimizer(PLAIN, crossed, LR, WEIGHT_DECAY, NoDevice())
    load_portable_state_dict(crossed_plain, copy.deepcopy(b))
    host.load_state_dict(copy.deepcopy(a))
    assert host.param_groups[0]["lr"] == a["param_groups"][0]["lr"] < LR  # still warming up
    train(crossed, crossed_plain, 2, start=2)
    train(offloaded, host, 2, start=2)
    train(reference, plain, 2, start=2)
    assert_same_weights(weights(reference), weights(crossed))
    assert_same_weights(weights(reference), weights(offloaded))


def test_offloaded_state_stays_off_the_emulated_device():
    model = tiny_unet()
    with EmulatedDevice(None) as device:
        device.track(model.parameters())
        parameters = device.live_bytes
        optimizer = build_optimizer(OFFLOAD, model, LR, WEIGHT_DECAY, device)
        assert device.live_bytes == parameters
        train(model, optimizer, 2)
        assert device.live_bytes == parameters
        assert device_state_tensors(optimizer) == []
        optimizer.load_state_dict(optimizer.state_dict())
        assert device.live_bytes == parameters


def test_accelerate_prepares_and_steps_the_offloaded_and_8bit_optimizers():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    for plan in (OFFLOAD, EIGHT_BIT):
        model = tiny_unet()
        optimizer = build_optimizer(plan, model, LR, WEIGHT_DECAY, NoDevice())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        before = weights(model)
        loss = loss_of(model, 0)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        assert any(not torch.equal(before[k], v) for k, v in weights(model).items())
        assert (device_state_tensors(optimizer) == []) == (plan.offload == "optimizer")
        assert optimizer.state_dict()["state"][0].keys() == {"step", "exp_avg", "exp_avg_sq"}


# -- 8-bit ----------------------------------------------------------------------------------------


def test_8bit_state_is_a_quarter_and_the_loss_still_goes_down():
    sizes = {}
    for plan in (PLAIN, EIGHT_BIT):
        model = mlp()
        optimizer = build_optimizer(plan, model, LR, WEIGHT_DECAY, NoDevice())
        initial = loss_of(model, 0).item()
        for _ in range(10):
            train(model, optimizer, 1)  # the same batch each time: its loss must fall
        assert loss_of(model, 0).item() < 0.7 * initial
        sizes[plan.optimizer] = sum(t.untyped_storage().nbytes() for t in device_state_tensors(optimizer))
    assert sizes["adamw8bit"] <= 0.4 * sizes["adamw"]


def test_8bit_state_dict_holds_adamw_moments():
    model = mlp()
    optimizer = build_optimizer(EIGHT_BIT, model, LR, WEIGHT_DECAY, NoDevice())
    loss_of(model, 0).backward()
    gradients = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    state = optimizer.state_dict()
    reference = torch.optim.AdamW(mlp().parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    assert state["param_groups"][0].keys() == reference.state_dict()["param_groups"][0].keys()
    for index, gradient in enumerate(gradients):
        moments = state["state"][index]
        assert moments.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert moments["step"].item() == 1.0 and moments["exp_avg"].dtype == torch.float32
        # one step from zero: m = (1 - b1) g, v = (1 - b2) g^2, to 8-bit precision
        scale = gradient.abs().max()
        torch.testing.assert_close(moments["exp_avg"], 0.1 * gradient, atol=0.1 * scale * 0.02, rtol=0.05)
        torch.testing.assert_close(moments["exp_avg_sq"], 0.001 * gradient**2, atol=0.001 * scale**2 * 0.02, rtol=0.05)
    assert set(state[CODES_KEY]) == {0, 2}  # the two weight matrices; the biases keep fp32 moments


@pytest.mark.parametrize("plan", [EIGHT_BIT, EIGHT_BIT_OFFLOAD], ids=["device", "offload"])
def test_8bit_resumes_exactly_from_its_state_dict(plan):
    model = mlp()
    optimizer = build_optimizer(plan, model, LR, WEIGHT_DECAY, NoDevice())
    train(model, optimizer, 3)
    saved_model, saved_state = copy.deepcopy(model), copy.deepcopy(optimizer.state_dict())
    resumed = build_optimizer(plan, saved_model, LR, WEIGHT_DECAY, NoDevice())
    resumed.load_state_dict(saved_state)
    train(model, optimizer, 3, start=3)
    train(saved_model, resumed, 3, start=3)
    for name, value in weights(model).items():
        assert torch.equal(value, weights(saved_model)[name]), name


@pytest.mark.parametrize(("first", "then"), [(PLAIN, EIGHT_BIT), (EIGHT_BIT, PLAIN), (OFFLOAD, EIGHT_BIT_OFFLOAD), (EIGHT_BIT_OFFLOAD, PLAIN)])
def test_a_checkpoint_crosses_the_8bit_rung(first, then):
    model = mlp()
    optimizer = build_optimizer(first, model, LR, WEIGHT_DECAY, NoDevice())
    train(model, optimizer, 3)
    saved = optimizer.state_dict()
    continued = build_optimizer(then, model, LR, WEIGHT_DECAY, NoDevice())
    continued.load_state_dict(copy.deepcopy(saved))
    state = continued.state_dict()
    for index, moments in saved["state"].items():
        assert state["state"][index]["step"].item() == 3.0
        for key in ("exp_avg", "exp_avg_sq"):
            # 8-bit block-wise codes: within 2 % of each block's largest value
            tolerance = 0.02 * moments[key].abs().max().item()
            torch.testing.assert_close(state["state"][index][key], moments[key], atol=tolerance, rtol=0.05)
    before = loss_of(model, 0).item()
    for _ in range(5):
        train(model, continued, 1)
    assert loss_of(model, 0).item() < before


def test_device_state_tensors_lists_each_storage_once():
    model, other = mlp(), mlp()
    plain = build_optimizer(PLAIN, model, LR, WEIGHT_DECAY, NoDevice())
    eight = build_optimizer(EIGHT_BIT, other, LR, WEIGHT_DECAY, NoDevice())
    assert device_state_tensors(plain) == []
    train(model, plain, 1)
    assert len(device_state_tensors(plain)) == 3 * 4  # step, exp_avg, exp_avg_sq per parameter
    train(other, eight, 1)
    # weights: 2 codes + 2 absmax each; biases: 2 fp32 moments each; the two shared code maps once
    assert len(device_state_tensors(eight)) == 2 * 4 + 2 * 2 + 2
