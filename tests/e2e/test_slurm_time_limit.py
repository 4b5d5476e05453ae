"""A Slurm time limit shorter than the job's run (--time=1 minute, the signal 30 s before it),
on a real cluster (tests/slurm_cluster.py): the job goes on across Slurm jobs to its target
step, each continuation resuming at the step the one before stopped at. In a file of its own:
it takes about a minute, beside the other Slurm tests rather than after them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.conftest import oomguard
from tests.e2e.slurm_jobs import attempts_of, cluster, daemon_config, job_file  # noqa: F401 - cluster is a fixture
from tests.slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401 - slurm_cluster is a fixture

pytestmark = pytest.mark.slow


def test_a_time_limit_is_continued_across_slurm_jobs_to_the_target_step_losing_no_step(
    tmp_path: Path, daemon_factory, cluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # At least 0.25 s per step: 160 steps are 40 s of training or more. Slurm sends the signal
    # 30 s before the limit or up to a minute earlier, never later, so a one-minute job trains
    # 31 s at most (124 steps): one cannot finish it. No periodic checkpoint.
    monkeypatch.setenv("OOMGUARD_INJECT_FAULT", "slow_steps@0.25")
    steps = 160
    job = job_file(tmp_path, "long", max_steps=steps, checkpoint_every_steps=100_000, extra='\n[resources]\ntime_limit = "1"\n')
    state = tmp_path / "state"
    daemon = daemon_factory("--config", str(daemon_config(tmp_path, signal_seconds=30)), state_dir=state)
    oomguard("submit", str(job), state_dir=state, check=True)
    record = daemon.wait_job("1", timeout=420)

    assert record["state"] == "finished", daemon.output()
    attempts = attempts_of(record)
    assert len(attempts) >= 2, [a["outcome"]["kind"] for a in attempts]
    assert len({a["scheduler_id"] for a in attempts}) == len(attempts)
    assert [a["outcome"]["kind"] for a in attempts] == ["time_limit"] * (len(attempts) - 1) + ["finished"]
    assert attempts[-1]["outcome"]["step"] == steps
    # Each continuation starts at the step the one before stopped at: nothing lost, nothing twice.
    lost = [before["outcome"]["step"] - (after["outcome"]["resumed_from"] or 0) for before, after in zip(attempts, attempts[1:])]
    assert lost == [0] * (len(attempts) - 1)
    trained = []
    for attempt in attempts:
        trained += [json.loads(line)["step"] for line in (Path(attempt["directory"]) / "metrics.jsonl").read_text().splitlines()]
    assert trained == list(range(1, steps + 1))
    continued = [e for e in record["events"] if e["kind"] == "retry" and "time limit came" in e["message"]]
    assert len(continued) == len(attempts) - 1
    for attempt in attempts[:-1]:
        assert cluster.job(attempt["scheduler_id"])["TimeLimit"] == "00:01:00"
    print(f"time limit: {len(attempts)} Slurm jobs, stopped at steps {[a['outcome']['step'] for a in attempts]}, steps lost {lost}")
