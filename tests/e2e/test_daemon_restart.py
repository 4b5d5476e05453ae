"""The daemon end to end, stopped and started again: a stop requeues and the next daemon resumes
from the checkpoint; a SIGTERMed or killed daemon leaves its attempt running and the next one
adopts it. Nothing is lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import oomguard, tiny_job, wait_for

pytestmark = pytest.mark.slow

# Enough steps that a stop or a leaving daemon comes before the end: a tiny step takes a few
# milliseconds on a fast, quiet machine, and 40 or 60 were done before the daemon stopped.
STEPS = 150


def test_stopping_and_restarting_the_daemon_loses_nothing(tmp_path: Path, daemon_factory) -> None:
    state_dir = tmp_path / "state"
    daemon = daemon_factory("--stop-jobs", state_dir=state_dir)
    oomguard("submit", str(tiny_job(tmp_path, max_steps=STEPS)), state_dir=state_dir, check=True)
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
    assert record["attempts"][1]["outcome"]["step"] == STEPS
    kinds = [e["kind"] for e in record["events"]]
    assert kinds.count("queued") == 1 and "requeued" in kinds and kinds[-1] == "finished"


def test_sigterm_leaves_the_attempt_running_and_the_next_daemon_adopts_it(tmp_path: Path, daemon_factory) -> None:
    state_dir = tmp_path / "state"
    daemon = daemon_factory(state_dir=state_dir)
    oomguard("submit", str(tiny_job(tmp_path, max_steps=STEPS)), state_dir=state_dir, check=True)
    wait_for(lambda: (daemon.show("1").get("heartbeat") or {}).get("step", 0) >= 2, 90, "training to start")
    runner_pid = daemon.show("1")["attempts"][0]["pid"]

    assert daemon.stop(timeout=10) == 0  # at once: nothing to wait for
    assert "leaving running attempts running" in daemon.output()
    Path(f"/proc/{runner_pid}").stat()  # the runner goes on without a daemon
    assert daemon.show("1")["state"] == "running"

    restarted = daemon_factory(state_dir=state_dir)
    record = restarted.wait_job("1")
    assert record["state"] == "finished"
    (attempt,) = record["attempts"]  # adopted: nothing ran twice
    assert attempt["outcome"]["kind"] == "finished" and attempt["outcome"]["resumed_from"] is None


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
