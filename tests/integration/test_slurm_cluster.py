"""The throwaway Slurm cluster (tests/slurm_cluster.py) does what the Slurm backend's tests rely
on: GPUs as gres, a job over its --mem ending OUT_OF_MEMORY, a requeued job running again. Skipped,
with the reason, where no cluster can start (not root, Slurm or munge missing, no cgroup v1)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.slurm_cluster import SlurmCluster, parse_fields, slurm_cluster, wait_for_state  # noqa: F401


def submit(cluster: SlurmCluster, folder: Path, body: str, *options: str) -> str:
    script = folder / "job.sh"
    script.write_text("#!/bin/bash\n" + body)
    result = cluster.run("sbatch", "--parsable", f"--chdir={folder}", f"--output={folder}/out", *options, str(script))
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def wait_for_line(path: Path, line: str, timeout: float) -> None:
    """RUNNING comes before the batch script starts on the node: wait for what it prints."""
    deadline = time.monotonic() + timeout
    while line not in read(path).splitlines():
        assert time.monotonic() < deadline, f"the batch script did not print {line!r} in {timeout} s: {read(path)!r}"
        time.sleep(0.05)


def test_parse_fields_keeps_spaces_in_paths_and_equals_in_values():
    line = "JobId=7 JobName=x MCS_label=N/A ReqB:S:C:T=0:0:*:* TRES=cpu=1,mem=100M CPUs/Task=1 Command=/tmp/a b/job.sh WorkDir=/tmp/a b Power= "
    fields = parse_fields(line)
    assert fields["MCS_label"] == "N/A"
    assert fields["ReqB:S:C:T"] == "0:0:*:*"
    assert fields["TRES"] == "cpu=1,mem=100M"
    assert fields["CPUs/Task"] == "1"
    assert fields["Command"] == "/tmp/a b/job.sh"
    assert fields["WorkDir"] == "/tmp/a b"
    assert fields["Power"] == ""


def test_the_cluster_is_its_own(slurm_cluster):  # noqa: F811
    """The client env reaches this cluster (not one on Slurm's default ports) with its fake GPUs."""
    node = slurm_cluster.run("scontrol", "show", "node", "-o", slurm_cluster.node)
    assert node.returncode == 0, node.stderr
    fields = parse_fields(node.stdout)
    assert fields["Gres"] == "gpu:2"
    assert fields["State"] == "IDLE"
    config = slurm_cluster.run("scontrol", "show", "config").stdout
    assert f"SlurmctldPort           = {slurm_cluster.ctld_port}" in config


def test_a_gpu_job_sees_its_gpu(slurm_cluster, tmp_path):  # noqa: F811
    job = submit(slurm_cluster, tmp_path, 'echo "$CUDA_VISIBLE_DEVICES"\n', "--gres=gpu:1")
    fields = wait_for_state(slurm_cluster, job, {"COMPLETED", "FAILED", "CANCELLED", "OUT_OF_MEMORY", "NODE_FAIL"}, timeout=20)
    assert fields["JobState"] == "COMPLETED", fields
    assert fields["ExitCode"] == "0:0"
    assert (tmp_path / "out").read_text().strip() in {"0", "1"}


def test_a_job_over_its_memory_ends_out_of_memory(slurm_cluster, tmp_path):  # noqa: F811
    # bytes * n writes every page (a bytearray's calloc would leave them untouched, uncharged).
    body = f"{sys.executable} -c \"data = b'x' * (400 << 20); print(len(data))\"\n"
    job = submit(slurm_cluster, tmp_path, body, "--mem=100M")
    fields = wait_for_state(slurm_cluster, job, {"COMPLETED", "FAILED", "CANCELLED", "OUT_OF_MEMORY", "NODE_FAIL"}, timeout=20)
    assert fields["JobState"] == "OUT_OF_MEMORY", (fields, (tmp_path / "out").read_text())
    assert fields["TRES"].startswith("cpu=1,mem=100M")


def test_a_requeued_job_runs_again(slurm_cluster, tmp_path):  # noqa: F811
    # `sleep & wait`: the batch shell can then take signals while the payload runs.
    job = submit(slurm_cluster, tmp_path, 'echo "run $SLURM_RESTART_COUNT"\nsleep 300 & wait\n', "--open-mode=append")
    wait_for_state(slurm_cluster, job, "RUNNING", timeout=20)
    # A requeue before the script has printed could land first.
    wait_for_line(tmp_path / "out", "run ", timeout=10)
    result = slurm_cluster.run("scontrol", "requeue", job)
    assert result.returncode == 0, result.stderr
    # Back in PENDING (Reason=BeginTime) until cred_expire (10 s) has passed, then started again.
    fields = wait_for_state(slurm_cluster, job, "PENDING", timeout=10)
    assert fields["Restarts"] == "1"
    fields = wait_for_state(slurm_cluster, job, "RUNNING", timeout=20)
    assert fields["Restarts"] == "1"
    # Likewise a cancel before the second run has printed (CI once saw only "run ").
    wait_for_line(tmp_path / "out", "run 1", timeout=10)
    slurm_cluster.run("scancel", job)
    fields = wait_for_state(slurm_cluster, job, "CANCELLED", timeout=15)
    lines = read(tmp_path / "out").splitlines()
    assert [line for line in lines if line.startswith("run")] == ["run ", "run 1"], lines

