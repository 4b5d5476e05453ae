"""The bootstrap reports each optimizer step of an unchanged script to the daemon
(jobs/bootstrap/oomguard_progress.py): metrics.jsonl and heartbeat.json in the attempt folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from oomguard.jobs.attempt import HEARTBEAT, METRICS
from oomguard.jobs.command import ATTEMPT_ENV, BOOTSTRAP_DIR

# A plain PyTorch script with two optimizers (as a GAN has): the job's step is the first one's.
SCRIPT = """
import torch
torch.manual_seed(0)
a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
first, second = torch.optim.SGD(a.parameters(), lr=0.5), torch.optim.SGD(b.parameters(), lr=0.1)
for _ in range(5):
    (a(torch.randn(4, 8)).sum() + b(torch.randn(4, 8)).sum()).backward()
    first.step(); second.step(); first.zero_grad(); second.zero_grad()
print("trained", flush=True)
"""


def run(script: str, attempt_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OOMGUARD_") and k != "RANK"}
    environment.update(
        PYTHONPATH=str(BOOTSTRAP_DIR), OOMGUARD_ATTEMPT_DIR=str(attempt_dir),
        **{ATTEMPT_ENV: json.dumps({"plan": "mb=4x1", "max_steps": 5, "batch_size": 4})}, **env,
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=environment)


def test_each_step_of_the_first_optimizer_is_a_line_and_the_heartbeat_holds_the_last(tmp_path: Path) -> None:
    done = run(SCRIPT, tmp_path)
    assert done.returncode == 0 and "trained" in done.stdout, done.stderr
    steps = [json.loads(line) for line in (tmp_path / METRICS).read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert [s["samples"] for s in steps] == [4, 8, 12, 16, 20] and all(s["lr"] == 0.5 and s["plan"] == "mb=4x1" for s in steps)
    assert steps[0]["samples_per_s"] is None and all(s["samples_per_s"] > 0 for s in steps[1:])
    heartbeat = json.loads((tmp_path / HEARTBEAT).read_text())
    assert heartbeat["step"] == 5 and heartbeat["max_steps"] == 5 and heartbeat["final_lr"] == 0.5 and heartbeat["resumed_from"] is None


def test_only_rank_zero_writes_and_a_failing_report_never_stops_the_script(tmp_path: Path) -> None:
    done = run(SCRIPT, tmp_path, RANK="1")
    assert done.returncode == 0 and not (tmp_path / METRICS).exists() and not (tmp_path / HEARTBEAT).exists()
    gone = tmp_path / "no-such-folder"
    done = run(SCRIPT, gone)
    assert done.returncode == 0 and "trained" in done.stdout
    assert f"oomguard: cannot write {METRICS}" in done.stderr


def test_the_daemon_and_the_bootstrap_name_the_same_variable() -> None:
    sys.path.insert(0, str(BOOTSTRAP_DIR))
    try:
        import oomguard_progress
    finally:
        sys.path.remove(str(BOOTSTRAP_DIR))
    assert oomguard_progress.ATTEMPT_ENV == ATTEMPT_ENV


def test_bitsandbytes_optional_kernel_warning_stays_out_of_the_job_log(tmp_path: Path) -> None:
    # The warning bitsandbytes' CPU backend logs on import (bitsandbytes/backends/cpu/ops.py)
    # on a CPU with AVX512-BF16 and without the optional `kernels` package.
    emit = (
        "import logging\nlogging.basicConfig()\nlog = logging.getLogger('bitsandbytes.backends.cpu.ops')\n"
        "log.warning('Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already "
        "`pip install kernels` and the kernels >= 0.11.1', 'No module named kernels')\nlog.error('a real error')\n"
    )
    done = run(emit, tmp_path)
    assert done.returncode == 0 and "gemm_4bit_forward" not in done.stderr and "a real error" in done.stderr
