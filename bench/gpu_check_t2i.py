#!/usr/bin/env python
"""The GPU check's text-to-image cases (``bench/gpu_check.py --cases t2i``): the product's own
path, ``oomguard run JOB --workdir W --emulate-device-memory 8GiB --json`` in a subprocess as a
user runs it, for a LoRA job and a full fine-tune job of the built-in ``text_to_image`` trainer,
on cards of 8, 12 and 24 GiB (memory fractions of the real GPU: jobs/memory_cap.py CudaMemory).

The pipeline. Nothing can be downloaded on the GPU machine, so an SD-1.5-size pipeline folder
is built there at run time with random weights, in a subprocess with a deadline: the UNet with
SD 1.5's config (``gpu_check.SD15_UNET``), the VAE with SD 1.5's (``SD15_VAE``), CLIP ViT-L/14's
text tower (``CLIP_L14_TEXT``) and a DDPMScheduler with SD's betas, initialised on the GPU
(random init of ~1.1 B parameters on the CPU takes minutes) and written with
``StableDiffusionPipeline.save_pretrained``. The tokenizer is tests/pipelines.py's
``tiny_tokenizer()`` (byte-level, built in memory, model_max_length 77): its vocabulary has 514
tokens, so the text encoder's ``vocab_size`` is 514 instead of 49,408 (a token embedding of
0.4 M parameters instead of 37.9 M, 150 MB less of the frozen text encoder in fp32); every other
size is CLIP ViT-L/14's, and the results say so. The images: 32 random PNGs of four sizes around
512 px, captions in metadata.jsonl, trained at 512 px.

What is recorded per job and card, from the job record that ``oomguard run --json`` prints (or,
for a case stopped at its deadline, from the workdir's store, which holds the same record): the
final state, the landed plan (the last attempt's plan), the OOMs (measurements with ``fits:
false`` across attempts, as gpu_check.summarise_oomguard counts them), attempts, wall time,
samples/s and peak allocated bytes from the last attempt's metrics.jsonl (the landed plan's
steps after the first), and on a GPU the device memory in use beyond the idle baseline,
sampled through NVML (CUDA contexts and the allocator's cache included: what a real card of
that size must hold, which the memory fraction does not cap).

Budget: the t2i part gets its own share of ``--budget`` (see gpu_check.py); the pipeline build
has a deadline (``BUILD_SHARE`` of it, at least ``BUILD_MIN_S``), and each case one: whole
cases in priority order (``case_order``), each capped at ``CASE_CAP_S`` (``--t2i-case-seconds``).
A case past its deadline is killed (its `oomguard run`, shim and runner) and reported as
"timed out"; one that would start with too little time left is listed as not run. In the
default 420 s of both parts (about 170 s for the cases once the pipeline is built), expect
three or four of the six cases; ``--cases t2i`` alone gives them the whole budget.

``--dry-run``: the same code on the CPU with tests/pipelines.py's tiny SD pipeline
(``save_tiny_pipeline``, layout "sd"), 8 small images at 32 px and an emulated card of
0.75 MiB (jobs/device_memory.py), one job (LoRA), in about 25 s on two cores.

This file is also the pipeline builder's worker: ``python bench/gpu_check_t2i.py --build DIR``
(the parent writes DIR/recipe.json first).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# Stable Diffusion 1.5's VAE (runwayml/stable-diffusion-v1-5, vae/config.json), written out.
SD15_VAE: dict[str, Any] = {
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "sample_size": 512,
    "scaling_factor": 0.18215,
}
# CLIP ViT-L/14's text tower (SD 1.5's text_encoder/config.json). vocab_size and the special
# token ids are the tokenizer's (sd_pipeline sets them): see the module docstring.
CLIP_L14_TEXT: dict[str, Any] = {
    "hidden_act": "quick_gelu",
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "max_position_embeddings": 77,
    "projection_dim": 768,
    "layer_norm_eps": 1e-5,
    "vocab_size": 49408,
}
# SD 1.5's noise schedule (scheduler/scheduler_config.json) in the DDPMScheduler that training
# uses, as diffusers' train_text_to_image.py does; SD's PNDM-only keys (set_alpha_to_one,
# skip_prk_steps) are left out, DDPMScheduler refuses them.
SD15_SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "steps_offset": 1,
}
TOKENIZER_NOTE = ("tokenizer: tests/pipelines.py tiny_tokenizer() (byte-level CLIP vocabulary built in memory, 514 tokens, "
                  "model_max_length 77; nothing can be downloaded), so the text encoder's vocab_size is 514, not CLIP's 49,408: "
                  "a token embedding of 0.4 M parameters instead of 37.9 M (150 MB less in fp32); every other size is CLIP ViT-L/14's")

# What each mode trains on: images (height, width) cycled, their count and the job's resolution.
IMAGES = {
    "sd15": {"count": 32, "sizes": [[512, 512], [640, 512], [512, 704], [768, 768]], "resolution": 512},
    "tiny": {"count": 8, "sizes": [[40, 48], [48, 40], [36, 36], [64, 44]], "resolution": 32},
}
LABELS = {
    "sd15": "SD 1.5-size pipeline (UNet 860 M, VAE 84 M, CLIP ViT-L/14 text tower with a 514-token vocabulary), random weights, fp32, 512 px",
    "tiny": "tests/pipelines.py save_tiny_pipeline (layout sd), random weights, 32 px",
}
METHODS = ("lora", "full")
# The dry run trains one job: each `oomguard run` costs ~12 s of imports, probe and steps on two
# CPU cores, and the full job's file is checked without training by tests/integration/test_gpu_check.py.
DRY_RUN_METHODS = ("lora",)
# The README's example LoRA (jobs/examples/text_to_image_lora.toml).
LORA_RANK = 16
LEARNING_RATE = {"lora": 1e-4, "full": 1e-5}
BATCH = 8
STEPS = 3
DRY_RUN_BATCH = 8
DRY_RUN_STEPS = 1
# The tiny pipeline's plain plan at batch 8 peaks near 2 MiB on the emulated device; at 0.75 MiB
# the LoRA job's probe runs out of memory five times before it lands on checkpointing, cached
# encodings and micro-batch 3 (the full job: two OOMs, then optimizer offload).
DRY_RUN_CARDS = ("0.75MiB",)
# The t2i share of --budget when the UNet check runs too; the dry run keeps the UNet's 55 s and
# adds DRY_RUN_SECONDS for these cases.
T2I_SHARE = 0.5
DRY_RUN_SECONDS = 30.0
# The pipeline build's deadline: this share of the t2i time, at least BUILD_MIN_S (imports alone
# take seconds); what it leaves goes to the cases.
BUILD_SHARE = 0.3
BUILD_MIN_S = 15.0
# A case with less time than this left is not started (an `oomguard run` needs about that much
# for its imports, the pipeline's load, the encoding caches and the probe: guesses for an H200,
# to be replaced by the first run's wall times; measured for the tiny pipeline on 2 CPU cores).
MIN_CASE_S = {"sd15": 30.0, "tiny": 2.0}
# The most one case may take (None: until the t2i part's end): a LoRA case should take ~40 s on
# an H200, a full fine-tune with optimizer offload (CPU AdamW over 860 M parameters) ~60-90 s.
CASE_CAP_S: dict[str, float | None] = {"sd15": 120.0, "tiny": None}
# NVML sampling period while a case runs.
SAMPLE_S = 0.25
RECIPE = "recipe.json"
BUILT = "built.json"
# The runner's lines worth a progress line here (the rest stays in the attempt's output.log).
PROGRESS_PREFIXES = ("probe:", "out of memory", "step ", "resumed", "the failed step", "Traceback", "caching")


@dataclass
class Settings:
    """What the t2i part runs, filled in by gpu_check.main from its options."""

    dry_run: bool
    cards: list[Any]  # gpu_check.Card
    methods: list[str]
    batch: int
    steps: int
    allow: list[str]
    case_seconds: float | None
    keep_workdirs: bool
    out: Path
    stem: str
    command: str
    machine: dict[str, Any]
    env: dict[str, str]
    unet_config: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> str:
        return "tiny" if self.dry_run else "sd15"


# ----------------------------------------------------------------------------- building the pipeline (worker)


def sd_pipeline(configs: dict[str, Any], device: str) -> Any:
    """A StableDiffusionPipeline of the given part configs with random weights, made on
    ``device`` (random init on a GPU takes a second where the CPU takes minutes)."""
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from tests.pipelines import tiny_tokenizer

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    # The special ids must be the tokenizer's: CLIP pools its output at the end token.
    text = {**configs["text"], "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    with torch.device(device):
        unet = UNet2DConditionModel(**configs["unet"])
        vae = AutoencoderKL(**configs["vae"])
        text_encoder = CLIPTextModel(CLIPTextConfig(**text))
    return StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=DDPMScheduler(**configs["scheduler"]),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )


def saved_parts(pipeline: Path) -> dict[str, dict[str, int]]:
    """Parameters and bytes of each part's safetensors files (headers only: no weights read)."""
    from safetensors import safe_open

    parts: dict[str, dict[str, int]] = {}
    for file in sorted(pipeline.glob("*/*.safetensors")):
        count = 0
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                shape = handle.get_slice(key).get_shape()
                count += math.prod(shape)
        part = parts.setdefault(file.parent.name, {"parameters": 0, "bytes": 0})
        part["parameters"] += count
        part["bytes"] += file.stat().st_size
    return parts


def write_images(folder: Path, spec: dict[str, Any]) -> Path:
    """``spec['count']`` random images of the sizes in ``spec['sizes']``, captions in metadata.jsonl."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(spec["count"]):
        height, width = spec["sizes"][i % len(spec["sizes"])]
        Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8")).save(folder / f"image{i:03d}.png")
        rows.append({"file_name": f"image{i:03d}.png", "text": f"a photo of thing number {i}, {('red', 'green', 'blue')[i % 3]}"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return folder


def build_worker(folder: Path) -> int:
    """Build the pipeline and images the parent's recipe asks for; timings in BUILT."""
    recipe = json.loads((folder / RECIPE).read_text())
    started = time.perf_counter()
    import torch

    # tests/pipelines.py is the one place that writes a working pipeline offline (its tokenizer too).
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.pipelines import save_tiny_pipeline

    timings = {"import_s": time.perf_counter() - started}
    pipeline = folder / "pipeline"
    if recipe["size"] == "tiny":
        save_tiny_pipeline(pipeline, "sd")
        timings["init_and_save_s"] = time.perf_counter() - started - timings["import_s"]
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        mark = time.perf_counter()
        made = sd_pipeline(recipe["configs"], device)
        if device == "cuda":
            torch.cuda.synchronize()
        timings["init_s"] = time.perf_counter() - mark
        mark = time.perf_counter()
        made.to("cpu")
        made.save_pretrained(str(pipeline))
        timings["save_s"] = time.perf_counter() - mark
    mark = time.perf_counter()
    write_images(folder / "images", recipe["images"])
    timings["images_s"] = time.perf_counter() - mark
    built = {"timings": timings, "parts": saved_parts(pipeline), "device": "cuda" if torch.cuda.is_available() else "cpu"}
    (folder / BUILT).write_text(json.dumps(built, indent=2))
    return 0


def build(check: Any, s: Settings, folder: Path, deadline: float) -> dict[str, Any]:
    """The pipeline and images in ``folder``, by the worker above, stopped at ``deadline``."""
    folder.mkdir(parents=True, exist_ok=True)
    configs = {"unet": s.unet_config, "vae": SD15_VAE, "text": CLIP_L14_TEXT, "scheduler": SD15_SCHEDULER}
    (folder / RECIPE).write_text(json.dumps({"size": s.size, "configs": configs, "images": IMAGES[s.size]}, indent=2))
    started = check.elapsed()
    check.log(f"t2i: building the pipeline ({LABELS[s.size]}) and {IMAGES[s.size]['count']} images (until {deadline:.0f}s)")
    log_path = folder.parent / "build.log"
    with log_path.open("wb") as output:
        process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--build", str(folder)], stdout=output,
                                   stderr=subprocess.STDOUT, env=s.env, cwd=ROOT, start_new_session=True)
    try:
        returncode = process.wait(timeout=max(0.1, deadline - check.elapsed()))
    except subprocess.TimeoutExpired:
        returncode = None
    finally:
        check.kill_group(process)  # nothing of it outlives the build, also on Ctrl-C
    result: dict[str, Any] = {"wall_s": check.elapsed() - started, "exit_code": returncode}
    if returncode is None:
        result.update(state="timed out", message=f"the build ran past its deadline ({deadline:.0f}s of the check)")
    elif returncode != 0 or not (folder / BUILT).exists():
        result.update(state="failed", message=f"the build exited {returncode}", log_tail=check.tail(log_path))
    else:
        result.update(state="built", **json.loads((folder / BUILT).read_text()), pipeline=str(folder / "pipeline"), images=str(folder / "images"))
    check.log(f"t2i: pipeline {result['state']} in {result['wall_s']:.0f}s" + (f": {result['message']}" if result.get("message") else ""))
    return result


# ----------------------------------------------------------------------------- one case: `oomguard run`


def write_job(folder: Path, method: str, built: dict[str, Any], s: Settings) -> Path:
    """The job file a user would write for this case (jobs/examples/text_to_image_*.toml)."""
    lora = f"lora_rank = {LORA_RANK}\nlora_alpha = {LORA_RANK}\n" if method == "lora" else ""
    max_steps = 1 + s.steps
    # json.dumps writes a TOML basic string (same escapes) for the paths and rung names.
    text = f"""\
name = "gpu-check-{method}"
trainer = "text_to_image"

[data]
source = {json.dumps(built["images"])}
resolution = {IMAGES[s.size]["resolution"]}
center_crop = true
random_flip = true

[model]
path = {json.dumps(built["pipeline"])}
method = "{method}"
{lora}
[train]
batch_size = {s.batch}
max_steps = {max_steps}
learning_rate = {LEARNING_RATE[method]}
lr_scheduler = "constant"
snr_gamma = 5.0
seed = 0
# No checkpoint on a schedule (a full SD 1.5 checkpoint is 10 GB); the runner still writes one
# when an OOM ends an attempt after step 0, for the next attempt.
checkpoint_every_steps = {max_steps}
keep_checkpoints = 1

[ladder]
allow = {json.dumps(s.allow)}
probe = true
"""
    path = folder / f"{method}.toml"
    path.write_text(text)
    return path


class DeviceSampler:
    """The GPU's used memory through NVML, sampled every SAMPLE_S while a case runs: the most
    above what was in use when it started (the case's CUDA contexts and allocator cache
    included). NVML device 0 is the GPU the check runs on (one GPU, no CUDA_VISIBLE_DEVICES)."""

    def __init__(self, enabled: bool) -> None:
        self.note: str | None = None
        self.baseline: int | None = None
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if not enabled:
            self.note = "not sampled: no GPU (dry run)"
            return
        try:
            import pynvml
        except ImportError as error:
            self.note = f"not sampled: {error}"
            return
        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.baseline = self.peak = pynvml.nvmlDeviceGetMemoryInfo(self._handle).used
        except pynvml.NVMLError as error:
            self.note = f"not sampled: NVML: {error}"
            return
        self._pynvml = pynvml
        self._thread = threading.Thread(target=self._sample, args=(pynvml,), daemon=True)
        self._thread.start()

    def _sample(self, pynvml: Any) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                used = pynvml.nvmlDeviceGetMemoryInfo(self._handle).used
            except pynvml.NVMLError as error:
                self.note = f"sampling stopped: NVML: {error}"
                return
            self.peak = max(self.peak or 0, used)

    def stop(self) -> int | None:
        """The peak above the baseline, in bytes (None when not sampled)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._pynvml.nvmlShutdown()  # nvmlInit counts its callers: one shutdown per case
        return self.peak - self.baseline if self.peak is not None and self.baseline is not None else None


def _log_end(attempt_dir: Path, size: int = 3000) -> str | None:
    """The end of an attempt's log, read across the tail files a long one goes on in
    (daemon/log_cap.py); None when it has none."""
    from oomguard.jobs.attempt import LOG, read_log_end

    try:
        return read_log_end(attempt_dir, size) if (attempt_dir / LOG).exists() else None
    except OSError:
        return None


class LogEcho:
    """Progress lines of the attempts' output.log files in a workdir, as they are written."""

    def __init__(self, check: Any, attempts: Path, prefix: str) -> None:
        self.check = check
        self.attempts = attempts
        self.prefix = prefix
        self.positions: dict[Path, int] = {}

    def poll(self) -> None:
        for path in sorted(self.attempts.glob("*/output.log")):
            position = self.positions.get(path, 0)
            with path.open("rb") as handle:
                handle.seek(position)
                data = handle.read()
            end = data.rfind(b"\n") + 1
            self.positions[path] = position + end
            for line in data[:end].decode(errors="replace").splitlines():
                if line.startswith(PROGRESS_PREFIXES):
                    self.check.log(f"{self.prefix}attempt {path.parent.name}: {line.strip()[:220]}")


def stop_case(check: Any, process: subprocess.Popen[Any], workdir: Path) -> int:
    """Kill a case's `oomguard run` and every process of its attempts; how many were found.

    SIGKILL, not SIGTERM: on SIGTERM `oomguard run` checkpoints the running attempt (10 GB for a
    full SD 1.5 fine-tune) before it ends, which a user wants and this check, which deletes the
    workdir, cannot afford. The shim runs in a session of its own, so it is found as a
    descendant (before its parent dies) or by the attempt mark in its environment."""
    from oomguard.daemon import processes

    inside = str(workdir) + os.sep
    found = processes.descendants(process.pid) | {pid for pid, mark in processes.marks().items() if mark.startswith(inside)}
    found.discard(os.getpid())
    processes.send(found, signal.SIGKILL)
    check.kill_group(process)
    return len(found)


def watch(check: Any, process: subprocess.Popen[Any], workdir: Path, deadline: float, prefix: str) -> int | None:
    """Wait for `oomguard run`, echoing its attempts' progress; its exit status, or None when it
    ran past ``deadline`` and was killed."""
    echo = LogEcho(check, workdir / "attempts", prefix)
    try:
        while True:
            try:
                returncode = process.wait(timeout=min(2.0, max(0.05, deadline - check.elapsed())))
            except subprocess.TimeoutExpired:
                echo.poll()
                if check.elapsed() >= deadline:
                    killed = stop_case(check, process, workdir)
                    check.log(f"{prefix}stopped at the case's deadline ({killed} process(es) of its attempts killed)")
                    return None
                continue
            echo.poll()
            return returncode
    except BaseException:
        stop_case(check, process, workdir)  # Ctrl-C: the shim and runner would go on in their own session
        raise


def stored_record(workdir: Path) -> dict[str, Any] | None:
    """The job record as `oomguard run --json` prints it, read from the workdir's store (for a
    run that was killed before it could print it)."""
    from oomguard.daemon.cli.state import job_record, open_store
    from oomguard.daemon.paths import StateDir

    state_dir = workdir / ".oomguard"
    if not StateDir(state_dir).database.exists():
        return None
    _, store = open_store(state_dir)
    try:
        jobs = store.jobs()
        return job_record(store, jobs[-1]) if jobs else None
    finally:
        store.close()


def summarise_record(check: Any, record: dict[str, Any] | None, stopped: bool) -> dict[str, Any]:
    """The job record's attempts in gpu_check.summarise_oomguard's form, and its summary."""
    from oomguard.strategies.outcome import Outcome
    from oomguard.strategies.plan import Plan

    record = record or {}
    heartbeat = record.get("heartbeat") or {}
    attempts = []
    for a in record.get("attempts", []):
        plan = Plan.from_dict(a["plan"])
        outcome = Outcome.from_dict(a["outcome"]) if a.get("outcome") else None
        entry = {"number": a["number"], "plan": plan.short(), "started": plan, "outcome": outcome, "directory": a["directory"],
                 "log_tail": None if outcome is not None and outcome.kind == "finished" else _log_end(Path(a["directory"]))}
        if outcome is None:
            current = heartbeat.get("plan") or plan.short()
            entry["current_plan"] = current
            entry["killed"] = (f"stopped at the case's deadline (budget), at step {heartbeat.get('step', 0)} under [{current}]" if stopped
                               else "ended without an outcome recorded")
        attempts.append(entry)
    state = "timed out" if stopped else record.get("state", "not run")
    summary = check.summarise_oomguard(attempts, state)
    # The runner's memory fraction caps the caching allocator; what it reserved is not in the
    # record (the NVML figure stands for it), and the ConditionalTrainer's final stats do not exist here.
    summary.pop("peak_reserved_bytes", None)
    summary["result"] = record.get("result")
    summary["events"] = [f"{e['kind']}: {e['message'][:400]}" for e in record.get("events", []) if e["kind"] not in ("queued", "started")]
    return summary


def run_case(check: Any, s: Settings, job_file: Path, workdir: Path, card: Any, deadline: float) -> dict[str, Any]:
    """One job on one card through `oomguard run`, as a user runs it; its summary."""
    prefix = f"  {job_file.stem} on {card.label}: "
    stdout, stderr = workdir.with_name(workdir.name + ".json"), workdir.with_name(workdir.name + ".stderr")
    argv = [sys.executable, "-m", "oomguard.daemon.cli", "run", str(job_file), "--workdir", str(workdir),
            "--emulate-device-memory", card.name, "--json"]
    check.log(f"{prefix}oomguard run {job_file.name} --emulate-device-memory {card.name} (until {deadline:.0f}s)")
    sampler = DeviceSampler(enabled=not s.dry_run)
    started = check.elapsed()
    with stdout.open("wb") as out, stderr.open("wb") as err:
        process = subprocess.Popen(argv, stdout=out, stderr=err, env=s.env, cwd=workdir.parent, start_new_session=True)
    try:
        returncode = watch(check, process, workdir, deadline, prefix)
    finally:
        device_used = sampler.stop()
    wall = check.elapsed() - started
    record = None
    if returncode is not None:
        try:
            record = json.loads(stdout.read_text())
        except json.JSONDecodeError:
            record = None  # `oomguard run` refused the job or failed before its record: its stderr says why
    if record is None:
        record = stored_record(workdir)
    summary = summarise_record(check, record, stopped=returncode is None)
    if record is None:
        summary["state"] = "timed out" if returncode is None else f"error (exit {returncode})"
    summary.update(wall_s=wall, exit_code=returncode, device_used_bytes=device_used, device_sampling=sampler.note, workdir=str(workdir),
                   cli_stderr_tail=check.tail(stderr) if returncode != 0 else None)
    return summary


def case_order(methods: list[str], cards: list[Any]) -> list[tuple[str, Any]]:
    """The cases in the order they run: LoRA from the smallest card up and full fine-tunes from
    the largest down, alternating. LoRA is what small cards are for and a full fine-tune wants
    a large one, so those come first; the ones the budget is likeliest to cut come last (LoRA
    on a large card fits anyway; a full fine-tune on the smallest card may find no exact plan)."""
    lora = [("lora", c) for c in sorted(cards, key=lambda c: c.nbytes)] if "lora" in methods else []
    full = [("full", c) for c in sorted(cards, key=lambda c: -c.nbytes)] if "full" in methods else []
    order = []
    for i in range(max(len(lora), len(full))):
        order += lora[i:i + 1] + full[i:i + 1]
    return order


def run_cases(check: Any, s: Settings, scratch: Path, built: dict[str, Any], end: float, out: dict[str, Any]) -> None:
    """Every method on every card, in case_order, each until min(``end``, its cap).

    Unlike the UNet check's cards, the cases do not split the time evenly: a case cut off
    before it trains measures nothing (an `oomguard run` spends its first tens of seconds on
    imports, the pipeline's load and the probe), so whole cases run in priority order, each
    capped (``CASE_CAP_S``, ``--t2i-case-seconds``) so that a slow one leaves time to the
    next, and those that would start with less than MIN_CASE_S left are listed as not run."""
    cap = s.case_seconds if s.case_seconds is not None else CASE_CAP_S[s.size]
    for method, card in case_order(s.methods, s.cards):
        left = end - check.elapsed()
        if left < MIN_CASE_S[s.size]:
            out["skipped"].append(f"{method} on {card.label}: not started, {max(0.0, left):.0f}s left of the budget "
                                  f"(an `oomguard run` needs {MIN_CASE_S[s.size]:.0f}s to start training)")
            check.log(f"t2i: {out['skipped'][-1]}")
            continue
        deadline = min(end, check.elapsed() + cap) if cap is not None else end
        workdir = (scratch / f"{method}-{card.name}").resolve()
        job_file = write_job(scratch, method, built, s)
        case = run_case(check, s, job_file, workdir, card, deadline)
        fraction = card.nbytes / s.machine["gpu_total_bytes"] if s.machine.get("gpu_total_bytes") else None
        out["cases"].append({"method": method, "card": card.label, "cap_bytes": card.nbytes, "memory_fraction": fraction, **case})
        check.log(f"t2i: {method} on {card.label}: {case['state']} on [{case['landed_plan']}] with {case['ooms']} OOMs in "
                  f"{case['attempts']} attempt(s), {check._fmt(case['samples_per_s'])} samples/s, peak {check.fmt_bytes(case['peak_allocated_bytes'])} "
                  f"allocated, device {check.fmt_bytes(case['device_used_bytes'])} ({case['wall_s']:.0f}s)")
        if not s.keep_workdirs:
            shutil.rmtree(workdir, ignore_errors=True)  # a full fine-tune's final pipeline is 4 GB


def run(check: Any, s: Settings, end: float) -> int:
    """The t2i part, until ``end`` seconds of the check; writes its results; 1 on an error.

    ``check`` is the gpu_check module itself (it runs as __main__: importing it by name would
    load a second copy with a clock of its own)."""
    started = check.elapsed()
    out: dict[str, Any] = {"build": None, "cases": [], "skipped": [], "errors": []}
    scratch = Path(tempfile.mkdtemp(prefix="oomguard-gpu-check-t2i-"))
    check.log(f"t2i: {len(s.methods) * len(s.cards)} case(s) ({', '.join(s.methods)} on {', '.join(c.label for c in s.cards)}), "
              f"batch {s.batch}, {1 + s.steps} steps, until {end:.0f}s")
    try:
        build_end = min(end, started + max(BUILD_SHARE * (end - started), BUILD_MIN_S))
        out["build"] = build(check, s, scratch / "build", build_end)
        if out["build"]["state"] == "built":
            run_cases(check, s, scratch, out["build"], end, out)
        else:
            out["skipped"] += [f"{m} on {c.label}: the pipeline was not built ({out['build']['state']})" for m in s.methods for c in s.cards]
    except Exception:  # noqa: BLE001 - a GPU session's few minutes: keep what was measured
        out["errors"].append(traceback.format_exc())
        check.log(f"t2i: ERROR, writing what was measured so far:\n{out['errors'][-1]}")
    finally:
        if s.keep_workdirs:
            check.log(f"t2i: workdirs and pipeline kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    write_results(check, s, out, started)
    return 1 if out["errors"] else 0


# ----------------------------------------------------------------------------- results


def skipped_without_cuda() -> str:
    """What the t2i part says on a machine without CUDA (the check exits 2 there)."""
    return ("text-to-image cases (--cases t2i): skipped: they train an SD 1.5-size pipeline through `oomguard run "
            "--emulate-device-memory 8GiB/12GiB/24GiB`, which on CUDA is a memory fraction of a real GPU, and there is no CUDA GPU here "
            "(add --dry-run to run them on the CPU with a tiny pipeline under emulated device memory)")


def write_results(check: Any, s: Settings, out: dict[str, Any], started: float) -> None:
    summary = {
        "command": s.command,
        "machine": {**s.machine, "load_average_at_end": os.getloadavg()[0]},
        "settings": {"dry_run": s.dry_run, "pipeline": LABELS[s.size], "tokenizer": TOKENIZER_NOTE if s.size == "sd15" else None,
                     "configs": {"unet": s.unet_config, "vae": SD15_VAE, "text": CLIP_L14_TEXT, "scheduler": SD15_SCHEDULER} if s.size == "sd15" else None,
                     "images": IMAGES[s.size], "methods": s.methods, "lora_rank": LORA_RANK, "learning_rate": LEARNING_RATE,
                     "batch": s.batch, "steps": s.steps, "cards": [c.label for c in s.cards], "allow": s.allow, "case_seconds": s.case_seconds,
                     "case_cap_s": s.case_seconds if s.case_seconds is not None else CASE_CAP_S[s.size],
                     "order": [f"{m} on {c.label}" for m, c in case_order(s.methods, s.cards)]},
        "t2i_s": check.elapsed() - started,
        "total_s": check.elapsed(),
        **out,
    }
    s.out.mkdir(parents=True, exist_ok=True)
    (s.out / f"{s.stem}.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (s.out / f"{s.stem}.md").write_text(markdown(check, summary))
    check.log(f"t2i: wrote {s.out / (s.stem + '.md')} and {s.stem}.json")
    print(case_rows(check, summary), flush=True)


def case_rows(check: Any, summary: dict[str, Any]) -> str:
    lines = ["| job | card | state | landed plan | OOMs (probe / in-process / ending an attempt) | attempts | peak allocated | "
             "device used (NVML) | samples/s | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in summary["cases"]:
        lines.append(f"| {c['method']} | {c['card']} | {c['state']} | `{c['landed_plan']}` | {c['ooms']} ({c['ooms_in_probe']} / {c['ooms_in_process']} / "
                     f"{c['ooms_ending_attempts']}) | {c['attempts']} | {check.fmt_bytes(c['peak_allocated_bytes'])} | "
                     f"{check.fmt_bytes(c['device_used_bytes'])} | {check._fmt(c['samples_per_s'])} | {c['wall_s']:.0f} |")
    return "\n".join(lines)


def count(n: int) -> str:
    return f"{n / 1e6:.1f} M" if n >= 100_000 else f"{n:,}"


def describe_build(check: Any, b: dict[str, Any] | None) -> list[str]:
    if b is None:
        return ["Pipeline: not built (the check stopped before)."]
    if b["state"] != "built":
        lines = [f"Pipeline: {b['state']} after {b['wall_s']:.0f} s: {b.get('message')}."]
        return lines + (["", "```", b["log_tail"][-2000:].strip(), "```"] if b.get("log_tail") else [])
    parts = ", ".join(f"{name} {count(p['parameters'])} parameters ({check.fmt_bytes(p['bytes'])})" for name, p in b["parts"].items())
    timings = ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in b["timings"].items())
    return [f"Pipeline: {parts}; built on the {b['device']} in {b['wall_s']:.0f} s ({timings})."]


def markdown(check: Any, summary: dict[str, Any]) -> str:
    m, s = summary["machine"], summary["settings"]
    device = (f"{m['gpu']} ({check.fmt_bytes(m['gpu_total_bytes'])})" if m["gpu"] else
              f"the CPU ({m['cpus']} CPUs), cards emulated by oomguard's emulated device memory")
    images = s["images"]
    out = [f"# GPU check: text-to-image jobs{' (dry run on the CPU)' if s['dry_run'] else ''}", "",
           f"Written by `bench/gpu_check.py` (its t2i cases, bench/gpu_check_t2i.py); rerun with `{summary['command']}`.", "",
           f"Measured {m['date']} on {device}; Python {m['python']}, torch {m['torch']} (CUDA {m['cuda']}), diffusers {m['diffusers']}, "
           f"peft {m['peft']}; {m['platform']}. The t2i cases took {summary['t2i_s']:.0f} s, the check {summary['total_s']:.0f} s so far.", "",
           f"Model: {s['pipeline']}.", ""]
    out += describe_build(check, summary["build"]) + [""]
    if s["tokenizer"]:
        out += [f"The {s['tokenizer']}.", ""]
    out += [f"Data: {images['count']} random PNGs of (height x width) {', '.join(f'{h}x{w}' for h, w in images['sizes'])}, captions in "
            f"metadata.jsonl; resolution {images['resolution']} (shorter side resized, centre crop, random flip).", "",
            f"Jobs: `trainer = \"text_to_image\"`, method {' and '.join(s['methods'])} (LoRA rank {s['lora_rank']}, alpha {s['lora_rank']}), "
            f"batch {s['batch']}, {s['steps'] + 1} steps, AdamW, snr_gamma 5, probe on, ladder.allow = {', '.join(s['allow'])}; each run as "
            "`oomguard run JOB --workdir W --emulate-device-memory CARD --json`, a fresh workdir per case, in this order: "
            f"{', '.join(s['order'])}" + (f", each for at most {s['case_cap_s']:.0f} s" if s["case_cap_s"] else "") + ". Cards: "
            + ("oomguard's emulated device memory on the CPU (counts live tensors, raises torch.OutOfMemoryError)." if s["dry_run"] else
               "a per-process memory fraction of the GPU (card / total memory; PyTorch's own OOMs)."), ""]
    if s["dry_run"]:
        out += ["**Dry run**: the numbers say nothing about a GPU; this checks the script's logic before a GPU session spends its minutes on it.", ""]
    out += ["## Per job and card", "", case_rows(check, summary), "",
            "*landed plan*: the last attempt's plan. *OOMs*: the measurements with `fits: false` across the attempts (the probe's, in-process "
            "recoveries', and those that ended an attempt). *peak allocated*: the largest `peak_bytes` of the landed plan's steps after the first "
            "in the last attempt's metrics.jsonl; *samples/s*: their median. *device used*: the most the GPU's used memory (NVML, sampled every "
            f"{SAMPLE_S} s) rose above what was in use when the case started: CUDA contexts and the allocator's cache included, which the "
            "memory fraction does not cap, so this is nearer what a real card of that size must hold. *wall s*: the whole `oomguard run`, "
            "imports, the pipeline's load and the encoding caches included.", ""]
    if summary["skipped"]:
        out += ["## Not run for lack of time (or of a pipeline)", "", *[f"- {x}" for x in summary["skipped"]], ""]
    for error in summary["errors"]:
        out += ["## Error (the t2i cases stopped here)", "", "```", error.strip()[-3000:], "```", ""]
    out += ["## Each case", ""]
    for c in summary["cases"]:
        out += case_details(c)
    return "\n".join(out)


def case_details(c: dict[str, Any]) -> list[str]:
    fraction = f", memory fraction {c['memory_fraction']:.4f}" if c.get("memory_fraction") else ""
    out = [f"### {c['method']} on {c['card']} ({c['cap_bytes']} bytes{fraction})", "", f"- result: {c.get('result') or c['state']}"]
    out += [f"- attempt {o['number']} (started with `[{o['started_with']}]`): {o['kind'] or 'stopped'}"
            + (f" at step {o['step']}" if o["step"] is not None else "")
            + (f" in {o['phase']}" if o["kind"] == "oom" else "") + (f": {o['message']}" if o["kind"] != "finished" and o["message"] else "")
            for o in c["outcomes"]]
    for o in c["outcomes"]:
        if o["kind"] not in ("finished", "oom") and (o.get("traceback_tail") or o.get("log_tail")):
            out += ["", f"Attempt {o['number']}'s output (end):", "", "```", (o.get("traceback_tail") or o["log_tail"])[-1500:].strip(), "```", ""]
    if c.get("cli_stderr_tail") and not c["outcomes"]:
        out += ["", "`oomguard run`'s stderr (end):", "", "```", c["cli_stderr_tail"][-1500:].strip(), "```", ""]
    out += [f"- oomguard measured: {x}" for x in c["measurements"]]
    out += [f"- event: {x}" for x in c["events"] if not x.startswith(("attempt-ended", "finished"))]
    if c.get("device_sampling"):
        out.append(f"- device memory {c['device_sampling']}")
    return out + [""]


def main() -> int:
    parser = argparse.ArgumentParser(description="the pipeline builder of bench/gpu_check.py's t2i cases (run it through gpu_check.py)")
    parser.add_argument("--build", type=Path, required=True, help="folder holding the parent's recipe.json")
    return build_worker(parser.parse_args().build)


if __name__ == "__main__":
    sys.exit(main())
