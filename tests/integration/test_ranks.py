"""A built-in job on several processes (resources.gpus = N): data parallel and the sharding
rungs train what one process trains, a sharded checkpoint resumes on 1, 2 or 4 processes, and
one rank's OOM is every rank's. Real runners (jobs/ranks.py starts the ranks), gloo on the CPU,
emulated device memory per rank."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from oomguard.jobs.emulated_gpus import EMULATED_GPUS_ENV, EmulatedGpu, EmulatedGpuFolder
from oomguard.jobs.spec import JobSpec
from oomguard.strategies.plan import Plan
from tests.jobs_helpers import assert_weights_allclose, load_final, run_runner, running_runner, tiny_job, write_attempt

pytestmark = pytest.mark.slow

# shard_optimizer (to a checkpoint) and shard_params (from it) train to the one process's
# weights in the resume test below; the other two levels from the start here.
LEVELS = ("none", "shard_offload")


def on_gpus(job: JobSpec, gpus: int) -> JobSpec:
    return job.replace(resources=job.resources.__class__(**{**job.resources.__dict__, "gpus": gpus}))


def plan_for(gpus: int, level: str = "none", micro_batch: int = 2, batch_size: int = 8) -> Plan:
    plan = Plan.initial(batch_size, world_size=gpus, micro_batch=micro_batch)
    if level != "none":
        from oomguard.strategies import rungs

        rung = rungs.rung(level)
        assert rung is not None
        plan = rung.step(plan)
    return plan


def train(tmp_path: Path, name: str, gpus: int, level: str = "none", max_steps: int = 6, cap: str | None = "64MiB", workdir: Path | None = None):
    job = on_gpus(tiny_job(max_steps=max_steps, checkpoint_every_steps=2, keep_checkpoints=10), gpus)
    attempt = tmp_path / f"{name}-attempt"
    attempt.mkdir()
    workdir = workdir or tmp_path / f"{name}-work"
    write_attempt(attempt, job, workdir, plan=plan_for(gpus, level), cap=cap)
    result = run_runner(attempt, timeout=300)
    assert result.returncode == 0, result
    return result, workdir


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return train(tmp_path_factory.mktemp("one"), "one", 1)


@pytest.mark.parametrize("level", LEVELS)
def test_two_ranks_train_the_weights_of_one_process(tmp_path, one_process, level):
    _, alone = one_process
    result, workdir = train(tmp_path, level, 2, level)
    assert result.outcome.kind == "finished"
    assert_weights_allclose(load_final(workdir), load_final(alone))
    lines = [json.loads(line) for line in (result.attempt_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 7))  # rank 0 reports, once per step
    assert all("2 processes" in line["plan"] for line in lines)


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint at step 2 of 2 ranks with sharded optimizer state (trained to step 4)."""
    _, sharded = train(tmp_path_factory.mktemp("sharded"), "sharded", 2, "shard_optimizer", max_steps=4)
    checkpoint = sharded / "checkpoints" / "step-000002"
    assert (checkpoint / "dcp" / ".metadata").exists() and not (checkpoint / "model.safetensors").exists()
    return checkpoint


@pytest.mark.parametrize(
    ("gpus", "level"),
    # Four ranks on two cores take 25 s: `make faults` runs that one (marker long).
    [(1, "none"), pytest.param(4, "shard_params", marks=pytest.mark.long)],
    ids=["one rank", "four ranks"],
)
def test_a_sharded_checkpoint_resumes_on_another_number_of_ranks(tmp_path, one_process, sharded_checkpoint, gpus, level):
    _, alone = one_process
    import shutil

    workdir = tmp_path / f"resume-{gpus}"
    # Only the step-2 checkpoint: the resume has 4 steps to train.
    (workdir / "checkpoints").mkdir(parents=True)
    shutil.copytree(sharded_checkpoint, workdir / "checkpoints" / sharded_checkpoint.name)
    result, _ = train(tmp_path, f"resume-{gpus}", gpus, level, workdir=workdir)
    assert result.outcome.resumed_from == 2
    assert_weights_allclose(load_final(workdir), load_final(alone))


def test_one_ranks_oom_brings_every_rank_to_the_same_new_plan_in_process(tmp_path, one_process):
    """Rank 1's GPU is too small for its plan, rank 0's is not: rank 1 runs out of memory in
    its first step, rank 0 learns of it where the ranks meet before averaging, and both go on
    with the smaller micro-batch that rank 0 chose, in the same processes."""
    _, alone = one_process
    folder = EmulatedGpuFolder(tmp_path / "gpus").create((EmulatedGpu(0, 64 * 2**20), EmulatedGpu(1, 1_700_000)))
    job = on_gpus(tiny_job(max_steps=6, checkpoint_every_steps=2), 2)
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    write_attempt(attempt, job, tmp_path / "work", plan=plan_for(2, micro_batch=4))
    started = time.monotonic()
    with running_runner(attempt, {EMULATED_GPUS_ENV: str(folder.root), "CUDA_VISIBLE_DEVICES": "0,1"}) as process:
        # From the moment step 0 begins (rank 0's line just before it) to the first step done on
        # the new plan (the ranks average their gradients in it, so both run that plan): the
        # OOM, the agreement and the change fall in between.
        seen = lines_seen(attempt / "output.log", ("no checkpoint: starting at step 0", "step 1/6"), process, timeout=300)
        assert process.wait(timeout=300) == 0, (attempt / "output.log").read_text()
    assert seen["step 1/6"] - seen["no checkpoint: starting at step 0"] < 10, seen
    outcome = json.loads((attempt / "outcome.json").read_text())
    assert outcome["kind"] == "finished", outcome
    # One change, at step 0, and no step back up: the smallest rank's room is what fits.
    (recovery,) = outcome["recoveries"]
    assert recovery["step"] == 0 and recovery["to"] != recovery["from"]
    assert "out of memory in forward at step 0; in-process" in (attempt / "output.log").read_text()
    lines = [json.loads(line) for line in (attempt / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 7))
    assert time.monotonic() - started < 120
    assert_weights_allclose(load_final(tmp_path / "work"), load_final(alone))


def test_a_sharded_ranks_oom_ends_it_and_the_others_are_stopped_within_seconds(tmp_path):
    """Inside a sharded model's collectives the other ranks cannot hear of an OOM: the rank that
    ran out ends with it, and the ranks' runner stops the others TEARDOWN_SECONDS later. The
    attempt's outcome is that OOM (for the doctor), not a crash."""
    from oomguard.jobs.ranks import TEARDOWN_SECONDS, rank_outcome_path

    folder = EmulatedGpuFolder(tmp_path / "gpus").create((EmulatedGpu(0, 64 * 2**20), EmulatedGpu(1, 600_000)))
    job = on_gpus(tiny_job(max_steps=6, checkpoint_every_steps=2), 2)
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    write_attempt(attempt, job, tmp_path / "work", plan=plan_for(2, "shard_params", micro_batch=4))
    with running_runner(attempt, {EMULATED_GPUS_ENV: str(folder.root), "CUDA_VISIBLE_DEVICES": "0,1"}) as process:
        assert process.wait(timeout=300) == 3, (attempt / "output.log").read_text()  # EXIT_OOM
    outcome = json.loads((attempt / "outcome.json").read_text())
    assert outcome["kind"] == "oom", outcome
    assert "(rank 1 ended it; rank 0 " in outcome["message"]
    assert "GPU 1 has a total capacity of 585.94 KiB" in outcome["message"]  # rank 1's own figures
    ended_alone = rank_outcome_path(attempt, 1).stat().st_mtime
    assert (attempt / "outcome.json").stat().st_mtime - ended_alone < TEARDOWN_SECONDS + 5


def lines_seen(log: Path, texts: tuple[str, ...], process, timeout: float) -> dict[str, float]:
    """When (time.monotonic(), polled every 20 ms) each text first appeared in a live log."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < len(texts) and time.monotonic() < deadline and process.poll() is None:
        content = log.read_text()
        now = time.monotonic()
        seen.update({text: now for text in texts if text in content and text not in seen})
        time.sleep(0.02)
    assert len(seen) == len(texts), (seen, log.read_text())
    return seen
