"""Every rung through the real runner: an attempt runs out of memory after a checkpoint, and the
next attempt, under a plan with the rung taken, resumes from that checkpoint and finishes.

Exact rungs must end with the weights of a run that never stopped; approximate ones must
still train every step once and leave a final model that diffusers loads as a plain UNet.
"""

from __future__ import annotations

import pytest

from oomguard.jobs import checkpoints
from oomguard.jobs.train_state import ADAPTERS
from oomguard.strategies.outcome import EXIT_FINISHED, EXIT_OOM
from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs import activation_offload, fused_backward
from oomguard.strategies.rungs.checkpoint_grades import with_grade
from tests.jobs_helpers import (
    assert_weights_allclose,
    load_final,
    max_abs_difference,
    run_runner,
    run_runners,
    tiny_job,
    write_attempt,
)

pytestmark = pytest.mark.slow

MAX_STEPS = 8
OOM_STEP = 3  # the cap drops to almost nothing here: the first attempt ends, checkpoint at 3
JOB = tiny_job("rungs-test", batch_size=4, max_steps=MAX_STEPS, checkpoint_every_steps=2)
START = Plan.initial(4)
DROP = f"4GiB,1KiB@{OOM_STEP}"

EXACT = {
    "offload": START.replace(offload="optimizer"),
    "attention": START.replace(attention="sliced"),
    "checkpointing+micro_batch": START.replace(gradient_checkpointing=True, micro_batch=3),
    "checkpoint_alternate+activation_offload": activation_offload.step(with_grade(START, "alternate")),
    "fused_backward": fused_backward.step(START),
}
APPROXIMATE = {
    "precision": START.replace(mixed_precision="bf16"),
    "optimizer_8bit": START.replace(optimizer="adamw8bit"),
    "offload+optimizer_8bit": START.replace(offload="optimizer", optimizer="adamw8bit"),
    "lora": START.replace(lora_rank=4),
    "lora+int8": START.replace(lora_rank=4, base_quantization="int8"),
    "lora+nf4": START.replace(lora_rank=4, base_quantization="nf4"),
}


@pytest.fixture(scope="module")
def first_attempt(tmp_path_factory):
    """One interrupted run (OOM at step 3, emergency checkpoint) and one that never stopped."""
    root = tmp_path_factory.mktemp("rungs")
    interrupted = write_attempt(root / "oom" / "attempt-1", JOB, root / "oom" / "work", cap=DROP, recover_in_process=False)
    baseline = write_attempt(root / "baseline" / "attempt-1", JOB, root / "baseline" / "work")
    oom, reference = run_runners([interrupted, baseline])
    assert oom.returncode == EXIT_OOM, oom
    assert reference.returncode == EXIT_FINISHED, reference
    assert checkpoints.verify(root / "oom" / "work" / "checkpoints" / f"step-{OOM_STEP:06d}").step == OOM_STEP
    return root / "oom" / "work", load_final(root / "baseline" / "work")


def resume_under(tmp_path, first_attempt, plan: Plan):
    """Copy the interrupted workdir and resume it under ``plan`` to the end."""
    import shutil

    workdir = tmp_path / "work"
    shutil.copytree(first_attempt[0], workdir)
    result = run_runner(write_attempt(tmp_path / "attempt-2", JOB, workdir, plan=plan, number=2))
    assert result.returncode == EXIT_FINISHED, result
    outcome = result.outcome
    assert outcome.resumed_from == OOM_STEP and outcome.step == MAX_STEPS
    assert [m["step"] for m in result.metrics] == list(range(OOM_STEP + 1, MAX_STEPS + 1))
    assert all(m["plan"] == plan.short() for m in result.metrics)
    return result, workdir


@pytest.mark.parametrize("name", list(EXACT))
def test_an_exact_rung_resumes_the_checkpoint_and_ends_with_the_same_weights(tmp_path, first_attempt, name):
    result, workdir = resume_under(tmp_path, first_attempt, EXACT[name])
    worst = assert_weights_allclose(load_final(workdir), first_attempt[1])
    print(f"{name}: max abs weight difference to the uninterrupted run {worst:.3g}")


@pytest.mark.parametrize("name", list(APPROXIMATE))
def test_an_approximate_rung_resumes_the_checkpoint_and_saves_a_plain_model(tmp_path, first_attempt, name):
    plan = APPROXIMATE[name]
    result, workdir = resume_under(tmp_path, first_attempt, plan)
    final = load_final(workdir)  # a plain UNet2DModel, whatever was trained
    assert final.keys() == first_attempt[1].keys()
    drift = max_abs_difference(final, first_attempt[1])
    print(f"{name}: max abs weight difference to the uninterrupted run {drift:.3g}")
    assert 0 < drift < 0.5
    newest = checkpoints.latest_valid(workdir / "checkpoints")
    if plan.lora_rank is not None:
        # A LoRA run's checkpoints keep the adapters apart from the frozen full-precision base.
        assert newest is not None and (newest.path / ADAPTERS).exists()


def test_a_lora_checkpoint_resumes_under_lora_exactly(tmp_path, first_attempt):
    """Adapters and their optimizer state come back from a LoRA checkpoint: stopping a LoRA
    run and resuming it changes nothing."""
    plan = APPROXIMATE["lora+int8"]
    straight, straight_dir = resume_under(tmp_path / "straight", first_attempt, plan)

    import shutil

    workdir = tmp_path / "twice" / "work"
    shutil.copytree(first_attempt[0], workdir)
    # Under LoRA to step 5 (an OOM ends it there with a checkpoint), then resumed under LoRA.
    stop = write_attempt(tmp_path / "twice" / "attempt-2", JOB, workdir, plan=plan, number=2, cap="4GiB,1KiB@5", recover_in_process=False)
    first = run_runner(stop)
    assert first.returncode == EXIT_OOM, first
    second = run_runner(write_attempt(tmp_path / "twice" / "attempt-3", JOB, workdir, plan=plan, number=3))
    assert second.returncode == EXIT_FINISHED, second
    assert second.outcome.resumed_from == 5
    assert_weights_allclose(load_final(workdir), load_final(straight_dir), rtol=1e-6, atol=1e-7)
