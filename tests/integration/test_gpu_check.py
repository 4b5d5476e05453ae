"""bench/gpu_check.py: its dry run on the CPU, its refusal without CUDA, and the real check on a GPU.

The dry run is the same code as the GPU check (oomguard's runner with the conditional trainer,
the doctor between attempts, the sweep and the oracle races) on a tiny UNet2DConditionModel
under emulated device memory, then its text-to-image cases (bench/gpu_check_t2i.py: `oomguard
run` on a tiny pipeline), so that a GPU session does not spend its minutes on a bug. What the
dry run cannot reach (the SD 1.5-size pipeline, the full job) is checked here without training.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
NO_CUDA = "no CUDA GPU found: bench/gpu_check.py measures real GPU memory; run it on a machine with an NVIDIA GPU"
T2I_SKIPPED = "text-to-image cases (--cases t2i): skipped: "
PLAN = re.compile(r"^mb=\d+x\d+( |$)")


def run_check(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def check_results(out: Path, stem: str, cards: int) -> dict[str, Any]:
    """Both files, one row per card in the markdown table, a plan for each card."""
    data = json.loads((out / f"{stem}.json").read_text())
    markdown = (out / f"{stem}.md").read_text()
    names = [card["card"] for card in data["cards"]]
    assert names == data["settings"]["cards"] and len(names) == cards
    for card in data["cards"]:
        assert PLAN.match(card["oomguard"]["landed_plan"]), card["oomguard"]
        assert card["oomguard"]["state"] in ("finished", "gave up", "timed out", "failed")
        assert card["oomguard"]["ooms"] == (card["oomguard"]["ooms_in_probe"] + card["oomguard"]["ooms_in_process"]
                                            + card["oomguard"]["ooms_ending_attempts"])
        rows = [line for line in markdown.splitlines() if line.startswith(f"| {card['card']} | `{card['oomguard']['landed_plan']}`")]
        assert len(rows) == 1, markdown
    assert data["machine"]["date"] in markdown and data["machine"]["torch"] in markdown
    assert "bench/gpu_check.py" in data["command"]
    return data


def no_crash(outcomes: list[dict[str, Any]]) -> None:
    """A crashed attempt in a dry run is a bug of the check (a trainer that no longer fits the
    runner's interface ended every attempt this way and the run still "passed")."""
    assert all(o["kind"] != "crashed" for o in outcomes), [o.get("traceback_tail") or o.get("message") for o in outcomes]


def check_t2i_results(out: Path, stem: str, cases: int) -> dict[str, Any]:
    """Both files, one row per case in the markdown table."""
    data = json.loads((out / f"{stem}.json").read_text())
    markdown = (out / f"{stem}.md").read_text()
    assert len(data["cases"]) == cases, data["skipped"] + data["errors"]
    assert data["build"]["state"] == "built", data["build"]
    for case in data["cases"]:
        assert case["state"] in ("finished", "failed", "timed out"), case
        assert case["ooms"] == case["ooms_in_probe"] + case["ooms_in_process"] + case["ooms_ending_attempts"]
        rows = [line for line in markdown.splitlines() if line.startswith(f"| {case['method']} | {case['card']} | {case['state']} |")]
        assert len(rows) == 1, markdown
        no_crash(case["outcomes"])
    assert not data["errors"], data["errors"]
    assert data["machine"]["date"] in markdown and "bench/gpu_check.py" in data["command"]
    return data


def leftover_processes(workdir: str) -> list[str]:
    """Command lines of live processes that name ``workdir`` (a case's runner or shim)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace") if entry.name.isdigit() else ""
        except OSError:
            continue
        if workdir in command:
            found.append(command)
    return found


@pytest.mark.slow
@pytest.mark.bench  # a minute and a half of training: `make bench` runs it, `make test` does not
@pytest.mark.timeout(300)
def test_dry_run_writes_one_row_and_a_plan_per_emulated_card_and_t2i_case(tmp_path: Path) -> None:
    result = run_check("--dry-run", "--out", str(tmp_path), timeout=240)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    data = check_results(tmp_path, "gpu-dry-run", cards=3)
    assert data["settings"]["dry_run"] and data["machine"]["gpu"] is None
    # A dry run never writes the GPU's results.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-dry-run-t2i.json", "gpu-dry-run-t2i.md", "gpu-dry-run.json", "gpu-dry-run.md"]
    # The UNet part within its share (55 s), and a little for the interpreter and writing the files.
    assert data["total_s"] < 60
    for card in data["cards"]:
        og = card["oomguard"]
        no_crash(og["outcomes"])
        if og["state"] == "finished":
            assert og["samples_per_s"] and og["peak_allocated_bytes"] <= card["cap_bytes"]
            assert og["peak_reserved_bytes"] is None  # no caching allocator on the emulated device
    t2i = check_t2i_results(tmp_path, "gpu-dry-run-t2i", cases=1)
    # The t2i part: the rest of the 85 s budget.
    assert t2i["total_s"] < 90
    (case,) = t2i["cases"]
    assert case["method"] == "lora" and case["exit_code"] is not None
    if case["state"] == "finished":
        assert PLAN.match(case["landed_plan"]) and case["samples_per_s"]
        assert case["peak_allocated_bytes"] <= case["cap_bytes"]
        assert case["device_used_bytes"] is None and "dry run" in case["device_sampling"]
        # The emulated card is below the job's plain plan: the probe ran out of memory on the way.
        assert case["ooms"] > 0 and case["landed_plan"] != "mb=8x1"


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(120)
def test_a_t2i_case_past_its_deadline_is_killed_and_reported_as_timed_out(tmp_path: Path) -> None:
    # Three seconds: less than an `oomguard run` takes to import its runner, on any machine.
    result = run_check("--dry-run", "--cases", "t2i", "--t2i-case-seconds", "3", "--out", str(tmp_path), timeout=100)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-dry-run-t2i.json", "gpu-dry-run-t2i.md"]
    data = check_t2i_results(tmp_path, "gpu-dry-run-t2i", cases=1)
    (case,) = data["cases"]
    assert case["state"] == "timed out" and case["exit_code"] is None
    assert case["wall_s"] < 3 + 5
    assert "stopped at the case's deadline" in result.stdout
    # Nothing of the case lives on: not `oomguard run`, not its shim, not its runner.
    assert leftover_processes(case["workdir"]) == []


def test_the_sd15_pipeline_builder_writes_a_pipeline_the_job_files_accept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's pipeline is built by the code the dry run does not run (the dry run takes
    tests/pipelines.py's tiny one): here with SD 1.5's layout at a few channels, on the CPU,
    checked by oomguard's own job-file check, with the job files of both methods."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu_check
    import gpu_check_t2i as t2i

    from oomguard.jobs.spec import load_job_file

    # SD 1.5's sizes as they are published (the text encoder's vocabulary aside: see TOKENIZER_NOTE).
    assert gpu_check.SD15_UNET["block_out_channels"] == (320, 640, 1280, 1280) and gpu_check.SD15_UNET["cross_attention_dim"] == 768
    assert t2i.SD15_VAE["block_out_channels"] == [128, 256, 512, 512] and t2i.SD15_VAE["latent_channels"] == 4
    assert {k: t2i.CLIP_L14_TEXT[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                                              "max_position_embeddings")} == {"hidden_size": 768, "num_hidden_layers": 12,
                                                                              "num_attention_heads": 12, "intermediate_size": 3072,
                                                                              "max_position_embeddings": 77}
    small = {
        "unet": {**gpu_check.SD15_UNET, "block_out_channels": [32, 32, 64, 64], "layers_per_block": 1, "cross_attention_dim": 32},
        "vae": {**t2i.SD15_VAE, "block_out_channels": [32, 32, 64, 64], "layers_per_block": 1},
        "text": {**t2i.CLIP_L14_TEXT, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2,
                 "projection_dim": 32},
        "scheduler": t2i.SD15_SCHEDULER,
    }
    pipeline = t2i.sd_pipeline(small, "cpu")
    assert pipeline.text_encoder.config.vocab_size == len(pipeline.tokenizer) < t2i.CLIP_L14_TEXT["vocab_size"]
    pipeline.save_pretrained(str(tmp_path / "pipeline"))
    parts = t2i.saved_parts(tmp_path / "pipeline")
    assert set(parts) == {"unet", "vae", "text_encoder"}
    assert parts["unet"]["parameters"] == sum(p.numel() for p in pipeline.unet.parameters())
    built = {"pipeline": str(tmp_path / "pipeline"),
             "images": str(t2i.write_images(tmp_path / "images", {"count": 2, "sizes": [[64, 80]], "resolution": 512}))}
    settings = t2i.Settings(dry_run=False, cards=[], methods=list(t2i.METHODS), batch=8, steps=3, allow=["micro_batch", "cache_latents"],
                            case_seconds=None, keep_workdirs=False, out=tmp_path, stem="gpu-t2i", command="", machine={}, env={})
    for method in t2i.METHODS:
        job = load_job_file(t2i.write_job(tmp_path, method, built, settings))
        assert job.trainer == "text_to_image" and job.model.method == method and job.data.resolution == 512
        assert job.train.max_steps == 4 and job.ladder.allow == ("micro_batch", "cache_latents")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_without_cuda_and_without_dry_run_it_exits_2_and_says_why(tmp_path: Path) -> None:
    result = run_check("--out", str(tmp_path), timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert NO_CUDA in result.stderr
    # The t2i cases say that they were skipped, and why.
    assert T2I_SKIPPED in result.stderr and "no CUDA GPU here" in result.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(400)
def test_real_check_on_one_emulated_card(tmp_path: Path) -> None:
    """SD 1.5's UNet on a 24 GiB card of the GPU, in a short budget (the oracle may be cut)."""
    result = run_check("--cases", "unet", "--cards", "24GiB", "--budget", "200", "--out", str(tmp_path), timeout=360)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    data = check_results(tmp_path, "gpu", cards=1)
    assert data["machine"]["gpu"] == torch.cuda.get_device_name(0)
    assert data["machine"]["gpu"] in (tmp_path / "gpu.md").read_text()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(400)
def test_real_t2i_check_of_a_lora_job_on_one_emulated_card(tmp_path: Path) -> None:
    """The SD 1.5-size pipeline built on the GPU, one LoRA job through `oomguard run` on 24 GiB."""
    result = run_check("--cases", "t2i", "--t2i-cards", "24GiB", "--t2i-methods", "lora", "--budget", "240", "--out", str(tmp_path), timeout=360)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    data = check_t2i_results(tmp_path, "gpu-t2i", cases=1)
    (case,) = data["cases"]
    assert case["state"] == "finished" and case["device_used_bytes"]
    assert data["build"]["parts"]["unet"]["parameters"] > 800_000_000


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(300)
def test_the_multi_gpu_case_dry_run_shards_on_two_emulated_cards(tmp_path: Path) -> None:
    """bench/gpu_check.py --cases multi --dry-run: the job's state does not fit one emulated
    card; on two it finishes under an exact plan on both (sharding, or host offload where the
    ranks' probe measured it faster, as on this CPU)."""
    result = run_check("--dry-run", "--cases", "multi", "--out", str(tmp_path), timeout=280)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    data = json.loads((tmp_path / "gpu-dry-run-multi.json").read_text())
    one, two = data["cases"]
    assert (one["gpus"], two["gpus"]) == (1, 2)
    assert two["state"] == "finished" and "2 processes" in two["landed_short"], two
    from oomguard.strategies import rungs
    from oomguard.strategies.plan import Plan

    landed = Plan.from_dict(two["landed"])
    assert all(r.exact for r in rungs.ladder() if r.is_on(landed)), two
    assert "two-cards" in (tmp_path / "gpu-dry-run-multi.md").read_text()


ALLOCATOR_FILES = ["gpu-dry-run-allocator.json", "gpu-dry-run-allocator.md"]


def check_allocator_rows(data: dict[str, Any], markdown: str, jobs: list[str], steps: int) -> None:
    """One row per job x plan x expandable setting, in the JSON and in the markdown table; the
    emulation's figures in every row, reserved never below allocated."""
    from oomguard.jobs.emulated_allocator import DEFAULT_OVERHEAD

    rows = data["rows"]
    assert [(r["job"], r["plan"], r["expandable"]) for r in rows] == [
        (job, plan, expandable) for expandable in (False, True) for job in jobs for plan in ("full", "half", "half+checkpointing")]
    for row in rows:
        emulated = row["emulated"]
        assert not emulated.get("error"), emulated.get("error")
        assert emulated["device"] == "cpu" and emulated["expandable_setting"] is row["expandable"]
        assert ("expandable" in row["plan_short"]) is row["expandable"] and ("ckpt" in row["plan_short"]) is row["plan"].endswith("checkpointing")
        assert len(emulated["steps"]) == steps
        for figures in [emulated, emulated["build"], *emulated["steps"]]:
            assert 0 < figures["peak_allocated_bytes"] <= figures["peak_reserved_bytes"], figures
        assert emulated["overhead_bytes"] == DEFAULT_OVERHEAD
        line = f"| {row['job']} | `{row['plan_short']}` | {'on' if row['expandable'] else 'off'} | "
        assert sum(1 for text in markdown.splitlines() if text.startswith(line)) == 1, markdown
    by_plan = {(r["job"], r["plan"], r["expandable"]): r["emulated"]["peak_allocated_bytes"] for r in rows}
    for job in jobs:
        for expandable in (False, True):
            # Half the batch a slice, then checkpointing, take less at their peak.
            full, half, checkpointed = (by_plan[job, plan, expandable] for plan in ("full", "half", "half+checkpointing"))
            assert full > half > checkpointed, (job, expandable, full, half, checkpointed)
    assert data["settings"]["default_overhead_bytes"] == data["overhead"]["default_bytes"] == DEFAULT_OVERHEAD


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(240)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the allocator case without CUDA")
def test_the_allocator_case_runs_its_cpu_half_without_a_card_and_says_the_card_half_was_skipped(tmp_path: Path) -> None:
    result = run_check("--cases", "allocator", "--allocator-steps", "2", "--out", str(tmp_path), timeout=200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "the card half was skipped: no CUDA device found" in result.stdout
    assert NO_CUDA not in result.stderr  # not the other parts' refusal
    assert sorted(p.name for p in tmp_path.iterdir()) == ALLOCATOR_FILES
    data = json.loads((tmp_path / "gpu-dry-run-allocator.json").read_text())
    markdown = (tmp_path / "gpu-dry-run-allocator.md").read_text()
    assert data["card"]["skipped"].startswith("no CUDA device found") and "The card half was skipped: no CUDA device found" in markdown
    check_allocator_rows(data, markdown, ["conv32", "attn32"], steps=2)
    assert all(r["real"] is None and r["ratio_reserved"] is None for r in data["rows"])
    assert data["overhead"]["measured_bytes"] is None and data["overhead"]["readings"] == []
    assert not data["errors"] and data["machine"]["gpu"] is None and data["machine"]["date"] in markdown


def test_the_allocator_case_puts_the_card_beside_the_emulation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The card half's merging and report, with the workers' lines made up (no training): the
    ratio emulated / card reserved per row, the measured overhead against the default."""
    import argparse

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu_check

    from oomguard.jobs.emulated_allocator import DEFAULT_OVERHEAD

    MiB = 2**20

    def worker(device: str, task: dict[str, Any], env: dict[str, str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str | None]:
        expandable = task["expandable"]
        assert ("expandable_segments:True" in env.get("PYTORCH_ALLOC_CONF", "")) is expandable
        assert "PYTORCH_CUDA_ALLOC_CONF" not in env and (env.get("OMP_NUM_THREADS") == "1") is (device == "cpu")
        rows = [{"job": "conv32", "plan": plan, "plan_short": f"mb={mb}", "expandable": expandable, "device": device,
                 "peak_allocated_bytes": 30 * MiB * scale, "peak_reserved_bytes": (40 if device == "cpu" else 50) * MiB * scale}
                for plan, mb, scale in (("full", "12x1", 2), ("half", "6x2", 1), ("half+checkpointing", "6x2 ckpt", 1))]
        readings = [{"moment": "after CUDA initialised", "overhead_bytes": 400 * MiB, "overhead_method": "NVML per-process used memory - memory_reserved",
                     "non_pytorch_by_nvml_bytes": 400 * MiB, "non_pytorch_by_mem_get_info_bytes": 401 * MiB, "reserved_bytes": 2 * MiB,
                     "nvml_note": None, "expandable": expandable}] if device == "cuda" else []
        return rows, readings, None

    monkeypatch.setattr(gpu_check, "run_allocator_worker", worker)
    args = argparse.Namespace(allocator_jobs="conv32", allocator_steps=2, dry_run=False, out=tmp_path)
    machine = {"date": "2026-12-07 00:00 UTC", "gpu": "NVIDIA H100", "gpu_total_bytes": 80 * 2**30, "cpus": 16, "platform": "Linux",
               "python": "3.11", "torch": "2.13.0", "cuda": "12.8", "diffusers": "0.42.1"}
    env = {"PATH": "/usr/bin", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert gpu_check.allocator_check(args, machine, "bench/gpu_check.py --cases allocator", env, cuda=True) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-allocator.json", "gpu-allocator.md"]
    data = json.loads((tmp_path / "gpu-allocator.json").read_text())
    markdown = (tmp_path / "gpu-allocator.md").read_text()
    assert data["card"] == {"skipped": None, "gpu": "NVIDIA H100"} and "skipped" not in markdown.split("## Memory")[0]
    assert len(data["rows"]) == 6 and all(r["ratio_reserved"] == pytest.approx(0.8) and r["ratio_allocated"] == 1 for r in data["rows"])
    assert "| conv32 | `mb=12x1` | off | 60.0 MiB | 80.0 MiB | 60.0 MiB | 100.0 MiB | 0.800 | 1.000 |" in markdown
    assert data["overhead"]["measured_bytes"] == 400 * MiB and data["overhead"]["ratio_to_default"] == pytest.approx(400 * MiB / DEFAULT_OVERHEAD)
    assert "**400.0 MiB**" in markdown and "0.78 x the emulation's default of 512.0 MiB" in markdown


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(600)
def test_real_allocator_case_puts_the_card_beside_the_emulation(tmp_path: Path) -> None:
    """Both halves on a card: every row has the card's peaks and a ratio, the overhead is measured."""
    result = run_check("--cases", "allocator", "--out", str(tmp_path), timeout=560)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    data = json.loads((tmp_path / "gpu-allocator.json").read_text())
    markdown = (tmp_path / "gpu-allocator.md").read_text()
    check_allocator_rows(data, markdown, ["conv32", "attn32"], steps=3)
    assert data["card"]["gpu"] == torch.cuda.get_device_name(0) and not data["errors"]
    for row in data["rows"]:
        real = row["real"]
        assert not real.get("error") and real["device"] == "cuda" and len(real["steps"]) == 3
        assert 0 < real["peak_allocated_bytes"] <= real["peak_reserved_bytes"] and row["ratio_reserved"] > 0
        assert real["segments_expandable"] in (row["expandable"], None)
    assert data["overhead"]["measured_bytes"] > 0 and data["overhead"]["method"]
