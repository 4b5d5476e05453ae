"""The exact frozen-part rungs on the real text-to-image trainer: each trains the weights the
plain plan trains, with less of the device; the caches they read are keyed by their inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from oomguard.jobs.spec import load_job_file
from oomguard.strategies import rungs
from oomguard.strategies.plan import Plan
from tests.integration.test_text_to_image import assert_same_weights
from tests.jobs_helpers import run_runners, write_attempt
from tests.pipelines import save_tiny_pipeline
from tests.t2i_helpers import text_to_image_job, write_captioned_images


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_pipeline(tmp_path_factory.mktemp("pipelines") / "sdxl", "sdxl")


def with_rungs(plan: Plan, *names: str) -> Plan:
    for name in names:
        plan = rungs.rung(name).step(plan)
    return plan


def steady_peak(attempt_dir: Path) -> int:
    peaks = [json.loads(line)["peak_bytes"] for line in (attempt_dir / "metrics.jsonl").read_text().splitlines()]
    return max(peaks[1:])


def test_the_exact_frozen_rungs_train_the_plain_plans_weights_on_less_memory(tmp_path, sdxl):
    data = write_captioned_images(tmp_path / "data")
    job = load_job_file(text_to_image_job(tmp_path, "frozen", sdxl, data, method="full", max_steps=4))
    plain = Plan.initial(4).replace(micro_batch=2)
    plans = {
        "plain": plain,
        "cached": with_rungs(plain, "cache_text", "cache_latents"),
        "offloaded": with_rungs(plain, "vae_slicing", "offload_frozen"),
    }
    attempts = {name: write_attempt(tmp_path / name / "a1", job, tmp_path / name, plan=plan, cap="64MiB") for name, plan in plans.items()}
    results = dict(zip(attempts, run_runners(list(attempts.values()), timeout=300)))
    for name, result in results.items():
        assert result.returncode == 0, f"{name}: {result}"
    assert "cache_latents: encoded 16/16" in results["cached"].stdout  # 8 images, both flips
    assert "cache_text: encoded 8/8" in results["cached"].stdout
    for name in ("cached", "offloaded"):
        assert_same_weights(tmp_path / name / "final", tmp_path / "plain" / "final")
    static = json.loads((attempts["plain"] / "outcome.json").read_text())["measurements"][-1]["static"]
    frozen = static["frozen_size_vae"] + static["frozen_size_text"]
    assert static["frozen"] == frozen > 0
    # Each keeps none of the frozen parts on the device between steps; the cached run also runs
    # no encoder in a step, the offloaded one has each on the device only while it encodes.
    assert steady_peak(attempts["plain"]) - steady_peak(attempts["cached"]) >= frozen
    assert steady_peak(attempts["plain"]) - steady_peak(attempts["offloaded"]) >= static["frozen_size_vae"]


def test_a_cache_is_reused_until_an_input_changes(tmp_path, sdxl):
    from oomguard.jobs.memory_cap import HostMemory
    from oomguard.jobs.trainers.text_to_image import TextToImageTrainer

    import torch

    data = write_captioned_images(tmp_path / "data", count=4)
    job = load_job_file(text_to_image_job(tmp_path, "cache", sdxl, data, method="lora"))
    plan = with_rungs(Plan.initial(4), "cache_text", "cache_latents")
    workdir = tmp_path / "work"

    def caches() -> dict[str, float]:
        trainer = TextToImageTrainer(job, workdir)
        trainer.place_frozen(plan, torch.device("cpu"), HostMemory())
        return {p.name: p.stat().st_mtime_ns for p in (workdir / "cache").iterdir()}

    first = caches()
    assert sorted(name.split("-")[0] for name in first) == ["latents", "text"]
    assert caches() == first  # the same inputs: the same files, not written again
    (data / "image1.txt").write_text("another caption", encoding="utf-8")
    edited = caches()
    assert [n for n in edited if n.startswith("latents")] == [n for n in first if n.startswith("latents")]
    assert {n for n in edited if n.startswith("text")}.isdisjoint(first)  # a new key; the old file is gone
    shutil.copy(data / "image2.png", data / "image0.png")  # another picture under the same name
    assert {n for n in caches() if n.startswith("latents")}.isdisjoint(edited)
