import gc
import io
import re

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from oomguard.jobs.cuda_oom import OOMInfo, cuda_oom_message
from oomguard.jobs.device_memory import EmulatedDevice, limit_cuda_memory
from oomguard.jobs.sizes import CapSchedule
from oomguard.strategies.units import format_torch_size

KiB, MiB = 1024, 1024**2

_SIZE = r"\d+(?:\.\d\d)? (?:bytes|KiB|MiB|GiB)"
CUDA_OOM_RE = re.compile(
    rf"CUDA out of memory\. Tried to allocate (?P<requested>{_SIZE})\. "
    rf"GPU (?P<device>\d+) has a total capacity of (?P<total>{_SIZE}) of which (?P<free>{_SIZE}) is free\. "
    rf"Including non-PyTorch memory, this process has (?P<in_use>{_SIZE}) memory in use\. "
    rf"Of the allocated memory (?P<allocated>{_SIZE}) is allocated by PyTorch, "
    rf"and (?P<unallocated>{_SIZE}) is reserved by PyTorch but unallocated\. "
    r"If reserved but unallocated memory is large try setting "
    r"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation\.  "
    r"See documentation for Memory Management  "
    r"\(https://pytorch\.org/docs/stable/notes/cuda\.html#environment-variables\)"
)


def mlp(width: int = 64, depth: int = 2, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def nbytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


# -- counting ------------------------------------------------------------------------


def test_counts_live_and_peak_bytes_of_new_storages_exactly():
    with EmulatedDevice(None) as dev:
        assert dev.live_bytes == 0
        a = torch.zeros(1024)  # 4096 bytes
        assert dev.live_bytes == 4096
        b = torch.ones(256, dtype=torch.float64)  # 2048 bytes
        assert dev.live_bytes == 6144
        c = a + 1
        assert dev.live_bytes == 10240
        del c
        assert dev.live_bytes == 6144
        assert dev.peak_bytes == 10240
        dev.reset_peak()
        assert dev.peak_bytes == 6144
        d = torch.arange(10, dtype=torch.int16)  # 20 bytes
        assert (dev.live_bytes, dev.peak_bytes) == (6164, 6164)
    del a, b, d
    assert dev.live_bytes == 0


def test_views_inplace_and_aliasing_ops_are_not_counted_again():
    with EmulatedDevice(None) as dev:
        a = torch.zeros(4, 256)
        assert dev.live_bytes == 4096
        views = [a[1], a.t(), a.view(-1), a.detach(), a.expand(2, 4, 256), a.reshape(1024)]
        views += a.split(2)
        a.add_(1)
        a.mul_(2)
        torch.add(a, 1, out=a)
        a[0] = 5.0
        unsafe = torch.ops.aten._unsafe_view(a, (1024,))  # no alias annotation, shares storage
        assert dev.live_bytes == 4096
        assert unsafe.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
        del views, unsafe


def test_nested_outputs_are_counted():
    with EmulatedDevice(None) as dev:
        x = torch.randn(1024)  # 4096
        values, indices = torch.sort(x)  # float32 + int64
        assert dev.live_bytes == 4096 + 4096 + 8192
        pair = torch._foreach_add([x, x], 1.0)  # a list of two new tensors
        assert dev.live_bytes == 16384 + 2 * 4096
        del values, indices, pair


def test_out_argument_growing_a_tracked_storage_is_counted():
    with EmulatedDevice(None) as dev:
        x = torch.randn(1024)
        out = torch.empty(0)
        assert dev.live_bytes == 4096
        torch.add(x, 1, out=out)  # resizes out's storage from 0 to 4096 bytes
        assert dev.live_bytes == 8192


def test_storage_released_when_its_last_tensor_dies_and_not_earlier():
    with EmulatedDevice(None) as dev:
        a = torch.zeros(1024)
        view = a[:10]
        storage = a.untyped_storage()
        del a
        gc.collect()
        assert dev.live_bytes == 4096  # the view still holds the storage
        del view
        assert dev.live_bytes == 4096  # so does the storage object
        del storage
        assert dev.live_bytes == 0
        assert dev.peak_bytes == 4096


def test_storages_are_still_released_after_exit_and_ops_no_longer_counted():
    with EmulatedDevice(None) as dev:
        a = torch.zeros(1024)
    b = a * 2
    assert dev.live_bytes == 4096
    del a
    assert dev.live_bytes == 0
    del b


def test_track_counts_existing_tensors_once():
    model = mlp(width=32)
    params = list(model.parameters())
    param_bytes = nbytes(params)
    dev = EmulatedDevice(None)
    with dev:
        model[0].weight.t()  # a view of an untracked parameter: nothing is counted
        assert dev.live_bytes == 0
        assert dev.track(params) == param_bytes
        assert dev.track(params) == 0
        assert dev.track([None, params[0], params[0][0]]) == 0  # views share the storage
        assert dev.live_bytes == param_bytes
    assert dev.peak_bytes == param_bytes


def test_track_never_raises_even_over_capacity():
    big = torch.zeros(4096)
    dev = EmulatedDevice(capacity=1024)
    assert dev.track([big]) == 16384
    assert dev.live_bytes == 16384
    with dev, pytest.raises(torch.OutOfMemoryError):
        torch.zeros(1)  # the next allocation fails, as on a device that is already full
    assert dev.oom_count == 1


def test_torch_load_makes_storages_outside_dispatch_so_they_need_track():
    model = mlp(width=32)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    with EmulatedDevice(None) as dev:
        state = torch.load(buffer)
        assert dev.live_bytes == 0  # storages come from the unpickler and are attached by set_
        assert dev.track(state.values()) == nbytes(model.parameters())


def test_paused_ops_are_not_counted_but_tracked_storages_still_die():
    with EmulatedDevice(None) as dev:
        kept = torch.zeros(1024)
        with dev.paused():
            host = torch.randn(4096)
            del kept
            with dev.paused():  # nests
                torch.randn(10)
        assert dev.live_bytes == 0
        after = host * 2  # a new storage from an uncounted input is counted
        assert dev.live_bytes == 16384
        del after


def test_capacity_must_be_positive_bytes_or_none():
    with pytest.raises(ValueError):
        EmulatedDevice(0)
    dev = EmulatedDevice(None)
    with pytest.raises(ValueError):
        dev.capacity = -1
    with pytest.raises(TypeError):
        dev.capacity = 1.5  # type: ignore[assignment]
    dev.capacity = 10
    dev.capacity = None
    assert dev.capacity is None


def test_cannot_enter_twice():
    dev = EmulatedDevice(None)
    with dev:
        with pytest.raises(RuntimeError, match="already active"):
            dev.__enter__()


# -- out of memory -------------------------------------------------------------------


def test_oom_message_is_pytorchs_cuda_wording_exactly():
    with EmulatedDevice(48 * MiB) as dev:
        held = torch.empty(45 * MiB, dtype=torch.uint8)
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.empty(20 * MiB, dtype=torch.uint8)
        del held
    assert str(info.value) == (
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 48.00 MiB "
        "of which 3.00 MiB is free. Including non-PyTorch memory, this process has 45.00 MiB memory "
        "in use. Of the allocated memory 45.00 MiB is allocated by PyTorch, and 0 bytes is reserved "
        "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation "
        "for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )
    assert dev.last_oom == OOMInfo(
        requested=20 * MiB,
        allocated=45 * MiB,
        reserved=45 * MiB,
        free=3 * MiB,
        total=48 * MiB,
        breakdown={"activations": 45 * MiB},
        message=str(info.value),
    )
    assert isinstance(info.value, RuntimeError)  # what generic handlers catch


def test_capacity_below_live_bytes_fails_the_next_allocation_with_nothing_free():
    with EmulatedDevice(None) as dev:
        held = torch.zeros(2048)  # 8 KiB
        dev.capacity = 4 * KiB  # another process took memory meanwhile
        with pytest.raises(torch.OutOfMemoryError, match="of which 0 bytes is free"):
            torch.zeros(1, dtype=torch.uint8)
        del held
    assert (dev.last_oom.requested, dev.last_oom.allocated, dev.last_oom.free) == (1, 8 * KiB, 0)


def test_growing_an_out_argument_past_capacity_raises():
    with EmulatedDevice(5 * KiB) as dev:
        x = torch.randn(1024)
        out = torch.empty(0)
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 4.00 KiB"):
            torch.add(x, 1, out=out)
        assert dev.live_bytes == 4096


def test_oom_message_names_the_device_index():
    message = cuda_oom_message(
        requested=2048, total=4096, free=1024, allocated=3072, reserved=3072, device_index=3
    )
    match = CUDA_OOM_RE.fullmatch(message)
    assert match is not None
    assert match["device"] == "3"
    assert (match["requested"], match["free"], match["unallocated"]) == ("2.00 KiB", "1024 bytes", "0 bytes")


def test_forward_backward_under_too_small_cap_raises_cuda_style_oom():
    model = mlp(width=128, depth=3)
    params = list(model.parameters())
    param_bytes = nbytes(params)
    dev = EmulatedDevice(param_bytes + 96 * KiB, groups=lambda: {"params": params})
    dev.track(params)
    with dev:
        x = torch.randn(64, 128)  # 32 KiB; each layer output is another 32 KiB
        with pytest.raises(torch.OutOfMemoryError) as info:
            model(x).square().mean().backward()
        live_after = dev.live_bytes
    oom = dev.last_oom
    assert oom is not None and dev.oom_count == 1
    match = CUDA_OOM_RE.fullmatch(str(info.value))
    assert match is not None, str(info.value)
    assert oom.message == str(info.value)
    assert match["requested"] == format_torch_size(oom.requested)
    assert match["total"] == format_torch_size(oom.total)
    assert match["free"] == format_torch_size(oom.free)
    assert match["allocated"] == match["in_use"] == format_torch_size(oom.allocated)
    assert oom.total == param_bytes + 96 * KiB
    assert oom.requested > oom.free
    assert oom.allocated + oom.requested > oom.total
    assert oom.reserved == oom.allocated
    assert oom.free == oom.total - oom.allocated
    assert oom.breakdown["params"] == param_bytes
    assert sum(oom.breakdown.values()) == oom.allocated
    # The refused outputs were never counted; the op's partial results are gone.
    assert live_after <= oom.allocated
    assert dev.peak_bytes <= oom.total


def test_oom_in_backward_is_raised_from_backward():
    model = mlp(width=128, depth=2)
    params = list(model.parameters())
    dev = EmulatedDevice(None)
    dev.track(params)
    with dev:
        loss = model(torch.randn(64, 128)).sum()
        dev.capacity = dev.live_bytes + 1024  # the forward fits; gradients do not
        with pytest.raises(torch.OutOfMemoryError, match=r"^CUDA out of memory\. Tried to allocate"):
            loss.backward()
    assert dev.oom_count == 1
    assert all(p.grad is None for p in params[:2])  # the first layer's grads never materialized


def test_breakdown_by_group_counts_each_storage_once():
    model = mlp(width=64, depth=2)
    params = list(model.parameters())
    param_bytes = nbytes(params)
    dev = EmulatedDevice(
        None,
        groups=lambda: {
            "params": params,
            "grads": [p.grad for p in params],
            "params again": params,  # already claimed by "params"
        },
    )
    dev.track(params)
    with dev:
        x = torch.randn(32, 64)
        model(x).sum().backward()
        assert dev.live_bytes == 2 * param_bytes + x.nbytes
        dev.capacity = dev.live_bytes + 16
        with pytest.raises(torch.OutOfMemoryError):
            model(x)
    assert dev.last_oom.breakdown == {
        "params": param_bytes,
        "grads": param_bytes,
        "params again": 0,
        "activations": x.nbytes,
    }


# -- training --------------------------------------------------------------------------


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    return loss.item()


def test_adam_training_under_a_generous_cap():
    model = mlp(width=128, depth=3)
    params = list(model.parameters())
    param_bytes = nbytes(params)
    optimizer = torch.optim.Adam(params, lr=1e-3)
    x = torch.randn(32, 128)
    dev = EmulatedDevice(64 * MiB)
    dev.track([*params, x])
    with dev:
        losses = [train_step(model, optimizer, x) for _ in range(5)]
    assert dev.oom_count == 0
    assert losses[-1] < losses[0]
    assert dev.peak_bytes > param_bytes
    # Live after a step: x, params, their grads, Adam's exp_avg and exp_avg_sq. Adam's step
    # counters are made with torch.tensor (not counted, see the test below); on a GPU they
    # stay on the host too unless the optimizer is capturable or fused.
    assert dev.live_bytes == 4 * param_bytes + x.nbytes


def test_tensors_from_python_data_alias_their_source_and_are_not_counted():
    # torch.tensor / as_tensor / from_numpy build the storage before dispatch and only
    # show up as aten.lift_fresh, which returns its input: like torch.load, use track().
    with EmulatedDevice(None) as dev:
        small = torch.tensor([1.0, 2.0, 3.0])
        assert dev.live_bytes == 0
        assert dev.track([small]) == 12
        copied = small.clone()
        assert dev.live_bytes == 24
        del copied


def test_gradient_checkpointing_lowers_the_peak():
    def peak_and_grads(use_checkpoint: bool) -> tuple[int, list[torch.Tensor]]:
        torch.manual_seed(0)
        blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(8))
        x = torch.randn(512, 256)
        dev = EmulatedDevice(None)
        dev.track([*blocks.parameters(), x])
        with dev:
            h = x
            for block in blocks:
                h = checkpoint(block, h, use_reentrant=False) if use_checkpoint else block(h)
            h.square().mean().backward()
        return dev.peak_bytes, [p.grad for p in blocks.parameters()]

    plain_peak, plain_grads = peak_and_grads(False)
    ckpt_peak, ckpt_grads = peak_and_grads(True)
    activation = 512 * 256 * 4  # 512 KiB per block output
    # Without checkpointing each block keeps its Linear output and GELU output for backward;
    # with it only the block inputs are kept and one block is recomputed at a time.
    print(f"peak without checkpointing {format_torch_size(plain_peak)}, with {format_torch_size(ckpt_peak)}")
    assert plain_peak - ckpt_peak >= 6 * activation
    assert all(torch.allclose(a, b) for a, b in zip(plain_grads, ckpt_grads))


def test_capacity_change_between_steps_takes_effect():
    model = mlp(width=128, depth=3)
    params = list(model.parameters())
    optimizer = torch.optim.Adam(params, lr=1e-3)
    x = torch.randn(64, 128)
    dev = EmulatedDevice(None)
    dev.track(params)
    with dev:
        train_step(model, optimizer, x)  # creates grads and Adam state
        steady = dev.live_bytes
        dev.reset_peak()
        train_step(model, optimizer, x)
        step_peak = dev.peak_bytes
        assert step_peak > steady

        tight = (steady + step_peak) // 2
        schedule = CapSchedule(((0, 2 * step_peak), (3, tight)))
        failed_at = None
        for step in range(6):
            dev.capacity = schedule.limit_at(step)
            try:
                train_step(model, optimizer, x)
            except torch.OutOfMemoryError:
                failed_at = step
                break
        assert failed_at == 3
        assert dev.last_oom.total == tight

        # Memory comes back (the other process went away): training carries on.
        dev.capacity = schedule.limit_at(0)
        train_step(model, optimizer, x)
    assert dev.oom_count == 1


# -- real GPU ---------------------------------------------------------------------------


def test_limit_cuda_memory_rejects_nonpositive_capacity():
    with pytest.raises(ValueError):
        limit_cuda_memory(0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behavior without CUDA")
def test_limit_cuda_memory_needs_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        limit_cuda_memory(MiB)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_limit_cuda_memory_makes_pytorch_itself_oom():
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(ValueError, match="has only"):
        limit_cuda_memory(total + 1)
    torch.cuda.empty_cache()
    limit_cuda_memory(256 * MiB)
    try:
        fits = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        with pytest.raises(torch.OutOfMemoryError, match=r"CUDA out of memory\. Tried to allocate 512\.00 MiB"):
            torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
        del fits
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()


def test_move_in_counts_host_made_tensors_and_refuses_what_does_not_fit():
    host = [torch.zeros(1024), torch.zeros(1024)]  # 4 KiB each, made before the device was active
    device = EmulatedDevice(capacity=6 * 1024)
    with device:
        device.move_in(host[:1])
        assert device.live_bytes == 4096
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 4.00 KiB"):
            device.move_in(host)
        assert device.live_bytes == 4096 and device.last_oom.requested == 4096


def test_sparse_tensors_are_not_counted_and_do_not_break_the_count():
    device = EmulatedDevice(capacity=None)
    with device:
        dense = torch.zeros(256)  # 1 KiB
        sparse = torch.eye(64).to_sparse()
        product = torch.sparse.mm(sparse, torch.ones(64, 4))  # a dense result, counted
        assert device.live_bytes >= dense.untyped_storage().nbytes() + product.untyped_storage().nbytes()


def test_with_count_moves_a_tensor_sent_to_the_device_counts_once_though_nothing_is_copied():
    from safetensors.torch import load, save

    # Weights as from_pretrained reads them: safetensors builds the storages outside any op.
    weights = load(save({"weight": torch.zeros(1024), "bias": torch.zeros(256)}))
    device = EmulatedDevice(capacity=None, count_moves=True)
    with device:
        assert device.live_bytes == 0
        moved = weights["weight"].to(torch.device("cpu"))
        assert moved.untyped_storage().data_ptr() == weights["weight"].untyped_storage().data_ptr()  # no copy
        assert device.live_bytes == 4096
        weights["weight"].to("cpu", non_blocking=True)
        assert device.live_bytes == 4096  # counted once
        weights["bias"].cpu()  # back to the host: not device memory
        weights["bias"].to(torch.float32)  # no device named: it stays where it is
        assert device.live_bytes == 4096
        half = weights["bias"].to(device="cpu", dtype=torch.float16)  # a copy: counted as made
        assert device.live_bytes == 4096 + 512
        del moved, half
    assert device.live_bytes == 4096  # the weights live on: their storage is still counted


def test_moves_are_counted_only_when_asked_and_refused_when_they_do_not_fit():
    from safetensors.torch import load, save

    weights = load(save({"weight": torch.zeros(2048)}))  # 8 KiB
    with EmulatedDevice(capacity=None) as runner_device:
        weights["weight"].to("cpu")
        assert runner_device.live_bytes == 0  # the built-in runner says what it moves itself
    model = nn.Linear(64, 64)  # 16.25 KiB, made on the host before the device
    with EmulatedDevice(capacity=12 * KiB, count_moves=True) as device:
        weights["weight"].to("cpu")
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 16.00 KiB"):
            model.to("cpu")
        assert device.last_oom is not None and device.last_oom.allocated == 8 * KiB


def test_what_outlives_a_mark_is_told_apart_from_what_came_after_it():
    device = EmulatedDevice(capacity=None)
    with device:
        weights = torch.zeros(1024)  # 4 KiB, before the mark: outlives the step
        device.mark()
        output = weights * 2  # made in the step and still held by its caller
        scratch = weights + 1
        del scratch
        assert (device.live_bytes, device.held_before_mark()) == (8192, 4096)
        device.mark()
        assert device.held_before_mark() == 8192  # the next step: the output is old now
        del output
        assert device.held_before_mark() == 4096
