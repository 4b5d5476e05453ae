"""The lab box, end to end: a real daemon on two emulated GPUs, jobs of two users running as
those users, an OOM that recovers, a neighbour's spike that only makes a job wait, a daemon
killed with SIGKILL and restarted, and a third user who may not cancel someone else's job."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import as_root
from tests.e2e.conftest import Daemon, oomguard, wait_for
from tests.jobs_helpers import TINY_JOB

pytestmark = [as_root, pytest.mark.slow]

GPUS = "2x64MiB"

def big_batch_job(name: str, max_steps: int) -> str:
    """The tiny UNet at 32x32 with a batch of 48: the full batch needs more than a 64 MiB GPU,
    half of it fits. The probe is off, so the first attempt starts at the full batch and runs
    out of memory."""
    text = TINY_JOB.format(name=name, batch_size=48, max_steps=max_steps, checkpoint_every_steps=5, keep_checkpoints=2)
    text = text.replace('source = "synthetic:16"', 'source = "synthetic:48"').replace("resolution = 16", "resolution = 32")
    return text + "\n[ladder]\nprobe = false\n"


def as_user(account_name: str, *args: str, state: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`oomguard ARGS` run by that user, as they would in their shell."""
    return subprocess.run(
        ["runuser", "-u", account_name, "--", sys.executable, "-m", "oomguard.daemon.cli", "--state-dir", str(state), *args],
        capture_output=True, text=True, timeout=120, cwd=cwd, env={**os.environ, "HOME": str(cwd)},
    )


def write_job(home: Path, owner: Any, name: str, text: str) -> Path:
    path = home / f"{name}.toml"
    path.write_text(text)
    shutil.chown(path, owner.uid, owner.gid)
    return path


def attempts_of(record: dict[str, Any]) -> list[dict[str, Any]]:
    return record["attempts"]


def heartbeat_step(record: dict[str, Any]) -> int:
    return (record.get("heartbeat") or {}).get("step", 0)


def test_three_jobs_two_users_two_gpus_oom_neighbour_and_a_killed_daemon(lab: Path, accounts) -> None:
    alice, bob = accounts["alice"], accounts["bob"]
    state = lab / "state"
    tiny = lambda name, steps: TINY_JOB.format(name=name, batch_size=8, max_steps=steps, checkpoint_every_steps=10, keep_checkpoints=2)  # noqa: E731
    job_a = write_job(lab / "alice", alice, "alice-a", tiny("alice-a", 150))
    job_b = write_job(lab / "bob", bob, "bob-b", big_batch_job("bob-b", 24))
    job_c = write_job(lab / "alice", alice, "alice-c", tiny("alice-c", 30))

    daemon = Daemon(state, "--emulate-gpus", GPUS, "--gpu-sample-seconds", "0.5").start()
    try:
        for who, job in (("alice", job_a), ("bob", job_b), ("alice", job_c)):
            submitted = as_user(accounts[who].name, "submit", str(job), state=state, cwd=job.parent)
            assert submitted.returncode == 0 and "queued" in submitted.stdout, submitted.stderr

        # Placement: A and B get a GPU each (exclusive by default); C waits, saying why.
        a, b = (wait_for(lambda j=j: (r := daemon.show(j))["state"] == "running" and r, 60, f"job {j} to run") for j in ("1", "2"))
        gpus = {attempts_of(a)[0]["gpus"], attempts_of(b)[0]["gpus"]}
        assert gpus == {"0", "1"}
        waiting = wait_for(lambda: (r := daemon.show("3"))["waiting"] and r, 30, "job 3 to wait")
        assert waiting["state"] == "queued" and "GPU 0 is taken by job" in waiting["waiting"] and "GPU 1 is taken by job" in waiting["waiting"]
        status = oomguard("status", state_dir=state, check=True).stdout
        assert "waiting: needs 1 GPU" in status and "ogtest-alice" in status and "ogtest-bob" in status
        # Users read the daemon's store too (read-only), their own jobs and others'.
        seen_by_bob = as_user(bob.name, "status", state=state, cwd=lab / "bob")
        assert seen_by_bob.returncode == 0 and "alice-a" in seen_by_bob.stdout and "bob-b" in seen_by_bob.stdout, seen_by_bob.stderr
        not_his = as_user(bob.name, "logs", "1", state=state, cwd=lab / "bob")
        assert not_his.returncode == 1 and "it belongs to ogtest-alice" in not_his.stderr

        # A third user may not cancel alice's job; nothing changes.
        refused = as_user(accounts["carol"].name, "cancel", "3", state=state, cwd=lab / "carol")
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "ogtest-carol may not cancel job 3 (alice-c): it belongs to ogtest-alice" in refused.stderr
        assert not daemon.show("3")["cancel_requested"]

        # A neighbour takes nearly all of A's GPU for a few seconds: A stops and waits, then runs the same plan again.
        a = wait_for(lambda: heartbeat_step(r := daemon.show("1")) >= 3 and r, 90, "job 1 to reach step 3")
        a_gpu = attempts_of(a)[0]["gpus"]
        neighbour = subprocess.Popen(
            [sys.executable, "-m", "oomguard.daemon.cli", "--state-dir", str(state), "neighbour", "--gpu", a_gpu, "--take", "62MiB", "--seconds", "4"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        contention = wait_for(lambda: [e for e in daemon.show("1")["events"] if e["kind"] == "contention"], 60, "job 1 to see contention")
        assert contention[0]["code"] == "contention" and contention[0]["data"]["free_bytes"] > 0
        assert not [e for e in daemon.show("1")["events"] if e["kind"] == "escalated" and e["code"] == "ladder"]  # no rung for a neighbour
        a = wait_for(lambda: len(attempts_of(r := daemon.show("1"))) == 2 and r["state"] == "running" and r, 60, "job 1's second attempt")
        assert neighbour.wait(timeout=30) == 0
        first, second = attempts_of(a)
        assert first["outcome"]["kind"] == "oom"
        assert second["plan"] == first["outcome"]["plan"], "the retry after a neighbour's spike runs the same plan"
        assert not [e for e in a["events"] if e["kind"] == "escalated"], "no rung for a neighbour's spike"

        # B ran out of memory at its full batch and recovered.
        b = wait_for(lambda: (r := daemon.show("2"))["state"] != "queued" and heartbeat_step(r) >= 2 and r, 120, "job 2 to make progress")
        b_rungs = [e for e in b["events"] if e["kind"] == "escalated"]
        assert b_rungs, "job 2 should have taken a rung after its OOM"

        # Kill the daemon mid-run; a new one adopts what runs and finishes everything.
        wait_for(lambda: heartbeat_step(daemon.show("1")) > (first["outcome"]["step"] or 0), 60, "job 1's second attempt to train")
        attempts_before = {job: len(attempts_of(daemon.show(job))) for job in ("1", "2", "3")}
        assert daemon.process is not None
        daemon.process.send_signal(signal.SIGKILL)
        daemon.process.wait(timeout=10)
        running = [job for job in ("1", "2") if daemon.show(job)["state"] == "running"]
        assert running, "something must still run when the daemon is killed"
        daemon = Daemon(state, "--emulate-gpus", GPUS, "--gpu-sample-seconds", "0.5").start()
        records = {job: daemon.wait_job(job, timeout=400) for job in ("1", "2", "3")}
    finally:
        if daemon.alive():
            daemon.stop()

    for job, record in records.items():
        assert record["state"] == "finished", (job, record["result"], record["report"])
        workdir = Path(record["workdir"])
        owner = alice if record["owner"] == alice.name else bob
        # Everything the job wrote is its owner's: its processes ran as that user.
        for path in [workdir / "final", *workdir.glob("attempts/*/output.log"), *workdir.glob("checkpoints/*")]:
            assert path.stat().st_uid == owner.uid, path
        # No attempt ran twice: one runner start per attempt, and the adopted ones were not restarted.
        never_started = 0
        for attempt in record["attempts"]:
            log_path = Path(attempt["directory"], "output.log")
            if not log_path.exists():
                # The kill fell between recording this attempt and starting its shim (CI saw it):
                # the next daemon found no process and recorded it as never started.
                assert attempt["outcome"]["kind"] == "interrupted" and "never started" in attempt["outcome"]["message"], attempt
                never_started += 1
                continue
            log = log_path.read_text()
            assert log.count(f"attempt {attempt['number']} of job") == 1, log
            assert attempt["outcome"] is not None
        started = [e for e in record["events"] if e["kind"] == "started"]
        assert len(started) == len(record["attempts"]) - never_started
        assert never_started <= 1
        final_steps = [a["outcome"]["step"] for a in record["attempts"] if a["outcome"]["kind"] == "finished"]
        assert final_steps == [record["spec"]["train"]["max_steps"]]
    for job in running:
        # The attempt that ran across the kill was adopted, not started again.
        assert len(records[job]["attempts"]) == attempts_before[job]
    assert [r["owner"] for r in records.values()] == [alice.name, bob.name, alice.name]
    assert records["1"]["attempts"][1]["plan"] == records["1"]["attempts"][0]["outcome"]["plan"]
    samples = json.loads(oomguard("show", "1", "--json", state_dir=state, check=True).stdout)
    assert samples["state"] == "finished"
    gpus_table = oomguard("gpus", state_dir=state, check=True).stdout
    assert gpus_table.count("emulated 64.00 MiB") == 2, gpus_table
