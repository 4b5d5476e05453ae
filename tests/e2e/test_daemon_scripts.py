"""The daemon end to end with command jobs: a script (one that knows nothing of oomguard, or a
plain PyTorch one under an emulated cap) that runs out of memory is relaunched with a smaller
micro-batch until it fits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import oomguard

pytestmark = pytest.mark.slow


# A stand-in for a training script that only fits at 4 samples per micro-batch: above that it
# dies the way PyTorch does, with a CUDA OOM message on stderr and exit status 1. As in a real
# script, what it holds and the allocation that fails grow with its micro-batch (6 GiB of
# weights and optimizer state, 0.35 GiB of activations a sample, failing midway through).
FITS_AT_4 = """\
import argparse, sys
parser = argparse.ArgumentParser()
parser.add_argument("--train_batch_size", type=int)
parser.add_argument("--gradient_accumulation_steps", type=int)
parser.add_argument("--gradient_checkpointing", action="store_true")
args = parser.parse_args()
print(f"args: mb={args.train_batch_size} accum={args.gradient_accumulation_steps} ckpt={args.gradient_checkpointing}", flush=True)
if args.train_batch_size > 4:
    in_use = 6.0 + 0.35 * args.train_batch_size / 4
    request = 0.35 * args.train_batch_size / 2
    sys.stderr.write(
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {request:.2f} GiB. GPU 0 has a total capacity of 8.00 GiB "
        f"of which {8 - in_use:.2f} GiB is free. Including non-PyTorch memory, this process has {in_use:.2f} GiB memory in use. Of "
        f"the allocated memory {in_use - 0.1:.2f} GiB is allocated by PyTorch, and 0.10 GiB is reserved by PyTorch but unallocated.\\n"
    )
    sys.exit(1)
print("training finished: 10 steps", flush=True)
"""


def test_a_command_job_is_relaunched_with_a_smaller_micro_batch_until_it_fits(tmp_path: Path, daemon_factory) -> None:
    script = tmp_path / "train.py"
    script.write_text(FITS_AT_4)
    job = tmp_path / "script.toml"
    job.write_text(
        f"""name = "script"
trainer = "command"
[command]
argv = ["{sys.executable}", "train.py", "--train_batch_size={{micro_batch}}", "--gradient_accumulation_steps={{grad_accum}}"]
cwd = "{tmp_path}"
[command.when]
gradient_checkpointing = ["--gradient_checkpointing"]
[train]
batch_size = 16
max_steps = 10
"""
    )
    daemon = daemon_factory()
    oomguard("submit", str(job), state_dir=daemon.state_dir, check=True)
    record = daemon.wait_job("1", timeout=120)
    assert record["state"] == "finished", (record["result"], record["report"])
    attempts = record["attempts"]
    assert [a["outcome"]["kind"] for a in attempts][:-1] == ["oom"] * (len(attempts) - 1)
    assert attempts[-1]["outcome"]["kind"] == "finished"
    last = attempts[-1]["plan"]
    assert last["micro_batch"] <= 4 and 16 % last["micro_batch"] == 0
    logs = oomguard("logs", "1", state_dir=daemon.state_dir, check=True).stdout
    assert f"args: mb={last['micro_batch']} accum={16 // last['micro_batch']}" in logs
    assert "training finished: 10 steps" in logs
    # The first OOM was read from the log: the doctor saw PyTorch's figures.
    assert attempts[0]["outcome"]["memory"]["total"] == 8 * 2**30


# A plain PyTorch script that knows nothing of oomguard: its batch size is an argument.
TORCH_SCRIPT = """\
import argparse, torch
parser = argparse.ArgumentParser()
parser.add_argument("--train_batch_size", type=int)
parser.add_argument("--gradient_accumulation_steps", type=int)
args = parser.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
optimizer = torch.optim.AdamW(model.parameters())
for step in range(4):
    for _ in range(args.gradient_accumulation_steps):
        loss = model(torch.randn(args.train_batch_size, 256)).pow(2).mean() / args.gradient_accumulation_steps
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"finished {step + 1} steps at micro-batch {args.train_batch_size}", flush=True)
"""


def test_a_torch_script_runs_out_of_emulated_memory_unchanged_and_is_relaunched(tmp_path: Path, daemon_factory) -> None:
    (tmp_path / "train.py").write_text(TORCH_SCRIPT)
    job = tmp_path / "torch-script.toml"
    job.write_text(
        f"""name = "torch-script"
trainer = "command"
[command]
argv = ["{sys.executable}", "train.py", "--train_batch_size={{micro_batch}}", "--gradient_accumulation_steps={{grad_accum}}"]
cwd = "{tmp_path}"
[train]
batch_size = 2048
max_steps = 4
"""
    )
    # 16 MiB: the whole batch of 2048 runs out (its activations alone are about 12 MiB) and the
    # plan the doctor picks from the OOM's figures fits; one relaunch, as in use.
    daemon = daemon_factory("--emulate-device-memory", "16MiB")
    oomguard("submit", str(job), state_dir=daemon.state_dir, check=True)
    record = daemon.wait_job("1", timeout=180)
    assert record["state"] == "finished", (record["result"], record["report"])
    first, *_, last = record["attempts"]
    assert first["outcome"]["kind"] == "oom" and first["outcome"]["memory"]["total"] == 16 * 2**20
    assert last["outcome"]["kind"] == "finished"
    assert last["plan"]["micro_batch"] < 2048 and last["plan"]["micro_batch"] * (2048 // last["plan"]["micro_batch"]) == 2048
    logs = oomguard("logs", "1", state_dir=daemon.state_dir, check=True).stdout
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in logs
    assert f"finished 4 steps at micro-batch {last['plan']['micro_batch']}" in logs
