"""The average of the trained weights (train.ema): its arithmetic is diffusers' EMAModel's, in
device or host memory alike; the job file's keys; what the memory model counts for it and what
the rung ema_offload saves."""

from __future__ import annotations

import pytest
import torch

from oomguard.jobs.ema import EmaWeights, decay_at
from oomguard.jobs.memory_cap import HostMemory
from oomguard.jobs.spec import parse_job_text
from oomguard.strategies import rungs
from oomguard.strategies.memory_model import Measurement, MemoryModel
from oomguard.strategies.plan import Plan
from oomguard.strategies.static_bytes import EMA_SIZE, static_bytes
from tests.unit.test_spec import error_of, to_toml, with_changes


@pytest.mark.parametrize("largest", [0.9, 0.999, 0.9999])
def test_the_decay_of_each_step_is_emamodels(largest: float):
    from diffusers.training_utils import EMAModel

    reference = EMAModel([torch.nn.Parameter(torch.zeros(1))], decay=largest)
    assert [decay_at(step, largest) for step in range(1, 200)] == [reference.get_decay(step) for step in range(1, 200)]


@pytest.mark.parametrize("on_host", [False, True])
def test_the_average_follows_emamodel_step_by_step(on_host: bool):
    """Five optimizer steps of a small model: the average, in device or host memory, is what
    EMAModel.step computes (its foreach form, which is the one oomguard's update writes)."""
    from diffusers.training_utils import EMAModel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    reference = EMAModel(model.parameters(), decay=0.8, foreach=True)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    ema = EmaWeights(start, 0.8, torch.device("cpu"), on_host, HostMemory())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 6):
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        reference.step(model.parameters())
        ema.update(((n, p.detach()) for n, p in model.named_parameters()), step)
    averages = ema.state_dict()
    for (name, _), shadow in zip(model.named_parameters(), reference.shadow_params):
        assert torch.equal(averages[name], shadow), name
    # Not the weights themselves: the average lags them.
    assert not torch.equal(averages["0.weight"], model[0].weight.detach())


def test_ema_keys_in_the_job_file():
    job = parse_job_text(to_toml(with_changes({"train.ema": True, "train.ema_decay": 0.999})), "job.toml")
    assert (job.train.ema, job.train.ema_decay) == (True, 0.999)
    assert "ema" in job.features() and "ema_offload" in job.policy().usable
    plain = parse_job_text(to_toml(with_changes({})), "job.toml")
    assert (plain.train.ema, plain.train.ema_decay) == (False, 0.9999)
    assert "ema" not in plain.features() and "ema_offload" not in plain.policy().usable


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"train.ema_decay": 0.99}, "train.ema_decay: is set but train.ema is not: add `ema = true` to [train], or drop ema_decay"),
        ({"train.ema": True, "train.ema_decay": 1.0}, "train.ema_decay: expected a number in (0, 1), found 1.0"),
        ({"train.ema": "yes"}, "train.ema: expected true or false"),
    ],
)
def test_bad_ema_keys_are_named_with_their_fix(changes: dict, expected: str):
    assert expected in str(error_of(with_changes(changes)))


def test_a_command_job_may_not_ask_for_the_ema():
    from oomguard.strategies.errors import JobFileError

    text = 'name = "script"\ntrainer = "command"\n[command]\nargv = ["python3", "train.py", "--bs={micro_batch}"]\ncwd = "/srv"\n[train]\nbatch_size = 8\nmax_steps = 4\nema = true\n'
    with pytest.raises(JobFileError) as info:
        parse_job_text(text, "job.toml", check_files=False)
    assert "train.ema" in str(info.value)


def test_ema_offload_takes_the_average_off_the_device_in_the_memory_model():
    plain = Plan.initial(8)
    offloaded = rungs.rung("ema_offload").step(plain)
    assert offloaded is not None and rungs.ema_on_host(offloaded) and not rungs.ema_on_host(plain)
    assert offloaded.short() == "mb=8x1 ema=host"
    assert static_bytes(plain, 1000.0, ema=1000.0).ema == 1000.0
    assert static_bytes(offloaded, 1000.0, ema=1000.0).ema == 0.0
    static = {"parameters": 4000, "trainable": 4000, "optimizer_state": 8000, "ema": 4000, EMA_SIZE: 4000}
    runs = [Measurement(plan=plain.replace(micro_batch=m), fits=True, peak_bytes=24000 + 1000 * m, capacity=10**6, static=static) for m in (4, 8)]
    model = MemoryModel(runs)
    assert model.predicted_peak(plain) - model.predicted_peak(offloaded) == pytest.approx(4000)
