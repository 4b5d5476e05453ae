"""Shared helpers for tests that start the real runner: a tiny job, attempt dirs, reading results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomguard.jobs.attempt import METRICS, OUTCOME, AttemptConfig
from oomguard.jobs.device import DeviceSpec
from oomguard.jobs.spec import JobSpec, parse_job_text
from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan
from tests import warm_runner

TINY_JOB = """\
name = "{name}"
trainer = "unconditional"

[data]
source = "synthetic:16"
resolution = 16

[model]
block_out_channels = [8, 16]
layers_per_block = 1
down_block_types = ["DownBlock2D", "DownBlock2D"]
up_block_types = ["UpBlock2D", "UpBlock2D"]
norm_num_groups = 4

[train]
batch_size = {batch_size}
max_steps = {max_steps}
learning_rate = 1e-3
seed = 0
checkpoint_every_steps = {checkpoint_every_steps}
keep_checkpoints = {keep_checkpoints}
"""


def tiny_job(
    name: str = "tiny",
    *,
    batch_size: int = 8,
    max_steps: int = 8,
    checkpoint_every_steps: int = 2,
    keep_checkpoints: int = 2,
) -> JobSpec:
    """A UNet small enough to train a step in milliseconds on a CPU."""
    text = TINY_JOB.format(
        name=name,
        batch_size=batch_size,
        max_steps=max_steps,
        checkpoint_every_steps=checkpoint_every_steps,
        keep_checkpoints=keep_checkpoints,
    )
    return parse_job_text(text, f"<{name}.toml>", base_dir=Path.cwd())


def write_attempt(
    attempt_dir: Path,
    job: JobSpec,
    workdir: Path,
    *,
    micro_batch: int | None = None,
    number: int = 1,
    cap: str | None = None,
    plan: Plan | None = None,
    probe: bool = False,
    recover_in_process: bool = True,
) -> Path:
    plan = plan or Plan.initial(job.train.batch_size, micro_batch=micro_batch)
    AttemptConfig(
        job=job, plan=plan, number=number, workdir=workdir, device=DeviceSpec.from_option(cap), probe=probe, recover_in_process=recover_in_process
    ).write(attempt_dir)
    return attempt_dir


def runner_command(attempt_dir: Path) -> list[str]:
    return [sys.executable, "-m", "oomguard.jobs.run", str(attempt_dir)]


def runner_env() -> dict[str, str]:
    # Two test runners may share a small machine: one thread each keeps them from fighting,
    # and keeps float reductions in the same order from run to run.
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@dataclass
class RunResult:
    attempt_dir: Path
    returncode: int
    stdout: str
    stderr: str

    @property
    def outcome(self) -> Outcome:
        return Outcome.from_dict(json.loads((self.attempt_dir / OUTCOME).read_text()))

    @property
    def metrics(self) -> list[dict[str, Any]]:
        return read_metrics(self.attempt_dir)

    def __str__(self) -> str:  # shown by failed asserts
        return f"exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr[-3000:]}"


def run_runner(attempt_dir: Path, timeout: float = 120) -> RunResult:
    return run_runners([attempt_dir], timeout)[0]


def run_runners(attempt_dirs: list[Path], timeout: float = 180) -> list[RunResult]:
    """Run several attempts side by side (each runner uses one thread) and wait for all. Each
    is forked from a process that has imported torch already (tests/warm_runner.py); a
    text-to-image job's runner starts cold: the warm server has switched off the diffusers
    integrations (transformers, peft) that trainer needs."""
    runners = [warm_runner.start(d, runner_env()) if _warm_server_can_run(d) else _ColdRunner(d) for d in attempt_dirs]
    results = []
    try:
        for attempt_dir, runner in zip(attempt_dirs, runners):
            returncode, stdout, stderr = runner.wait(timeout)
            results.append(RunResult(attempt_dir, returncode, stdout, stderr))
    finally:
        for runner in runners:
            runner.kill()
    return results


def _warm_server_can_run(attempt_dir: Path) -> bool:
    return AttemptConfig.read(attempt_dir).job.trainer == "unconditional"


class _ColdRunner:
    """A runner started as the daemon starts it (``python -m oomguard.jobs.run``), with the
    interface of a warm one."""

    def __init__(self, attempt_dir: Path) -> None:
        self.process = subprocess.Popen(runner_command(attempt_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=runner_env())

    def wait(self, timeout: float) -> tuple[int, str, str]:
        stdout, stderr = self.process.communicate(timeout=timeout)
        return self.process.returncode, stdout, stderr

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


@contextmanager
def running_runner(attempt_dir: Path, extra_env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    """A started runner that is killed on the way out if the test left it running."""
    process = start_runner(attempt_dir, extra_env)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def start_runner(attempt_dir: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    log = (attempt_dir / "output.log").open("w")
    return subprocess.Popen(
        runner_command(attempt_dir), stdout=log, stderr=subprocess.STDOUT, text=True, env={**runner_env(), **(extra_env or {})}
    )


def read_metrics(attempt_dir: Path) -> list[dict[str, Any]]:
    path = attempt_dir / METRICS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_final(workdir: Path):  # -> dict[str, torch.Tensor]
    """The final model's weights, loaded the way a user would (diffusers from_pretrained)."""
    from diffusers import UNet2DModel

    model = UNet2DModel.from_pretrained(workdir / "final")
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def max_abs_difference(a, b, names=None) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in (names or a))


def assert_weights_allclose(a, b, *, rtol: float = 1e-5, atol: float = 1e-6) -> float:
    """Assert every weight allclose; returns the max abs difference."""
    import torch

    names = list(a)
    assert a.keys() == b.keys()
    bad = [k for k in names if not torch.allclose(a[k], b[k], rtol=rtol, atol=atol)]
    worst = max_abs_difference(a, b, names)
    assert not bad, f"weights differ beyond rtol={rtol} atol={atol} (max abs {worst:.3g}): {bad}"
    return worst


def final_output(workdir: Path):  # -> torch.Tensor
    """The final model's prediction for a fixed input: what the weights mean."""
    import torch
    from diffusers import UNet2DModel

    model = UNet2DModel.from_pretrained(workdir / "final").eval()
    size = model.config.sample_size
    generator = torch.Generator().manual_seed(1234)
    sample = torch.randn((4, model.config.in_channels, size, size), generator=generator)
    with torch.no_grad():
        return model(sample, torch.tensor([10, 200, 500, 900])).sample


def checkpoint_steps(workdir: Path) -> list[int]:
    """Steps of the complete checkpoint directories (not the temporary ones), oldest first."""
    directory = workdir / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted(int(p.name.split("-")[1]) for p in directory.iterdir() if p.is_dir() and p.name.startswith("step-"))


def wait_for_checkpoint(workdir: Path, process: subprocess.Popen[str], timeout: float = 60) -> int:
    """Poll (every few ms) until the runner has written its first checkpoint; return its step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = checkpoint_steps(workdir)
        if steps:
            return steps[0]
        if process.poll() is not None:
            raise AssertionError(f"the runner exited with {process.returncode} before its first checkpoint")
        time.sleep(0.003)
    process.kill()
    raise AssertionError(f"no checkpoint under {workdir} after {timeout} s")


__all__ = [
    "RunResult",
    "assert_weights_allclose",
    "checkpoint_steps",
    "final_output",
    "wait_for_checkpoint",
    "load_final",
    "max_abs_difference",
    "read_metrics",
    "run_runner",
    "run_runners",
    "running_runner",
    "start_runner",
    "tiny_job",
    "write_attempt",
]
