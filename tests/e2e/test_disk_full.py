"""Issue 18's full-disk acceptance: a real daemon trains a job whose workdir is on a small tmpfs
that a ballast file has filled so that its third checkpoint has no room. The job waits for disk
(status and show say where and how much), its people get one message, and once the ballast is
gone it goes on by itself and ends with the weights of `oomguard run` of the same job file on a
disk with room."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.e2e.conftest import tiny_job, wait_for
from tests.e2e.conftest import oomguard as oomguard_cli
from tests.e2e.test_notifications import Endpoint, endpoint  # noqa: F401 - the fixture
from tests.jobs_helpers import assert_weights_allclose
from tests.small_disk import MiB, fill, small_disk

pytestmark = pytest.mark.slow

# A checkpoint of the tiny job takes about 0.6 MiB (616 KiB in 4 KiB pages), and one needs that
# and the 0.25 MiB reserve free: 1.75 MiB left free hold the checkpoints of steps 4 and 8 (the
# one of step 4 is pruned only after a newer one verifies) and not a third beside them, so that
# the checkpoint of step 12 cannot be written at all.
LEFT_FREE = 7 * MiB // 4
MAX_STEPS = 16


def weights(workdir: Path) -> dict:
    return load_file(workdir / "final" / "diffusion_pytorch_model.safetensors")


def test_a_full_disk_waits_notifies_once_and_the_job_finishes_with_the_uninterrupted_weights(
    tmp_path: Path, endpoint: Endpoint, daemon_factory,  # noqa: F811 - the fixture
) -> None:
    started = time.monotonic()
    job = tiny_job(tmp_path, name="full", max_steps=MAX_STEPS)
    # The reference, on a disk with room, trains while the daemon's job waits.
    reference_work = tmp_path / "reference"
    reference = subprocess.Popen(
        [sys.executable, "-m", "oomguard.daemon.cli", "run", str(job), "--workdir", str(reference_work), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    config = tmp_path / "apprise.txt"
    config.write_text(f"json://127.0.0.1:{endpoint.port}/global\n")
    with small_disk(tmp_path / "disk", 8 * MiB) as disk:
        workdir = disk / "work"
        workdir.mkdir()
        on_disk = tmp_path / "full-on-disk.toml"
        on_disk.write_text(f"workdir = {json.dumps(str(workdir))}\n" + job.read_text())
        ballast = fill(disk, leave=LEFT_FREE)
        daemon = daemon_factory("--notify-config", str(config))
        oomguard_cli("submit", str(on_disk), state_dir=daemon.state_dir, check=True)

        # The job waits for disk, its last verified checkpoints kept, and says so (rather than
        # a crash to retry: the wait ends at the first attempt that ended, to say which).
        def waiting_or_ended() -> dict | None:
            r = daemon.show("1")
            return r if r.get("disk_path") or any(a["outcome"] for a in r["attempts"]) else None

        record = wait_for(waiting_or_ended, 120, "an attempt to end")
        checkpoints = workdir / "checkpoints"
        outcomes = [(a["outcome"] or {}).get("kind") for a in record["attempts"]]
        assert record["state"] == "queued" and record.get("disk_path") == str(checkpoints), (outcomes, record.get("waiting"), record["events"][-1])
        assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000004", "step-000008"]
        (first,) = record["attempts"]
        outcome = first["outcome"]
        assert (outcome["kind"], outcome["step"], first["exit_code"]) == ("disk_full", 12, 5)
        assert outcome["disk_needed"] > outcome["disk_free"] and outcome["disk_needed"] == record["disk_wait_bytes"]
        note = re.compile(rf"waiting for disk: {re.escape(str(checkpoints))} needs \d+\.\d (KiB|MiB) free, has \d+\.\d (KiB|MiB)")
        status = oomguard_cli("status", state_dir=daemon.state_dir, check=True).stdout
        # rich folds a long cell over lines (within words too): compare without the folds.
        squashed = re.compile(re.sub(r"\\ |\\s| ", "", note.pattern))
        assert squashed.search(re.sub(r"[│\s]", "", status)), status
        shown = oomguard_cli("show", "1", state_dir=daemon.state_dir, check=True).stdout
        assert note.search(shown), shown
        assert "disk_full at step 12: no room for a checkpoint at" in shown

        def titles() -> list[str]:
            return [body["title"] for _, body in endpoint.received]

        wait_for(lambda: any("waiting_for_disk" in t for t in titles()), 30, "the waiting_for_disk notification")
        message = next(body["message"] for _, body in endpoint.received if "waiting_for_disk" in body["title"])
        assert f"what next: make room at {checkpoints}" in message and "starts the job again by itself" in message
        # It keeps waiting past a look at the disk (every 10 s): no attempt, no event, no message.
        events_before = len(daemon.show("1")["events"])
        time.sleep(12)
        record = daemon.show("1")
        assert record["state"] == "queued" and len(record["attempts"]) == 1 and len(record["events"]) == events_before
        assert titles() == ["oomguard: job 1 (full) waiting_for_disk"]
        waited = time.monotonic()

        ballast.unlink()
        record = daemon.wait_job("1", timeout=120)
        resumed_after = time.monotonic() - waited
        assert record["state"] == "finished", record
        kinds = [event["kind"] for event in record["events"]]
        assert kinds.count("waiting_for_disk") == 1 and kinds.count("resumed") == 1 and "retry" not in kinds
        first, second = record["attempts"]
        assert second["outcome"]["resumed_from"] == 8 and second["plan"] == first["plan"] and second["rung"] is None
        wait_for(lambda: len(titles()) == 2, 30, "the finished notification")
        assert titles() == ["oomguard: job 1 (full) waiting_for_disk", "oomguard: job 1 (full) finished"]

        stdout, stderr = reference.communicate(timeout=300)
        assert reference.returncode == 0, stdout + stderr
        worst = assert_weights_allclose(weights(workdir), weights(reference_work), rtol=1e-5, atol=1e-6)
    print(
        f"full-disk e2e: {time.monotonic() - started:.1f} s, resumed {resumed_after:.1f} s after the ballast went, "
        f"attempts {[a['outcome']['kind'] for a in record['attempts']]}, events {kinds}, max abs weight difference {worst:.3g}"
    )
