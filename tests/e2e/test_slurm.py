"""The daemon on a real Slurm cluster (tests/slurm_cluster.py: slurmctld, slurmd and munged on
this machine, fake GPUs as gres): each attempt one sbatch, OOMs resubmitted with the doctor's
plan, a job over its --mem given more, a killed daemon's attempts adopted by their Slurm job
ids, and cancels from either side. The time limit's continuation, which takes minutes, is in
test_slurm_time_limit.py (a worker and a cluster of its own).

Skipped, with the reason, where no cluster can start (not root, Slurm not installed)."""

from __future__ import annotations

import json
import os
import pwd
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from oomguard.daemon.config import SlurmConfig
from oomguard.daemon.launch import Handle, LaunchRequest
from oomguard.daemon.launch.slurm import SlurmLauncher
from oomguard.daemon.users import Account
from tests.e2e.conftest import TINY_CAP, oomguard, wait_for
from tests.e2e.slurm_jobs import attempts_of, cluster, daemon_config, job_file  # noqa: F401 - cluster is a fixture
from tests.slurm_cluster import SlurmCluster, slurm_cluster, wait_for_state  # noqa: F401 - slurm_cluster is a fixture

pytestmark = pytest.mark.slow


def test_an_oom_is_resubmitted_with_the_doctors_plan_and_ends_with_the_weights_of_a_local_run(tmp_path: Path, daemon_factory, cluster) -> None:
    # In-process recovery off: the OOM ends the Slurm job, and the next plan is a new sbatch.
    job = job_file(tmp_path, "oom", max_steps=12, extra="\n[ladder]\nprobe = false\nin_process = false\n")
    state = tmp_path / "state"
    daemon = daemon_factory("--config", str(daemon_config(tmp_path)), "--emulate-device-memory", TINY_CAP, state_dir=state)
    oomguard("submit", str(job), state_dir=state, check=True)
    record = daemon.wait_job("1", timeout=300)

    assert record["state"] == "finished", daemon.output()
    first, second = attempts_of(record)
    assert first["outcome"]["kind"] == "oom" and second["outcome"]["kind"] == "finished"
    assert second["outcome"]["resumed_from"] == first["outcome"]["step"] >= 4  # nothing trained before the OOM is lost
    # The doctor's plan (an exact rung), not the one that ran out of memory.
    (escalated,) = [e for e in record["events"] if e["kind"] == "escalated"]
    assert second["plan"] != first["plan"] and escalated["data"]["from"] == "mb=8x1" and escalated["data"]["to"] != "mb=8x1"
    # Two Slurm jobs, one per attempt, each ended as Slurm saw it.
    assert first["scheduler_id"] != second["scheduler_id"]
    assert cluster.job(second["scheduler_id"])["JobState"] == "COMPLETED"

    # The same job file, uncapped, on this machine: one attempt, no OOM.
    local = oomguard("run", str(job), "--workdir", str(tmp_path / "local"), "--json", timeout=300)
    assert local.returncode == 0, local.stdout + local.stderr
    on_slurm = load_file(str(Path(record["workdir"]) / "final" / "diffusion_pytorch_model.safetensors"))
    uninterrupted = load_file(str(tmp_path / "local" / "final" / "diffusion_pytorch_model.safetensors"))
    assert on_slurm.keys() == uninterrupted.keys()
    for key in on_slurm:
        assert torch.allclose(on_slurm[key], uninterrupted[key], rtol=1e-5, atol=1e-6), key


def test_a_job_over_its_mem_ends_as_host_oom_and_is_given_more(tmp_path: Path, daemon_factory, cluster) -> None:
    # 250 MiB is less than the runner needs (about 375 MiB at its peak, torch loaded): the
    # cgroup's OOM killer ends it; twice that is enough.
    job = job_file(tmp_path, "hungry", max_steps=8, extra='\n[resources]\nhost_memory = "250MiB"\n')
    state = tmp_path / "state"
    daemon = daemon_factory("--config", str(daemon_config(tmp_path)), state_dir=state)
    oomguard("submit", str(job), state_dir=state, check=True)
    record = daemon.wait_job("1", timeout=300)

    assert record["state"] == "finished", daemon.output()
    attempts = attempts_of(record)
    host_ooms = [a for a in attempts if a["outcome"]["kind"] == "host_oom"]
    assert host_ooms and host_ooms[0]["outcome"]["host_memory_limit"] == 250 * 2**20
    assert cluster.job(host_ooms[0]["scheduler_id"])["JobState"] == "OUT_OF_MEMORY"
    # Each attempt after a host OOM asked Slurm for twice the memory.
    asked = [cluster.job(a["scheduler_id"])["TRES"] for a in attempts]
    assert [next(item for item in tres.split(",") if item.startswith("mem=")) for tres in asked][:2] == ["mem=250M", "mem=500M"]
    assert attempts[-1]["outcome"]["kind"] == "finished"


def test_a_killed_daemon_adopts_its_slurm_attempts_and_cancel_reaches_an_adopted_one(
    tmp_path: Path, daemon_factory, cluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OOMGUARD_INJECT_FAULT", "slow_steps@0.02")
    state = tmp_path / "state"
    config = daemon_config(tmp_path)
    daemon = daemon_factory("--config", str(config), state_dir=state)
    oomguard("submit", str(job_file(tmp_path, "short", max_steps=300, checkpoint_every_steps=50)), state_dir=state, check=True)
    oomguard("submit", str(job_file(tmp_path, "endless", max_steps=1_000_000, checkpoint_every_steps=50)), state_dir=state, check=True)
    for job in ("1", "2"):
        wait_for(lambda: (daemon.show(job).get("heartbeat") or {}).get("step", 0) >= 2, 120, f"job {job} to train")
    ids = {job: attempts_of(daemon.show(job))[0]["scheduler_id"] for job in ("1", "2")}

    daemon.process.send_signal(signal.SIGKILL)
    daemon.process.wait()
    restarted = daemon_factory("--config", str(config), state_dir=state)
    short = restarted.wait_job("1", timeout=240)
    assert short["state"] == "finished"
    (attempt,) = attempts_of(short)  # the same Slurm job carried on: nothing ran twice
    assert attempt["scheduler_id"] == ids["1"] and attempt["outcome"]["resumed_from"] is None

    assert oomguard("cancel", "2", state_dir=state).returncode == 0
    endless = restarted.wait_job("2", timeout=120)
    assert endless["state"] == "cancelled"
    (attempt,) = attempts_of(endless)
    assert attempt["scheduler_id"] == ids["2"] and attempt["outcome"]["kind"] == "interrupted"
    assert (Path(endless["workdir"]) / "checkpoints" / f"step-{attempt['outcome']['step']:06d}").is_dir()  # checkpointed as it stopped
    wait_for_state(cluster, ids["2"], ("COMPLETED",), timeout=30)


def test_status_shows_a_pending_attempts_reason_and_a_cancel_in_slurm_cancels_the_job(
    tmp_path: Path, daemon_factory, cluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OOMGUARD_INJECT_FAULT", "slow_steps@0.02")
    state = tmp_path / "state"
    daemon = daemon_factory("--config", str(daemon_config(tmp_path)), state_dir=state)
    # The cluster has two GPUs: the first job takes both, the second waits for one.
    both = job_file(tmp_path, "both", max_steps=1_000_000, checkpoint_every_steps=50, extra="\n[resources]\ngpus = 2\n")
    oomguard("submit", str(both), state_dir=state, check=True)
    wait_for(lambda: (daemon.show("1").get("heartbeat") or {}).get("step", 0) >= 2, 120, "job 1 to train")
    oomguard("submit", str(job_file(tmp_path, "one", max_steps=20)), state_dir=state, check=True)
    pending = wait_for(lambda: (a := attempts_of(daemon.show("2"))) and a[0]["scheduler_reason"] == "Resources" and a[0], 60, "job 2 to wait")
    assert pending["scheduler_state"] == "PENDING"
    status = oomguard("status", state_dir=state, check=True).stdout
    assert f"Slurm job {pending['scheduler_id']}: PENDING (Resources)" in " ".join(status.split())

    first = attempts_of(daemon.show("1"))[0]["scheduler_id"]
    cluster.run("scancel", first, check=True)  # by hand, outside oomguard
    cancelled = daemon.wait_job("1", timeout=60)
    assert cancelled["state"] == "cancelled" and "not by oomguard" in cancelled["result"]
    assert daemon.wait_job("2", timeout=120)["state"] == "finished"


def test_adoption_by_folder_takes_only_the_owners_job(tmp_path: Path, cluster) -> None:
    """An attempt recorded just before sbatch returned is found by its folder (the job's
    comment), among its owner's jobs only: another user's job naming the folder is not it."""
    folder = tmp_path / "wd" / "attempts" / "001"
    nobody = pwd.getpwnam("nobody").pw_uid
    theirs = cluster.run("sbatch", "--parsable", f"--comment={folder}", "--uid=nobody", "-o", "/dev/null", "--wrap", "sleep 30", check=True)
    launcher = SlurmLauncher(SlurmConfig(poll_seconds=0.1))
    found = launcher.adopt(Handle(str(folder), None, None), os.getuid())
    assert found.scheduler_id is None  # nobody's job is not ours
    # Nor when the store names it (a cluster that numbered its jobs anew).
    assert launcher.adopt(Handle(str(folder), None, None, theirs.stdout.strip()), os.getuid()).scheduler_id is None
    # A job Slurm has forgotten (ended longer than MinJobAge ago), watched alone: it has ended
    # (squeue answers "Invalid job id" for one id, and leaves it out among several).
    forgotten = SlurmLauncher(SlurmConfig(poll_seconds=0.1))
    gone = forgotten.adopt(Handle(str(tmp_path / "old" / "001"), None, None, "999999"), os.getuid())
    assert gone.scheduler_id == "999999" and forgotten.running(gone) is False
    request = LaunchRequest(
        attempt_dir=folder, argv=("sleep", "30"), env={"PATH": os.environ["PATH"]}, owner=Account.from_uid(os.getuid()), workdir=tmp_path / "wd",
        cwd=None, stdin=b"{}", gpus=None,
    )
    (tmp_path / "wd").mkdir()
    started = launcher.start(request)
    adopted = SlurmLauncher(SlurmConfig(poll_seconds=0.1)).adopt(Handle(str(folder), None, None), os.getuid())
    assert adopted.scheduler_id == started.scheduler_id
    assert nobody != os.getuid()
    cluster.run("scancel", "-u", "nobody")
    launcher.stop(started, kill=True)
