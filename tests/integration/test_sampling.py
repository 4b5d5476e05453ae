"""Samples rendered while a text-to-image job trains (train.sample_every_steps): a sampling phase
that runs out of memory steps down its own settings and never the training plan; the job
finishes with every step's samples. And the optimizer state moved off the device while
sampling comes back exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from oomguard.jobs.memory_cap import EmulatedMemory
from oomguard.jobs.sampling import LADDER, optimizer_state_on_host
from oomguard.jobs.sizes import CapSchedule
from tests.e2e.conftest import oomguard
from tests.pipelines import save_tiny_pipeline
from tests.t2i_helpers import text_to_image_job, write_captioned_images

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [f"a photo of thing {i}" for i in range(16)]
# The tiny SD pipeline at micro-batch 4 peaks at 2.28 MiB a step; sixteen prompts at once (a
# UNet forward of 32 under guidance, then 16 images decoded) need more, one at a time less.
CAP = "2340KiB"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sampling")
    pipeline = save_tiny_pipeline(root / "sd", "sd")
    data = write_captioned_images(root / "data")
    train = f"sample_every_steps = 2\nsample_prompts = {json.dumps(PROMPTS)}\nsample_inference_steps = 2\n"
    return text_to_image_job(root, "sampling", pipeline, data, method="full", max_steps=4, train=train)


def test_a_sampling_oom_keeps_the_training_plan_and_the_job_finishes_with_its_samples(tmp_path, job):
    result = oomguard("run", "--json", str(job), "--workdir", str(tmp_path / "work"), "--emulate-device-memory", CAP, timeout=300)
    record = json.loads(result.stdout)
    assert record["state"] == "finished", result.stderr[-3000:]
    # One attempt, no rung: the plan the job started with.
    assert len(record["attempts"]) == 1
    assert not [e for e in record["events"] if e["kind"] == "escalated"]
    assert record["attempts"][0]["outcome"]["plan"]["micro_batch"] == 4
    log = (tmp_path / "work" / "attempts" / "001" / "output.log").read_text()
    assert "sampling at step 2: out of memory with every prompt at once; now one prompt at a time (the training plan stays)" in log
    for step in (2, 4):
        images = sorted((tmp_path / "work" / "samples" / f"step-{step:06d}").glob("*.png"))
        assert [p.name for p in images] == [f"{i:02d}.png" for i in range(len(PROMPTS))]
    steps = [json.loads(line)["step"] for line in (tmp_path / "work" / "attempts" / "001" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_the_optimizer_state_leaves_the_device_while_sampling_and_comes_back_the_same():
    memory = EmulatedMemory(CapSchedule(((0, 64 << 30),)))
    with memory:
        weight = torch.nn.Parameter(torch.randn(256, 256))
        optimizer = torch.optim.AdamW([weight], lr=1e-2)
        weight.grad = torch.randn(256, 256)
        optimizer.step()
        before = {k: v.clone() for k, v in optimizer.state[weight].items()}
        held = memory.live_bytes()
        with optimizer_state_on_host(optimizer, memory):
            # The two moments (256 KiB each) are no longer on the device.
            assert held - memory.live_bytes() >= 2 * 256 * 256 * 4
        assert memory.live_bytes() >= held - 1024
    for key, value in before.items():
        assert torch.equal(optimizer.state[weight][key], value), key


def test_the_sampling_settings_go_from_the_fastest_to_the_smallest():
    assert [s.describe() for s in LADDER] == [
        "every prompt at once",
        "one prompt at a time",
        "one prompt at a time, the optimizer state in host memory while sampling",
        "one prompt at a time, the optimizer state in host memory while sampling, the VAE decoding in tiles",
    ]


def test_an_optimizer_without_state_on_the_device_is_left_alone():
    memory = EmulatedMemory(CapSchedule(((0, 64 << 30),)))
    with memory:
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.randn(4))], lr=1e-2)  # no step yet: no state
        with optimizer_state_on_host(optimizer, memory):
            pass
    assert not optimizer.state


def test_an_attempt_that_ended_while_sampling_has_an_outcome_the_daemon_reads():
    from oomguard.strategies.outcome import Outcome

    outcome = Outcome.from_dict({"kind": "crashed", "phase": "sampling", "step": 4, "message": "boom"})
    assert outcome.phase == "sampling"


@pytest.mark.long  # another layout of the case above (make faults runs it)
def test_an_sdxl_job_renders_its_samples(tmp_path):
    pipeline = save_tiny_pipeline(tmp_path / "sdxl", "sdxl")
    data = write_captioned_images(tmp_path / "data")
    train = 'sample_every_steps = 2\nsample_prompts = ["a red thing", "a blue thing"]\nsample_inference_steps = 2\n'
    job = text_to_image_job(tmp_path, "sdxl-samples", pipeline, data, method="lora", max_steps=2, train=train)
    result = oomguard("run", "--json", str(job), "--workdir", str(tmp_path / "work"), timeout=300)
    assert json.loads(result.stdout)["state"] == "finished", result.stderr[-3000:]
    images = sorted((tmp_path / "work" / "samples" / "step-000002").glob("*.png"))
    assert [p.name for p in images] == ["00.png", "01.png"]
    from PIL import Image

    with Image.open(images[0]) as image:
        assert image.size == (32, 32)
