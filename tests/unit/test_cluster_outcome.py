"""How Slurm's end of an attempt becomes its Outcome (daemon/cluster_outcome.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.daemon.cluster_outcome import with_scheduler_end
from oomguard.daemon.launch import SchedulerEnd
from oomguard.daemon.store_rows import AttemptRow
from oomguard.jobs.attempt import HEARTBEAT, AttemptFiles
from oomguard.strategies.outcome import Outcome


def attempt(**fields) -> AttemptRow:
    return AttemptRow.from_stored({"id": 1, "job_id": 1, "number": 2, "plan": "{}", "directory": "/x", "started_at": 0.0, "scheduler_id": "12", **fields})


def files(tmp_path: Path, heartbeat: dict | None) -> AttemptFiles:
    if heartbeat is not None:
        (tmp_path / HEARTBEAT).write_text(json.dumps(heartbeat))
    return AttemptFiles(tmp_path)


def test_over_its_mem_is_a_host_oom_with_the_limit(tmp_path: Path) -> None:
    outcome = with_scheduler_end(attempt(), files(tmp_path, {"step": 9, "last_checkpoint": 8, "resumed_from": 4}),
                                 SchedulerEnd("OUT_OF_MEMORY", "OutOfMemory", 3600, 512 * 2**20), None)
    assert outcome is not None and outcome.kind == "host_oom" and outcome.host_memory_limit == 512 * 2**20
    assert (outcome.step, outcome.resumed_from) == (8, 4)
    assert "Slurm ended job 12 OUT_OF_MEMORY (OutOfMemory)" in outcome.message and "512.0 MiB" in outcome.message


@pytest.mark.parametrize(
    ("heartbeat", "without_checkpoint", "step"),
    [
        ({"step": 30, "last_checkpoint": 25, "resumed_from": 10}, None, 25),  # checkpointed in the attempt
        ({"step": 30, "last_checkpoint": 10, "resumed_from": 10}, 60, 10),  # none since it resumed
        ({"step": 3, "last_checkpoint": None, "resumed_from": None}, 60, 0),  # none at all
        ({"step": 30, "resumed_from": 10}, None, 30),  # a script's heartbeat: its checkpoints are its own; how far it got
    ],
)
def test_a_time_limit_without_a_report_says_whether_the_attempt_made_a_checkpoint(tmp_path: Path, heartbeat, without_checkpoint, step) -> None:
    outcome = with_scheduler_end(attempt(), files(tmp_path, heartbeat), SchedulerEnd("TIMEOUT", None, 60, None), None)
    assert outcome is not None and outcome.kind == "time_limit"
    assert outcome.time_limit_without_checkpoint == without_checkpoint and outcome.step == step


def test_the_sigterm_at_the_limit_is_a_time_limit_after_a_checkpoint(tmp_path: Path) -> None:
    reported = Outcome(kind="interrupted", step=17)
    outcome = with_scheduler_end(attempt(), files(tmp_path, None), SchedulerEnd("TIMEOUT"), reported)
    assert outcome is not None and outcome.kind == "time_limit" and outcome.step == 17 and outcome.time_limit_without_checkpoint is None
    # Stopped by oomguard (cancel) as the limit came: still the interruption it asked for.
    assert with_scheduler_end(attempt(term_sent_at=5.0), files(tmp_path, None), SchedulerEnd("TIMEOUT"), reported) == reported


@pytest.mark.parametrize("state", ["NODE_FAIL", "PREEMPTED", "BOOT_FAIL"])
def test_the_clusters_failures_are_interruptions(tmp_path: Path, state: str) -> None:
    outcome = with_scheduler_end(attempt(), files(tmp_path, {"last_checkpoint": 6, "resumed_from": None}), SchedulerEnd(state), None)
    assert outcome is not None and outcome.kind == "interrupted" and outcome.step == 6 and outcome.scheduler_state == state


def test_a_cancel_from_outside_oomguard_cancels_the_job_and_one_of_oomguards_is_an_interruption(tmp_path: Path) -> None:
    outside = with_scheduler_end(attempt(), files(tmp_path, None), SchedulerEnd("CANCELLED"), None)
    assert outside is not None and outside.kind == "cancelled" and "not by oomguard" in outside.message
    asked = with_scheduler_end(attempt(term_sent_at=3.0), files(tmp_path, None), SchedulerEnd("CANCELLED"), None)
    assert asked is not None and asked.kind == "interrupted"


def test_a_completed_or_failed_job_is_left_to_the_shims_exit_status(tmp_path: Path) -> None:
    assert with_scheduler_end(attempt(), files(tmp_path, None), SchedulerEnd("FAILED"), None) is None
    assert with_scheduler_end(attempt(), files(tmp_path, None), SchedulerEnd("COMPLETED"), None) is None


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"host_memory_limit": "lots"}, "host_memory_limit must be an integer"),
        ({"host_memory_limit": 0}, "host_memory_limit must be positive"),
        ({"time_limit_without_checkpoint": -60}, "time_limit_without_checkpoint must be positive"),
        ({"scheduler_state": "NODE FAIL"}, "scheduler_state must be a state's name"),
    ],
)
def test_the_cluster_fields_of_an_outcome_json_are_checked(fields: dict, expected: str) -> None:
    # outcome.json is the job's owner's to write: what the doctor reads must be what it can be.
    with pytest.raises((TypeError, ValueError), match=expected):
        Outcome.from_dict({"kind": "interrupted", "step": 0, **fields})
