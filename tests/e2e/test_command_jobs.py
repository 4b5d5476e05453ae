"""Command jobs end to end: a script that behaves like diffusers' examples, unchanged, under
the daemon with an emulated cap that drops mid-run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import oomguard

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parents[1] / "scripts" / "diffusers_like_train.py"
STEPS = 20


def test_a_diffusers_like_script_ooms_is_relaunched_smaller_resumes_and_finishes_every_step(tmp_path: Path, daemon_factory) -> None:
    job = tmp_path / "script.toml"
    job.write_text(
        f"""name = "diffusers-like"
trainer = "command"
[command]
argv = ["{sys.executable}", "{SCRIPT}", "--train_batch_size={{micro_batch}}", "--gradient_accumulation_steps={{grad_accum}}",
        "--mixed_precision={{mixed_precision}}", "--max_train_steps={STEPS}", "--checkpointing_steps=5",
        "--output_dir={{workdir}}/out", "--resume_from_checkpoint=latest"]
[command.when]
gradient_checkpointing = ["--gradient_checkpointing"]
[train]
batch_size = 1024
max_steps = {STEPS}
learning_rate = 1e-3
"""
    )
    # 64 MiB for the first 7 optimizer steps of each process, then 6 MiB: the full batch of
    # 1024 needs more than that, half of it fits (measured with this script).
    daemon = daemon_factory("--emulate-device-memory", "64MiB,6MiB@7")
    oomguard("submit", str(job), state_dir=daemon.state_dir, check=True)
    record = daemon.wait_job("1", timeout=300)
    assert record["state"] == "finished", (record["result"], record["report"])
    first, *_, last = record["attempts"]
    assert first["plan"]["micro_batch"] == 1024 and first["outcome"]["kind"] == "oom"
    assert first["outcome"]["step"] == 7  # read from the script's progress line: the cap dropped after step 7
    assert last["outcome"]["kind"] == "finished" and last["outcome"]["step"] == STEPS
    assert last["plan"]["micro_batch"] < 1024 and last["plan"]["micro_batch"] * (1024 // last["plan"]["micro_batch"]) == 1024
    logs = oomguard("logs", "1", state_dir=daemon.state_dir, check=True).stdout
    assert "torch.OutOfMemoryError: CUDA out of memory" in logs
    assert "Resuming from checkpoint checkpoint-5" in logs
    assert logs.rstrip().endswith(f"Steps: {STEPS}/{STEPS}")

    # The same script without oomguard, uninterrupted: the same number of optimizer steps.
    straight = subprocess.run(
        [sys.executable, str(SCRIPT), "--train_batch_size=1024", f"--max_train_steps={STEPS}", f"--output_dir={tmp_path / 'straight'}"],
        capture_output=True, text=True, timeout=120,
    )
    assert straight.returncode == 0 and straight.stdout.rstrip().endswith(f"Steps: {STEPS}/{STEPS}")
