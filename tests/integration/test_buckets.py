"""A text-to-image job with aspect-ratio buckets (data.buckets, bucket_no_upscale): most
images are small landscape ones, one in six is large and square, so one step in six has a
batch of 2.7 times the pixels. The probe measures at that bucket and the job lands on its
first attempt without an OOM; started at a plan that fits only the small buckets, the large
bucket's OOM is answered for that bucket alone (named by its shape), and the job still
finishes in one attempt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.jobs.buckets import Bucket
from tests.e2e.conftest import oomguard
from tests.pipelines import save_tiny_pipeline
from tests.t2i_helpers import text_to_image_job

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Measured with the emulated device, micro-batch 4, nothing saved: 1.1 MiB a step of the
# 24x16 bucket, 2.4 MiB of the 32x32 one (at micro-batch 2 it fits under this cap).
CAP = "2MiB"
MAX_STEPS = 6


def write_bucketed_images(folder: Path) -> Path:
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(24):
        height, width = (40, 40) if i % 6 == 5 else (16, 24)
        Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8")).save(folder / f"image{i}.png")
        rows.append({"file_name": f"image{i}.png", "text": f"a photo of thing number {i}"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("buckets")
    return save_tiny_pipeline(root / "sd", "sd"), write_bucketed_images(root / "data")


def bucketed_job(folder: Path, files: tuple[Path, Path], *, probe: bool) -> Path:
    pipeline, data = files
    job = text_to_image_job(folder, "buckets", pipeline, data, method="full", max_steps=MAX_STEPS, probe=probe)
    text = job.read_text().replace("random_flip = true\n", "random_flip = true\nbuckets = true\nbucket_no_upscale = true\n")
    # The micro-batch only: the probe measures three plans, not every rung's.
    job.write_text(text + 'allow = ["micro_batch"]\n')
    return job


def large_bucket_steps(job: Path, workdir: Path) -> list[int]:
    from oomguard.jobs.spec.job_file import load_job_file
    from oomguard.jobs.trainers import make_trainer

    trainer = make_trainer(load_job_file(job), workdir)
    return [step for step in range(MAX_STEPS) if trainer.step_bucket(step) == Bucket(32, 32)]


def run(job: Path, workdir: Path) -> dict:
    result = oomguard("run", "--json", str(job), "--workdir", str(workdir), "--emulate-device-memory", CAP, timeout=300)
    record = json.loads(result.stdout)
    assert record["state"] == "finished", result.stderr[-3000:]
    return record


def test_the_probe_measures_the_largest_bucket_and_the_job_lands_on_its_first_attempt(tmp_path, files):
    job = bucketed_job(tmp_path, files, probe=True)
    assert large_bucket_steps(job, tmp_path / "work")  # the large bucket comes up in the run
    record = run(job, tmp_path / "work")
    assert len(record["attempts"]) == 1
    log = (tmp_path / "work" / "attempts" / "001" / "output.log").read_text()
    assert "out of memory" not in log
    # The only change of plan is the probe's, at step 0.
    assert [e["message"].split(":")[0] for e in record["events"] if e["kind"] == "escalated"] == ["at step 0, in the runner"]


def test_a_spike_of_the_large_bucket_shrinks_that_buckets_micro_batch_only(tmp_path, files):
    job = bucketed_job(tmp_path, files, probe=False)
    first_large = large_bucket_steps(job, tmp_path / "work")[0]
    record = run(job, tmp_path / "work")
    assert len(record["attempts"]) == 1
    escalations = [e["message"] for e in record["events"] if e["kind"] == "escalated"]
    assert len(escalations) == 1
    assert f"out of memory in forward at step {first_large} (a micro-batch of 4 at 32x32 px)" in escalations[0]
    assert "batches of the 32x32 bucket are larger than the ones that fit under this plan: its steps now run in micro-batches of 2" in escalations[0]
    # The plan stayed: every step ran under the job's own micro-batch 4.
    metrics = [json.loads(line) for line in (tmp_path / "work" / "attempts" / "001" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, MAX_STEPS + 1))
    assert {m["plan"] for m in metrics} == {"mb=4x1"}
    assert record["attempts"][0]["outcome"]["plan"]["micro_batch"] == 4
