"""The daemon on a real Slurm cluster (tests/slurm_cluster.py: slurmctld, slurmd and munged on
this machine, fake GPUs as gres): each attempt one sbatch, OOMs resubmitted with the doctor's
plan, a time limit turned into a continuation, a job over its --mem given more, a killed
daemon's attempts adopted by their Slurm job ids, and cancels from either side.

Skipped, with the reason, where no cluster can start (not root, Slurm not installed)."""

from __future__ import annotations

import json
import os
import pwd
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from oomguard.daemon.config import SlurmConfig
from oomguard.daemon.launch import Handle, LaunchRequest
from oomguard.daemon.launch.slurm import SlurmLauncher
from oomguard.daemon.users import Account
from tests.e2e.conftest import TINY_CAP, oomguard, wait_for
from tests.jobs_helpers import TINY_JOB
from tests.slurm_cluster import SlurmCluster, slurm_cluster, wait_for_state  # noqa: F401 - slurm_cluster is a fixture

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    """The module's cluster, named to the daemon and the CLI this test starts."""
    for name, value in slurm_cluster.env.items():
        if name == "SLURM_CONF" or name == "PATH":
            monkeypatch.setenv(name, value)
    # Single-threaded runners: several attempts may share the two cores.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return slurm_cluster


def job_file(folder: Path, name: str, *, max_steps: int, checkpoint_every_steps: int = 4, extra: str = "") -> Path:
    path = folder / f"{name}.toml"
    text = TINY_JOB.format(name=name, batch_size=8, max_steps=max_steps, checkpoint_every_steps=checkpoint_every_steps, keep_checkpoints=2)
    path.write_text(text + extra)
    return path


def daemon_config(folder: Path, **slurm: Any) -> Path:
    path = folder / "daemon.toml"
    lines = ['backend = "slurm"', "[slurm]", "poll_seconds = 0.5", *(f"{key} = {json.dumps(value)}" for key, value in slurm.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


def attempts_of(record: dict[str, Any]) -> list[dict[str, Any]]:
    return record["attempts"]


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


def test_a_time_limit_is_continued_across_slurm_jobs_to_the_target_step_losing_no_step(
    tmp_path: Path, daemon_factory, cluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # At least 0.1 s per step: 700 steps are 70 s of training or more, more than two one-minute
    # jobs hold once the signal (30 s before the limit, at Slurm's 30 s check) has ended each
    # (at most 300 steps); no periodic checkpoint.
    monkeypatch.setenv("OOMGUARD_INJECT_FAULT", "slow_steps@0.1")
    steps = 700
    job = job_file(tmp_path, "long", max_steps=steps, checkpoint_every_steps=100_000, extra='\n[resources]\ntime_limit = "1"\n')
    state = tmp_path / "state"
    daemon = daemon_factory("--config", str(daemon_config(tmp_path, signal_seconds=30)), state_dir=state)
    oomguard("submit", str(job), state_dir=state, check=True)
    record = daemon.wait_job("1", timeout=420)

    assert record["state"] == "finished", daemon.output()
    attempts = attempts_of(record)
    assert len(attempts) >= 3, [a["outcome"]["kind"] for a in attempts]
    assert len({a["scheduler_id"] for a in attempts}) == len(attempts)
    assert [a["outcome"]["kind"] for a in attempts] == ["time_limit"] * (len(attempts) - 1) + ["finished"]
    assert attempts[-1]["outcome"]["step"] == steps
    # Each continuation starts at the step the one before stopped at: nothing lost, nothing twice.
    lost = [before["outcome"]["step"] - after["outcome"]["resumed_from"] for before, after in zip(attempts, attempts[1:])]
    assert lost == [0] * (len(attempts) - 1)
    trained = []
    for attempt in attempts:
        trained += [json.loads(line)["step"] for line in (Path(attempt["directory"]) / "metrics.jsonl").read_text().splitlines()]
    assert trained == list(range(1, steps + 1))
    continued = [e for e in record["events"] if e["kind"] == "retry" and "time limit" in e["message"]]
    assert len(continued) == len(attempts) - 1
    for attempt in attempts[:-1]:
        assert cluster.job(attempt["scheduler_id"])["TimeLimit"] == "00:01:00"
    print(f"time limit: {len(attempts)} Slurm jobs, stopped at steps {[a['outcome']['step'] for a in attempts]}, steps lost {lost}")


def test_a_job_over_its_mem_ends_as_host_oom_and_is_given_more(tmp_path: Path, daemon_factory, cluster) -> None:
    # 100 MiB is less than a Python process with torch loaded: the cgroup's OOM killer ends it.
    job = job_file(tmp_path, "hungry", max_steps=8, extra='\n[resources]\nhost_memory = "100MiB"\n')
    state = tmp_path / "state"
    daemon = daemon_factory("--config", str(daemon_config(tmp_path)), state_dir=state)
    oomguard("submit", str(job), state_dir=state, check=True)
    record = daemon.wait_job("1", timeout=300)

    assert record["state"] == "finished", daemon.output()
    attempts = attempts_of(record)
    host_ooms = [a for a in attempts if a["outcome"]["kind"] == "host_oom"]
    assert host_ooms and host_ooms[0]["outcome"]["host_memory_limit"] == 100 * 2**20
    assert cluster.job(host_ooms[0]["scheduler_id"])["JobState"] == "OUT_OF_MEMORY"
    # Each attempt after a host OOM asked Slurm for twice the memory.
    asked = [cluster.job(a["scheduler_id"])["TRES"] for a in attempts]
    assert [next(item for item in tres.split(",") if item.startswith("mem=")) for tres in asked][:2] == ["mem=100M", "mem=200M"]
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
    cluster.run("sbatch", f"--comment={folder}", "--uid=nobody", "-o", "/dev/null", "--wrap", "sleep 30", check=True)
    launcher = SlurmLauncher(SlurmConfig(poll_seconds=0.1))
    found = launcher.adopt(Handle(str(folder), None, None), os.getuid())
    assert found.scheduler_id is None  # nobody's job is not ours
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
