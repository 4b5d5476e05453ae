"""Notifications from a real daemon to a real HTTP endpoint on localhost (apprise json://),
a dead endpoint beside it, and the report PNG of the jobs that sent them."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import oomguard, wait_for
from tests.e2e.test_lab_box import big_batch_job
from tests.jobs_helpers import TINY_JOB

pytestmark = pytest.mark.slow


class Endpoint:
    """An HTTP server that records the JSON bodies posted to it, by path."""

    def __init__(self) -> None:
        received: list[tuple[str, dict[str, Any]]] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                received.append((self.path, json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.received = received
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    server = Endpoint()
    yield server
    server.close()


def dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens here once the socket closes


def test_failed_and_finished_jobs_notify_and_a_dead_endpoint_disturbs_nothing(tmp_path: Path, endpoint: Endpoint, daemon_factory) -> None:
    config = tmp_path / "apprise.txt"
    config.write_text(f"json://127.0.0.1:{endpoint.port}/global\n")  # apprise's TEXT config: untagged, for every job
    dead = dead_port()
    # The failing job: its full batch does not fit the GPU and it allows no rung at all.
    failing = tmp_path / "doomed.toml"
    failing.write_text(
        big_batch_job("doomed", 10).replace("probe = false", "probe = false\nallow = []")
        + f'[notify]\nurls = ["json://user:secret@127.0.0.1:{endpoint.port}/job", "json://127.0.0.1:{dead}/dead"]\n'
    )
    finishing = tmp_path / "fine.toml"
    finishing.write_text(TINY_JOB.format(name="fine", batch_size=8, max_steps=8, checkpoint_every_steps=4, keep_checkpoints=2))

    daemon = daemon_factory("--emulate-gpus", "64MiB", "--notify-config", str(config))
    oomguard("submit", str(failing), state_dir=daemon.state_dir, check=True)
    oomguard("submit", str(finishing), state_dir=daemon.state_dir, check=True)
    doomed, fine = daemon.wait_job("1"), daemon.wait_job("2")
    assert doomed["state"] == "failed" and fine["state"] == "finished"

    def arrived(path: str, title: str) -> list[dict[str, Any]]:
        return [body for at, body in endpoint.received if at == path and title in body["title"]]

    failed_global = wait_for(lambda: arrived("/global", "job 1 (doomed) failed"), 30, "the failed notification")
    failed_own = wait_for(lambda: arrived("/job", "job 1 (doomed) failed"), 30, "the failed notification to the job's own URL")
    finished = wait_for(lambda: arrived("/global", "job 2 (fine) finished"), 30, "the finished notification")
    message = failed_global[0]["message"]
    for line in ("job: 1 (doomed)", "user: root", "event: failed", "attempts: 1", "plan: mb=48x1", "step: 0 of 10", "GPUs: 0"):
        assert line in message, message
    assert "memory: peak " in message and " of cap " in message
    assert "what next: nothing more: the job has ended; `oomguard show 1`" in message
    assert failed_own[0]["message"] == message
    assert "what next: nothing: the final model is in" in finished[0]["message"]
    assert "step: 8 of 8" in finished[0]["message"]
    # Each event once: duplicates are throttled, and nothing is sent for events not asked for.
    assert len(arrived("/global", "job 1 (doomed) failed")) == 1
    assert not [body for _, body in endpoint.received if "escalated" in body["title"]]

    # The dead endpoint: logged and retried, and the daemon carries on (both jobs ended above,
    # and it still answers and stops at once).
    wait_for(lambda: f"127.0.0.1:{dead}" in daemon.output() and "try 1 of" in daemon.output(), 30, "the failed delivery to be logged")
    status = oomguard("status", state_dir=daemon.state_dir, check=True)
    assert "doomed" in status.stdout
    assert daemon.stop(timeout=30) == 0
    # The job's secret never reaches the shared store or the logs.
    record = json.loads(oomguard("show", "1", "--json", state_dir=daemon.state_dir, check=True).stdout)
    assert "secret" not in json.dumps(record)
    assert "secret" not in daemon.output()
    assert record["spec"]["notify"]["urls"][0].startswith("json://user:")

    # The report of the finished job: a PNG of its memory over time.
    report = tmp_path / "fine.png"
    written = oomguard("report", "2", "-o", str(report), state_dir=daemon.state_dir, check=True)
    assert str(report) in written.stdout
    assert report.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_stalled_attempt_is_reported_once_and_the_job_still_finishes(tmp_path: Path, endpoint: Endpoint, daemon_factory) -> None:
    job = tmp_path / "slow.toml"
    job.write_text(
        # Steps enough to stop it before its end (60 take about 2 s on a quiet machine).
        TINY_JOB.format(name="slow", batch_size=8, max_steps=200, checkpoint_every_steps=20, keep_checkpoints=2)
        + f'[notify]\nurls = ["json://127.0.0.1:{endpoint.port}/job"]\nevents = ["stalled", "finished"]\n'
    )
    # Long enough for the runner to start (torch loads before the first heartbeat).
    daemon = daemon_factory("--stall-after", "15")
    oomguard("submit", str(job), state_dir=daemon.state_dir, check=True)
    record = wait_for(lambda: (r := daemon.show("1"))["heartbeat"] and r["heartbeat"]["step"] >= 2 and r, 120, "the job to train")
    shim = record["attempts"][0]["pid"]
    os.killpg(shim, signal.SIGSTOP)  # the runner hangs: no heartbeat any more
    try:
        stalled = wait_for(lambda: [e for e in daemon.show("1")["events"] if e["kind"] == "stalled"], 60, "the stalled event")
        assert "has written no heartbeat for" in stalled[0]["message"]
        message = wait_for(lambda: [b for at, b in endpoint.received if "stalled" in b["title"]], 30, "the stalled notification")
        assert "what next: oomguard keeps it running" in message[0]["message"] and "oomguard cancel 1" in message[0]["message"]
    finally:
        os.killpg(shim, signal.SIGCONT)
    assert daemon.wait_job("1")["state"] == "finished"
    assert len([e for e in daemon.show("1")["events"] if e["kind"] == "stalled"]) == 1
    wait_for(lambda: [b for at, b in endpoint.received if "finished" in b["title"]], 30, "the finished notification")


def test_memory_that_creeps_up_is_reported_with_its_rate_before_the_oom_it_ends_in(
    tmp_path: Path, endpoint: Endpoint, daemon_factory, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job that keeps 128 KiB more on its device every step (a leak in a callback) under a cap
    it outgrows near step 120: the daemon reads its step timeline while it runs and warns, with
    the rate and the steps, well before the OOM."""
    monkeypatch.setenv("OOMGUARD_INJECT_FAULT", "leak_per_step@131072")
    job = tmp_path / "leaky.toml"
    job.write_text(
        TINY_JOB.format(name="leaky", batch_size=8, max_steps=400, checkpoint_every_steps=1000, keep_checkpoints=2)
        + "[ladder]\nprobe = false\n"
        + f'[notify]\nurls = ["json://127.0.0.1:{endpoint.port}/job"]\nevents = ["creep"]\n'
    )
    # About 4.3 MiB a step, and 15 MiB of leak to grow into.
    daemon = daemon_factory("--emulate-device-memory", "19MiB")
    oomguard("submit", str(job), state_dir=daemon.state_dir, check=True)
    ended = wait_for(lambda: [e for e in daemon.show("1")["events"] if e["kind"] == "attempt-ended"], 120, "the first attempt to end")
    oomguard("cancel", "1", state_dir=daemon.state_dir, check=True)
    events = daemon.show("1")["events"]
    creep = [e for e in events if e["kind"] == "creep"]
    assert len(creep) == 1, events
    assert ended[0]["code"] == "oom", ended
    assert creep[0]["id"] < ended[0]["id"], "the warning comes before the OOM"
    message = creep[0]["message"]
    assert "device memory creeps up" in message and "per step" in message and "over steps" in message, message
    # The rate it names is the leak's, within the floors' jitter.
    rate = creep[0]["data"]["bytes_per_step"]
    assert 0.8 * 131072 < rate < 1.2 * 131072, creep[0]
    assert creep[0]["data"]["last_step"] < ended[0]["data"]["step"]
    notified = wait_for(lambda: [b for at, b in endpoint.received if "creep" in b["title"]], 30, "the creep notification")
    assert "creeps up" in notified[0]["message"]
    print(f"creep: {message} (the OOM at step {ended[0]['data']['step']})")
