"""The daemon end to end: a job submitted with the CLI under an emulated cap runs out of
memory, steps down the ladder, resumes from its checkpoint and finishes; the daemon can be
stopped and started again without losing anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import TINY_CAP, oomguard, tiny_job, wait_for

pytestmark = pytest.mark.slow


def test_submitted_job_recovers_from_oom_and_finishes(tmp_path: Path, daemon_factory) -> None:
    daemon = daemon_factory("--emulate-device-memory", TINY_CAP)
    submitted = oomguard("submit", str(tiny_job(tmp_path)), state_dir=daemon.state_dir, check=True)
    assert "job 1 (tiny) queued" in submitted.stdout

    record = daemon.wait_job("1")

    assert record["state"] == "finished", record["result"]
    attempts = record["attempts"]
    assert len(attempts) >= 2
    first, second = attempts[0], attempts[1]
    assert first["outcome"]["kind"] == "oom" and first["outcome"]["step"] == 5
    assert first["outcome"]["phase"] in ("forward", "backward")
    assert first["plan"]["micro_batch"] == 8
    assert second["rung"] == "micro_batch" and "micro-batch 8 -> 4" in second["reason"]
    assert second["plan"]["micro_batch"] == 4 and second["plan"]["batch_size"] == 8
    assert second["outcome"]["resumed_from"] == 5
    assert attempts[-1]["outcome"]["kind"] == "finished" and attempts[-1]["outcome"]["step"] == 12
    assert (Path(record["workdir"]) / "final" / "config.json").exists()
    status = oomguard("status", state_dir=daemon.state_dir, check=True).stdout
    assert "tiny" in status and "finished" in status
    logs = oomguard("logs", "1", state_dir=daemon.state_dir, check=True).stdout
    assert "== attempt 2 (mb=4x2) ==" in logs and "resumed from checkpoint at step 5" in logs


def test_stopping_and_restarting_the_daemon_loses_nothing(tmp_path: Path, daemon_factory) -> None:
    state_dir = tmp_path / "state"
    daemon = daemon_factory(state_dir=state_dir)
    oomguard("submit", str(tiny_job(tmp_path, max_steps=40)), state_dir=state_dir, check=True)
    wait_for(lambda: (daemon.show("1").get("heartbeat") or {}).get("step", 0) >= 2, 90, "training to start")

    assert daemon.stop() == 0
    stopped = daemon.show("1")
    assert stopped["state"] == "queued"
    interrupted = stopped["attempts"][0]["outcome"]
    assert interrupted["kind"] == "interrupted"
    stopped_at = interrupted["step"]
    assert (Path(stopped["workdir"]) / "checkpoints" / f"step-{stopped_at:06d}").is_dir()

    restarted = daemon_factory(state_dir=state_dir)
    record = restarted.wait_job("1")
    assert record["state"] == "finished"
    assert [a["number"] for a in record["attempts"]] == [1, 2]
    assert record["attempts"][1]["outcome"]["resumed_from"] == stopped_at
    assert record["attempts"][1]["outcome"]["step"] == 40
    kinds = [e["kind"] for e in record["events"]]
    assert kinds.count("queued") == 1 and "requeued" in kinds and kinds[-1] == "finished"


def test_cancel_checkpoints_and_stops_the_job(tmp_path: Path, daemon_factory) -> None:
    daemon = daemon_factory()
    oomguard("submit", str(tiny_job(tmp_path, max_steps=400)), state_dir=daemon.state_dir, check=True)
    wait_for(lambda: (daemon.show("tiny").get("heartbeat") or {}).get("step", 0) >= 1, 90, "training to start")

    cancelled = oomguard("cancel", "tiny", state_dir=daemon.state_dir, check=True)
    assert "cancel requested for job 1" in cancelled.stdout
    record = daemon.wait_job("1")
    assert record["state"] == "cancelled"
    assert record["attempts"][0]["outcome"]["kind"] == "interrupted"
    again = oomguard("cancel", "1", state_dir=daemon.state_dir)
    assert again.returncode == 1 and "already ended" in again.stderr
    missing = oomguard("show", "nope", state_dir=daemon.state_dir)
    assert missing.returncode == 3 and "no job 'nope'" in missing.stderr


def test_a_killed_daemon_adopts_the_attempt_it_left_running(tmp_path: Path, daemon_factory) -> None:
    state_dir = tmp_path / "state"
    daemon = daemon_factory(state_dir=state_dir)
    oomguard("submit", str(tiny_job(tmp_path, max_steps=60)), state_dir=state_dir, check=True)
    wait_for(lambda: (daemon.show("1").get("heartbeat") or {}).get("step", 0) >= 2, 90, "training to start")

    daemon.process.kill()  # SIGKILL: no chance to stop the runner, which has its own session
    daemon.process.wait()
    restarted = daemon_factory(state_dir=state_dir)
    record = restarted.wait_job("1")

    assert record["state"] == "finished"
    # The same attempt carried on: nothing was run twice.
    assert len(record["attempts"]) == 1
    assert record["attempts"][0]["outcome"]["kind"] == "finished"
    assert record["attempts"][0]["outcome"]["resumed_from"] is None
