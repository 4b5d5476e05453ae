"""The average of the trained weights (train.ema) on the real text-to-image trainer: the final
model is the average; the rung ema_offload keeps it in host memory and trains the same weights
on less of the device; a resumed run goes on from the checkpoint's average."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oomguard.jobs.spec import load_job_file
from oomguard.strategies import rungs
from oomguard.strategies.plan import Plan
from tests.integration.test_text_to_image import assert_same_weights
from tests.integration.test_text_to_image_rungs import steady_peak
from tests.jobs_helpers import run_runner, run_runners, write_attempt
from tests.pipelines import save_tiny_pipeline
from tests.t2i_helpers import CAP_BELOW_PLAIN, final_tensors, text_to_image_job, write_captioned_images

EMA = "ema = true\nema_decay = 0.9"


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipelines")
    return {layout: save_tiny_pipeline(root / layout, layout) for layout in ("sd", "sdxl")}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_captioned_images(tmp_path_factory.mktemp("captioned"))


# SDXL with LoRA: 20 s on two cores, the same mechanism as SD's full fine-tune: `make faults`
# runs it (marker long).
@pytest.mark.parametrize(("layout", "method"), [("sd", "full"), pytest.param("sdxl", "lora", marks=pytest.mark.long)])
def test_ema_offload_trains_the_same_average_off_the_device_and_the_final_model_is_the_average(tmp_path, pipelines, data, layout, method):
    averaged = load_job_file(text_to_image_job(tmp_path, "ema", pipelines[layout], data, method=method, max_steps=4, train=EMA))
    last = load_job_file(text_to_image_job(tmp_path, "last", pipelines[layout], data, method=method, max_steps=4))
    plain = Plan.initial(4)
    runs = {
        "device": (averaged, plain),
        "host": (averaged, rungs.rung("ema_offload").step(plain)),
        "no-ema": (last, plain),
    }
    attempts = {name: write_attempt(tmp_path / name / "a1", job, tmp_path / name, plan=plan, cap="64MiB") for name, (job, plan) in runs.items()}
    results = dict(zip(attempts, run_runners(list(attempts.values()), timeout=300)))
    for name, result in results.items():
        assert result.outcome.kind == "finished", f"{name}: {result}"
    assert_same_weights(tmp_path / "host" / "final", tmp_path / "device" / "final")
    # The final model is the average, not the last weights (decay 0.9 over 4 steps lags them).
    got, last_weights = final_tensors(tmp_path / "device" / "final"), final_tensors(tmp_path / "no-ema" / "final")
    assert got.keys() == last_weights.keys()
    assert any(not torch.allclose(got[key], last_weights[key], rtol=1e-4, atol=1e-6) for key in got)
    static = results["device"].outcome.measurements[-1].static
    assert static["ema"] == static["ema_size"] == static["trainable"] > 0
    assert results["host"].outcome.measurements[-1].static["ema"] == 0
    assert steady_peak(attempts["device"]) - steady_peak(attempts["host"]) >= static["ema_size"]


def test_a_resumed_run_goes_on_from_the_checkpoints_average(tmp_path, pipelines, data):
    """The cap drops at step 3 after the checkpoint at step 2: the attempt saves step 3 (with
    its average) and ends; the next, at micro-batch 1 with the average in host memory, resumes
    there. Its final average is the uninterrupted run's."""
    job = load_job_file(text_to_image_job(tmp_path, "ema", pipelines["sd"], data, method="full", train=EMA))
    plain = Plan.initial(job.train.batch_size)
    reference = run_runner(write_attempt(tmp_path / "reference" / "a1", job, tmp_path / "reference", plan=plain), timeout=240)
    assert reference.returncode == 0, reference
    workdir = tmp_path / "dropped"
    schedule = f"8MiB,{CAP_BELOW_PLAIN}@3"
    first = run_runner(write_attempt(workdir / "a1", job, workdir, plan=plain, cap=schedule, recover_in_process=False), timeout=240)
    assert first.outcome.kind == "oom" and first.outcome.step == 3, first
    assert (workdir / "checkpoints" / "step-000003" / "ema.safetensors").exists()
    resumed_plan = rungs.rung("ema_offload").step(plain.replace(micro_batch=1))
    second = run_runner(write_attempt(workdir / "a2", job, workdir, plan=resumed_plan, cap=schedule, number=2), timeout=240)
    assert second.outcome.kind == "finished", second
    assert "resumed from checkpoint at step 3" in second.stdout
    assert_same_weights(workdir / "final", tmp_path / "reference" / "final")
