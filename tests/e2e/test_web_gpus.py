"""The dashboard's GPU page on emulated GPUs: the memory of every process on a GPU, a job's
runner named as that job's and a neighbour's as not oomguard's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import oomguard, tiny_job, wait_for
from tests.web_helpers import serving, token_of

pytestmark = pytest.mark.slow


def test_the_gpu_page_tells_a_jobs_processes_from_a_neighbours(tmp_path: Path, daemon_factory) -> None:
    daemon = daemon_factory("--emulate-gpus", "1x64MiB", "--gpu-sample-seconds", "0.3")
    oomguard("submit", str(tiny_job(tmp_path, "on-gpu", max_steps=2000)), state_dir=daemon.state_dir, check=True)
    wait_for(lambda: (daemon.show("1").get("heartbeat") or {}).get("step", 0) >= 1, 90, "the job to train")
    neighbour = subprocess.Popen(
        [sys.executable, "-m", "oomguard.daemon.cli", "--state-dir", str(daemon.state_dir), "neighbour", "--take", "10MiB", "--seconds", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        with serving(daemon.state_dir) as dashboard:
            token = dashboard.sign_in(token_of(oomguard("web-url", state_dir=daemon.state_dir, check=True).stdout))

            def page() -> str | None:
                body = dashboard.get("/gpus", cookie=token).body
                return body if "job 1 on-gpu" in body and f"{neighbour.pid}: 10.0 MiB (not oomguard&#39;s)" in body else None

            body = wait_for(page, 60, "both processes on the GPU page")
            assert re.search(r'<span class="ours">\d+: [\d.]+ [KM]iB \(job 1 on-gpu\)</span>', body), body
            assert "1 on-gpu (root)" in body  # the jobs on the GPU
    finally:
        neighbour.terminate()
        neighbour.wait(timeout=30)
