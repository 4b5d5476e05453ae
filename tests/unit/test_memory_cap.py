"""The device an attempt trains on: DeviceSpec (jobs/device.py), how it travels in attempt.json
and the environment, the device memory the runner opens from it (jobs/memory_cap.py), and the
after-step fault hook (jobs/faults.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from oomguard.jobs.attempt import AttemptConfig
from oomguard.jobs.device import EMULATE_DEVICE_MEMORY_ENV, DeviceSpec
from oomguard.jobs.cuda_oom import cuda_oom_message
from oomguard.jobs.faults import INJECT_FAULT_ENV, injected_fault
from oomguard.jobs.memory_cap import EmulatedMemory, HostMemory, open_device_memory
from oomguard.jobs.sizes import CapSchedule
from oomguard.strategies.plan import Plan
from oomguard.strategies.units import MiB
from tests.jobs_helpers import tiny_job

CPU = torch.device("cpu")


def test_a_spec_reads_the_option_and_travels_in_the_environment():
    spec = DeviceSpec.from_option("64MiB,40MiB@15")
    assert spec.emulated and spec.emulated_capacity == CapSchedule(((0, 64 * MiB), (15, 40 * MiB)))
    assert spec.environment() == {EMULATE_DEVICE_MEMORY_ENV: "64MiB,40MiB@15"}
    assert DeviceSpec.from_environment(spec.environment()) == spec
    assert DeviceSpec.from_option(None) == DeviceSpec() and not DeviceSpec().emulated
    assert DeviceSpec().environment() == {}
    with pytest.raises(ValueError, match="not a memory size"):
        DeviceSpec.from_option("48 furlongs")


def test_a_runner_started_by_hand_takes_the_capacity_from_its_environment():
    env = {EMULATE_DEVICE_MEMORY_ENV: "8MiB"}
    assert DeviceSpec().or_environment(env) == DeviceSpec.from_option("8MiB")
    # The attempt's own device comes first.
    assert DeviceSpec.from_option("48MiB").or_environment(env) == DeviceSpec.from_option("48MiB")
    assert DeviceSpec().or_environment({}) == DeviceSpec()


@pytest.mark.parametrize("cap", [None, "48MiB", "64MiB,3MiB@5"])
def test_attempt_json_keeps_the_device(tmp_path: Path, cap):
    config = AttemptConfig(job=tiny_job(), plan=Plan.initial(8), number=1, workdir=tmp_path, device=DeviceSpec.from_option(cap))
    config.write(tmp_path)
    assert AttemptConfig.read(tmp_path) == config


def test_an_attempt_json_from_before_the_device_field_still_reads(tmp_path: Path):
    """Attempts started before an upgrade are adopted and resumed: their attempt.json holds the
    capacity under "emulate_device_memory"."""
    config = AttemptConfig(job=tiny_job(), plan=Plan.initial(8), number=2, workdir=tmp_path)
    old = {key: value for key, value in config.to_dict().items() if key != "device"}
    assert AttemptConfig.from_dict({**old, "emulate_device_memory": "48MiB"}).device == DeviceSpec.from_option("48MiB")
    assert AttemptConfig.from_dict({**old, "emulate_device_memory": None}).device == DeviceSpec()
    assert AttemptConfig.from_dict(old).device == DeviceSpec()


def test_without_cuda_the_spec_opens_the_emulated_device_or_none():
    assert isinstance(open_device_memory(DeviceSpec(), CPU), HostMemory)
    assert isinstance(open_device_memory(DeviceSpec.from_option("48MiB"), CPU), EmulatedMemory)
    host = open_device_memory(DeviceSpec(), CPU)
    with host:
        host.begin_step(0)
        assert (host.capacity(), host.live_bytes(), host.peak_bytes(), host.others_bytes()) == (None, None, None, None)
        figures = host.oom_figures("CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of 8.00 MiB")
        assert figures.requested == 2 * MiB and figures.total is None


def test_the_emulated_device_follows_the_schedule_and_raises_pytorchs_oom():
    memory = open_device_memory(DeviceSpec.from_option("1MiB,64KiB@2"), CPU, lambda: {"params": list(model.parameters())})
    model = nn.Linear(16, 16)
    with memory:
        memory.track(model.parameters())
        memory.begin_step(0)
        assert memory.capacity() == MiB
        kept = torch.zeros(64 * 1024 // 4)  # 64 KiB: fits under 1 MiB
        memory.begin_step(2)
        assert memory.capacity() == 64 * 1024
        with pytest.raises(torch.OutOfMemoryError) as caught:
            torch.zeros(1024)
        live = memory.live_bytes()
        assert str(caught.value) == cuda_oom_message(requested=4096, total=64 * 1024, free=0, allocated=live, reserved=live)
        figures = memory.oom_figures(str(caught.value))
        assert (figures.requested, figures.total, figures.allocated) == (4096, 64 * 1024, live)
        assert figures.breakdown["params"] == sum(p.numel() * 4 for p in model.parameters())
        del kept


def test_the_fault_hook_is_there_only_when_asked_for():
    assert injected_fault({}) is None
    assert injected_fault({INJECT_FAULT_ENV: "something_else@3"}) is None
    assert injected_fault({INJECT_FAULT_ENV: "nan_under_reduced_precision@x"}) is None
    assert injected_fault({INJECT_FAULT_ENV: "nan_under_reduced_precision@3"}) is not None


def test_the_fault_turns_a_weight_into_nan_at_the_kth_step_under_reduced_precision(capsys: pytest.CaptureFixture[str]):
    hook = injected_fault({INJECT_FAULT_ENV: "nan_under_reduced_precision@2"})
    assert hook is not None
    model = nn.Linear(2, 2)
    full = SimpleNamespace(plan=Plan.initial(8), model=model)
    half = SimpleNamespace(plan=Plan.initial(8).replace(mixed_precision="bf16"), model=model)
    hook(full, 1)  # full precision: not counted
    hook(half, 2)
    assert torch.isfinite(model.weight).all()
    hook(half, 3)
    assert torch.isnan(model.weight).any()
    assert "oomguard fault injection: NaN weights after step 3 under bf16" in capsys.readouterr().out
