"""The emulated device under the caching allocator's emulation (--emulate-allocator caching):
real tensors, PyTorch's reserve, its OOM message, expandable segments from the environment."""

import pytest
import torch
from torch import nn

from oomguard.jobs.device import DeviceSpec
from oomguard.jobs.device_memory import EmulatedDevice
from oomguard.jobs.emulated_allocator import DEFAULT_OVERHEAD, AllocatorEmulation, expandable_segments
from oomguard.jobs.memory_cap import open_device_memory
from oomguard.jobs.sizes import CapSchedule
from oomguard.strategies.oom_text import read_oom
from oomguard.strategies.units import MiB

CACHING = AllocatorEmulation(overhead=32 * MiB)


def floats(nbytes: int) -> int:
    return nbytes // 4


def fragmented(device: EmulatedDevice) -> list[torch.Tensor]:
    """Ten 12 MiB blocks freed, ten 7 MiB tensors kept: one in each cached block, 5 MiB free
    beside each (the best fit of PyTorch's allocator), then ten more 12 MiB requests."""
    activations = [torch.empty(floats(12 * MiB)) for _ in range(10)]
    del activations
    kept = [torch.zeros(floats(7 * MiB)) for _ in range(10)]
    return kept + [torch.empty(floats(12 * MiB)) for _ in range(10)]


def test_small_tensors_reserve_whole_segments_and_round_their_blocks():
    with EmulatedDevice(None, allocator=CACHING) as device:
        x = torch.zeros(10)  # 40 bytes: a 512-byte block of a 2 MiB segment
        assert device.live_bytes == 40
        assert device.allocated_bytes == 512
        assert device.reserved_bytes == 2 * MiB
        del x
        assert device.allocated_bytes == 0 and device.reserved_bytes == 2 * MiB  # cached, not given back
        device.empty_cache()
        assert device.reserved_bytes == 0
        assert device.peak_reserved_bytes == 2 * MiB and device.peak_bytes == 40


def test_a_fragmented_cache_raises_pytorchs_message_with_the_reserve_and_expandable_segments_fit():
    with EmulatedDevice(210 * MiB, allocator=CACHING, expandable=False) as device:
        with pytest.raises(torch.OutOfMemoryError) as caught:
            fragmented(device)
    message = str(caught.value)
    assert message.startswith("CUDA out of memory. Tried to allocate 12.00 MiB.")
    assert "50.00 MiB is reserved by PyTorch but unallocated" in message
    assert "expandable_segments:True" in message
    info = device.last_oom
    assert info is not None and info.reserved - info.allocated == 50 * MiB
    assert info.alloc_stats == {"num_alloc_retries": 1, "num_ooms": 1}  # its own flush: no evidence of earlier ones
    # The shim's reading of the same text: fragmentation.
    verdict = read_oom(message)
    assert verdict is not None and verdict.kind == "oom_fragmentation"
    # The bytes fit: the exact emulation never refuses them.
    with EmulatedDevice(210 * MiB) as exact:
        fragmented(exact)
    with EmulatedDevice(210 * MiB, allocator=CACHING, expandable=True) as device:
        fragmented(device)
        assert device.reserved_bytes == 200 * MiB  # ten 20 MiB pages of one segment


def test_expandable_segments_are_read_from_pytorchs_variables(monkeypatch):
    assert not expandable_segments({})
    assert expandable_segments({"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"})
    assert not expandable_segments({"PYTORCH_ALLOC_CONF": "expandable_segments:False"})
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    with EmulatedDevice(210 * MiB, allocator=CACHING) as device:
        fragmented(device)


def test_on_an_emulated_card_the_message_has_the_card_the_overhead_and_the_allowed_limit():
    with EmulatedDevice(64 * MiB, allocator=CACHING) as device:
        device.card = (1024 * MiB, 100 * MiB)  # the card's total, what others hold
        keep = [torch.empty(floats(30 * MiB))]
        with pytest.raises(torch.OutOfMemoryError) as caught:
            keep.append(torch.empty(floats(40 * MiB)))
    message = str(caught.value)
    assert "has a total capacity of 1024.00 MiB of which 862.00 MiB is free." in message  # 1024 - 100 - 32 - 30
    assert "this process has 62.00 MiB memory in use. 64.00 MiB allowed; Of the allocated memory 30.00 MiB" in message
    verdict = read_oom(message)
    assert verdict is not None and verdict.allowed == 64 * MiB and verdict.process_in_use == 62 * MiB


def test_tensors_tracked_after_the_fact_are_never_refused_and_the_next_allocation_is():
    model = nn.Linear(1024, 1024)  # 4 MiB of weights, made before the device
    with EmulatedDevice(3 * MiB, allocator=CACHING) as device:
        device.track(model.parameters())
        # The weight's 20 MiB segment and the bias's 2 MiB one, over the limit.
        assert device.reserved_bytes == 22 * MiB
        small = torch.zeros(10)  # a cached block has room: nothing new is reserved
        with pytest.raises(torch.OutOfMemoryError):
            torch.zeros(floats(17 * MiB))  # needs a new segment
        assert small.numel() == 10


def test_a_resized_storage_takes_a_new_block_and_frees_the_old_one():
    with EmulatedDevice(None, allocator=CACHING) as device:
        t = torch.zeros(floats(4 * MiB))
        assert device.allocated_bytes == 4 * MiB
        t.untyped_storage().resize_(0)
        assert device.allocated_bytes == 0
        t.untyped_storage().resize_(2 * MiB)
        assert device.allocated_bytes == 2 * MiB


def test_the_runner_sees_allocated_and_reserved_peaks_and_its_capacity_is_the_limit():
    spec = DeviceSpec(CapSchedule(((0, 48 * MiB),)), AllocatorEmulation.parse("caching/1024"))
    memory = open_device_memory(spec, torch.device("cpu"))
    with memory:
        model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
        memory.track(model.parameters())
        memory.reset_peak()
        model(torch.randn(64, 256)).sum().backward()
        assert memory.peak_reserved() >= memory.peak_bytes() >= memory.emulated.peak_bytes > 0
        assert memory.capacity() == 48 * MiB
    assert open_device_memory(DeviceSpec(CapSchedule(((0, 48 * MiB),))), torch.device("cpu")).peak_reserved() is None


@pytest.mark.parametrize(
    ("text", "divisor", "overhead"),
    [
        ("caching", 1, DEFAULT_OVERHEAD),
        ("caching/1024", 1024, DEFAULT_OVERHEAD // 1024),
        ("caching,overhead=300MiB", 1, 300 * MiB),
        ("caching/64, overhead=0", 64, 0),
    ],
)
def test_allocator_emulation_texts(text: str, divisor: int, overhead: int):
    emulation = AllocatorEmulation.parse(text)
    assert emulation is not None and (emulation.divisor, emulation.overhead_bytes) == (divisor, overhead)
    assert AllocatorEmulation.parse(str(emulation)) == emulation
    spec = DeviceSpec(CapSchedule(((0, MiB),)), emulation)
    assert DeviceSpec.from_environment(spec.environment()) == spec
    assert DeviceSpec.from_dict(spec.to_dict()) == spec
    assert AllocatorEmulation.parse("exact") is None


@pytest.mark.parametrize(
    ("text", "names"),
    [("cached", "not an allocator emulation"), ("caching/3", "power of two"), ("caching/x", "not a divisor"),
     ("caching,size=3MiB", "unknown allocator option"), ("caching,overhead=lots", "memory size"), ("exact,overhead=1MiB", "not an allocator")],
)
def test_bad_allocator_emulations_name_the_problem_and_the_form(text: str, names: str):
    with pytest.raises(ValueError, match=names) as caught:
        AllocatorEmulation.parse(text)
    assert "caching/1024" in str(caught.value) or "memory size" in names


def test_on_an_emulated_gpu_the_process_holds_its_reserve_and_its_overhead(tmp_path):
    from oomguard.jobs.emulated_gpus import AssignedGpu, EmulatedGpu, EmulatedGpuFolder

    folder = EmulatedGpuFolder(tmp_path).create((EmulatedGpu(0, 64 * MiB),))
    folder.publish(0, 1, 10 * MiB, "a neighbour")  # pid 1 is always alive
    gpu = AssignedGpu(folder, 0)
    memory = open_device_memory(DeviceSpec(None, CACHING), torch.device("cpu"), gpu=gpu)
    # The card's 64 MiB, less the neighbour's 10 and this process's 32 of non-PyTorch memory.
    assert memory.capacity() == 22 * MiB
    with memory:
        x = torch.zeros(10)
        memory.publish(force=True)
        assert folder.used_by_others(0, 1) == 32 * MiB + 2 * MiB  # the overhead and a 2 MiB segment
        with pytest.raises(torch.OutOfMemoryError) as caught:
            torch.empty(floats(21 * MiB))
        assert "has a total capacity of 64.00 MiB of which 20.00 MiB is free" in str(caught.value)
        assert x.numel() == 10
    memory.withdraw()
