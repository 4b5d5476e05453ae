"""The daemon end to end: a job submitted with the CLI under an emulated cap runs out of
memory, steps down the ladder and finishes; a rung taken in the runner is an event while it
runs; a job waits behind another. (Restarts: test_daemon_restart.py; command jobs:
test_daemon_scripts.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from oomguard.daemon.cli.output import short_plan
from tests.e2e.conftest import TINY_CAP, oomguard, tiny_job, wait_for
from tests.jobs_helpers import TINY_JOB


pytestmark = pytest.mark.slow


def test_submitted_job_recovers_from_oom_in_process_and_finishes(tmp_path: Path, daemon_factory) -> None:
    # The cap drops from 64 MiB to 3500 KiB at step 5: the probe starts the job at the full
    # micro-batch, and the runner itself steps down when the drop comes.
    daemon = daemon_factory("--emulate-device-memory", TINY_CAP)
    submitted = oomguard("submit", str(tiny_job(tmp_path)), state_dir=daemon.state_dir, check=True)
    assert "job 1 (tiny) queued" in submitted.stdout

    record = daemon.wait_job("1")

    assert record["state"] == "finished", record["result"]
    (attempt,) = record["attempts"]
    assert attempt["plan"]["micro_batch"] == 8
    outcome = attempt["outcome"]
    assert outcome["kind"] == "finished" and outcome["step"] == 12
    (recovery,) = outcome["recoveries"]
    assert recovery["step"] == 5 and recovery["from"]["micro_batch"] == 8
    # Smaller activations: a smaller micro-batch, or checkpointing (whichever the memory
    # model expects to run faster).
    assert recovery["to"]["micro_batch"] < 8 or recovery["to"]["gradient_checkpointing"]
    assert outcome["plan"]["micro_batch"] == recovery["to"]["micro_batch"]
    assert [m["fits"] for m in outcome["measurements"]].count(False) == 1
    escalations = [e["data"] for e in record["events"] if e["kind"] == "escalated" and e["code"] == "in_runner"]
    assert [(d["step"], d["from"]) for d in escalations] == [(5, "mb=8x1")], escalations
    assert escalations[0]["to"] == short_plan(outcome["plan"])
    assert (Path(record["workdir"]) / "final" / "config.json").exists()
    status = oomguard("status", state_dir=daemon.state_dir, check=True).stdout
    assert "tiny" in status and "finished" in status
    logs = oomguard("logs", "1", state_dir=daemon.state_dir, check=True).stdout
    assert "probe: start at [mb=8x1]" in logs and "out of memory in" in logs and "at step 5; in-process" in logs
    shown = oomguard("show", "1", state_dir=daemon.state_dir, check=True).stdout
    assert "    step 5, in the runner: [mb=8x1] -> [" in shown
    assert "    measured [mb=1x8]: peak " in shown and "out of memory (needed more than" in shown


def test_an_oom_only_a_new_process_can_fix_ends_the_attempt_and_the_next_one_resumes(tmp_path: Path, daemon_factory) -> None:
    # A wide, low-resolution UNet: parameters, gradients and AdamW state (~10 MiB) dwarf the
    # activations, so no micro-batch fits once the device shrinks to 8 MiB at step 5; moving
    # the optimizer state to the host does, and that needs a new process.
    text = TINY_JOB.format(name="wide", batch_size=2, max_steps=8, checkpoint_every_steps=4, keep_checkpoints=2)
    text = text.replace("[8, 16]", "[32, 64]").replace("norm_num_groups = 4", "norm_num_groups = 8").replace("resolution = 16", "resolution = 8")
    job = tmp_path / "wide.toml"
    job.write_text(text + '\n[ladder]\nallow = ["micro_batch", "offload"]\n')
    daemon = daemon_factory("--emulate-device-memory", "64MiB,8MiB@5")
    oomguard("submit", str(job), state_dir=daemon.state_dir, check=True)

    record = daemon.wait_job("wide")

    assert record["state"] == "finished", record["result"]
    first, second = record["attempts"]
    assert first["outcome"]["kind"] == "oom" and first["outcome"]["step"] == 5
    assert first["outcome"]["recoveries"] == []  # nothing the running process could switch to
    assert "offload" in second["rung"] and "predicted peak" in second["reason"]
    assert second["plan"]["offload"] == "optimizer"
    assert second["outcome"]["resumed_from"] == 5
    assert second["outcome"]["kind"] == "finished" and second["outcome"]["step"] == 8


def test_a_rung_the_runner_takes_is_an_event_while_it_runs_and_cancel_stops_the_job(tmp_path: Path, daemon_factory) -> None:
    # One long job for both (a runner start is most of an e2e test's time): the cap drops at
    # step 3, the runner steps down by itself, and the escalation is an event while the attempt
    # still runs; then the job is cancelled.
    daemon = daemon_factory("--emulate-device-memory", "64MiB,3500KiB@3")
    oomguard("submit", str(tiny_job(tmp_path, max_steps=400)), state_dir=daemon.state_dir, check=True)

    def escalated_while_running():
        record = daemon.show("1")
        running = record["state"] == "running" and record["attempts"] and record["attempts"][-1]["outcome"] is None
        return running and [e for e in record["events"] if e["kind"] == "escalated"]

    (event,) = wait_for(escalated_while_running, 90, "an escalation event while the attempt runs")
    assert event["code"] == "in_runner" and event["data"]["step"] == 3 and event["data"]["from"] == "mb=8x1", event

    cancelled = oomguard("cancel", "tiny", state_dir=daemon.state_dir, check=True)
    assert "cancel requested for job 1" in cancelled.stdout
    record = daemon.wait_job("1")
    assert record["state"] == "cancelled"
    assert record["attempts"][0]["outcome"]["kind"] == "interrupted"
    # Reported once: not again when the attempt ended.
    assert [e["kind"] for e in record["events"]].count("escalated") == 1
    again = oomguard("cancel", "1", state_dir=daemon.state_dir)
    assert again.returncode == 1 and "already ended" in again.stderr
    missing = oomguard("show", "nope", state_dir=daemon.state_dir)
    assert missing.returncode == 3 and "no job 'nope'" in missing.stderr


def test_a_job_queued_behind_a_running_one_says_so_in_status(tmp_path: Path, daemon_factory) -> None:
    marker = tmp_path / "started"
    for name in ("first", "second"):
        (tmp_path / f"{name}.toml").write_text(
            f'name = "{name}"\ntrainer = "command"\n[command]\n'
            f'argv = ["{sys.executable}", "-c", "import pathlib, time; pathlib.Path(\\"{marker}\\").touch(); time.sleep(30)"]\n'
            "[train]\nbatch_size = 1\nmax_steps = 1\n"
        )
    daemon = daemon_factory()  # no GPUs: one job at a time
    submitted = oomguard("submit", str(tmp_path / "first.toml"), str(tmp_path / "second.toml"), state_dir=daemon.state_dir, check=True)
    assert submitted.stdout.splitlines() == ["job 1 (first) queued", "job 2 (second) queued"]  # one command, both answers
    wait_for(marker.exists, 60, "the first job to start")
    second = wait_for(lambda: (record := daemon.show("2"))["waiting"] and record, 30, "the second job's note")
    assert second["state"] == "queued" and second["waiting"].startswith("queued behind running job(s) 1 (without GPUs the daemon runs one at a time")
    oomguard("cancel", "1", state_dir=daemon.state_dir, check=True)
