"""A command job's script on the emulated device: weights it loads count as on a GPU.

The script runs unchanged under the bootstrap (jobs/bootstrap/sitecustomize.py) with real
diffusers, peft and accelerate: a UNet saved with ``save_pretrained`` (safetensors) and loaded
with ``from_pretrained`` in the ways training scripts load it, then sent to the device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.jobs.command import BOOTSTRAP_DIR

pytestmark = pytest.mark.slow


# Each way prints the live bytes of the emulated device against the bytes of the model's
# parameters and buffers once the model is on the job's device.
LOAD = """
import gc, json, sys
import torch
from accelerate import Accelerator
from diffusers import UNet2DModel
from peft import LoraConfig, get_peft_model
from oomguard.jobs.script_memory import _DEVICE

device = _DEVICE[0]

def held(model):
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])

def load(way, accelerator):
    if way == "default":  # low_cpu_mem_usage: built on the meta device, the loaded tensors assigned
        return accelerator.prepare(UNet2DModel.from_pretrained(sys.argv[1]))
    if way == "no_low_cpu_mem_usage":
        return UNet2DModel.from_pretrained(sys.argv[1], low_cpu_mem_usage=False).to(accelerator.device)
    if way == "half":  # weight_dtype under mixed precision, as the examples move frozen parts
        return UNet2DModel.from_pretrained(sys.argv[1]).to(accelerator.device, dtype=torch.float16)
    if way == "lora":
        model = UNet2DModel.from_pretrained(sys.argv[1]).requires_grad_(False)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"]))
        return accelerator.prepare(model)
    raise SystemExit(f"unknown way {way}")

for way in sys.argv[2:]:
    accelerator = Accelerator(cpu=True)  # it keeps the models it prepared: one per way
    before = device.live_bytes
    model = load(way, accelerator)
    print(json.dumps({"way": way, "live": device.live_bytes - before, "held": held(model)}), flush=True)
    del model, accelerator
    gc.collect()
"""

WAYS = ["default", "no_low_cpu_mem_usage", "half", "lora"]


def bootstrapped(code: str, *args: str, cap: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOMGUARD_")}
    env.update(PYTHONPATH=str(BOOTSTRAP_DIR), OOMGUARD_EMULATE_DEVICE_MEMORY=cap)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=180, env=env)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("unet")
    from tests.scripts.save_tiny_unet import save_tiny_unet  # diffusers: imported only where needed

    save_tiny_unet(str(folder))
    assert (folder / "diffusion_pytorch_model.safetensors").is_file()
    return folder


def test_a_pretrained_model_on_the_device_holds_its_weights_bytes_whichever_way_it_was_loaded(pretrained: Path) -> None:
    done = bootstrapped(LOAD, str(pretrained), *WAYS, cap="1GiB")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [row["way"] for row in rows] == WAYS
    for row in rows:
        assert row["held"] > 1_000_000, row  # fp32 ~2.8 MB, fp16 half of it
        assert abs(row["live"] - row["held"]) <= 0.1 * row["held"], row


def test_weights_that_do_not_fit_the_cap_run_out_of_memory_as_they_are_loaded(pretrained: Path) -> None:
    done = bootstrapped(LOAD, str(pretrained), "default", cap="1MiB")  # the weights are ~2.7 MiB
    assert done.returncode != 0
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in done.stderr
    assert "GPU 0 has a total capacity of 1024.00 KiB" in done.stderr
