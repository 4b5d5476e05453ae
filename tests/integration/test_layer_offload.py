"""Layer offload (rung layer_offload) on the built-in unconditional trainer's UNet under the
emulated device: half and all of the blocks on the host train the weights plain training
trains, the steps' device peak drops by about the state the blocks took along, the memory model
predicts that drop from a plain run's figures, and a checkpoint written at one fraction resumes
at another (and without the rung)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oomguard.jobs import train_state
from oomguard.jobs.attempt import Control
from oomguard.jobs.memory_cap import EmulatedMemory
from oomguard.jobs.sizes import CapSchedule
from oomguard.jobs.trainers.unconditional import UnconditionalTrainer
from oomguard.jobs.training import Training, build_training, one_step
from oomguard.strategies.memory_model import Measurement, MemoryModel
from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs import layer_offload
from tests.jobs_helpers import tiny_job

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 3
JOB = tiny_job("layer-offload", batch_size=2, max_steps=STEPS)
# Micro-batch 1 at 16 px: the weights' state is a large part of the peak, as when a big model is
# fine-tuned.
PLAIN = Plan.initial(2, micro_batch=1)
HALF = PLAIN.with_extra(layer_offload.KNOB, 0.5, 0.0)
ALL = PLAIN.with_extra(layer_offload.KNOB, 1.0, 0.0)


def train(plan: Plan, steps: range, checkpoint: Path | None = None, resume: Path | None = None) -> tuple[dict[str, torch.Tensor], list[int], Training]:
    """Steps under ``plan`` on an emulated device without a cap: the final weights (plain
    tensors) and each step's device peak; the training (its static figures). ``resume``: from
    that checkpoint; ``checkpoint``: written after the last step."""
    trainer = UnconditionalTrainer(JOB)
    memory = EmulatedMemory(CapSchedule(((0, 64 << 30),)))
    peaks = []
    with memory:
        weights = train_state.load_weights(resume, plan) if resume is not None else None
        training = build_training(trainer, JOB, plan, torch.device("cpu"), memory, weights)
        if resume is not None:
            with memory.paused():
                train_state.load_rest(resume, optimizer=training.optimizer, lr_scheduler=training.lr_scheduler, scaler=None, plan=plan, say=print)
        for step in steps:
            memory.begin_step(step)
            memory.reset_peak()
            one_step(trainer, training, step, memory, Control())
            peaks.append(memory.peak_bytes())
        if checkpoint is not None:
            checkpoint.mkdir()
            with memory.paused():
                train_state.save(
                    checkpoint, weights=training.weights(), optimizer=training.optimizer, lr_scheduler=training.lr_scheduler, scaler=None,
                    plan=plan, step=steps.stop, job_name=JOB.name,
                )
        final = {name: value.detach().clone() for name, value in training.model.state_dict().items()}
    return final, peaks, training


@pytest.fixture(scope="module")
def plain_run():
    return train(PLAIN, range(STEPS))


def assert_same_weights(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        assert type(weights[name]) is torch.Tensor, name  # plain, as checkpoints and save_pretrained need
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("plan", [HALF, ALL], ids=["half", "all"])
def test_offloaded_blocks_train_the_plain_weights_on_less_device_memory(plain_run, plan):
    plain_weights, plain_peaks, plain_training = plain_run
    weights, peaks, training = train(plan, range(STEPS))
    assert_same_weights(weights, plain_weights)
    # From the second step on the optimizer state exists: the steady peak.
    saved = plain_peaks[-1] - peaks[-1]
    static = plain_training.static_bytes()
    moved = training.static_bytes()
    # The blocks' weights, gradients and AdamW state (4 bytes a weight byte) left the device,
    # less what visits it at once (blocks running and prefetched, a block's gradients) where that
    # is at the peak (here it is not: the activations peak first).
    state_left = 4 * (static["parameters"] - moved["parameters"])
    assert 0.8 * state_left < saved < 1.02 * state_left, (saved, state_left)
    assert moved["whole_model"] == static["parameters"] and moved["optimizer_state"] < static["optimizer_state"]
    # The memory model predicts the offloaded plan from the plain run's figures on the safe side:
    # it counts the largest block's visit to the device at the peak (jobs/layer_offload.py
    # held_bytes), which this small UNet's activations hide.
    plain = Measurement(plan=PLAIN, fits=True, peak_bytes=plain_peaks[-1], static=static, samples_per_s=1.0)
    predicted = MemoryModel([plain]).predicted_peak(plan)
    assert peaks[-1] <= predicted < 1.35 * peaks[-1], (predicted, peaks[-1])


def test_more_blocks_on_the_host_leave_less_on_the_device(plain_run):
    _, plain_peaks, _ = plain_run
    steady = [train(PLAIN.with_extra(layer_offload.KNOB, f, 0.0), range(2))[1][-1] for f in (0.25, 0.75)]
    assert plain_peaks[-1] > steady[0] > steady[1]


def test_a_checkpoint_resumes_at_another_fraction_and_without_the_rung(plain_run, tmp_path):
    plain_weights = plain_run[0]
    train(HALF, range(1), checkpoint=tmp_path / "half-1")
    train(ALL, range(1, 2), checkpoint=tmp_path / "all-2", resume=tmp_path / "half-1")
    weights, _, _ = train(PLAIN, range(2, STEPS), resume=tmp_path / "all-2")
    assert_same_weights(weights, plain_weights)


@pytest.mark.long
def test_the_runner_resumes_an_oom_under_layer_offload_and_ends_with_the_plain_weights(tmp_path):
    from oomguard.strategies.outcome import EXIT_FINISHED, EXIT_OOM
    from tests.jobs_helpers import load_final, max_abs_difference, run_runners, write_attempt

    job = tiny_job("layer-offload-runner", batch_size=4, max_steps=6, checkpoint_every_steps=2)
    offloaded = Plan.initial(4).with_extra(layer_offload.KNOB, 0.5, 0.0)
    baseline = write_attempt(tmp_path / "base" / "attempt-1", job, tmp_path / "base" / "work")
    # The cap drops to almost nothing at step 3: the first attempt ends with a checkpoint there.
    interrupted = write_attempt(tmp_path / "oom" / "attempt-1", job, tmp_path / "oom" / "work", cap="4GiB,1KiB@3", recover_in_process=False)
    reference, oom = run_runners([baseline, interrupted])
    assert reference.returncode == EXIT_FINISHED and oom.returncode == EXIT_OOM, (reference, oom)
    resumed, = run_runners([write_attempt(tmp_path / "oom" / "attempt-2", job, tmp_path / "oom" / "work", plan=offloaded, number=2)])
    assert resumed.returncode == EXIT_FINISHED, resumed.stderr[-3000:]
    assert resumed.outcome.resumed_from == 3 and all(m["plan"] == offloaded.short() for m in resumed.metrics)
    assert max_abs_difference(load_final(tmp_path / "oom" / "work"), load_final(tmp_path / "base" / "work")) < 1e-5


@pytest.mark.long
def test_an_oom_in_forward_is_recovered_in_process_with_the_blocks_on_the_host(tmp_path):
    # FSDP's state after an OOM inside a step is whole again at the next step: the runner takes
    # smaller slices, checkpointing and activation offload in process, and stays exact.
    from oomguard.strategies.outcome import EXIT_FINISHED
    from tests.jobs_helpers import load_final, max_abs_difference, run_runners, write_attempt

    job = tiny_job("layer-offload-in-process", batch_size=4, max_steps=6, checkpoint_every_steps=2)
    offloaded = Plan.initial(4).with_extra(layer_offload.KNOB, 1.0, 0.0)
    baseline = write_attempt(tmp_path / "base" / "attempt-1", job, tmp_path / "base" / "work")
    # At step 3 the cap drops below what the steps took (1.9 MiB).
    squeezed = write_attempt(tmp_path / "squeezed" / "attempt-1", job, tmp_path / "squeezed" / "work", plan=offloaded, cap="4GiB,420KiB@3")
    reference, result = run_runners([baseline, squeezed])
    assert reference.returncode == EXIT_FINISHED and result.returncode == EXIT_FINISHED, result.stderr[-3000:]
    plans = [m["plan"] for m in result.metrics]
    assert plans[0] == offloaded.short() and plans[-1] != plans[0] and plans[-1].endswith("layers@host=1"), plans
    assert max_abs_difference(load_final(tmp_path / "squeezed" / "work"), load_final(tmp_path / "base" / "work")) < 1e-5
