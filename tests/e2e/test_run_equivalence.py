"""The quickstart job (cut to 20 steps) through `oomguard run`: once without a cap, once under a cap that forces
an OOM after the first checkpoint. Recovery through exact rungs (inside the runner) must end
with the same weights, after the same optimizer steps, none of them run twice."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.conftest import oomguard

pytestmark = pytest.mark.slow

QUICKSTART = Path(__file__).parents[2] / "jobs" / "examples" / "quickstart.toml"
# Emulated peaks of quickstart (measured): micro-batch 16 about 148 MiB, 8 about 81 MiB. The
# full batch runs until step 15, when the device shrinks to 100 MiB (as if another process
# took the rest); the first checkpoint is at step 10.
CAP = "200MiB,100MiB@15"


# The quickstart cut to 20 of its 40 steps (everything else as written): the OOM at step 15,
# the recovery and five steps after it are all still there, at half the training time.
STEPS = 20


def quickstart(folder: Path) -> Path:
    text = QUICKSTART.read_text()
    assert "\nmax_steps = 40 " in text, "the quickstart's max_steps line changed: update STEPS' comment"
    path = folder / "quickstart.toml"
    path.write_text(text.replace("\nmax_steps = 40 ", f"\nmax_steps = {STEPS} ", 1))
    return path


def run(workdir: Path, *extra: str) -> dict[str, Any]:
    job = quickstart(workdir.parent)
    result = oomguard("run", str(job), "--workdir", str(workdir), "--json", *extra, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def steps_trained(record: dict[str, Any]) -> list[int]:
    steps: list[int] = []
    for attempt in record["attempts"]:
        lines = (Path(attempt["directory"]) / "metrics.jsonl").read_text().splitlines()
        steps += [json.loads(line)["step"] for line in lines]
    return steps


def losses(record: dict[str, Any]) -> dict[int, float]:
    result: dict[int, float] = {}
    for attempt in record["attempts"]:
        for line in (Path(attempt["directory"]) / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            result[row["step"]] = row["loss"]
    return result


@pytest.fixture(scope="module")
def uncapped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run(tmp_path_factory.mktemp("uncapped") / "work")


@pytest.fixture(scope="module")
def recovered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run(tmp_path_factory.mktemp("capped") / "work", "--emulate-device-memory", CAP)


def test_the_capped_run_ooms_at_step_15_and_recovers_inside_the_runner(recovered: dict[str, Any]) -> None:
    assert recovered["state"] == "finished"
    (attempt,) = recovered["attempts"]
    outcome = attempt["outcome"]
    assert outcome["kind"] == "finished" and outcome["step"] == STEPS
    (recovery,) = [r for r in outcome["recoveries"] if r["step"] > 0]
    assert recovery["step"] == 15
    oom = [m for m in outcome["measurements"] if not m["fits"]]
    assert len(oom) == 1 and oom[0]["capacity"] == 100 * 2**20
    landed = outcome["plan"]
    assert landed["batch_size"] == 16 and (landed["micro_batch"] < 16 or landed["gradient_checkpointing"])


def test_same_optimizer_steps_none_repeated(uncapped: dict[str, Any], recovered: dict[str, Any]) -> None:
    assert steps_trained(uncapped) == list(range(1, STEPS + 1))
    assert steps_trained(recovered) == list(range(1, STEPS + 1))


def test_same_losses_and_same_final_weights(uncapped: dict[str, Any], recovered: dict[str, Any]) -> None:
    reference, other = losses(uncapped), losses(recovered)
    assert reference.keys() == other.keys()
    for step in reference:
        assert other[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step
    a = load_file(Path(uncapped["workdir"]) / "final" / "diffusion_pytorch_model.safetensors")
    b = load_file(Path(recovered["workdir"]) / "final" / "diffusion_pytorch_model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_demos_lines_say_it_ran_out_what_changed_and_that_it_resumed(recovered: dict[str, Any]) -> None:
    (escalated,) = [e["message"] for e in recovered["events"] if e["kind"] == "escalated" and "at step 15" in e["message"]]
    assert "out of memory in forward at step 15: tried to allocate" in escalated
    assert "micro-batch 16 -> 8, gradient accumulation 1 -> 2 (effective batch 16 kept)" in escalated
    assert escalated.endswith("resumed at step 15 in the same process")


def test_the_readmes_demo_follow_up_commands_work_as_written(recovered: dict[str, Any]) -> None:
    """`make demo` is this run (the same job file, there with all its 40 steps, and cap) in
    demo-workdir; the README's commands
    after it, and the Makefile's last lines, are run with this run's workdir in its place."""
    root = Path(__file__).parents[2]
    readme = (root / "README.md").read_text()
    demo = readme[readme.index("`make demo` runs"): readme.index("## A job file")]
    commands = re.findall(r"^(\.venv/bin/oomguard .+)$", demo, re.M)
    makefile = (root / "Makefile").read_text()
    assert f"DEMO_CAP ?= {CAP}" in makefile
    assert len(commands) == 2 and all(command.replace(".venv/bin", "$(BIN)") in makefile for command in commands)
    shown = {}
    for command in commands:
        argv = shlex.split(command.replace("demo-workdir", recovered["workdir"]))[1:]
        done = subprocess.run([sys.executable, "-m", "oomguard.daemon.cli", *argv], capture_output=True, text=True, timeout=60, cwd=root)
        assert done.returncode == 0, (command, done.stderr)
        shown[argv[-2]] = done.stdout
    assert "out of memory in forward at step 15; in-process -> [mb=8x2]" in shown["logs"]
    assert "step 15, in the runner: [mb=16x1] -> [mb=8x2]: out of memory in forward at step 15" in shown["show"]
    # `status` on the same state shows the plan the job ended on, not the one it started with.
    state_dir = shlex.split(commands[0].replace("demo-workdir", recovered["workdir"]))[2]
    status = subprocess.run(
        [sys.executable, "-m", "oomguard.daemon.cli", "--state-dir", state_dir, "status"], capture_output=True, text=True, timeout=60, cwd=root,
        env={**os.environ, "COLUMNS": "300"},
    )
    assert status.returncode == 0, status.stderr
    (row,) = [line for line in status.stdout.splitlines() if "quickstart" in line and "finished" in line]
    assert "mb=8x2" in row and "mb=16x1" not in row, row
