"""The runner as the daemon starts it: ``python -m oomguard.jobs.run ATTEMPT_DIR`` in a real
child process, training a tiny UNet for real on the CPU, with device memory emulated.

Each runner process pays a few seconds for importing torch and diffusers, so the runs that
several tests compare against (the uninterrupted full-batch run, the memory measurement and
the micro-batch-3 run) are made once, side by side, in a module-scoped fixture. Runners use
one thread each (tests/jobs_helpers.runner_env), which also keeps their float sums reproducible.
"""

from __future__ import annotations

import dataclasses

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.jobs_helpers import (
    RunResult,
    assert_weights_allclose,
    checkpoint_steps,
    final_output,
    load_final,
    read_metrics,
    run_runner,
    run_runners,
    running_runner,
    tiny_job,
    wait_for_checkpoint,
    write_attempt,
)
from oomguard.jobs import checkpoints
from oomguard.jobs.attempt import HEARTBEAT, OUTCOME
from oomguard.strategies import rungs
from oomguard.strategies.plan import Plan
from oomguard.strategies.outcome import EXIT_FINISHED, EXIT_INTERRUPTED, EXIT_OOM, EXIT_USAGE, Outcome

MAX_STEPS = 12
EVERY = 2  # checkpoint_every_steps
HUGE_CAP = "4GiB"  # counts bytes (metrics get peak_bytes) without ever refusing
OOM_STEP = 5  # the cap drops here: after the checkpoints at steps 2 and 4, between two checkpoints

JOB = tiny_job("runner-test", batch_size=8, max_steps=MAX_STEPS, checkpoint_every_steps=EVERY)


def losses(metrics: list[dict]) -> list[float]:
    return [m["loss"] for m in metrics]


def assert_finished(result: RunResult, resumed_from: int | None = None) -> Outcome:
    assert result.returncode == EXIT_FINISHED, result
    outcome = result.outcome
    assert outcome.kind == "finished", outcome
    assert outcome.step == MAX_STEPS
    assert outcome.exit_code == EXIT_FINISHED
    assert outcome.resumed_from == resumed_from
    return outcome


# ----------------------------------------------------------------------------- shared runs


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory):
    """The runs several tests compare against, made once and side by side:

    baseline:      full batch, no cap, never interrupted (the reference)
    measured_full: the same under a cap that never bites, so its metrics carry peak_bytes
    micro_batch_3: micro_batch 3 of 8, an uneven split 3, 3, 2, under the same huge cap
    """
    root = tmp_path_factory.mktemp("shared")
    setups = {
        "baseline": {},
        "measured_full": {"cap": HUGE_CAP},
        "micro_batch_3": {"cap": HUGE_CAP, "micro_batch": 3},
    }
    dirs = [write_attempt(root / name / "attempt-1", JOB, root / name / "work", **kw) for name, kw in setups.items()]
    results = run_runners(dirs)
    return {name: (result, root / name / "work") for name, result in zip(setups, results)}


@pytest.fixture(scope="module")
def baseline(shared_runs):
    return shared_runs["baseline"]


@pytest.fixture(scope="module")
def baseline_weights(baseline):
    result, workdir = baseline
    assert result.returncode == EXIT_FINISHED, result
    return load_final(workdir)


@pytest.fixture(scope="module")
def measured_full(shared_runs):
    result, workdir = shared_runs["measured_full"]
    assert result.returncode == EXIT_FINISHED, result
    return result, workdir


@pytest.fixture(scope="module")
def micro_batch_3(shared_runs):
    result, workdir = shared_runs["micro_batch_3"]
    assert result.returncode == EXIT_FINISHED, result
    return result, workdir


def steady_peak(result: RunResult) -> int:
    """The step peak once the optimizer state exists (from the second step on)."""
    peaks = [m["peak_bytes"] for m in result.metrics]
    assert all(isinstance(p, int) and p > 0 for p in peaks), peaks
    return max(peaks[1:])


def cap_between_micro_batch_4_and_8(measured_full, micro_batch_3) -> int:
    """peak ~ static + per_sample * micro_batch: estimate micro-batch 4's peak from 3's and 8's,
    and cap halfway between it and 8's."""
    full_peak = steady_peak(measured_full[0])
    mb3_peak = steady_peak(micro_batch_3[0])
    mb4_estimate = mb3_peak + (full_peak - mb3_peak) / 5
    return int((full_peak + mb4_estimate) / 2)


# ----------------------------------------------------------------------------- 1. finishing


@pytest.mark.slow
def test_uncapped_run_finishes_and_saves_a_loadable_model(baseline, baseline_weights):
    from diffusers import UNet2DModel

    result, workdir = baseline
    assert_finished(result, resumed_from=None)
    assert "no checkpoint: starting at step 0" in result.stdout
    metrics = result.metrics
    assert [m["step"] for m in metrics] == list(range(1, MAX_STEPS + 1))
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    assert all(m["peak_bytes"] is None and m["capacity_bytes"] is None for m in metrics)  # nothing emulated
    assert json.loads((result.attempt_dir / HEARTBEAT).read_text())["step"] == MAX_STEPS
    # Checkpoints every 2 steps (not at the end: the final model is there), the newest 2 kept.
    assert checkpoint_steps(workdir) == [MAX_STEPS - 2 * EVERY, MAX_STEPS - EVERY]
    model = UNet2DModel.from_pretrained(workdir / "final")
    assert model.config.sample_size == 16
    assert list(model.config.block_out_channels) == [8, 16]
    assert metrics[-1]["loss"] < metrics[0]["loss"]  # it learned something


@pytest.mark.slow
def test_emulated_memory_counts_without_changing_the_training(baseline_weights, measured_full):
    result, workdir = measured_full
    assert all(m["capacity_bytes"] == 4 * 1024**3 for m in result.metrics)
    # Counting tensors is all the emulation does: the same plan trains bit for bit the same.
    weights = load_final(workdir)
    assert all(torch.equal(weights[k], baseline_weights[k]) for k in weights)


# ----------------------------------------------------------------------------- 2. determinism


@pytest.mark.slow
def test_micro_batches_train_the_same_as_the_full_batch(baseline, baseline_weights, measured_full, micro_batch_3):
    result, workdir = micro_batch_3
    assert_finished(result)
    assert "plan mb=3x3" in result.stdout
    assert losses(result.metrics) == pytest.approx(losses(baseline[0].metrics), rel=1e-5, abs=1e-6)

    weights = load_final(workdir)
    # Every weight, the attention key biases included (their gradient is zeroed: see
    # UnconditionalTrainer.zero_gradient_parameters).
    worst = assert_weights_allclose(weights, baseline_weights)
    torch.testing.assert_close(final_output(workdir), final_output(baseline[1]), rtol=1e-5, atol=1e-6)
    print(f"micro_batch 3 vs 8: max abs weight difference {worst:.3g}")

    # Smaller slices need less memory: that is what the micro_batch rung is for.
    assert steady_peak(result) < steady_peak(measured_full[0])


# ----------------------------------------------------------------------------- 3. OOM and recovery


@pytest.mark.slow
def test_oom_after_a_checkpoint_then_half_the_micro_batch_finishes_the_same(
    tmp_path, baseline, baseline_weights, measured_full, micro_batch_3
):
    full_peak = steady_peak(measured_full[0])
    mb3_peak = steady_peak(micro_batch_3[0])
    cap = cap_between_micro_batch_4_and_8(measured_full, micro_batch_3)
    schedule = f"{HUGE_CAP},{cap}B@{OOM_STEP}"
    print(f"steady peaks: mb=8 {full_peak} B, mb=3 {mb3_peak} B; cap {cap} B from step {OOM_STEP}")

    workdir = tmp_path / "work"
    # In-process recovery off: this is the path of rungs that need a new process.
    first = run_runner(write_attempt(tmp_path / "attempt-1", JOB, workdir, cap=schedule, recover_in_process=False))
    assert first.returncode == EXIT_OOM, first
    oom = first.outcome
    assert oom.kind == "oom" and oom.exit_code == EXIT_OOM
    assert oom.phase in ("forward", "backward"), oom
    assert oom.step == OOM_STEP
    assert "CUDA out of memory. Tried to allocate" in oom.message
    figures = oom.memory
    assert figures is not None and figures.total == cap
    assert figures.requested > 0 and figures.allocated > 0
    assert figures.allocated + figures.requested > cap
    assert figures.breakdown["parameters"] > 0 and figures.breakdown["optimizer_state"] > 0
    assert figures.dominant_consumer() == "activations"
    assert f"out of memory in {oom.phase} at step {OOM_STEP}" in first.stdout
    # The steps before the drop ran and were measured.
    assert [m["step"] for m in first.metrics] == list(range(1, OOM_STEP + 1))
    # An emergency checkpoint at the step of the OOM (the state is consistent: no optimizer step ran).
    emergency = checkpoints.verify(workdir / "checkpoints" / f"step-{OOM_STEP:06d}")
    assert emergency.step == OOM_STEP and emergency.plan["micro_batch"] == 8
    assert checkpoint_steps(workdir) == [OOM_STEP - 1, OOM_STEP]

    second = run_runner(write_attempt(tmp_path / "attempt-2", JOB, workdir, micro_batch=4, number=2, cap=schedule))
    assert_finished(second, resumed_from=OOM_STEP)
    assert f"resumed from checkpoint at step {OOM_STEP}" in second.stdout
    assert "plan mb=4x2" in second.stdout
    assert [m["step"] for m in second.metrics] == list(range(OOM_STEP + 1, MAX_STEPS + 1))
    assert all(m["peak_bytes"] < cap and m["capacity_bytes"] == cap for m in second.metrics)
    print(f"mb=4 after resume: steady peak {max(m['peak_bytes'] for m in second.metrics)} B")

    # Together the two attempts trained exactly what the uninterrupted full batch trained.
    assert losses(first.metrics + second.metrics) == pytest.approx(losses(baseline[0].metrics), rel=1e-5, abs=1e-6)
    weights = load_final(workdir)
    worst = assert_weights_allclose(weights, baseline_weights)
    print(f"OOM + resume with micro_batch 4 vs uninterrupted: max abs weight difference {worst:.3g}")
    torch.testing.assert_close(final_output(workdir), final_output(baseline[1]), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_oom_in_process_reruns_the_step_with_a_smaller_micro_batch_and_recomputes_nothing(
    tmp_path, baseline, baseline_weights, measured_full, micro_batch_3
):
    cap = cap_between_micro_batch_4_and_8(measured_full, micro_batch_3)
    schedule = f"{HUGE_CAP},{cap}B@{OOM_STEP}"

    workdir = tmp_path / "work"
    result = run_runner(write_attempt(tmp_path / "attempt-1", JOB, workdir, cap=schedule))
    outcome = assert_finished(result)
    # One attempt, one process: every step ran exactly once, the step of the OOM included.
    assert [m["step"] for m in result.metrics] == list(range(1, MAX_STEPS + 1))
    assert f"out of memory in forward at step {OOM_STEP}" in result.stdout or f"out of memory in backward at step {OOM_STEP}" in result.stdout
    (recovery,) = outcome.recoveries
    assert recovery["step"] == OOM_STEP and recovery["from"]["micro_batch"] == 8
    to = Plan.from_dict(recovery["to"])
    # Only what a running process can switch to; smaller activations one way or another.
    assert (to.offload, to.optimizer, to.mixed_precision, to.lora_rank, to.allocator) == ("none", "adamw", "no", None, "")
    assert to.micro_batch < 8 or to.gradient_checkpointing or to.attention == "sliced", to
    assert outcome.plan == to
    # No emergency checkpoint was needed: only the regular ones.
    assert OOM_STEP not in checkpoint_steps(workdir)
    after = [m for m in result.metrics if m["step"] > OOM_STEP]
    assert all(m["peak_bytes"] <= cap for m in after)
    # The OOM is on record as a measurement the memory model can use.
    assert any(not m.fits and m.plan.micro_batch == 8 and m.capacity == cap for m in outcome.measurements)

    assert losses(result.metrics) == pytest.approx(losses(baseline[0].metrics), rel=1e-5, abs=1e-6)
    worst = assert_weights_allclose(load_final(workdir), baseline_weights)
    print(f"in-process recovery [mb=8x1] -> [{to.short()}] at step {OOM_STEP}: max abs weight difference {worst:.3g}")


@pytest.mark.slow
@pytest.mark.parametrize("room_goes_again", [False, True], ids=["room-stays", "room-goes-again"])
def test_a_job_steps_back_up_when_the_room_returns_and_back_down_when_it_does_not_hold(
    tmp_path, baseline, baseline_weights, measured_full, micro_batch_3, room_goes_again
):
    """The device shrinks at step 5 (a neighbour came) and grows back from step 8 (it left): the
    runner steps down at 5, and back up at the first checkpoint boundary that has the room (10).
    When the room goes again at step 11, the step up does not hold: back to the plan that worked."""
    cap = cap_between_micro_batch_4_and_8(measured_full, micro_batch_3)
    schedule = f"{HUGE_CAP},{cap}B@{OOM_STEP},{HUGE_CAP}@8" + (f",{cap}B@11" if room_goes_again else "")

    workdir = tmp_path / "work"
    result = run_runner(write_attempt(tmp_path / "attempt-1", JOB, workdir, cap=schedule))
    outcome = assert_finished(result)
    assert [m["step"] for m in result.metrics] == list(range(1, MAX_STEPS + 1))
    down, up, *back = outcome.recoveries
    assert down["step"] == OOM_STEP and down["from"]["micro_batch"] == 8
    assert up["direction"] == "up" and up["step"] == 10 and up["from"] == down["to"] and up["to"] == down["from"]
    assert "stepped back up" in up["reason"] and "stepped back up" in result.stdout
    plans = {m["step"]: m["plan"] for m in result.metrics}
    lower = Plan.from_dict(down["to"]).short()
    if room_goes_again:
        (back,) = back
        assert back["direction"] == "back" and back["step"] == 11 and back["to"] == down["to"]
        assert "the next try after 1 checkpoint(s)" in back["reason"]
        # metrics count steps from 1: the 12th (index 11) ran out under mb=8 and ran again under the lower plan
        assert [plans[step] for step in (6, 10, 11, 12)] == [lower, lower, "mb=8x1", lower]
    else:
        assert back == []
        assert [plans[step] for step in (6, 10, 11, 12)] == [lower, lower, "mb=8x1", "mb=8x1"]
    # Back up means the plan's own memory again, not only its name (checkpointing switched off).
    full_peak = max(m["peak_bytes"] for m in result.metrics[1:OOM_STEP])
    assert result.metrics[10]["peak_bytes"] == full_peak
    # Every rung on the way is exact: the run that stepped down and up is the run that did not.
    assert losses(result.metrics) == pytest.approx(losses(baseline[0].metrics), rel=1e-5, abs=1e-6)
    assert_weights_allclose(load_final(workdir), baseline_weights)


@pytest.mark.slow
def test_a_job_that_started_beside_a_neighbour_steps_up_to_its_own_plan_when_it_leaves(
    tmp_path, baseline_weights, measured_full, micro_batch_3
):
    """The device is short from the start (a neighbour was there): the probe starts below the
    job's own plan, which the measurements say does not fit, and records that it left it for lack
    of room. The neighbour leaves at step 3: at the boundary at 4 the job is back on its own plan."""
    cap = cap_between_micro_batch_4_and_8(measured_full, micro_batch_3)
    workdir = tmp_path / "work"
    # The rungs a running process can take off again: the probe picks by the speeds it measures,
    # and under load a plan that needs a new process (layer offload, say) sometimes timed fastest.
    in_process = dataclasses.replace(JOB, ladder=dataclasses.replace(JOB.ladder, allow=tuple(
        name for name in JOB.policy().allow if not rungs.rung(name).needs_restart
    )))
    result = run_runner(write_attempt(tmp_path / "attempt-1", in_process, workdir, cap=f"{cap}B,{HUGE_CAP}@3", probe=True))
    outcome = assert_finished(result)
    probed, up = outcome.recoveries
    assert probed["step"] == 0 and probed["from"]["micro_batch"] == 8 and probed["for_room"] is True
    assert up["direction"] == "up" and up["step"] == 4 and up["to"] == probed["from"] and not up["restart"]
    assert outcome.plan == Plan.initial(8)
    assert_weights_allclose(load_final(workdir), baseline_weights)


@pytest.mark.slow
def test_probe_starts_at_the_micro_batch_that_fits_and_finishes_without_an_oom(tmp_path, measured_full, micro_batch_3):
    full_peak = steady_peak(measured_full[0])
    mb3_peak = steady_peak(micro_batch_3[0])
    per_sample = (full_peak - mb3_peak) / 5
    mb2 = mb3_peak - per_sample
    cap = int(mb2 + 0.6 * per_sample) * 100 // 90  # micro-batch 2 fits with the margin, 3 does not
    workdir = tmp_path / "work"
    # Only the micro-batch may change, so the one plan that fits is micro-batch 2 (with every
    # exact rung allowed, checkpointing at a bigger micro-batch may be faster).
    only_micro_batch = dataclasses.replace(JOB, ladder=dataclasses.replace(JOB.ladder, allow=("micro_batch",)))
    result = run_runner(write_attempt(tmp_path / "attempt-1", only_micro_batch, workdir, cap=f"{cap}B", probe=True))
    outcome = assert_finished(result)
    assert "probe: start at [mb=2x4]" in result.stdout, result
    assert outcome.plan is not None and outcome.plan.micro_batch == 2
    assert not any(not m.fits for m in outcome.measurements), outcome.measurements
    assert outcome.recoveries and outcome.recoveries[0]["step"] == 0
    assert [m["step"] for m in result.metrics] == list(range(1, MAX_STEPS + 1))
    assert all("mb=2x4" == m["plan"] for m in result.metrics)


# ----------------------------------------------------------------------------- 4./5. signals


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_resumes_from_it_exactly(tmp_path, baseline_weights):
    workdir = tmp_path / "work"
    # The huge cap only slows the steps a little, for a wider window between checkpoint and end.
    killed_dir = write_attempt(tmp_path / "attempt-1", JOB, workdir, cap=HUGE_CAP)
    with running_runner(killed_dir) as process:
        first_checkpoint = wait_for_checkpoint(workdir, process)
        os.kill(process.pid, signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL
    assert first_checkpoint >= EVERY
    assert not (workdir / "final").exists(), "the kill landed after the end: nothing was tested"
    assert not (killed_dir / OUTCOME).exists()  # killed hard: the daemon goes by the exit status

    result = run_runner(write_attempt(tmp_path / "attempt-2", JOB, workdir, number=2))
    resumed_from = result.outcome.resumed_from
    assert resumed_from is not None and resumed_from >= first_checkpoint, result
    assert_finished(result, resumed_from=resumed_from)
    assert f"resumed from checkpoint at step {resumed_from}" in result.stdout
    assert [m["step"] for m in result.metrics] == list(range(resumed_from + 1, MAX_STEPS + 1))
    # The same plan resumed: no splitting, so every weight matches, key biases included.
    worst = assert_weights_allclose(load_final(workdir), baseline_weights)
    print(f"SIGKILL at step >= {first_checkpoint}, resumed from {resumed_from}: max abs weight difference {worst:.3g}")
    assert not list((workdir / "checkpoints").glob(".tmp-*"))  # a half-written checkpoint is cleaned up


@pytest.mark.slow
def test_sigterm_stops_after_a_checkpoint_at_the_current_step(tmp_path):
    workdir = tmp_path / "work"
    attempt_dir = write_attempt(tmp_path / "attempt-1", JOB, workdir, cap=HUGE_CAP)
    with running_runner(attempt_dir) as process:
        wait_for_checkpoint(workdir, process)
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=60)
    log = (attempt_dir / "output.log").read_text()
    assert returncode == EXIT_INTERRUPTED, log
    outcome = Outcome.from_dict(json.loads((attempt_dir / OUTCOME).read_text()))
    assert outcome.kind == "interrupted" and outcome.exit_code == EXIT_INTERRUPTED
    stopped = outcome.step
    assert EVERY <= stopped < MAX_STEPS, outcome
    assert checkpoints.verify(workdir / "checkpoints" / f"step-{stopped:06d}").step == stopped
    assert max(checkpoint_steps(workdir)) == stopped
    assert read_metrics(attempt_dir)[-1]["step"] == stopped
    assert not (workdir / "final").exists()


@pytest.mark.slow
def test_sigterm_while_torch_loads_still_ends_interrupted(tmp_path):
    """The handler is in place from the runner's first line of output, before the slow imports."""
    workdir = tmp_path / "work"
    attempt_dir = write_attempt(tmp_path / "attempt-1", JOB, workdir)
    log = attempt_dir / "output.log"
    with running_runner(attempt_dir) as process:
        deadline = time.monotonic() + 60
        while "attempt 1 of job" not in log.read_text() and time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()
            time.sleep(0.003)
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=60)
    assert returncode == EXIT_INTERRUPTED, log.read_text()
    outcome = Outcome.from_dict(json.loads((attempt_dir / OUTCOME).read_text()))
    assert outcome.kind == "interrupted" and outcome.step == 0, outcome
    assert read_metrics(attempt_dir) == []


# ----------------------------------------------------------------------------- OOM in setup


@pytest.mark.slow
def test_a_model_that_does_not_fit_is_an_oom_in_setup_not_a_crash(tmp_path):
    result = run_runner(write_attempt(tmp_path / "attempt-1", JOB, tmp_path / "work", cap="64KiB"))
    assert result.returncode == EXIT_OOM, result
    outcome = result.outcome
    assert outcome.kind == "oom" and outcome.phase == "setup" and outcome.step == 0, outcome
    assert outcome.memory is not None and outcome.memory.total == 64 * 1024
    assert outcome.memory.requested > 0
    assert "out of memory in setup at step 0" in result.stdout


# ----------------------------------------------------------------------------- 6. damage


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, baseline, baseline_weights):
    workdir = tmp_path / "work"
    shutil.copytree(baseline[1] / "checkpoints", workdir / "checkpoints")
    previous, newest = checkpoint_steps(workdir)
    damaged = workdir / "checkpoints" / f"step-{newest:06d}" / "model.safetensors"
    with damaged.open("r+b") as f:
        f.truncate(damaged.stat().st_size // 2)

    result = run_runner(write_attempt(tmp_path / "attempt-1", JOB, workdir))
    assert_finished(result, resumed_from=previous)
    assert f"skipping damaged checkpoint: {damaged.parent}" in result.stdout
    assert "model.safetensors" in result.stdout
    assert f"resumed from checkpoint at step {previous}" in result.stdout
    worst = assert_weights_allclose(load_final(workdir), baseline_weights)
    print(f"resumed from step {previous} past a damaged step {newest}: max abs weight difference {worst:.3g}")


# ----------------------------------------------------------------------------- 7. bad input


def _missing(tmp_path):
    return tmp_path / "no-such-attempt"


def _garbage(tmp_path):
    (tmp_path / "attempt.json").write_text("{not json")
    return tmp_path


def _invalid_job(tmp_path):
    write_attempt(tmp_path, JOB, tmp_path / "work")
    data = json.loads((tmp_path / "attempt.json").read_text())
    data["job"]["train"]["batch_size"] = 0
    (tmp_path / "attempt.json").write_text(json.dumps(data))
    return tmp_path


def _no_plan(tmp_path):
    write_attempt(tmp_path, JOB, tmp_path / "work")
    data = json.loads((tmp_path / "attempt.json").read_text())
    del data["plan"]
    (tmp_path / "attempt.json").write_text(json.dumps(data))
    return tmp_path


def _plan_for_another_batch(tmp_path):
    write_attempt(tmp_path, JOB, tmp_path / "work")
    data = json.loads((tmp_path / "attempt.json").read_text())
    data["plan"].update(batch_size=4, micro_batch=4)  # would train on half of each batch of 8
    (tmp_path / "attempt.json").write_text(json.dumps(data))
    return tmp_path


@pytest.mark.parametrize("make", [_missing, _garbage, _invalid_job, _no_plan, _plan_for_another_batch], ids=lambda f: f.__name__.strip("_"))
def test_a_bad_attempt_dir_exits_2_without_training(tmp_path, make):
    attempt_dir = make(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "oomguard.jobs.run", str(attempt_dir)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == EXIT_USAGE, done.stderr
    assert "attempt.json" in done.stderr
    assert not (tmp_path / "work").exists()


def test_no_arguments_exits_2_with_usage():
    done = subprocess.run([sys.executable, "-m", "oomguard.jobs.run"], capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_USAGE
    assert "usage:" in done.stderr

