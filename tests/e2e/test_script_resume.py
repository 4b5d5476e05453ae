"""A command job whose script behaves like diffusers' train_unconditional.py (its schedule sized
from the data loader in micro-batches, accelerate's save_state/load_state, resume from
``checkpoint-N``), unchanged, under the daemon with an emulated cap: it runs out of memory, is
relaunched with a smaller micro-batch, and ends where the uninterrupted run ends: the same
optimizer steps, samples and final learning rate. Also with a pretrained UNet (safetensors,
``from_pretrained``) trained through LoRA adapters (peft)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from oomguard.daemon.supervisor import COMMAND_SPLIT_KEEPS
from tests.e2e.conftest import oomguard

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parents[1] / "scripts" / "unconditional_like_train.py"
DONE = re.compile(r"^done: steps=\d+ samples=\d+ final_lr=\S+$", re.M)



@dataclass(frozen=True)
class Case:
    arguments: tuple[str, ...]  # "{unet}" stands for the pretrained folder
    batch_size: int
    steps: int
    cap: str
    first_ends_at: int  # the optimizer steps the first attempt completed
    resumed_from: int | None  # the checkpoint the relaunch resumes from


CASES = {
    # (A cap that drops mid-run, once in the first attempt and again in the relaunch: in
    # test_script_resume_twice.py.)
    # From the start (the first step, before AdamW has its state, still fits): the first attempt
    # leaves no checkpoint, and the next one starts over, with its own split's schedule sizes.
    "cap-from-the-start": Case(("--checkpointing_steps=5",), 128, 18, "420KiB", 1, None),
    # A pretrained UNet (2.8 MB of weights, counted once on the device) under rank-4 LoRA, 64
    # images of 8x8, 16 a step, 2 epochs. Measured: 10.6 MiB a step with 16 samples a
    # micro-batch, 6.7 MiB with 8.
    "lora-over-a-pretrained-unet": Case(
        ("--pretrained_model_name_or_path={unet}", "--lora_rank=4", "--resolution=8", "--dataset_size=64", "--num_epochs=2",
         "--checkpointing_steps=3"),
        16, 8, "64MiB,9MiB@4", 4, 3,
    ),
}


def uninterrupted(tmp_path: Path, case: Case, unet: Path) -> str:
    """The script's last line run alone, without oomguard, under the job's first plan."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOMGUARD_")}
    arguments = [a.replace("{unet}", str(unet)) for a in case.arguments]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), f"--train_batch_size={case.batch_size}", f"--output_dir={tmp_path / 'alone'}", *arguments],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return DONE.findall(done.stdout)[-1]


def job_file(tmp_path: Path, case: Case, unet: Path) -> Path:
    job = tmp_path / "job.toml"
    argv = [
        sys.executable, str(SCRIPT), "--train_batch_size={micro_batch}", "--gradient_accumulation_steps={grad_accum}",
        "--output_dir={workdir}/out", "--resume_from_checkpoint=latest", *(a.replace("{unet}", str(unet)) for a in case.arguments),
    ]
    job.write_text(
        f"""name = "unconditional-like"
trainer = "command"
[command]
argv = {json.dumps(argv)}
[train]
batch_size = {case.batch_size}
max_steps = {case.steps}
"""
    )
    return job


@pytest.mark.parametrize("name", CASES)
def test_a_relaunched_script_ends_with_the_uninterrupted_runs_steps_samples_and_learning_rate(tmp_path: Path, daemon_factory, name: str) -> None:
    case = CASES[name]
    unet = tmp_path / "unet"
    if any("{unet}" in a for a in case.arguments):
        from tests.scripts.save_tiny_unet import save_tiny_unet  # diffusers: imported only where needed

        save_tiny_unet(str(unet), 8)
    daemon = daemon_factory("--emulate-device-memory", case.cap)
    oomguard("submit", str(job_file(tmp_path, case, unet)), state_dir=daemon.state_dir, check=True)
    record = daemon.wait_job("1", timeout=300)
    assert record["state"] == "finished", (record["result"], record["report"])
    first, *middle, last = record["attempts"]
    assert first["plan"]["micro_batch"] == case.batch_size and first["outcome"]["kind"] == "oom"
    assert first["outcome"]["step"] == case.first_ends_at
    assert middle == [], [a["plan"] for a in record["attempts"]]  # the first OOM lands on a plan that fits
    assert last["plan"]["micro_batch"] * last["plan"]["grad_accum"] == case.batch_size and last["plan"]["micro_batch"] < case.batch_size
    assert last["outcome"]["kind"] == "finished" and last["outcome"]["step"] == case.steps
    assert last["outcome"]["resumed_from"] == case.resumed_from

    log = (Path(last["directory"]) / "output.log").read_text()
    if case.resumed_from is not None:
        assert f"Resuming from checkpoint checkpoint-{case.resumed_from}" in log
    assert "oomguard: the script sized its learning-rate schedule as cosine(" in log
    samples = case.steps * case.batch_size
    assert DONE.findall(log)[-1] == uninterrupted(tmp_path, case, unet) == f"done: steps={case.steps} samples={samples} final_lr=0.000000000e+00"
    assert f"end state as planned: {case.steps}/{case.steps} optimizer steps, {samples} samples, final learning rate 0 as scheduled" in record["result"]
    assert COMMAND_SPLIT_KEEPS in record["result"]
    ended = [e["data"] for e in record["events"] if e["kind"] == "attempt-ended" and e["code"] == "finished"]
    assert [(d["attempt"], d["step"], d["resumed_from"]) for d in ended] == [(2, case.steps, case.resumed_from)], ended
