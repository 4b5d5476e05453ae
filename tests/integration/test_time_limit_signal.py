"""SIGUSR1 before a cluster's time limit: the shim (the batch shell) passes it on with
--pass-usr1, and the runner checkpoints and ends "time_limit" at the step it reached; without
--pass-usr1 the command is not signalled, and the shim outlives it either way."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from oomguard.daemon.shim import EXIT_STATUS
from oomguard.jobs.attempt import HEARTBEAT, OUTCOME, AttemptConfig
from oomguard.jobs.device import DeviceSpec
from oomguard.strategies.outcome import EXIT_TIME_LIMIT
from oomguard.strategies.plan import Plan
from tests.jobs_helpers import runner_command, runner_env, tiny_job


def start_shim(attempt_dir: Path, options: list[str], command: list[str], config: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, "-m", "oomguard.daemon.shim", str(attempt_dir), *options, "--", *command],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, env=runner_env(),
    )
    assert process.stdin is not None
    process.stdin.write(config.encode())
    process.stdin.close()
    return process


def wait_until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_sigusr1_to_the_shim_makes_the_runner_checkpoint_and_end_time_limit(tmp_path: Path) -> None:
    workdir = tmp_path / "wd"
    attempt = workdir / "attempts" / "001"
    workdir.mkdir()  # made at intake; the shim enters it
    job = tiny_job(max_steps=100_000, checkpoint_every_steps=100_000)
    config = AttemptConfig(job=job, plan=Plan.initial(8), number=1, workdir=workdir, device=DeviceSpec(), probe=False)
    shim = start_shim(attempt, ["--workdir", str(workdir), "--pass-usr1"], runner_command(attempt), json.dumps(config.to_dict()))

    def step() -> int:
        try:
            return json.loads((attempt / HEARTBEAT).read_text())["step"]
        except (OSError, ValueError):
            return 0

    wait_until(lambda: step() >= 3 or shim.poll() is not None, 90, "the runner to train")
    assert shim.poll() is None, (attempt / "output.log").read_text()
    shim.send_signal(signal.SIGUSR1)  # Slurm's --signal=B:USR1 reaches the batch shell only
    assert shim.wait(timeout=60) == 0
    outcome = json.loads((attempt / OUTCOME).read_text())
    assert outcome["kind"] == "time_limit" and outcome["step"] >= 3, outcome
    # Nothing trained is lost: the checkpoint is at the step it stopped at.
    assert (workdir / "checkpoints" / f"step-{outcome['step']:06d}").is_dir()
    status = json.loads((attempt / EXIT_STATUS).read_text())
    assert status["returncode"] == EXIT_TIME_LIMIT and status["signals"] == ["SIGUSR1"]


def test_without_pass_usr1_the_command_is_not_signalled_and_the_shim_lives_on(tmp_path: Path) -> None:
    attempt = tmp_path / "a"
    script = "import time\nprint('ready', flush=True)\ntime.sleep(3)\nprint('done', flush=True)"
    shim = start_shim(attempt, [], [sys.executable, "-c", script], "{}")
    wait_until(lambda: (attempt / "output.log").exists() and "ready" in (attempt / "output.log").read_text(), 30, "the command to start")
    shim.send_signal(signal.SIGUSR1)
    assert shim.wait(timeout=30) == 0
    assert "done" in (attempt / "output.log").read_text()
    status = json.loads((attempt / EXIT_STATUS).read_text())
    assert status["returncode"] == 0 and status["signals"] == ["SIGUSR1"]


def test_a_signal_that_comes_before_the_runner_is_ready_is_not_its_death(tmp_path: Path) -> None:
    workdir = tmp_path / "wd"
    attempt = workdir / "attempts" / "001"
    workdir.mkdir()
    job = tiny_job(max_steps=100_000, checkpoint_every_steps=100_000)
    config = AttemptConfig(job=job, plan=Plan.initial(8), number=1, workdir=workdir, device=DeviceSpec(), probe=False)
    shim = start_shim(attempt, ["--workdir", str(workdir), "--pass-usr1"], runner_command(attempt), json.dumps(config.to_dict()))
    wait_until(lambda: (attempt / "output.log").exists(), 30, "the runner to start")
    shim.send_signal(signal.SIGUSR1)  # while the runner's interpreter starts: its handler is not in yet
    assert shim.wait(timeout=90) == 0
    outcome = json.loads((attempt / OUTCOME).read_text())
    assert outcome["kind"] == "time_limit", outcome  # passed on again once it could be heard
    status = json.loads((attempt / EXIT_STATUS).read_text())
    assert status["returncode"] == EXIT_TIME_LIMIT


SCRIPT = Path(__file__).parents[1] / "scripts" / "unconditional_like_train.py"


def test_an_accelerate_script_checkpoints_where_its_resume_finds_it_and_ends_time_limit(tmp_path: Path) -> None:
    """Through the bootstrap: the script, which knows nothing of the signal, saves
    checkpoint-N in its output folder at the step after it, ends "time_limit", and a relaunch
    with --resume_from_checkpoint latest ends where an uninterrupted run ends."""
    from oomguard.jobs.command import BOOTSTRAP_DIR

    env = {**runner_env(), "PYTHONPATH": str(BOOTSTRAP_DIR)}
    arguments = ["--num_epochs", "40", "--checkpointing_steps", "1000", "--resume_from_checkpoint", "latest"]

    def run(attempt: Path, output: Path, *, signal_at_step: int | None) -> str:
        process = subprocess.Popen(
            [sys.executable, "-m", "oomguard.daemon.shim", str(attempt), "--pass-usr1", "--", sys.executable, str(SCRIPT), "--output_dir", str(output), *arguments],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, env=env,
        )
        assert process.stdin is not None
        process.stdin.close()
        if signal_at_step is not None:
            wait_until(lambda: process.poll() is not None or f"step={signal_at_step}]" in _log(attempt), 120, "the script to train")
            process.send_signal(signal.SIGUSR1)
        assert process.wait(timeout=180) == 0
        return _log(attempt)

    uninterrupted = run(tmp_path / "plain", tmp_path / "plain-out", signal_at_step=None)
    stopped = run(tmp_path / "a1", tmp_path / "out", signal_at_step=3)
    outcome = json.loads((tmp_path / "a1" / OUTCOME).read_text())
    assert outcome["kind"] == "time_limit", stopped
    step = outcome["step"]
    assert step >= 3 and (tmp_path / "out" / f"checkpoint-{step}" / "oomguard.json").is_file()
    assert json.loads((tmp_path / "a1" / EXIT_STATUS).read_text())["returncode"] == EXIT_TIME_LIMIT
    resumed = run(tmp_path / "a2", tmp_path / "out", signal_at_step=None)
    assert f"Resuming from checkpoint checkpoint-{step}" in resumed
    done = [line for line in uninterrupted.splitlines() if line.startswith("done:")]
    assert done and done == [line for line in resumed.splitlines() if line.startswith("done:")]


def _log(attempt: Path) -> str:
    path = attempt / "output.log"
    return path.read_text() if path.exists() else ""
