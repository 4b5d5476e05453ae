"""A neighbour's spike on the runner's (emulated) GPU: the runner takes no rung, it
checkpoints and stops with the evidence, and the doctor answers "wait, same plan"."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from oomguard.jobs import checkpoints
from oomguard.jobs.attempt import HEARTBEAT, OUTCOME
from oomguard.jobs.emulated_gpus import EMULATED_GPUS_ENV, EmulatedGpuFolder, parse_gpus
from oomguard.strategies.doctor import decide
from oomguard.strategies.decision import PastAttempt, Wait
from oomguard.strategies.outcome import EXIT_OOM, Outcome
from tests.jobs_helpers import running_runner, tiny_job, write_attempt

MiB = 2**20


def test_a_neighbours_spike_stops_the_runner_without_a_rung(tmp_path: Path) -> None:
    folder = EmulatedGpuFolder(tmp_path / "gpus").create(parse_gpus("64MiB"))
    job = tiny_job(max_steps=400, checkpoint_every_steps=4)
    workdir = tmp_path / "work"
    attempt_dir = write_attempt(workdir / "attempts" / "001", job, workdir)
    neighbour = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        with running_runner(attempt_dir, {EMULATED_GPUS_ENV: str(folder.root), "CUDA_VISIBLE_DEVICES": "0"}) as runner:
            deadline = time.monotonic() + 120
            while json.loads((attempt_dir / HEARTBEAT).read_text() if (attempt_dir / HEARTBEAT).exists() else "{}").get("step", 0) < 6:
                assert runner.poll() is None and time.monotonic() < deadline, (attempt_dir / "output.log").read_text()
                time.sleep(0.05)
            # The runner says what it holds on the GPU, as NVML would show it.
            (runner_usage,) = [p for p in folder.processes(0) if p.what == "runner"]
            assert runner_usage.pid == runner.pid and 1 * MiB < runner_usage.used_bytes < 8 * MiB
            folder.publish(0, neighbour.pid, 62 * MiB, "neighbour")
            assert runner.wait(timeout=120) == EXIT_OOM
    finally:
        neighbour.kill()
        neighbour.wait()
    outcome = Outcome.from_dict(json.loads((attempt_dir / OUTCOME).read_text()))
    log = (attempt_dir / "output.log").read_text()
    assert outcome.kind == "oom" and outcome.recoveries == (), log
    assert outcome.memory is not None
    assert (outcome.memory.others_before, outcome.memory.others_at_oom) == (0, 62 * MiB)
    assert "contention; stopping for the daemon to wait" in log
    # The step it stopped at is kept: the retry loses nothing.
    assert checkpoints.latest_valid(workdir / "checkpoints").step == outcome.step
    # Its usage file goes with it.
    assert [p for p in folder.processes(0) if p.what == "runner"] == []
    decision = decide(outcome, outcome.plan, [PastAttempt(outcome.plan, outcome)], job.policy())
    assert isinstance(decision, Wait) and decision.free_bytes > runner_usage.used_bytes
