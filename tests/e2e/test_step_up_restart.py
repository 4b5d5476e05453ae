"""Stepping back up through a rung that needs a new process, through `oomguard run` (the real
supervisor, shim and runner processes): a job whose model state dominates steps down to the
offload rung when a neighbour takes most of the device (the only rung it allows), and back up to
its own plan once the room is back, at a checkpoint boundary, through a restart ("replan", no
try used). The neighbour comes back once just after the step up: the step up does not hold,
the runner goes back to the plan that worked in a new process, waits one boundary more, and
steps up again when the neighbour has left for good. Offload is exact, so the run ends with
the weights of the run that never had a neighbour. A job on the 8-bit optimizer (approximate)
that steps off it is told the rest of its run is exact again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.conftest import oomguard
from tests.jobs_helpers import TINY_JOB

pytestmark = pytest.mark.slow

# The tiny job with wide blocks at 8 px, so that its optimizer state weighs half its peak.
# Emulated peaks (measured): about 10.2 MiB under its own plan, 5.2 MiB with the optimizer state
# in host memory (the state is 5 MiB of it). 8 MiB fits only the offloaded plan.
WIDE = {"block_out_channels = [8, 16]": "block_out_channels = [32, 64]", "resolution = 16": "resolution = 8", "norm_num_groups = 4": "norm_num_groups = 8"}


def job_text(name: str, rung: str) -> str:
    text = TINY_JOB.format(name=name, batch_size=4, max_steps=24, checkpoint_every_steps=2, keep_checkpoints=2)
    for tiny, wide in WIDE.items():
        assert tiny in text, tiny
        text = text.replace(tiny, wide)
    # Two tries: a step up (or its way back) that cost one would leave none for the rest.
    return text + f'[ladder]\nallow = ["{rung}"]\nmax_attempts = 2\n'


# A neighbour takes all but 8 MiB from step 5 to 9, and again from 11 (just after the first step
# up, at 10) to 17.
NEIGHBOUR = "64MiB,8MiB@5,64MiB@9,8MiB@11,64MiB@17"


def run(folder: Path, rung: str, *extra: str) -> dict[str, Any]:
    job = folder / "job.toml"
    job.write_text(job_text(f"up-{rung}", rung))
    result = oomguard("run", str(job), "--workdir", str(folder / "work"), "--json", *extra, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def steps_trained(record: dict[str, Any]) -> list[int]:
    return [
        json.loads(line)["step"] for attempt in record["attempts"]
        for line in (Path(attempt["directory"]) / "metrics.jsonl").read_text().splitlines()
    ]


def final_weights(record: dict[str, Any]) -> dict[str, torch.Tensor]:
    (path,) = (Path(record["workdir"]) / "final").glob("*.safetensors")
    return load_file(path)


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run(tmp_path_factory.mktemp("alone"), "offload")


@pytest.fixture(scope="module")
def neighboured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run(tmp_path_factory.mktemp("neighboured"), "offload", "--emulate-device-memory", NEIGHBOUR)


def test_it_steps_down_then_back_up_through_a_restart_and_back_when_the_step_up_does_not_hold(neighboured: dict[str, Any]) -> None:
    assert neighboured["state"] == "finished"
    ended = [(a["outcome"]["kind"], a["outcome"]["step"], a["outcome"]["plan"]["offload"]) for a in neighboured["attempts"]]
    assert ended == [
        ("oom", 5, "none"),  # the neighbour came: offload, by the doctor
        ("replan", 10, "optimizer"),  # the room is back at the boundary at 10: up, in a new process
        ("replan", 11, "none"),  # the neighbour came back: the step up did not hold, back to offload
        ("replan", 18, "optimizer"),  # it waited a boundary (12), then the room came back at 17: up at 18
        ("finished", 24, "none"),
    ]
    codes = [(e["kind"], e["code"]) for e in neighboured["events"] if e["code"] in ("step_up", "step_up_failed", "replan") and e["kind"] != "attempt-ended"]
    assert codes == [
        ("stepped-up", "step_up"), ("requeued", "replan"),
        ("escalated", "step_up_failed"), ("requeued", "replan"),
        ("stepped-up", "step_up"), ("requeued", "replan"),
    ]
    (failed,) = [e["message"] for e in neighboured["events"] if e["code"] == "step_up_failed"]
    assert "the step back up did not hold: back to the plan that worked; the next try after 1 checkpoint(s)" in failed
    assert failed.endswith("a new process goes on from the checkpoint at step 11")
    up = next(e["message"] for e in neighboured["events"] if e["code"] == "step_up")
    assert "stepped back up to [mb=4x1]" in up and "a new process resumes from the checkpoint at step 10 under it" in up


def test_each_step_is_trained_once_and_the_weights_are_those_of_the_run_without_a_neighbour(
    alone: dict[str, Any], neighboured: dict[str, Any]
) -> None:
    assert steps_trained(alone) == steps_trained(neighboured) == list(range(1, 25))
    reference, stepped = final_weights(alone), final_weights(neighboured)
    assert reference.keys() == stepped.keys()
    for name in reference:
        torch.testing.assert_close(stepped[name], reference[name], rtol=1e-5, atol=1e-6, msg=name)


def test_stepping_off_an_approximate_rung_says_the_rest_of_the_run_is_exact_again(tmp_path: Path) -> None:
    record = run(tmp_path, "optimizer_8bit", "--emulate-device-memory", "64MiB,8MiB@5,64MiB@9")
    assert record["state"] == "finished"
    assert [a["outcome"]["plan"]["optimizer"] for a in record["attempts"]] == ["adamw", "adamw8bit", "adamw"]
    (up,) = [e["message"] for e in record["events"] if e["code"] == "step_up"]
    assert up.endswith("off the approximate rung optimizer_8bit: the rest of the run is exact again; a new process resumes from the checkpoint at step 10 under it")
