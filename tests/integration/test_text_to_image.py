"""The built-in text-to-image trainer on tiny SD and SDXL pipelines saved offline: a run that
runs out of memory under an emulated cap and recovers through exact rungs ends with the weights
of the uninterrupted run, and what it saves loads into diffusers' pipelines."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from oomguard.jobs.spec import load_job_file
from oomguard.strategies.plan import Plan
from tests.e2e.conftest import oomguard
from tests.jobs_helpers import run_runner, write_attempt
from tests.pipelines import save_tiny_pipeline
from tests.t2i_helpers import CAP_BELOW_PLAIN, final_tensors, text_to_image_job, write_captioned_images

pytestmark = pytest.mark.usefixtures("offline")


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # A download attempt fails at once instead of hanging (the runner inherits it).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipelines")
    return {layout: save_tiny_pipeline(root / layout, layout) for layout in ("sd", "sdxl")}  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_captioned_images(tmp_path_factory.mktemp("captioned"))


def run_job(job_file: Path, workdir: Path, cap: str | None = None) -> dict:
    args = ["run", "--json", str(job_file), "--workdir", str(workdir)]
    if cap is not None:
        args += ["--emulate-device-memory", cap]
    result = oomguard(*args, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def assert_same_weights(final: Path, reference: Path) -> None:
    import torch

    got, want = final_tensors(final), final_tensors(reference)
    assert got.keys() == want.keys() and got
    for key, tensor in want.items():
        torch.testing.assert_close(got[key], tensor, rtol=1e-5, atol=1e-5, msg=key)


def exact_only(plan: dict) -> bool:
    """No knob of an approximate rung is turned in this plan."""
    return plan["mixed_precision"] == "no" and plan["optimizer"] == "adamw" and plan["lora_rank"] is None and plan["base_quantization"] is None


# SDXL full: 20 s on two cores, the same recovery as SD's (SDXL's full fine-tune is trained and
# loaded in the tests below and in test_text_to_image_rungs.py): `make faults` runs it (marker long).
@pytest.mark.parametrize(("layout", "method"), [("sd", "lora"), pytest.param("sdxl", "full", marks=pytest.mark.long)])
def test_an_oom_under_the_cap_recovers_by_exact_rungs_to_the_uninterrupted_weights(tmp_path, pipelines, data, layout, method):
    job = text_to_image_job(tmp_path, f"{layout}-{method}", pipelines[layout], data, method=method)
    uninterrupted = run_job(job, tmp_path / "uninterrupted")
    capped = run_job(job, tmp_path / "capped", cap=CAP_BELOW_PLAIN)
    assert uninterrupted["state"] == capped["state"] == "finished"
    escalations = [e for e in capped["events"] if e["kind"] == "escalated"]
    assert escalations, "the plain plan fitted the cap: the test proves nothing"
    # The record names each rung taken, and why: the OOM and what the rung saves.
    assert all("out of memory" in e["message"] and "->" in e["message"] for e in escalations)
    assert all(exact_only(a["plan"]) for a in capped["attempts"])
    assert_same_weights(tmp_path / "capped" / "final", tmp_path / "uninterrupted" / "final")


# SDXL with LoRA takes 40 s on two cores: `make faults` runs it (marker long).
@pytest.mark.parametrize(("layout", "method"), [("sd", "full"), pytest.param("sdxl", "lora", marks=pytest.mark.long)])
def test_a_new_process_resumes_after_an_oom_at_a_checkpoint_to_the_uninterrupted_weights(tmp_path, pipelines, data, layout, method):
    """The cap drops at step 3 (a neighbour takes memory), after the checkpoint at step 2: the
    attempt saves step 3 and ends; the next, a process at micro-batch 1, resumes there under
    the lower cap. Its learning-rate schedule (cosine) and data order must go on as before."""
    job = load_job_file(text_to_image_job(tmp_path, f"{layout}-{method}", pipelines[layout], data, method=method))
    plain = Plan.initial(job.train.batch_size)
    reference = run_runner(write_attempt(tmp_path / "reference" / "a1", job, tmp_path / "reference", plan=plain), timeout=240)
    assert reference.returncode == 0, reference
    workdir = tmp_path / "dropped"
    schedule = f"8MiB,{CAP_BELOW_PLAIN}@3"
    first = run_runner(write_attempt(workdir / "a1", job, workdir, plan=plain, cap=schedule, recover_in_process=False), timeout=240)
    assert first.outcome.kind == "oom" and first.outcome.step == 3, first
    if method == "lora":
        # The frozen UNet comes from the pipeline folder: a checkpoint holds only the adapters.
        from safetensors.torch import load_file

        saved = load_file(str(workdir / "checkpoints" / "step-000003" / "model.safetensors"))
        assert saved and all(".lora_" in key for key in saved), sorted(saved)[:3]
    second = run_runner(write_attempt(workdir / "a2", job, workdir, plan=plain.replace(micro_batch=1), cap=schedule, number=2), timeout=240)
    assert second.outcome.kind == "finished", second
    assert "resumed from checkpoint at step 3" in second.stdout
    # Resuming (weights, then the optimizer state read on the host and moved per tensor) needs
    # no more of the device than the training steps that follow it.
    (resume_peak,) = re.findall(r"device peak while resuming: (\d+) bytes", second.stdout)
    assert 0 < int(resume_peak) <= min(m["peak_bytes"] for m in second.metrics), (resume_peak, second.metrics)
    print(f"{layout}-{method}: device peak while resuming {int(resume_peak)} bytes, steps after it {[m['peak_bytes'] for m in second.metrics]}")
    assert_same_weights(workdir / "final", tmp_path / "reference" / "final")


def test_saved_outputs_load_into_diffusers_pipelines_and_generate(tmp_path, pipelines, data):
    import numpy as np
    import torch
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    def generate(pipeline) -> np.ndarray:
        return pipeline("a photo of thing", num_inference_steps=2, height=32, width=32, output_type="np", generator=torch.manual_seed(0)).images

    for layout, method, pipeline_class in (("sd", "lora", StableDiffusionPipeline), ("sdxl", "full", StableDiffusionXLPipeline)):
        job = text_to_image_job(tmp_path, f"{layout}-{method}", pipelines[layout], data, method=method, max_steps=4)
        final = tmp_path / layout / "final"
        assert run_job(job, final.parent)["state"] == "finished"
        base = pipeline_class.from_pretrained(pipelines[layout])
        before = generate(base)
        if method == "lora":
            assert [p.name for p in final.iterdir()] == ["pytorch_lora_weights.safetensors"]
            base.load_lora_weights(final)
            trained = base
        else:
            trained = pipeline_class.from_pretrained(final)
        images = generate(trained)
        assert images.shape == (1, 32, 32, 3) and np.isfinite(images).all()
        assert not np.array_equal(images, before), f"{method}: the saved weights loaded but change nothing"
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def captioned_copy(source: Path, target: Path) -> Path:
    import shutil

    return Path(shutil.copytree(source, target))


def test_a_file_that_is_not_an_image_stops_the_runner_before_training_and_names_it(tmp_path, pipelines, data):
    from oomguard.jobs.trainers.text_to_image import DataError, TextToImageTrainer

    folder = captioned_copy(data, tmp_path / "data")
    (folder / "image3.png").write_text("not a picture")
    job = load_job_file(text_to_image_job(tmp_path, "bad", pipelines["sd"], folder))
    with pytest.raises(DataError, match=rf"data: {folder / 'image3.png'} is not an image that can be read .*: replace it or remove it"):
        TextToImageTrainer(job)


def test_an_image_damaged_past_its_header_is_named_when_it_is_loaded(tmp_path, pipelines, data):
    from oomguard.jobs.trainers.text_to_image import DataError, TextToImageTrainer

    folder = captioned_copy(data, tmp_path / "data")
    damaged = folder / "image0.png"
    damaged.write_bytes(damaged.read_bytes()[:60])  # the header reads; the pixels do not
    job = load_job_file(text_to_image_job(tmp_path, "bad", pipelines["sd"], folder))
    trainer = TextToImageTrainer(job)
    with pytest.raises(DataError, match=rf"data: image {damaged} does not decode .*: replace it or remove it"):
        for step in range(4):  # two epochs of 8 images in batches of 4: image0 is in one of them
            trainer.step_inputs(step)
