"""A built-in job's training metrics in TensorBoard (jobs/tracking.py), read back with
TensorBoard's own reader: the real runner trains a tiny job under emulated memory, and the
charts must hold one value per step, continue across attempts, and say where the ladder acted.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from oomguard.jobs.tracking import ATTEMPT_TAG, MEMORY_SCALARS, OOM_TAG, PLAN_TAG, STEP_SCALARS, TENSORBOARD_DIR, TrainingMetrics
from oomguard.strategies.outcome import EXIT_FINISHED, EXIT_OOM, Outcome
from oomguard.strategies.plan import Plan
from tests.jobs_helpers import RunResult, run_runner, tiny_job, write_attempt

MAX_STEPS = 8
OOM_STEP = 5  # the emulated cap drops here, after the checkpoint at step 4
HUGE_CAP = "4GiB"
JOB = tiny_job("tracking-test", batch_size=8, max_steps=MAX_STEPS, checkpoint_every_steps=2)
# What the runner always has for each step (reserved memory only where a caching allocator is emulated).
EVERY_STEP_TAGS = [tag for tag, _ in STEP_SCALARS] + ["memory/peak_allocated_mib", "memory/cap_mib"]


def read_run(workdir: Path, job_name: str = JOB.name) -> EventAccumulator:
    run = EventAccumulator(str(workdir / TENSORBOARD_DIR / job_name), size_guidance={"scalars": 0, "tensors": 0})
    run.Reload()
    return run


def texts(run: EventAccumulator, tag: str) -> dict[int, str]:
    """A text tag's entries by step (torch's SummaryWriter.add_text stores them under TAG/text_summary)."""
    return {event.step: event.tensor_proto.string_val[0].decode() for event in run.Tensors(f"{tag}/text_summary")}


def assert_one_value_per_step(run: EventAccumulator) -> None:
    for tag in EVERY_STEP_TAGS:
        assert [event.step for event in run.Scalars(tag)] == list(range(1, MAX_STEPS + 1)), tag


def assert_finished(result: RunResult) -> Outcome:
    assert result.returncode == EXIT_FINISHED, result
    assert "metrics: the" not in result.stdout, result  # no tracker failed
    return result.outcome


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A run under a cap that never bites: its peaks say where to cap the other runs."""
    root = tmp_path_factory.mktemp("measured")
    result = run_runner(write_attempt(root / "attempt-1", JOB, root / "work", cap=HUGE_CAP))
    assert_finished(result)
    return result, root / "work"


def oom_schedule(measured) -> str:
    """Full until OOM_STEP, then below the steady peak of the full micro-batch."""
    steady_peak = max(m["peak_bytes"] for m in measured[0].metrics[1:])
    return f"{HUGE_CAP},{int(steady_peak * 0.8)}B@{OOM_STEP}"


def test_every_step_writes_loss_learning_rate_speed_and_memory_as_metrics_jsonl_has_them(measured):
    result, workdir = measured
    run = read_run(workdir)
    assert_one_value_per_step(run)
    records = result.metrics
    for tag, key in STEP_SCALARS:
        assert [e.value for e in run.Scalars(tag)] == pytest.approx([m[key] for m in records], rel=1e-6), tag
    for tag, key in MEMORY_SCALARS:
        if records[0][key] is not None:
            assert [e.value for e in run.Scalars(tag)] == pytest.approx([m[key] / 2**20 for m in records], rel=1e-6), tag
    assert all(e.value == 4096 for e in run.Scalars("memory/cap_mib"))
    assert texts(run, ATTEMPT_TAG) == {0: "attempt 1 starts with plan mb=8x1 (from step 0, no checkpoint)"}


def test_an_in_process_recovery_is_a_text_entry_at_its_step_naming_the_new_plan(tmp_path, measured):
    workdir = tmp_path / "work"
    outcome = assert_finished(run_runner(write_attempt(tmp_path / "attempt-1", JOB, workdir, cap=oom_schedule(measured))))
    (recovery,) = outcome.recoveries
    assert recovery["step"] == OOM_STEP
    new_plan = Plan.from_dict(recovery["to"]).short()

    run = read_run(workdir)
    assert_one_value_per_step(run)
    caps = [e.value for e in run.Scalars("memory/cap_mib")]
    assert caps[OOM_STEP - 1] == 4096 and caps[OOM_STEP] < 4096  # step OOM_STEP ran under the full room, the next under the cap
    assert texts(run, PLAN_TAG) == {OOM_STEP: f"plan mb=8x1 -> {new_plan}: {recovery['reason']}"}
    oom = texts(run, OOM_TAG)
    assert oom == {OOM_STEP: recovery["oom"]}
    assert oom[OOM_STEP].startswith(("out of memory in forward at step 5: tried to allocate", "out of memory in backward at step 5: tried to allocate"))


def test_a_resumed_attempt_continues_the_same_curves(tmp_path, measured):
    workdir = tmp_path / "work"
    schedule = oom_schedule(measured)
    first = run_runner(write_attempt(tmp_path / "attempt-1", JOB, workdir, cap=schedule, recover_in_process=False))
    assert first.returncode == EXIT_OOM, first
    second = run_runner(write_attempt(tmp_path / "attempt-2", JOB, workdir, micro_batch=4, number=2, cap=schedule))
    assert_finished(second)
    assert second.outcome.resumed_from == OOM_STEP

    run = read_run(workdir)
    # Both attempts' events files in the one run, the steps going on from where the first stopped.
    assert len(list((workdir / TENSORBOARD_DIR / JOB.name).glob("events.out.tfevents.*"))) == 2
    assert_one_value_per_step(run)
    losses = [e.value for e in run.Scalars("train/loss")]
    assert losses == pytest.approx([m["loss"] for m in first.metrics + second.metrics], rel=1e-6)
    assert texts(run, ATTEMPT_TAG) == {
        0: "attempt 1 starts with plan mb=8x1 (from step 0, no checkpoint)",
        OOM_STEP: f"attempt 2 starts with plan mb=4x2 (resumed from the checkpoint at step {OOM_STEP})",
    }
    assert list(texts(run, OOM_TAG)) == [OOM_STEP]


def test_log_with_empty_writes_no_metrics_but_trains(tmp_path):
    job = JOB.replace(train=dataclasses.replace(JOB.train, log_with=()))
    workdir = tmp_path / "work"
    assert_finished(run_runner(write_attempt(tmp_path / "attempt-1", job, workdir)))
    assert not (workdir / TENSORBOARD_DIR).exists()


# ----------------------------------------------------------------------------- in this process


def step_record(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "learning_rate": 1e-3, "samples_per_s": 100.0, "peak_bytes": 2**20, "reserved_bytes": None, "capacity_bytes": 2**30}


def log_steps(workdir: Path, attempt: int, start: int, end: int, loss: float) -> None:
    trackers = TrainingMetrics(["tensorboard"], workdir, "job", attempt, say=print)
    trackers.attempt_started(start, Plan.initial(8), resumed=start > 0, changes=[])
    for step in range(start + 1, end + 1):
        trackers.step(step_record(step, loss), [])
    trackers.close()


def test_steps_an_attempt_trains_again_after_a_resume_replace_the_earlier_ones(tmp_path):
    """The first attempt logged steps 1..6 and was killed; its last checkpoint was at step 4."""
    log_steps(tmp_path, 1, 0, 6, loss=1.0)
    log_steps(tmp_path, 2, 4, 8, loss=2.0)
    run = read_run(tmp_path, "job")
    assert [(e.step, e.value) for e in run.Scalars("train/loss")] == [(s, 1.0 if s <= 4 else 2.0) for s in range(1, 9)]


def test_a_tracker_that_fails_is_named_once_and_training_goes_on(tmp_path, capsys):
    (tmp_path / TENSORBOARD_DIR).write_text("a file where the run's folder should be")
    trackers = TrainingMetrics(["tensorboard"], tmp_path, "job", 1, say=print)
    trackers.attempt_started(0, Plan.initial(8), resumed=False, changes=[])
    for step in range(1, 4):
        trackers.step(step_record(step, 1.0), [])
    trackers.attempt_ended(Outcome(kind="finished", step=3), [])
    trackers.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("metrics:")]
    assert len(lines) == 1 and "the tensorboard tracker failed" in lines[0] and "training goes on without it" in lines[0], lines
