"""What the Slurm end-to-end tests share: the module's cluster named to the processes a test
starts, a tiny job file, the daemon's configuration for the cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.jobs_helpers import TINY_JOB
from tests.slurm_cluster import SlurmCluster


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
    """backend = "slurm" and these [slurm] keys (squeue asked twice a second)."""
    path = folder / "daemon.toml"
    lines = ['backend = "slurm"', "[slurm]", "poll_seconds = 0.5", *(f"{key} = {json.dumps(value)}" for key, value in slurm.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


def attempts_of(record: dict[str, Any]) -> list[dict[str, Any]]:
    return record["attempts"]
