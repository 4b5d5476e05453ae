#!/usr/bin/env python
"""GPU check: which plan oomguard lands on for a Stable-Diffusion-1.5-sized UNet on 8, 12 and
24 GiB cards, emulated on one big GPU, how many OOMs that takes, and how fast that plan trains
compared with the fastest plan that fits; and (``--cases t2i``) what `oomguard run` does with
text-to-image jobs on an SD-1.5-size pipeline on the same cards.

Two parts, ``--cases unet,t2i`` (the default: both). *unet*, described below, runs first in
its share of ``--budget`` (half of it when both run); *t2i*, in bench/gpu_check_t2i.py, gets the
rest: the product's own path, ``oomguard run JOB --emulate-device-memory 8GiB --json`` in a
subprocess, for a LoRA and a full fine-tune job of the built-in ``text_to_image`` trainer on an
SD-1.5-size pipeline folder (random weights, 512 px) that it builds on the GPU at run time,
with deadlines for the build and for each case (see that file). Its results go to
gpu-t2i.md/json (gpu-dry-run-t2i.md/json for the dry run), apart from the unet part's, so that
either part can be run again alone without losing the other's.

A third part, *multi* (bench/gpu_check_multi.py), runs where the machine has 2 or more GPUs (or
when ``--cases multi`` names it; ``--dry-run`` on the CPU): a built-in job whose model state
does not fit one card, by `oomguard run` on one card and on two, each capped at the same size;
results in gpu-multi.md/json.

A fourth part, *offload* (``--cases offload``; with the default cases on a GPU), times one
training step (forward, backward, optimizer step) of SD 1.5's UNet at batch 1 with the state
offloaded by oomguard's ``offload`` rung (jobs/optimizers.py HostOffloadedOptimizer) and by
torchao's ``CPUOffloadOptimizer`` (which copies each gradient in backward and keeps tensors under
4096 values on the GPU), the same initial weights, fused CPU AdamW in both; results in
gpu-offload.md/json. torchao's asserts CUDA or XPU, so the dry run times ours alone (tiny UNet)
and says why. The product switches implementations only on such a measurement.

A fifth part, *allocator* (``--cases allocator``, never by default), calibrates the emulation of
PyTorch's caching allocator (jobs/caching_allocator.py, ``--emulate-allocator caching``): the
jobs bench/jobs/conv32.toml and attn32.toml (``--allocator-jobs``), each at its whole batch, half
of it, and half with gradient checkpointing, ``--allocator-steps`` (3) steps each, with
expandable segments off and on (a process each: torch reads $PYTORCH_ALLOC_CONF when CUDA
initialises), trained (a) on the card, uncapped: each step's ``max_memory_allocated`` and
``max_memory_reserved``, and the process's memory outside PyTorch at quiet moments (NVML's
per-process used memory less ``memory_reserved``, else ``mem_get_info``'s total - free less
``memory_reserved``), the measured overhead against the emulation's 512 MiB default; and (b) on
the CPU under the caching emulation with divisor 1 (PyTorch's own sizes), the same plans: peak
allocated and reserved, side by side with the card's and the ratio emulated / card reserved.
Without CUDA (or with ``--dry-run``) the CPU half runs alone, without the exit status 2 of the
other parts, and the results say that the card half was skipped and why. Results in
gpu-allocator.md/json (gpu-dry-run-allocator.md/json for the CPU half alone).

The rest of this docstring is the unet part.

The model is ``diffusers.UNet2DConditionModel`` with SD 1.5's UNet config (written inline
below, random weights, nothing downloaded: 860M parameters), trained with the DDPM
noise-prediction MSE loss and AdamW on random latents (4x64x64) and random text embeddings
(77x768), one fixed effective batch (16) on every card. A card of N GiB is a per-process
memory fraction N GiB / total (``torch.cuda.set_per_process_memory_fraction``, through
oomguard's own ``jobs/memory_cap.py``), so the OOMs are PyTorch's own.

Which path, and why. This part measures the UNet alone, on random latents and embeddings (no
VAE, no text encoder, no images to read), so that its sweep and oracle compare plans of the
UNet's own memory; the built-in ``text_to_image`` trainer always brings a pipeline's frozen parts
and data (the t2i part measures that path as a user runs it). Nor does this part re-implement
the decisions: it runs oomguard's real runner,
``oomguard.jobs.run.main`` (the probe, the memory model and planner, in-process recovery
through ``doctor.decide_in_process``, OOM figures from ``jobs/memory_cap.py``, the checkpoint
after an OOM, ``outcome.json``), in a fresh process per attempt as the daemon does, with one
substitution: ``jobs.loop.make_trainer`` returns ``ConditionalTrainer`` (below), which has the
built-in trainer's interface (build_model, step_inputs, slice_loss, ...) for a text-conditioned
UNet. Between attempts it does what the supervisor's ``_next_step`` does: ``doctor.decide`` over
the attempts so far, and the next attempt's environment from ``rungs.process_environment``
(the allocator rung). A Plan's knobs are applied by oomguard's own code
(``jobs/training.build_training`` and ``one_step``): micro_batch x grad_accum, gradient
checkpointing (``enable_gradient_checkpointing``), the attention rung (SDPA under activation
checkpointing: diffusers' ``set_attention_slice`` raises the training peak, see
strategies/rungs/attention.py), bf16 autocast (fp16 with a GradScaler on a GPU without bf16), optimizer
offload, bitsandbytes' 8-bit AdamW and peft LoRA. The job allows every rung (``--allow`` to
change): exact rungs first, approximate ones only where no exact plan fits, as the product does.

What runs, in order (each phase has a deadline within ``--budget``, default 420 s, so the
whole check ends in under 8 minutes on an H200):

1. oomguard, per card: attempts as above (the first one probes), until the job finishes its
   ``1 + --steps`` steps or the doctor gives up. Landed plan: the last attempt's plan; OOMs:
   every measurement with ``fits: false`` (probe, in-process, attempt-ending); peak allocated
   (``max_memory_allocated``) and samples/s from the landed plan's steps after the first;
   peak reserved (``max_memory_reserved``) at the end of the last step.
2. Sweep, uncapped, shared by all cards (the H200 holds every plan): a few shapes (sets of
   rungs) at the whole batch and at micro-batch 2, a warm step and a measured one each, for
   peak and speed; an approximate tier only when a card has no exact shape that fits.
3. Oracle, per card: from the most faithful tier with a shape predicted to fit (the peak is
   linear in the micro-batch between the two measured points), each shape's largest fitting
   micro-batch (one per number of slices); the two fastest by the sweep and oomguard's own
   plan are measured directly under the card's memory fraction (a warm step and ``--steps``
   timed ones; a candidate that runs out of memory gives way to the next smaller
   micro-batch; one predicted under 3/4 of a plan already measured is left out); the oracle
   is the fastest that fits, the most faithful tier first. What the time does not allow is
   skipped and listed in the results.

Without CUDA it exits with status 2 (and says that the t2i cases were skipped, and why), unless
``--dry-run``: the same code on the CPU with a tiny UNet2DConditionModel (batch 8, one timed
step) and cards of a few MiB through oomguard's emulated device memory
(``jobs/device_memory.py``), within a 55 s budget, written to gpu-dry-run.md/json (never
gpu.md); then the t2i cases' dry run, 30 s more (tests/pipelines.py's tiny pipeline, one LoRA
job on an emulated 0.75 MiB card). On a loaded machine the budget cuts it short (attempts
stopped, oracle skipped), which the results say.

Results: bench/results/gpu.md and gpu.json, gpu-t2i.md and gpu-t2i.json (``--out`` to change).
Run it with ``.venv/bin/python bench/gpu_check.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import math
import os
import platform
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The text-to-image cases (--cases t2i) live beside this file (the script's folder is on sys.path).
import gpu_check_t2i as t2i

STARTED = time.monotonic()
ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
MiB = 2**20
GiB = 2**30

NO_CUDA = ("no CUDA GPU found: bench/gpu_check.py measures real GPU memory; run it on a machine with an NVIDIA GPU "
           "(or add --dry-run to try its logic on the CPU with a tiny model)")

# Stable Diffusion 1.5's UNet (runwayml/stable-diffusion-v1-5, unet/config.json), written out.
SD15_UNET: dict[str, Any] = {
    "sample_size": 64,
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": (320, 640, 1280, 1280),
    "layers_per_block": 2,
    "cross_attention_dim": 768,
    "attention_head_dim": 8,
    "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    "norm_num_groups": 32,
    "act_fn": "silu",
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "downsample_padding": 1,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-5,
    "center_input_sample": False,
}
# The dry run's model: the same blocks, a few channels.
TINY_UNET: dict[str, Any] = {
    "sample_size": 8,
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": (32, 64),
    "layers_per_block": 1,
    "cross_attention_dim": 32,
    "attention_head_dim": 8,
    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
    "norm_num_groups": 8,
}
MODELS: dict[str, dict[str, Any]] = {
    "sd15": {"unet": SD15_UNET, "tokens": 77, "label": "SD 1.5 UNet2DConditionModel (860M parameters), latents 4x64x64, text 77x768"},
    "tiny": {"unet": TINY_UNET, "tokens": 77, "label": "tiny UNet2DConditionModel (channels 32/64), latents 4x8x8, text 77x32"},
}

GPU_CARDS = ("8GiB", "12GiB", "24GiB")
# The tiny model's whole batch of 8 peaks at about 20 MiB on the emulated device, 15 MiB at
# micro-batch 2, 9 MiB with optimizer offload and checkpointing: one card with room, one
# that needs offload, one that needs offload and small slices.
DRY_RUN_CARDS = ("8MiB", "14MiB", "24MiB")
BATCH = 16
STEPS = 3
# The dry run keeps to a minute on two shared CPU cores: a smaller batch, fewer timed steps.
DRY_RUN_BATCH = 8
DRY_RUN_STEPS = 1
GPU_BUDGET_S = 420.0
DRY_RUN_BUDGET_S = 55.0
# Phase deadlines as shares of the budget: oomguard on every card (the main result, and a
# process start per attempt), the sweep, the oracle races (these two skip what does not fit).
OOMGUARD_SHARE = 0.65
SWEEP_SHARE = 0.82
RACE_SHARE = 0.97
# Of its share of the oomguard phase, what each card keeps for itself when an earlier card
# needs more than its own.
CARD_RESERVE = 0.75
# The sweep measures each shape at the whole batch and at this micro-batch; the peak is
# interpolated linearly between the two (and extrapolated to micro-batch 1).
SWEEP_SMALL_MICRO_BATCH = 2
# A candidate's predicted peak must be this far under the card (the race checks it for real).
FIT_MARGIN = 0.97
# Oracle candidates raced per card (the landed plan comes on top), and smaller micro-batches
# tried per shape after a candidate ran out of memory. A candidate the sweep predicts at less
# than PRUNE x the fastest plan already measured to fit is not raced.
RACE_CANDIDATES = 2
STEP_DOWNS = 2
PRUNE = 0.75
# Shapes swept, as the rungs that make them from the job's own plan, by tier. The exact ones
# always; an approximate tier only when a card has no exact shape that fits.
EXACT_SHAPES: tuple[tuple[str, ...], ...] = (
    (),
    ("checkpointing",),
    ("checkpointing", "attention"),
    ("offload", "checkpointing"),
    ("offload", "checkpointing", "attention"),
)
APPROXIMATE_SHAPES: tuple[tuple[str, ...], ...] = (
    ("checkpointing", "attention", "precision"),
    ("offload", "checkpointing", "attention", "precision"),
    ("checkpointing", "attention", "precision", "optimizer_8bit"),
    ("checkpointing", "attention", "lora"),
    ("checkpointing", "attention", "precision", "lora"),
    ("checkpointing", "attention", "lora", "base_quantization"),
)
TRAINER_FILE = "gpu_check_trainer.json"
FINAL_STATS = "gpu_check.json"
# One thread per process in the dry run (2 shared cores here), as bench/ladder.py does.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def log(text: str) -> None:
    print(f"[{time.monotonic() - STARTED:6.1f}s] {text}", flush=True)


def elapsed() -> float:
    return time.monotonic() - STARTED


# ----------------------------------------------------------------------------- the trainer


@dataclass(frozen=True)
class StepInputs:
    """Host-side tensors for one whole effective batch."""

    latents: Any
    noise: Any
    timesteps: Any
    text: Any

    @property
    def size(self) -> int:
        return self.latents.shape[0]


class ConditionalTrainer:
    """The built-in trainer's interface (jobs/trainers/unconditional.py) for a text-conditioned
    UNet2DConditionModel on random latents and random text embeddings.

    Everything random about a step is drawn for the whole effective batch from a generator
    seeded by (seed, step) and then sliced, as the built-in trainer does, so every plan trains
    the same thing. ``save_final`` writes this process's CUDA peaks instead of 3.4 GB of weights.
    """

    def __init__(self, job: Any, model: str) -> None:
        from diffusers import DDPMScheduler

        self.job = job
        self.config = MODELS[model]
        self.noise_scheduler = DDPMScheduler(num_train_timesteps=job.train.num_train_timesteps)

    def build_model(self) -> Any:
        import torch
        from diffusers import UNet2DConditionModel

        torch.manual_seed(self.job.train.seed)
        unet = self.config["unet"]
        return UNet2DConditionModel(**{k: list(v) if isinstance(v, tuple) else v for k, v in unet.items()})

    def zero_gradient_parameters(self, model: Any) -> list[Any]:
        # The attention key bias gets a zero gradient (see the built-in trainer); SD's
        # attention layers have no bias, so this is usually empty.
        return [p for name, p in model.named_parameters() if name.endswith("to_k.bias")]

    def step_inputs(self, step: int) -> StepInputs:
        import torch

        from oomguard.jobs.data import step_generator

        unet = self.config["unet"]
        batch = self.job.train.batch_size
        shape = (batch, unet["in_channels"], unet["sample_size"], unet["sample_size"])
        generator = step_generator(self.job.train.seed, step)
        latents = torch.randn(shape, generator=generator)
        noise = torch.randn(shape, generator=generator)
        timesteps = torch.randint(0, self.noise_scheduler.config.num_train_timesteps, (batch,), generator=generator)
        text = torch.randn((batch, self.config["tokens"], unet["cross_attention_dim"]), generator=generator)
        return StepInputs(latents=latents, noise=noise, timesteps=timesteps, text=text)

    def slice_loss(self, model: Any, inputs: StepInputs, start: int, stop: int, device: Any) -> Any:
        import torch.nn.functional as F

        # copy=True: on the CPU .to() would return a view that the emulated device does not count.
        latents = inputs.latents[start:stop].to(device, copy=True)
        noise = inputs.noise[start:stop].to(device, copy=True)
        timesteps = inputs.timesteps[start:stop].to(device, copy=True)
        text = inputs.text[start:stop].to(device, copy=True)
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        prediction = model(noisy, timesteps, encoder_hidden_states=text).sample
        return F.mse_loss(prediction.float(), noise.float())

    def save_final(self, model: Any, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / FINAL_STATS).write_text(json.dumps(cuda_peaks(), indent=2))

    # The text embeddings are random inputs, not a text encoder's output: nothing frozen to
    # place or count (jobs/trainers/base.py, the frozen parts of a text-to-image job).
    def place_frozen(self, plan: Any, device: Any, memory: Any) -> None:
        """Nothing frozen."""

    def frozen_tensors(self) -> list[Any]:
        return []

    def frozen_sizes(self) -> dict[str, int]:
        return {}

    # Every step's batch has the same shape (no aspect-ratio buckets): the loop asks at every
    # step, the probe asks which step to measure at (jobs/trainers/base.py's Trainer protocol).
    def step_bucket(self, step: int) -> None:
        return None

    def heaviest_step(self) -> int:
        return 0


def cuda_peaks() -> dict[str, int | None]:
    """This process's CUDA peaks since the last reset (the runner resets them every step)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {"max_memory_allocated": None, "max_memory_reserved": None, "memory_reserved": None}
    return {
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "memory_reserved": torch.cuda.memory_reserved(),
    }


# ----------------------------------------------------------------------------- workers


def attempt_worker(attempt_dir: Path) -> int:
    """One attempt: oomguard's runner with the conditional trainer (its exit codes)."""
    settings = json.loads((attempt_dir / TRAINER_FILE).read_text())
    import torch

    if settings.get("threads"):
        torch.set_num_threads(settings["threads"])
    import oomguard.jobs.loop as loop
    from oomguard.jobs import run

    # The loop calls make_trainer(job, workdir), as the trainer registry does; this trainer keeps nothing in the workdir.
    loop.make_trainer = lambda job, workdir=None: ConditionalTrainer(job, settings["model"])
    return run.main([str(attempt_dir)])


def measure_worker() -> int:
    """Measure plans, one JSON task per line on stdin, one ``RESULT {json}`` line per task on
    stdout. Ends after a failed step left memory behind (the parent starts a new worker)."""
    import torch

    from oomguard.jobs.spec import JobSpec

    if os.environ.get("OMP_NUM_THREADS") == "1":
        torch.set_num_threads(1)
    # The slow imports, before READY: the first plan's time is then the plan's own.
    importlib.import_module("oomguard.jobs.training")
    importlib.import_module("diffusers").UNet2DConditionModel  # noqa: B018 (diffusers imports lazily)

    print("READY", flush=True)
    trainers: dict[str, ConditionalTrainer] = {}
    for line in sys.stdin:
        if not line.strip():
            continue
        task = json.loads(line)
        job = JobSpec.parse(task["job"])
        trainer = trainers.get(task["model"])
        if trainer is None:
            trainer = trainers[task["model"]] = ConditionalTrainer(job, task["model"])
        result = measure_plan(trainer, job, task)
        print("RESULT " + json.dumps(result), flush=True)
        if result.get("leftover_bytes"):
            return 0
    return 0


def measure_plan(trainer: ConditionalTrainer, job: Any, task: dict[str, Any]) -> dict[str, Any]:
    """Build the task's plan fresh and train a warm step plus ``steps`` timed ones, under the
    task's cap (a memory fraction on CUDA, the emulated device on the CPU) or none."""
    import torch

    from oomguard.jobs.attempt import Control
    from oomguard.jobs.device import DeviceSpec
    from oomguard.jobs.memory_cap import open_device_memory
    from oomguard.jobs.sizes import CapSchedule
    from oomguard.jobs.training import build_training, one_step
    from oomguard.jobs.step_oom import free, unfit_to_continue
    from oomguard.strategies.plan import Plan

    plan = Plan.from_dict(task["plan"])
    cap = task["cap"]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        schedule = CapSchedule(((0, cap),)) if cap is not None else None
        if cap is None:
            torch.cuda.set_per_process_memory_fraction(1.0)
    else:
        # Without a cap, an emulated device that counts and never refuses.
        schedule = CapSchedule(((0, cap if cap is not None else 2**40),))
    memory = open_device_memory(DeviceSpec(schedule), device)
    control = Control()
    result: dict[str, Any] = {"plan": plan.to_dict(), "cap": cap}
    started = time.perf_counter()
    training = None
    step = 0
    oom_text: str | None = None
    with memory:
        memory.begin_step(0)
        clean = memory.live_bytes() or 0
        memory.reset_peak()
        try:
            training = build_training(trainer, job, plan, device, memory)
            result["build_s"] = time.perf_counter() - started
            rates = []
            for step in range(1 + task["steps"]):
                outcome = one_step(trainer, training, step, memory, control)
                if step > 0:
                    rates.append(plan.batch_size / outcome.seconds)
                if not math.isfinite(outcome.loss):
                    result["diverged"] = f"loss {outcome.loss} at step {step}"
            result.update(fits=True, rates=rates, samples_per_s=statistics.median(rates) if rates else None,
                          peak_bytes=memory.peak_bytes(), reserved_bytes=torch.cuda.max_memory_reserved() if cuda else None)
        except torch.OutOfMemoryError as error:
            oom_text = str(error)
            figures = memory.oom_figures(oom_text)
            result.update(fits=False, oom_step=step, oom_phase=control.phase, oom_message=oom_text.splitlines()[0][:300],
                          needed_at_least=(figures.allocated or 0) + (figures.requested or 0))
        training = None
        free(memory)
        leftover = unfit_to_continue(memory, clean)
        if leftover is not None:
            result["leftover_bytes"] = leftover
    result["wall_s"] = time.perf_counter() - started
    return result


class MeasureWorker:
    """The parent's handle on a measuring process, started ahead of time (its imports take
    seconds) and started again when one ends."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.env = env
        self.log_path = log_path
        self.process: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.started = 0
        self.started_at = 0.0
        # Seconds from start to READY (imports), once known: the cost of starting it again.
        self.ready_s: float | None = None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        self.lines = queue.Queue()
        self.started_at = elapsed()
        log_file = self.log_path.open("a")
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker-measure"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, text=True, env=self.env, start_new_session=True, cwd=ROOT,
        )
        log_file.close()
        self.started += 1
        lines, stdout = self.lines, self.process.stdout
        assert stdout is not None
        started_at = self.started_at

        def read() -> None:
            for line in stdout:
                if line.startswith("READY"):
                    self.ready_s = elapsed() - started_at
                    continue
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()

    def measure(self, task: dict[str, Any], deadline: float) -> dict[str, Any]:
        """The task's result; an error dict when the worker died or ran past ``deadline``."""
        self.start()
        assert self.process is not None and self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(task) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            self.kill()
            return {"error": "the measuring process died before the task", "log_tail": tail(self.log_path)}
        while True:
            remaining = deadline - elapsed()
            try:
                line = self.lines.get(timeout=max(0.05, remaining))
            except queue.Empty:
                self.kill()
                return {"error": "stopped at the phase's deadline (budget)", "budget": True}
            if line is None:
                self.kill()
                return {"error": "the measuring process died", "log_tail": tail(self.log_path)}
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
                if result.get("leftover_bytes"):
                    try:
                        self.process.wait(timeout=30)  # it ends itself; the next task starts a new one
                    except subprocess.TimeoutExpired:
                        self.kill()
                return result

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            kill_group(self.process)
        self.process = None

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None and self.process.stdin is not None:
            try:
                self.process.stdin.close()
                self.process.wait(timeout=10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                pass
        self.kill()


def kill_group(process: subprocess.Popen[Any]) -> None:
    """SIGKILL the process we started and its group (it leads a session of its own)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


# ----------------------------------------------------------------------------- oomguard per card


@dataclass
class Card:
    name: str  # as given: "8GiB", "20MiB"
    nbytes: int

    @property
    def label(self) -> str:
        return self.name.replace("GiB", " GiB").replace("MiB", " MiB")


def make_job(model: str, batch: int, steps: int, allow: tuple[str, ...]) -> Any:
    """The job the runner sees. ``[data]`` and ``[model]`` are required by the job schema for a
    built-in trainer; ConditionalTrainer ignores both (its model and data are MODELS[model])."""
    from oomguard.jobs.spec import JobSpec

    return JobSpec.parse({
        "name": f"{model}-text-to-image",
        "trainer": "unconditional",
        "data": {"source": f"synthetic:{batch}", "resolution": 8},
        "model": {"block_out_channels": [32], "down_block_types": ["DownBlock2D"], "up_block_types": ["UpBlock2D"], "norm_num_groups": 8},
        "train": {
            "batch_size": batch,
            "max_steps": 1 + steps,
            "learning_rate": 1e-5,
            "weight_decay": 1e-2,
            "seed": 0,
            "mixed_precision": "no",
            # No checkpoint on a schedule (an SD 1.5 checkpoint is 10 GB); the runner still
            # writes one when an OOM ends an attempt after step 0, for the next attempt.
            "checkpoint_every_steps": 1 + steps,
            "keep_checkpoints": 1,
        },
        "ladder": {"allow": list(allow), "probe": True},
    })


def run_oomguard(job: Any, card: Card, model: str, workdir: Path, env: dict[str, str], deadline: float, threads: int | None) -> dict[str, Any]:
    # Over 60 lines: the attempt loop as the daemon takes it, step by step; split, its order would be hidden.
    """The job on one card, attempt after attempt, as the daemon runs it."""
    from oomguard.jobs.attempt import LOG, OUTCOME, AttemptConfig, read_json
    from oomguard.jobs.device import DeviceSpec
    from oomguard.strategies import rungs
    from oomguard.strategies.doctor import decide
    from oomguard.strategies.decision import GiveUp, NextPlan, PastAttempt, Retry, Wait
    from oomguard.strategies.outcome import Outcome

    policy = job.policy()
    plan = job.initial_plan()
    history: list[Any] = []
    attempts: list[dict[str, Any]] = []
    decisions: list[str] = []
    state = "failed"
    started = elapsed()
    for number in range(1, policy.max_attempts + 1):
        attempt_dir = workdir / "attempts" / f"{number:03d}"
        config = AttemptConfig(job=job, plan=plan, number=number, workdir=workdir, device=DeviceSpec.from_option(card.name),
                               probe=job.ladder.probe and number == 1)
        config.write(attempt_dir)
        (attempt_dir / TRAINER_FILE).write_text(json.dumps({"model": model, "threads": threads}))
        log(f"  {card.label}: attempt {number} starts with [{plan.short()}]" + (" (probe on)" if config.probe else ""))
        with (attempt_dir / LOG).open("wb") as output:
            process = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--worker-attempt", str(attempt_dir)],
                stdout=output, stderr=subprocess.STDOUT, env=rungs.process_environment(plan, env), cwd=workdir, start_new_session=True,
            )
            returncode = follow(process, attempt_dir / LOG, deadline, f"  {card.label}: ")
        data = read_json(attempt_dir / OUTCOME)
        if returncode is None:
            heartbeat = read_json(attempt_dir / "heartbeat.json") or {}
            current = heartbeat.get("plan") or plan.short()
            attempts.append({"number": number, "plan": plan.short(), "outcome": None, "directory": str(attempt_dir), "current_plan": current,
                             "killed": f"stopped at the card's deadline (budget), at step {heartbeat.get('step', 0)} under [{current}]",
                             "log_tail": tail(attempt_dir / LOG)})
            log(f"  {card.label}: attempt {number} stopped at the card's deadline")
            state = "timed out"
            break
        if isinstance(data, dict):
            outcome = Outcome.from_dict(data)
        else:
            from oomguard.daemon.supervisor import outcome_without_report

            outcome = outcome_without_report(attempt_dir, returncode)
        ended_plan = outcome.plan or plan
        attempts.append({"number": number, "plan": plan.short(), "started": plan, "outcome": outcome, "directory": str(attempt_dir),
                         "exit_code": returncode, "log_tail": tail(attempt_dir / LOG) if outcome.kind != "finished" else None})
        log(f"  {card.label}: attempt {number} ended: {outcome.kind} at step {outcome.step}" + (f" in {outcome.phase}" if outcome.kind == "oom" else "")
            + f", plan [{ended_plan.short()}]" + (f": {(outcome.message or '').strip()[:300]}" if outcome.kind not in ("finished", "oom") else ""))
        history.append(PastAttempt(plan=ended_plan, outcome=outcome))
        if outcome.kind == "finished":
            state = "finished"
            break
        decision = decide(outcome, ended_plan, history, policy)
        decisions.append(f"after attempt {number}: {type(decision).__name__}: {decision.reason}")
        log(f"  {card.label}: doctor: {type(decision).__name__}: {decision.reason}")
        if isinstance(decision, NextPlan):
            plan = decision.plan
        elif isinstance(decision, (Retry, Wait)):
            plan = ended_plan
        elif isinstance(decision, GiveUp):
            state = "gave up"
            break
        if elapsed() >= deadline:
            state = "timed out"
            break
    summary = summarise_oomguard(attempts, state)
    summary.update(decisions=decisions, wall_s=elapsed() - started)
    return summary


def tail(path: Path, size: int = 3000) -> str | None:
    """The end of a log that goes away with the scratch folder, for the results."""
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, path.stat().st_size - size))
            return handle.read().decode(errors="replace")
    except OSError:
        return None


# The runner's lines worth a progress line here (the rest stays in the attempt's output.log).
PROGRESS_PREFIXES = ("probe:", "out of memory", "step ", "resumed", "the failed step", "Traceback")


def follow(process: subprocess.Popen[Any], output: Path, deadline: float, prefix: str) -> int | None:
    """Wait for the attempt, echoing its progress lines; its exit status, or None when it ran
    past ``deadline`` and was killed."""
    position = 0

    def echo() -> None:
        nonlocal position
        with output.open("rb") as handle:
            handle.seek(position)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        position += end
        for line in data[:end].decode(errors="replace").splitlines():
            if line.startswith(PROGRESS_PREFIXES):
                log(prefix + line.strip()[:240])

    try:
        while True:
            try:
                returncode = process.wait(timeout=min(2.0, max(0.05, deadline - elapsed())))
            except subprocess.TimeoutExpired:
                echo()
                if elapsed() >= deadline:
                    kill_group(process)
                    return None
                continue
            echo()
            return returncode
    except BaseException:
        kill_group(process)  # Ctrl-C: the attempt runs in a session of its own and would go on
        raise


def summarise_oomguard(attempts: list[dict[str, Any]], state: str) -> dict[str, Any]:
    # Over 60 lines: one pass over the attempts that gathers every figure of the summary.
    """Landed plan, OOMs by where they happened, and the landed plan's steps."""
    from oomguard.strategies.plan import Plan

    ooms: list[dict[str, Any]] = []
    measured: list[str] = []
    reasons: list[str] = []
    in_process = attempt_ending = 0
    landed: Plan | None = None
    for attempt in attempts:
        outcome = attempt["outcome"]
        if outcome is None:
            continue
        landed = outcome.plan or attempt["started"]
        for m in outcome.measurements:
            if m.fits:
                speed = f", {m.samples_per_s:.2f} samples/s" if m.samples_per_s else ""
                # The probe's measurements carry their step (0); the attempt's steady training steps do not.
                where = "probe" if m.step is not None else "training steps"
                measured.append(f"attempt {attempt['number']}, {where}: [{m.plan.short()}] peak {fmt_bytes(m.peak_bytes)}{speed}")
            else:
                measured.append(f"attempt {attempt['number']}: [{m.plan.short()}] OOM at step {m.step} (needed more than {fmt_bytes(m.peak_bytes)})")
                ooms.append({"attempt": attempt["number"], "plan": m.plan.short(), "step": m.step, "needed_at_least_bytes": m.peak_bytes,
                             "capacity_bytes": m.capacity})
        for change in outcome.recoveries:
            reasons.append(f"attempt {attempt['number']}, step {change.get('step')}: {change.get('reason')}")
            if not str(change.get("reason", "")).startswith("probe"):
                in_process += 1
        if outcome.kind == "oom":
            attempt_ending += 1
    if attempts and attempts[-1]["outcome"] is None:
        # The last attempt was stopped at the deadline: the plan it was running.
        landed, landed_text = None, attempts[-1]["current_plan"]
    else:
        landed_text = landed.short() if landed is not None else (attempts[-1]["plan"] if attempts else None)
    rates: list[float] = []
    peaks: list[int] = []
    reserved = None
    last = attempts[-1] if attempts else None
    if last is not None and landed is not None:
        metrics = Path(last["directory"]) / "metrics.jsonl"
        if metrics.exists():
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            # The first step of an attempt creates the optimizer state: not steady.
            steady = [r for r in rows[1:] if r.get("plan") == landed.short()]
            rates = [r["samples_per_s"] for r in steady]
            peaks = [r["peak_bytes"] for r in steady if r.get("peak_bytes") is not None]
        final = Path(last["directory"]).parent.parent / "final" / FINAL_STATS
        if state == "finished" and final.exists():
            reserved = json.loads(final.read_text()).get("max_memory_reserved")
    killed = [a["killed"] for a in attempts if a.get("killed")]
    return {
        "state": state,
        "attempts": len(attempts),
        "landed_plan": landed_text,
        "landed": landed.to_dict() if landed is not None else None,
        "ooms": len(ooms),
        "ooms_in_probe": len(ooms) - in_process - attempt_ending,
        "ooms_in_process": in_process,
        "ooms_ending_attempts": attempt_ending,
        "oom_details": ooms,
        "measurements": measured,
        "plan_changes": reasons,
        "samples_per_s": statistics.median(rates) if rates else None,
        "steady_steps": len(rates),
        "peak_allocated_bytes": max(peaks) if peaks else None,
        "peak_reserved_bytes": reserved,
        "outcomes": [{"number": a["number"], "started_with": a["plan"], "kind": a["outcome"].kind if a["outcome"] else None,
                      "step": a["outcome"].step if a["outcome"] else None, "phase": a["outcome"].phase if a["outcome"] else None,
                      "message": (a["outcome"].message or "")[:300] if a["outcome"] else a.get("killed"),
                      "traceback_tail": (a["outcome"].traceback_tail or "")[-3000:] if a["outcome"] else None,
                      "log_tail": a.get("log_tail")} for a in attempts],
        "notes": killed,
    }


# ----------------------------------------------------------------------------- sweep and oracle


@dataclass
class Shape:
    """Every knob but the micro-batch, and what the sweep measured of it."""

    rungs: tuple[str, ...]
    base: Any  # the Plan at micro-batch 1
    tier: int
    points: dict[int, dict[str, Any]] = field(default_factory=dict)  # micro-batch -> measurement

    @property
    def name(self) -> str:
        return "+".join(self.rungs) or "none"

    def plan(self, micro_batch: int) -> Any:
        return self.base.replace(micro_batch=micro_batch)

    def fitted(self) -> list[tuple[int, dict[str, Any]]]:
        return sorted((mb, r) for mb, r in self.points.items() if r.get("fits"))

    def predicted_peak(self, micro_batch: int) -> float | None:
        """Linear in the micro-batch between the lowest and highest micro-batch that ran
        (the memory model's form); a micro-batch above one that ran out of memory does not fit."""
        if any(not r.get("fits") and not r.get("error") and mb <= micro_batch for mb, r in self.points.items()):
            return math.inf
        ran = self.fitted()
        if not ran:
            return None
        if micro_batch in self.points and self.points[micro_batch].get("fits"):
            return float(self.points[micro_batch]["peak_bytes"])
        if len(ran) < 2:
            return None
        (a, ra), (b, rb) = ran[0], ran[-1]
        slope = (rb["peak_bytes"] - ra["peak_bytes"]) / (b - a)
        if slope < 0:  # autocast's weight copies can outweigh a few samples: no line to trust
            return float(max(ra["peak_bytes"], rb["peak_bytes"]))
        return ra["peak_bytes"] + slope * (micro_batch - a)

    def predicted_rate(self, micro_batch: int) -> float | None:
        """samples/s from a step time linear in the number of slices."""
        ran = [(mb, r) for mb, r in self.fitted() if r.get("samples_per_s")]
        if not ran:
            return None
        slices = self.plan(micro_batch).grad_accum
        if len(ran) < 2:
            mb, r = ran[0]
            return r["samples_per_s"] if self.plan(mb).grad_accum == slices else None
        (a, ra), (b, rb) = ran[0], ran[-1]
        sa, sb = self.plan(a).grad_accum, self.plan(b).grad_accum
        batch = self.base.batch_size
        ta, tb = batch / ra["samples_per_s"], batch / rb["samples_per_s"]
        step = ta + (tb - ta) * (slices - sa) / (sb - sa) if sa != sb else ta
        return batch / step if step > 0 else None


def representative_micro_batches(start: Any) -> list[int]:
    """Per number of slices the smallest micro-batch (the most even split: the lowest peak for
    the same work), largest first: 16, 8, 6, 4, 3, 2, 1 for a batch of 16."""
    sizes = {math.ceil(start.per_rank_batch / s) for s in range(1, start.per_rank_batch + 1)}
    return sorted((mb for mb in sizes if mb in start.micro_batch_choices()), reverse=True)


def make_shapes(job: Any, rung_sets: tuple[tuple[str, ...], ...]) -> list[Shape]:
    from oomguard.strategies import planner, rungs

    start = job.initial_plan()
    allowed = set(job.ladder.allow)
    shapes: list[Shape] = []
    for names in rung_sets:
        if not set(names) <= allowed or any(rungs.rung(name) is None for name in names):
            continue
        plan = start.replace(micro_batch=1)
        for name in names:
            stepped = rungs.rung(name).step(plan)
            if stepped is None:
                break
            plan = stepped
        else:
            shapes.append(Shape(rungs=names, base=plan, tier=planner.faithfulness(start, plan)))
    return shapes


class Measurer:
    """Plans to the worker, with progress lines and a running estimate of a plan's cost."""

    def __init__(self, worker: MeasureWorker, job: Any, model: str, steps: int) -> None:
        self.worker = worker
        self.job = job
        self.model = model
        self.steps = steps
        self.costs: list[float] = []
        self.skipped: list[str] = []

    def expected_cost(self, steps: int) -> float:
        restart = 0.0 if self.worker.alive() else (self.worker.ready_s or 0.0)
        if not self.costs:
            return restart
        return restart + statistics.median(self.costs) * (1 + steps) / (1 + self.steps)

    def run(self, plan: Any, cap: int | None, steps: int, deadline: float, what: str) -> dict[str, Any] | None:
        """The measurement, or None when the time left before ``deadline`` is too short."""
        if elapsed() + self.expected_cost(steps) > deadline:
            self.skipped.append(f"{what}: [{plan.short()}]")
            log(f"  skipped for lack of time: {what} [{plan.short()}] (~{self.expected_cost(steps):.0f}s, {max(0.0, deadline - elapsed()):.0f}s left)")
            return None
        started = elapsed()
        task = {"job": self.job.to_dict(), "model": self.model, "plan": plan.to_dict(), "cap": cap, "steps": steps}
        result = self.worker.measure(task, deadline)
        if result.get("budget"):
            self.skipped.append(f"{what}: [{plan.short()}] (stopped at the deadline)")
        elif result.get("fits"):
            self.costs.append(result["wall_s"] * (1 + self.steps) / (1 + steps))
        log(f"  {what} [{plan.short()}]: {describe_measurement(result)} ({elapsed() - started:.1f}s)")
        return result


def describe_measurement(r: dict[str, Any]) -> str:
    if r.get("error"):
        return f"ERROR {r['error']}"
    if not r.get("fits"):
        return f"OOM in {r.get('oom_phase')} at step {r.get('oom_step')} (needed more than {fmt_bytes(r.get('needed_at_least'))})"
    reserved = f", reserved {fmt_bytes(r['reserved_bytes'])}" if r.get("reserved_bytes") is not None else ""
    rate = f", {r['samples_per_s']:.2f} samples/s" if r.get("samples_per_s") else ""
    return f"peak {fmt_bytes(r.get('peak_bytes'))}{reserved}{rate}"


def sweep_micro_batches(start: Any) -> tuple[int, ...]:
    return tuple(sorted({start.per_rank_batch, min(SWEEP_SMALL_MICRO_BATCH, start.per_rank_batch)}, reverse=True))


def sweep(measurer: Measurer, shapes: list[Shape], deadline: float) -> bool:
    """Each shape at the whole batch and micro-batch 2, uncapped; at half the batch, then a
    quarter, while the whole batch runs out of memory. False when the time ran out."""
    for shape in shapes:
        for mb in sweep_micro_batches(shape.base):
            if mb in shape.points:
                continue
            result = measurer.run(shape.plan(mb), None, 1, deadline, f"sweep {shape.name}")
            if result is None or result.get("budget"):
                return False
            shape.points[mb] = result
            size = mb
            while not result.get("fits") and not result.get("error") and size > 2 * SWEEP_SMALL_MICRO_BATCH:
                size //= 2
                result = measurer.run(shape.plan(size), None, 1, deadline, f"sweep {shape.name}")
                if result is None or result.get("budget"):
                    return False
                shape.points[size] = result
    return True


def fits_somewhere(shapes: list[Shape], cap: int, reps: list[int]) -> bool:
    return any((p := s.predicted_peak(mb)) is not None and p <= FIT_MARGIN * cap for s in shapes for mb in reps)


def oracle_candidates(shapes: list[Shape], cap: int, reps: list[int]) -> tuple[int | None, list[tuple[Shape, int]]]:
    """(the tier, its shapes' largest fitting micro-batches, fastest predicted first)."""
    for tier in sorted({s.tier for s in shapes}):
        found = []
        for shape in (s for s in shapes if s.tier == tier):
            for mb in reps:
                peak = shape.predicted_peak(mb)
                if peak is not None and peak <= FIT_MARGIN * cap:
                    found.append((shape, mb))
                    break
        if found:
            found.sort(key=lambda c: -(c[0].predicted_rate(c[1]) or 0.0))
            return tier, found
    return None, []


def race(measurer: Measurer, card: Card, shapes: list[Shape], reps: list[int], landed: Any, start: Any, deadline: float) -> dict[str, Any]:
    """The card's oracle: candidates measured directly under the card's cap."""
    from oomguard.strategies import planner
    from oomguard.strategies.plan import Plan

    tier, found = oracle_candidates(shapes, card.nbytes, reps)
    queue_: list[tuple[Shape | None, int | None, Any]] = [(s, mb, s.plan(mb)) for s, mb in found[:RACE_CANDIDATES]]
    landed_key = None
    if landed is not None:
        # The allocator setting is for a new process's environment: the race's worker has none.
        landed_key = Plan.from_dict(landed).replace(allocator="")
        if all(p != landed_key for _, _, p in queue_):
            queue_.append((None, None, landed_key))
    measured: dict[str, dict[str, Any]] = {}
    step_downs: dict[str, int] = {}
    while queue_:
        shape, mb, plan = queue_.pop(0)
        if plan.short() in measured:
            continue
        best = max((r["samples_per_s"] for r in measured.values() if r.get("fits") and r.get("samples_per_s")), default=None)
        predicted = shape.predicted_rate(mb) if shape is not None else None
        if best is not None and predicted is not None and predicted < PRUNE * best:
            log(f"  {card.label}: not racing [{plan.short()}]: predicted {predicted:.2f} samples/s, under {PRUNE} x {best:.2f} measured")
            continue
        label = "oomguard's plan" if shape is None else "oracle candidate"
        result = measurer.run(plan, card.nbytes, measurer.steps, deadline, f"{card.label} race, {label}")
        if result is None:
            continue
        measured[plan.short()] = {**result, "faithfulness": planner.faithfulness(start, plan), "landed": plan == landed_key,
                                  "predicted_samples_per_s": shape.predicted_rate(mb) if shape is not None else None,
                                  "predicted_peak_bytes": shape.predicted_peak(mb) if shape is not None else None}
        if shape is not None and not result.get("fits") and not result.get("error") and step_downs.get(shape.name, 0) < STEP_DOWNS:
            smaller = [m for m in reps if m < mb]
            if smaller:
                step_downs[shape.name] = step_downs.get(shape.name, 0) + 1
                queue_.insert(0, (shape, smaller[0], shape.plan(smaller[0])))
    fitting = {k: r for k, r in measured.items() if r.get("fits") and r.get("samples_per_s") and not r.get("diverged")}
    oracle = min(fitting, key=lambda k: (fitting[k]["faithfulness"], -fitting[k]["samples_per_s"])) if fitting else None
    return {
        "tier": tier,
        "candidates": [s.plan(mb).short() for s, mb in found[:RACE_CANDIDATES]],
        "measured": measured,
        "oracle_plan": oracle,
        "oracle_samples_per_s": fitting[oracle]["samples_per_s"] if oracle else None,
        "oracle_peak_bytes": fitting[oracle]["peak_bytes"] if oracle else None,
        "oracle_reserved_bytes": fitting[oracle].get("reserved_bytes") if oracle else None,
        "landed_race": measured.get(landed_key.short()) if landed_key is not None else None,
    }


# ----------------------------------------------------------------------------- results


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    if n == math.inf:
        return "inf"
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def card_rows(summary: dict[str, Any]) -> str:
    lines = [
        "| card | oomguard plan | state | OOMs (probe / in-process / ending an attempt) | attempts | peak allocated | peak reserved | "
        "samples/s | oracle plan | oracle samples/s | ratio | oomguard wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in summary["cards"]:
        og, oracle = c["oomguard"], c.get("oracle") or {}
        approx = " (approximate)" if c.get("landed_faithfulness") else ""
        oracle_approx = " (approximate)" if oracle.get("oracle_plan") and oracle["measured"][oracle["oracle_plan"]]["faithfulness"] else ""
        lines.append(
            f"| {c['card']} | `{og.get('landed_plan')}`{approx} | {og['state']} | {og['ooms']} ({og['ooms_in_probe']} / {og['ooms_in_process']} / "
            f"{og['ooms_ending_attempts']}) | {og['attempts']} | {fmt_bytes(og.get('peak_allocated_bytes'))} | {fmt_bytes(og.get('peak_reserved_bytes'))} | "
            f"{_fmt(og.get('samples_per_s'))} | " + (f"`{oracle['oracle_plan']}`{oracle_approx}" if oracle.get("oracle_plan") else "not measured")
            + f" | {_fmt(oracle.get('oracle_samples_per_s'))} | {_fmt(c.get('ratio'))} | {og['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def markdown(summary: dict[str, Any]) -> str:
    # Over 60 lines: the report's text, in the order it is read.
    m = summary["machine"]
    s = summary["settings"]
    device = (f"{m['gpu']} ({fmt_bytes(m['gpu_total_bytes'])})" if m["gpu"] else
              f"the CPU ({m['cpus']} CPUs), cards emulated by oomguard's emulated device memory")
    out = [
        f"# GPU check{' (dry run on the CPU)' if s['dry_run'] else ''}",
        "",
        f"Written by `bench/gpu_check.py`; rerun with `{summary['command']}`.",
        "",
        f"Measured {m['date']} on {device}; Python {m['python']}, torch {m['torch']} (CUDA {m['cuda']}), diffusers {m['diffusers']}, "
        f"bitsandbytes {m['bitsandbytes']}, peft {m['peft']}; {m['platform']}. Total {summary['total_s']:.0f} s of a {s['budget_s']:.0f} s budget.",
        "",
        f"Model: {s['model_label']}; DDPM noise-prediction MSE, AdamW (lr 1e-5), effective batch {s['batch']} on every card; "
        f"ladder.allow = {', '.join(s['allow'])}. Cards: {', '.join(s['cards'])} "
        + ("(oomguard's emulated device memory on the CPU: counts live tensors, raises torch.OutOfMemoryError)." if s["dry_run"] else
           "(per-process memory fraction = card / total memory; PyTorch's own OOMs)."),
        "",
    ]
    if s["dry_run"]:
        out += ["**Dry run**: the numbers say nothing about a GPU; this checks the script's logic before a GPU session spends its minutes on it.", ""]
    out += ["## Per card", "", card_rows(summary), "",
            "*ratio*: oomguard's plan over the oracle's samples/s, both measured the same way in the race under the card's cap when oomguard's plan "
            "was raced (else oomguard's own steps over the oracle's race). *peak allocated*: `max_memory_allocated` over the landed plan's steps after "
            "the first; *peak reserved*: `max_memory_reserved` at the end of the last step (the cache only grows between steps). *samples/s*: median "
            "over the landed plan's steps after the first of its attempt. *(approximate)*: the plan takes a rung that changes the training "
            "(precision, 8-bit optimizer, LoRA, quantized base); the oracle's tier is the most faithful that fits, as the product's policy wants.", ""]
    if summary["skipped"]:
        out += ["## Not measured for lack of time", "", *[f"- {x}" for x in summary["skipped"]], ""]
    for error in summary["errors"]:
        out += ["## Error (the check stopped here)", "", "```", error.strip()[-3000:], "```", ""]
    out += ["## How it is measured", "",
            "- **oomguard**: oomguard's runner (`oomguard.jobs.run`: probe, memory model, planner, in-process recovery, OOM figures) in a fresh "
            "process per attempt, with its trainer swapped for a text-conditioned one (the built-in trainer trains UNet2DModel only); between "
            "attempts `doctor.decide`, as the daemon's supervisor does. A job of "
            f"{s['batch']} samples x {s['steps'] + 1} steps, probe on, the product's defaults otherwise.",
            f"- **Sweep** (uncapped): shapes {', '.join(summary['sweep']['shapes'])} at the whole batch and micro-batch {SWEEP_SMALL_MICRO_BATCH} (half the batch, then a quarter, while the whole batch runs out of memory), "
            "a warm and a measured step each.",
            f"- **Oracle**: the most faithful tier with a shape whose peak, linear between the sweep's two points, fits {FIT_MARGIN:.0%} of the card; "
            f"per shape its largest fitting micro-batch (one per number of slices), the {RACE_CANDIDATES} fastest by the sweep, plus oomguard's plan, "
            f"each built fresh and trained a warm step and {s['steps']} timed step(s) under the card's cap; a candidate that runs out of memory gives way "
            f"to the next smaller micro-batch; one the sweep predicts under {PRUNE} x a plan already measured to fit is not raced. The oracle is the "
            "fastest that fits (most faithful tier first): the best of the plans measured, not of all plans. oomguard's plan races without its "
            "allocator setting (an environment variable at process start; the race's process has none).",
            "- **Cards**: " + ("oomguard's emulated device counts the live bytes of real tensors; there is no allocator cache, so no reserved figures."
                               if s["dry_run"] else
                               "the memory fraction caps PyTorch's caching allocator only: the CUDA context and anything allocated outside "
                               "the allocator are not counted, so a real card of that size has a few hundred MiB less for the job."),
            ""]
    for c in summary["cards"]:
        og, oracle = c["oomguard"], c.get("oracle") or {}
        fraction = f", memory fraction {c['memory_fraction']:.4f}" if c.get("memory_fraction") else ""
        out += [f"### {c['card']} ({c['cap_bytes']} bytes{fraction})", ""]
        out += [f"- attempt {o['number']} (started with `[{o['started_with']}]`): {o['kind'] or 'stopped'} at step {o['step']}"
                + (f" in {o['phase']}" if o["kind"] == "oom" else "") + (f": {o['message']}" if o["kind"] not in ("finished",) and o["message"] else "")
                for o in og["outcomes"]]
        for o in og["outcomes"]:
            if o["kind"] not in ("finished", "oom") and (o.get("traceback_tail") or o.get("log_tail")):
                out += ["", f"Attempt {o['number']}'s output (end):", "", "```", (o.get("traceback_tail") or o["log_tail"])[-1500:].strip(), "```", ""]
        out += [f"- oomguard measured: {x}" for x in og["measurements"]]
        out += [f"- plan change: {x}" for x in og["plan_changes"]]
        out += [f"- doctor: {x}" for x in og["decisions"]]
        for plan, r in (oracle.get("measured") or {}).items():
            who = "oomguard's plan" if r.get("landed") else "candidate"
            predicted = (f" (predicted {_fmt(r['predicted_samples_per_s'])} samples/s, peak {fmt_bytes(r['predicted_peak_bytes'])})"
                         if r.get("predicted_samples_per_s") else "")
            out.append(f"- race, {who} `[{plan}]` (tier {r['faithfulness']}): {describe_measurement(r)}{predicted}")
            if r.get("log_tail"):
                out += ["", "```", r["log_tail"][-1500:].strip(), "```", ""]
        out.append("")
    out += ["## Sweep (uncapped)", "", "| plan | tier | peak allocated | peak reserved | samples/s | wall s |", "|---|---|---|---|---|---|"]
    for shape in summary["sweep"]["results"]:
        for r in shape["points"]:
            status = f"{_fmt(r.get('samples_per_s'))}" if r.get("fits") else (r.get("error") or f"OOM in {r.get('oom_phase')}")
            out.append(f"| `{r['plan_short']}` | {shape['tier']} | {fmt_bytes(r.get('peak_bytes'))} | {fmt_bytes(r.get('reserved_bytes'))} | {status} | "
                       f"{_fmt(r.get('wall_s'), '.1f')} |")
    out.append("")
    return "\n".join(out)


# Rough costs for the estimate printed at the start. SD 1.5 on an H200 (guesses, to be replaced
# by the first run's numbers): a process start (imports, CUDA) ~10 s; a model built on the host
# and moved ~5 s; an fp32 step of 16 samples ~1 s, ~3 s with the optimizer on the host. The
# tiny model on two CPU cores (measured here): ~8 s per process start, ~0.3 s per plan and step.
COSTS = {
    "sd15": {"start": 10.0, "build": 5.0, "step": 1.0, "offload_step": 3.0, "static_bytes": 16 * 859_520_964},
    "tiny": {"start": 8.0, "build": 0.3, "step": 0.3, "offload_step": 0.3, "static_bytes": 0},
}


def estimate(model: str, cards: list[Card], exact_shapes: int, steps: int) -> dict[str, Any]:
    """Seconds each phase should take: ~4 plans probed per card, 2 points per exact shape (2 of 5
    with offload), the race's candidates plus oomguard's plan per card. A card under the fp32
    AdamW static memory (weights, gradients, two moments) needs optimizer offload: slower steps."""
    c = COSTS[model]

    def step(card: Card) -> float:
        return c["offload_step"] if card.nbytes < 1.1 * c["static_bytes"] else c["step"]

    oomguard = sum(c["start"] + 4 * (c["build"] + 2 * step(card)) + (1 + steps) * step(card) for card in cards)
    sweep_cost = exact_shapes * 2 * (c["build"] + 2 * c["step"]) + 4 * 2 * (c["offload_step"] - c["step"])
    race_cost = sum((RACE_CANDIDATES + 1) * (c["build"] + (1 + steps) * step(card)) for card in cards)
    basis = "guessed costs for SD 1.5 on an H200" if model == "sd15" else "costs measured for the tiny model on 2 CPU cores"
    return {"oomguard": oomguard, "sweep": sweep_cost, "race": race_cost, "total": oomguard + sweep_cost + race_cost + c["start"], "basis": basis}


def machine_info(dry_run: bool) -> dict[str, Any]:
    import torch

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    gpu = total = None
    if not dry_run:
        gpu = torch.cuda.get_device_name(0)
        total = torch.cuda.get_device_properties(0).total_memory
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": gpu,
        "gpu_total_bytes": total,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": version("diffusers"),
        "bitsandbytes": version("bitsandbytes"),
        "torchao": version("torchao"),
        "peft": version("peft"),
        "load_average_at_start": os.getloadavg()[0],
    }


# ----------------------------------------------------------------------------- main


CASES = ("unet", "t2i", "multi", "offload", "allocator")


def parse_options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, tiny models and emulated cards of a few MiB (writes gpu-dry-run*.md/json)")
    parser.add_argument("--cases",
                        help="which parts run, comma-separated: unet (the SD 1.5 UNet through the runner, sweep and oracle), "
                             "t2i (text-to-image jobs through `oomguard run`), multi (a job on one and on two capped GPUs: "
                             "bench/gpu_check_multi.py), offload (oomguard's offloaded optimizer against torchao's CPUOffloadOptimizer), "
                             "allocator (the caching allocator's emulation against the card's peaks and non-PyTorch memory; its CPU half "
                             "runs without a GPU) (default: unet and t2i, and on a GPU offload, and multi where there are 2 or more GPUs)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the results go (default: bench/results)")
    parser.add_argument("--budget", type=float,
                        help=f"seconds for the whole check (default: {GPU_BUDGET_S:.0f}, {t2i.T2I_SHARE * 100:.0f}%% of it for t2i when both run; "
                             f"{DRY_RUN_BUDGET_S:.0f} + {t2i.DRY_RUN_SECONDS:.0f} for t2i with --dry-run)")
    parser.add_argument("--cards", help=f"unet: card sizes, comma-separated (default: {','.join(GPU_CARDS)}; {','.join(DRY_RUN_CARDS)} with --dry-run)")
    parser.add_argument("--batch", type=int, help=f"unet: the effective batch on every card (default: {BATCH}; {DRY_RUN_BATCH} with --dry-run)")
    parser.add_argument("--steps", type=int, help=f"unet: timed steps per plan, after a warm one (default: {STEPS}; {DRY_RUN_STEPS} with --dry-run)")
    parser.add_argument("--allow", help="unet: rungs the job allows, comma-separated (default: all of them)")
    parser.add_argument("--t2i-cards", help=f"t2i: card sizes (default: {','.join(GPU_CARDS)}; {','.join(t2i.DRY_RUN_CARDS)} with --dry-run)")
    parser.add_argument("--t2i-methods", help=f"t2i: the jobs' [model] method, comma-separated (default: {','.join(t2i.METHODS)}; "
                                             f"{','.join(t2i.DRY_RUN_METHODS)} with --dry-run)")
    parser.add_argument("--t2i-batch", type=int, help=f"t2i: the jobs' batch_size (default: {t2i.BATCH}; {t2i.DRY_RUN_BATCH} with --dry-run)")
    parser.add_argument("--t2i-steps", type=int, help=f"t2i: steps after the first (default: {t2i.STEPS}; {t2i.DRY_RUN_STEPS} with --dry-run)")
    parser.add_argument("--t2i-allow", help="t2i: the jobs' ladder.allow, comma-separated, or 'all' (default: the exact rungs)")
    parser.add_argument("--t2i-case-seconds", type=float, help=f"t2i: at most this many seconds per case (default: {t2i.CASE_CAP_S['sd15']:.0f}; "
                                                                           "the rest of the budget with --dry-run)")
    parser.add_argument("--allocator-jobs", help=f"allocator: bench/jobs/NAME.toml names, comma-separated (default: {','.join(ALLOCATOR_JOBS)})")
    parser.add_argument("--allocator-steps", type=int, help=f"allocator: steps per plan (default: {ALLOCATOR_STEPS})")
    parser.add_argument("--keep-workdirs", action="store_true", help="keep the attempts' workdirs (printed; an SD 1.5 checkpoint is 10 GB)")
    parser.add_argument("--worker-attempt", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-allocator", choices=("cuda", "cpu"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    # Without --cases: unet and t2i, and multi once main() has seen two GPUs.
    args.default_cases = args.cases is None
    args.cases = [c.strip() for c in (args.cases or "unet,t2i").split(",") if c.strip()]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown or not args.cases:
        parser.error(f"--cases: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(CASES)}")
    return args


def main() -> int:
    args = parse_options()
    if args.worker_attempt is not None:
        return attempt_worker(args.worker_attempt)
    if args.worker_measure:
        return measure_worker()
    if args.worker_allocator is not None:
        return allocator_worker(args.worker_allocator)

    import torch

    cuda = torch.cuda.is_available()
    # The allocator case alone runs without CUDA: its CPU half, and it says the card half was skipped.
    if not args.dry_run and not cuda and args.cases != ["allocator"]:
        print(NO_CUDA, file=sys.stderr)
        if "t2i" in args.cases:
            print(t2i.skipped_without_cuda(), file=sys.stderr)
        return 2
    if args.budget is not None:
        budget = args.budget
    elif args.dry_run:
        budget = ("unet" in args.cases) * DRY_RUN_BUDGET_S + ("t2i" in args.cases) * t2i.DRY_RUN_SECONDS
    else:
        budget = GPU_BUDGET_S
    # The UNet check runs first, in its share; the t2i cases get the rest (and what the UNet left).
    share = (t2i.DRY_RUN_SECONDS / (DRY_RUN_BUDGET_S + t2i.DRY_RUN_SECONDS)) if args.dry_run else t2i.T2I_SHARE
    unet_budget = budget * (1 - share) if "t2i" in args.cases else budget
    machine = machine_info(args.dry_run or not cuda)
    command = ".venv/bin/python bench/gpu_check.py " + " ".join(a if " " not in a else repr(a) for a in sys.argv[1:])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(THREAD_ENV if args.dry_run else {})}
    t2i_settings = t2i_options(args, machine, command, env) if "t2i" in args.cases else None
    if isinstance(t2i_settings, str):
        print(t2i_settings, file=sys.stderr)
        return 2
    status = 0
    if "unet" in args.cases:
        status = unet_check(args, unet_budget, machine, command, env)
        if status == 2:
            return status
    if t2i_settings is not None:
        status |= t2i.run(sys.modules[__name__], t2i_settings, budget * RACE_SHARE)
    if "multi" in args.cases or (args.default_cases and not args.dry_run and torch.cuda.device_count() >= 2):
        status |= multi_check(args, env)
    if "offload" in args.cases or (args.default_cases and not args.dry_run):
        status |= offload_check(args, machine, command)
    if "allocator" in args.cases:
        status |= allocator_check(args, machine, command, env, cuda)
    log(f"the check took {elapsed():.0f}s" + (f" of its {budget:.0f}s budget" if {"unet", "t2i"} & set(args.cases) else " (the allocator case has its workers' time limits)"))
    return status


def multi_check(args: argparse.Namespace, env: dict[str, str]) -> int:
    """The case with several GPUs (bench/gpu_check_multi.py): a job whose state does not fit one
    card, on one card and on two. Skipped, with the reason, where there are fewer than 2 GPUs."""
    script = Path(__file__).with_name("gpu_check_multi.py")
    done = subprocess.run([sys.executable, str(script), "--out", str(args.out), *(["--dry-run"] if args.dry_run else [])], env=env, timeout=3600)
    if done.returncode == 2:
        log("multi: skipped (it needs 2 or more GPUs)")
        return 0
    return done.returncode


OFFLOAD_STEPS = 3  # timed steps per optimizer, after a warm one


def offload_check(args: argparse.Namespace, machine: dict[str, Any], command: str) -> int:
    """One training step's time and peak GPU memory with oomguard's host-offloaded AdamW and
    with torchao's CPUOffloadOptimizer, on the same model from the same weights; written to
    gpu-offload.md/json (gpu-dry-run-offload.* with --dry-run)."""
    import torch
    from diffusers import UNet2DConditionModel

    from oomguard.jobs.memory_cap import HostMemory
    from oomguard.jobs.optimizers import build_optimizer
    from oomguard.strategies.plan import Plan

    config = TINY_UNET if args.dry_run else SD15_UNET
    device = torch.device("cpu" if args.dry_run else "cuda")
    torch.manual_seed(0)
    model = UNet2DConditionModel(**{k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}).to(device)
    initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    size = config["sample_size"]
    latents = torch.randn(1, 4, size, size, device=device)
    text = torch.randn(1, 77, config["cross_attention_dim"], device=device)
    timesteps = torch.tensor([500], device=device)

    def oomguard_offload() -> Any:
        return build_optimizer(Plan.initial(1).replace(offload="optimizer"), model, 1e-5, 1e-2, HostMemory())

    def torchao_offload() -> Any:
        from torchao.optim import CPUOffloadOptimizer

        return CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, fused=True, lr=1e-5, weight_decay=1e-2)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    rows: list[dict[str, Any]] = []
    for name, make in (("oomguard offload (HostOffloadedOptimizer)", oomguard_offload), ("torchao CPUOffloadOptimizer", torchao_offload)):
        if name.startswith("torchao") and device.type != "cuda":
            rows.append({"optimizer": name, "skipped": "torchao's CPUOffloadOptimizer asserts CUDA or XPU ('CPU Offload currently only supports CUDA & XPU')"})
            continue
        model.load_state_dict(initial)
        optimizer = make()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for step in range(1 + OFFLOAD_STEPS):
            sync()
            began = time.perf_counter()
            noise = model(latents, timesteps, encoder_hidden_states=text).sample
            torch.nn.functional.mse_loss(noise, latents).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - began)
        peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
        step_s = statistics.median(times[1:])
        rows.append({"optimizer": name, "step_s": step_s, "steps_per_s": 1 / step_s, "first_step_s": times[0], "peak_allocated_bytes": peak})
        log(f"offload: {name}: {step_s * 1000:.0f} ms a step (first {times[0]:.1f} s)" + (f", peak {peak / 2**30:.2f} GiB" if peak is not None else ""))
        del optimizer
    label = "tiny UNet2DConditionModel, batch 1" if args.dry_run else "SD 1.5 UNet2DConditionModel, batch 1"
    summary = {"machine": machine, "command": command, "model": label, "timed_steps": OFFLOAD_STEPS, "results": rows}
    stem = "gpu-dry-run-offload" if args.dry_run else "gpu-offload"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    lines = [f"# Optimizer offload: oomguard's against torchao's ({summary['model']})", "",
             f"Measured {machine['date']} on {machine['gpu'] or 'the CPU'}, torch {machine['torch']}: `{command}`", "",
             "| optimizer | step (median of %d) | first step | peak allocated |" % OFFLOAD_STEPS, "|---|---|---|---|"]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['optimizer']} | skipped: {row['skipped']} | | |")
        else:
            peak = f"{row['peak_allocated_bytes'] / 2**30:.2f} GiB" if row["peak_allocated_bytes"] is not None else "-"
            lines.append(f"| {row['optimizer']} | {row['step_s'] * 1000:.0f} ms | {row['first_step_s']:.1f} s | {peak} |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return 0


# ----------------------------------------------------------------------------- allocator


# The allocator case: bench jobs small enough for any card and for the CPU, each at three plans.
ALLOCATOR_JOBS = ("conv32", "attn32")
ALLOCATOR_PLANS = ("full", "half", "half+checkpointing")
ALLOCATOR_STEPS = 3  # steps per plan, each with its own peaks (the first makes the optimizer state)
# The emulated device's capacity when nothing is capped: the emulation counts and never refuses.
UNCAPPED = 2**40
# Seconds a worker may take (a process start, 6 plans of a few steps each): generous, as a
# card session's minutes are better spent on a slow result than on none.
ALLOCATOR_WORKER_TIMEOUT_S = {"cuda": 300.0, "cpu": 240.0}
NO_CUDA_DEVICE = "no CUDA device found (torch.cuda.is_available() is False)"


def allocator_plans(job: Any, expandable: bool) -> list[tuple[str, Any]]:
    """The case's plans of ``job``: the whole batch, half of it twice, half with gradient
    checkpointing; with the allocator rung's expandable segments when ``expandable``."""
    from oomguard.strategies.plan import EXPANDABLE_SEGMENTS

    start = job.initial_plan().replace(allocator=EXPANDABLE_SEGMENTS if expandable else "")
    half = max(1, start.batch_size // 2)
    plans = {"full": start.replace(micro_batch=start.batch_size), "half": start.replace(micro_batch=half),
             "half+checkpointing": start.replace(micro_batch=half, gradient_checkpointing=True)}
    return [(label, plans[label]) for label in ALLOCATOR_PLANS]


def allocator_environment(env: dict[str, str], expandable: bool) -> dict[str, str]:
    """A worker's environment: no allocator settings of the caller's, expandable segments as
    the allocator rung sets them (the variable this torch reads) when ``expandable``. Read once
    by torch when CUDA initialises, and by the emulated device when it is made."""
    from oomguard.jobs.emulated_allocator import ALLOC_CONF_VARIABLES
    from oomguard.strategies.plan import EXPANDABLE_SEGMENTS, Plan
    from oomguard.strategies.rungs.allocator import environment

    base = {k: v for k, v in env.items() if k not in ALLOC_CONF_VARIABLES}
    return environment(Plan.initial(1).replace(allocator=EXPANDABLE_SEGMENTS if expandable else ""), base)


def nvml_process_memory() -> dict[str, Any]:
    """NVML's view of the card: this process's used memory (None where NVML does not list this
    process's id, as inside some containers' pid namespaces) and every process's, with a note
    on what went wrong, if anything."""
    import torch

    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            # The card by its UUID (torch prints it without NVML's "GPU-"), else by its index.
            uuid = str(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", ""))
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid)
            except pynvml.NVMLError:
                visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)
            processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        finally:
            pynvml.nvmlShutdown()
    except Exception as error:  # noqa: BLE001 - NVML is optional: mem_get_info stands in
        return {"nvml_process_used_bytes": None, "nvml_processes": None, "nvml_note": f"NVML: {type(error).__name__}: {error}"}
    mine = [p.usedGpuMemory for p in processes if p.pid == os.getpid() and p.usedGpuMemory is not None]
    return {
        "nvml_process_used_bytes": sum(mine) if mine else None,
        "nvml_processes": [{"pid": p.pid, "used_bytes": p.usedGpuMemory} for p in processes],
        "nvml_note": None if mine else f"NVML lists {len(processes)} process(es), none with this process's id {os.getpid()} (a pid namespace?)",
    }


def card_memory() -> dict[str, Any]:
    """This process's memory on the card outside PyTorch's caching allocator, at a quiet moment
    (synchronised, nothing in flight): NVML's per-process used memory less ``memory_reserved``,
    and ``mem_get_info``'s total - free less ``memory_reserved`` (every process's memory on the
    card: this process's only when it is alone there)."""
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    nvml = nvml_process_memory()
    by_nvml = nvml["nvml_process_used_bytes"] - reserved if nvml["nvml_process_used_bytes"] is not None else None
    by_info = total - free - reserved
    alone = nvml["nvml_processes"] is not None and len(nvml["nvml_processes"]) <= 1
    if by_nvml is not None:
        method, overhead = "NVML per-process used memory - memory_reserved", by_nvml
    else:
        method = "mem_get_info total - free - memory_reserved" + ("" if alone else " (assumes no other process on the card)")
        overhead = by_info
    return {"allocated_bytes": torch.cuda.memory_allocated(), "reserved_bytes": reserved, "card_used_bytes": total - free,
            "non_pytorch_by_nvml_bytes": by_nvml, "non_pytorch_by_mem_get_info_bytes": by_info,
            "overhead_bytes": overhead, "overhead_method": method, **nvml}


def quiet_card() -> None:
    """Give back everything the last plan left: collect, free cuBLAS's workspaces (held in the
    allocator across calls) and empty the cache, so that the next plan starts from an empty
    allocator, as the emulation's fresh device does."""
    import gc

    import torch

    gc.collect()
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


def expandable_in_use() -> bool | None:
    """Whether the real allocator's segments are expandable (its snapshot says; None: unknown)."""
    import torch

    try:
        segments = torch.cuda.memory_snapshot()
    except Exception:  # noqa: BLE001 - a figure for the report, not a reason to stop
        return None
    flags = [s.get("is_expandable") for s in segments if "is_expandable" in s]
    return any(flags) if flags else None


def measure_allocator_plan(trainer: Any, job: Any, plan: Any, device: Any, steps: int) -> dict[str, Any]:
    """Build ``plan`` fresh and train ``steps`` steps, each step's peak allocated and reserved
    from oomguard's own device memory: torch.cuda's on a card (CudaMemory, uncapped), the
    caching allocator's emulation on the CPU (EmulatedMemory, divisor 1: PyTorch's own sizes)."""
    import torch

    from oomguard.jobs.attempt import Control
    from oomguard.jobs.device import DeviceSpec
    from oomguard.jobs.emulated_allocator import AllocatorEmulation
    from oomguard.jobs.memory_cap import open_device_memory
    from oomguard.jobs.sizes import CapSchedule
    from oomguard.jobs.step_oom import free
    from oomguard.jobs.training import build_training, one_step

    cuda = device.type == "cuda"
    spec = DeviceSpec() if cuda else DeviceSpec(CapSchedule(((0, UNCAPPED),)), AllocatorEmulation(divisor=1))
    memory = open_device_memory(spec, device)
    control = Control()
    per_step: list[dict[str, Any]] = []
    started = time.perf_counter()
    result: dict[str, Any] = {}
    with memory:
        result["start_allocated_bytes"] = torch.cuda.memory_allocated() if cuda else memory.emulated.allocated_bytes
        result["start_reserved_bytes"] = torch.cuda.memory_reserved() if cuda else memory.emulated.reserved_bytes
        memory.begin_step(0)
        memory.reset_peak()
        training = build_training(trainer, job, plan, device, memory)
        result["build"] = {"peak_allocated_bytes": memory.peak_bytes(), "peak_reserved_bytes": memory.peak_reserved()}
        for step in range(steps):
            memory.begin_step(step)
            memory.reset_peak()
            outcome = one_step(trainer, training, step, memory, control)
            per_step.append({"peak_allocated_bytes": memory.peak_bytes(), "peak_reserved_bytes": memory.peak_reserved(),
                             "seconds": outcome.seconds, "loss": outcome.loss})
        result["segments_expandable"] = expandable_in_use() if cuda else None
        training = None
        free(memory)
        result["reserved_after_empty_cache_bytes"] = torch.cuda.memory_reserved() if cuda else memory.emulated.reserved_bytes
    result.update(
        steps=per_step, wall_s=time.perf_counter() - started,
        peak_allocated_bytes=max(s["peak_allocated_bytes"] for s in per_step),
        peak_reserved_bytes=max(s["peak_reserved_bytes"] for s in per_step),
    )
    if not cuda:
        result["overhead_bytes"] = memory.emulated.overhead  # the emulation's figure, not a measurement
    return result


def allocator_worker(device_name: str) -> int:
    """The allocator case's half on one device: every job's plans (a JSON task on stdin), one
    ``RESULT {json}`` line per plan; on a card also ``OVERHEAD {json}`` lines, after CUDA
    initialises and after every plan at a quiet moment."""
    task = json.loads(sys.stdin.read())
    import torch

    from oomguard.jobs.emulated_allocator import expandable_segments
    from oomguard.jobs.spec import load_job_file
    from oomguard.jobs.trainers import make_trainer

    def emit(kind: str, data: dict[str, Any]) -> None:
        print(f"{kind} {json.dumps(data, default=str)}", flush=True)

    cuda = device_name == "cuda"
    if not cuda and os.environ.get("OMP_NUM_THREADS") == "1":
        torch.set_num_threads(1)
    device = torch.device(device_name)
    if cuda:
        torch.zeros(1, device=device)  # the context, and the allocator's first segment
        emit("OVERHEAD", {"moment": "after CUDA initialised (one 1-element tensor)", **card_memory()})
    for path in task["jobs"]:
        job = load_job_file(Path(path))
        trainer = make_trainer(job)
        for label, plan in allocator_plans(job, task["expandable"]):
            try:
                row = measure_allocator_plan(trainer, job, plan, device, task["steps"])
            except Exception:  # noqa: BLE001 - the other plans still measure
                row = {"error": traceback.format_exc()[-2000:]}
            row.update(job=job.name, plan=label, plan_short=plan.short(), expandable=task["expandable"],
                       expandable_setting=expandable_segments(), device=device_name)
            emit("RESULT", row)
            if cuda:
                quiet_card()
                emit("OVERHEAD", {"moment": f"after {job.name} [{plan.short()}], quiet", **card_memory()})
    return 0


def run_allocator_worker(device_name: str, task: dict[str, Any], env: dict[str, str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str | None]:
    """One worker's rows and overhead readings, and what went wrong (None: nothing)."""
    timeout = ALLOCATOR_WORKER_TIMEOUT_S[device_name]
    error = None
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker-allocator", device_name], input=json.dumps(task),
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
        stdout = done.stdout
        if done.returncode != 0:
            error = f"the {device_name} worker exited with {done.returncode}: {done.stderr[-2000:]}"
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout or ""
        stdout = out.decode(errors="replace") if isinstance(out, bytes) else out
        error = f"the {device_name} worker was stopped after {timeout:.0f} s"
    rows, overheads = [], []
    for line in stdout.splitlines():
        kind, _, data = line.partition(" ")
        if kind == "RESULT":
            rows.append(json.loads(data))
        elif kind == "OVERHEAD":
            overheads.append({**json.loads(data), "expandable": task["expandable"]})
    return rows, overheads, error


def allocator_check(args: argparse.Namespace, machine: dict[str, Any], command: str, env: dict[str, str], cuda: bool) -> int:
    """The caching allocator's emulation against the card's allocator: the same jobs and plans
    trained on the card (torch.cuda's peaks, and the process's memory outside PyTorch) and on
    the CPU under ``caching`` emulation (divisor 1), with expandable segments off and on (a
    process each: torch reads the setting when CUDA initialises). Without a card, or with
    --dry-run, the CPU half alone, and the results say why. Writes gpu-allocator.md/json
    (gpu-dry-run-allocator.md/json without the card half)."""
    from oomguard.jobs.emulated_allocator import DEFAULT_OVERHEAD

    names = [n.strip() for n in (args.allocator_jobs or ",".join(ALLOCATOR_JOBS)).split(",") if n.strip()]
    paths = [ROOT / "bench" / "jobs" / f"{name}.toml" for name in names]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"--allocator-jobs: no such job file: {', '.join(missing)}", file=sys.stderr)
        return 2
    steps = args.allocator_steps or ALLOCATOR_STEPS
    card_skipped = None if cuda and not args.dry_run else ("--dry-run was given" if cuda else NO_CUDA_DEVICE)
    if card_skipped:
        log(f"allocator: the card half was skipped: {card_skipped}; the CPU half (the emulation) runs alone")
    started = elapsed()
    emulated: list[dict[str, Any]] = []
    real: list[dict[str, Any]] = []
    overheads: list[dict[str, Any]] = []
    errors: list[str] = []
    for expandable in (False, True):
        task = {"jobs": [str(p) for p in paths], "steps": steps, "expandable": expandable}
        variant = allocator_environment(env, expandable)
        log(f"allocator: expandable segments {'on' if expandable else 'off'}: the emulation on the CPU")
        rows, _, error = run_allocator_worker("cpu", task, {**variant, **THREAD_ENV})
        emulated += rows
        errors += [error] if error else []
        if card_skipped is None:
            log(f"allocator: expandable segments {'on' if expandable else 'off'}: the card")
            rows, readings, error = run_allocator_worker("cuda", task, variant)
            real += rows
            overheads += readings
            errors += [error] if error else []
    by_key = {(r["job"], r["plan"], r["expandable"]): r for r in real}
    rows_out = []
    for row in emulated:
        card = by_key.get((row["job"], row["plan"], row["expandable"]))
        out = {"job": row["job"], "plan": row["plan"], "plan_short": row["plan_short"], "expandable": row["expandable"],
               "emulated": row, "real": card}
        for what in ("reserved", "allocated"):
            e = row.get(f"peak_{what}_bytes")
            r = card.get(f"peak_{what}_bytes") if card else None
            out[f"ratio_{what}"] = e / r if e and r else None
        rows_out.append(out)
        log(f"allocator: {row['job']} [{row['plan_short']}]: emulated {fmt_bytes(row.get('peak_allocated_bytes'))} allocated, "
            f"{fmt_bytes(row.get('peak_reserved_bytes'))} reserved" + (f"; card {fmt_bytes(card.get('peak_allocated_bytes'))} allocated, "
                                                                       f"{fmt_bytes(card.get('peak_reserved_bytes'))} reserved" if card else "")
            + (f"; ERROR {row['error'].strip().splitlines()[-1]}" if row.get("error") else ""))
    measured = [o["overhead_bytes"] for o in overheads if o.get("overhead_bytes") is not None]
    summary = {
        "command": command,
        "machine": machine,
        "settings": {"jobs": names, "plans": list(ALLOCATOR_PLANS), "steps": steps, "emulation": "caching (divisor 1)",
                     "default_overhead_bytes": DEFAULT_OVERHEAD, "dry_run": args.dry_run},
        "card": {"skipped": card_skipped} if card_skipped else {"skipped": None, "gpu": machine["gpu"]},
        "rows": rows_out,
        "overhead": {
            "default_bytes": DEFAULT_OVERHEAD,
            "measured_bytes": max(measured) if measured else None,
            "ratio_to_default": max(measured) / DEFAULT_OVERHEAD if measured else None,
            "method": overheads[-1]["overhead_method"] if overheads else None,
            "readings": overheads,
        },
        "errors": errors,
        "total_s": elapsed() - started,
    }
    stem = "gpu-allocator" if card_skipped is None else "gpu-dry-run-allocator"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (args.out / f"{stem}.md").write_text(allocator_markdown(summary))
    log(f"allocator: wrote {args.out / (stem + '.md')} and {stem}.json ({summary['total_s']:.0f} s)")
    print(allocator_rows(summary), flush=True)
    for error in errors:
        log(f"allocator: ERROR: {error}")
    return 1 if errors or any(r["emulated"].get("error") or (r["real"] or {}).get("error") for r in rows_out) else 0


def allocator_rows(summary: dict[str, Any]) -> str:
    lines = ["| job | plan | expandable | emulated allocated | emulated reserved | card allocated | card reserved | "
             "emulated / card reserved | emulated / card allocated |", "|---|---|---|---|---|---|---|---|---|"]
    skipped = summary["card"]["skipped"]
    for r in summary["rows"]:
        e, c = r["emulated"], r["real"] or {}
        card = ((f"{fmt_bytes(c.get('peak_allocated_bytes'))} | {fmt_bytes(c.get('peak_reserved_bytes'))}" if not c.get("error") else "error | error")
                if r["real"] else "skipped | skipped" if skipped else "missing | missing")
        emulated = f"{fmt_bytes(e.get('peak_allocated_bytes'))} | {fmt_bytes(e.get('peak_reserved_bytes'))}" if not e.get("error") else "error | error"
        lines.append(f"| {r['job']} | `{r['plan_short']}` | {'on' if r['expandable'] else 'off'} | {emulated} | {card} | "
                     f"{_fmt(r['ratio_reserved'], '.3f')} | {_fmt(r['ratio_allocated'], '.3f')} |")
    return "\n".join(lines)


def allocator_markdown(summary: dict[str, Any]) -> str:
    m, s, o = summary["machine"], summary["settings"], summary["overhead"]
    skipped = summary["card"]["skipped"]
    where = f"{m['gpu']} ({fmt_bytes(m['gpu_total_bytes'])}) and its host's CPU" if not skipped else f"the CPU ({m['cpus']} CPUs)"
    out = [f"# The caching allocator's emulation against a card's{' (CPU half only)' if skipped else ''}", "",
           f"Written by `bench/gpu_check.py`; rerun with `{summary['command']}`.", "",
           f"Measured {m['date']} on {where}; Python {m['python']}, torch {m['torch']} (CUDA {m['cuda']}), diffusers {m['diffusers']}; "
           f"{m['platform']}. {summary['total_s']:.0f} s.", ""]
    if skipped:
        out += [f"**The card half was skipped: {skipped}.** Only the emulation ran; the card's columns are empty and there is no measured "
                "overhead. Run it on a machine with an NVIDIA GPU for the comparison.", ""]
    out += [f"Jobs {', '.join(f'bench/jobs/{j}.toml' for j in s['jobs'])}, each at its whole batch, half of it, and half with gradient "
            f"checkpointing, {s['steps']} steps per plan, expandable segments off and on. Peaks are the largest over the steps (each step's "
            "are in the JSON, with the build's). *expandable*: `expandable_segments:True` in `PYTORCH_ALLOC_CONF`.", "",
            allocator_rows(summary), ""]
    out += ["## Memory outside PyTorch (the emulation's overhead)", ""]
    if o["measured_bytes"] is None:
        out += [f"Not measured (no card). The emulation's default: {fmt_bytes(o['default_bytes'])} (jobs/emulated_allocator.py DEFAULT_OVERHEAD).", ""]
    else:
        out += [f"Measured: **{fmt_bytes(o['measured_bytes'])}** at most ({o['measured_bytes']} bytes; {o['method']}), "
                f"{o['ratio_to_default']:.2f} x the emulation's default of {fmt_bytes(o['default_bytes'])}.", "",
                "| expandable | moment | non-PyTorch (NVML) | non-PyTorch (mem_get_info) | reserved | NVML note |", "|---|---|---|---|---|---|"]
        for r in o["readings"]:
            out.append(f"| {'on' if r['expandable'] else 'off'} | {r['moment']} | {fmt_bytes(r['non_pytorch_by_nvml_bytes'])} | "
                       f"{fmt_bytes(r['non_pytorch_by_mem_get_info_bytes'])} | {fmt_bytes(r['reserved_bytes'])} | {r['nvml_note'] or ''} |")
        out.append("")
    for error in summary["errors"]:
        out += ["## Error", "", "```", error.strip()[-3000:], "```", ""]
    for r in summary["rows"]:
        for side in ("emulated", "real"):
            if (r[side] or {}).get("error"):
                out += [f"## Error: {r['job']} `{r['plan_short']}` ({side})", "", "```", r[side]["error"].strip()[-1500:], "```", ""]
    out += ["## How it is measured", "",
            "- **card**: oomguard's `build_training` and `one_step` with the built-in trainer, uncapped (`CudaMemory`): per step "
            "`torch.cuda.max_memory_allocated` / `max_memory_reserved` after `reset_peak_memory_stats`. One process per expandable setting "
            "(`PYTORCH_ALLOC_CONF` as the allocator rung sets it: torch reads it when CUDA initialises); between plans everything is freed, "
            "cuBLAS's workspaces cleared and the cache emptied, so every plan starts from an empty allocator.",
            "- **emulated**: the same code on the CPU under `EmulatedMemory` with `AllocatorEmulation(divisor=1)` (`--emulate-allocator caching`: "
            "PyTorch's own block and segment sizes), a fresh emulated device per plan; expandable segments from the same environment variable. "
            "The ops are the CPU's: where a CUDA kernel allocates differently (cuDNN and cuBLAS workspaces, SDPA's kernels) the gap is the ops', not the allocator model's.",
            "- **overhead**: the process's card memory outside PyTorch's allocator (the CUDA context, loaded kernels, library handles) at quiet moments "
            "(synchronised, cache emptied): NVML's per-process used memory less `memory_reserved` where NVML lists this process, else "
            "`mem_get_info`'s total - free less `memory_reserved` (every process's: right when the process is alone on the card).",
            ""]
    return "\n".join(out)


def t2i_options(args: argparse.Namespace, machine: dict[str, Any], command: str, env: dict[str, str]) -> Any:
    """The t2i part's settings from the options, or the message of what is wrong with them."""
    from oomguard.strategies import rungs
    from oomguard.strategies.units import parse_size

    names = [c.strip() for c in (args.t2i_cards or ",".join(t2i.DRY_RUN_CARDS if args.dry_run else GPU_CARDS)).split(",") if c.strip()]
    cards = [Card(name, parse_size(name)) for name in names]
    too_big = [c.name for c in cards if machine["gpu_total_bytes"] and c.nbytes > machine["gpu_total_bytes"]]
    if too_big:
        return f"t2i cards larger than the GPU ({fmt_bytes(machine['gpu_total_bytes'])}): {', '.join(too_big)}"
    methods = args.t2i_methods or ",".join(t2i.DRY_RUN_METHODS if args.dry_run else t2i.METHODS)
    unknown = [m for m in methods.split(",") if m.strip() and m.strip() not in t2i.METHODS]
    if unknown:
        return f"--t2i-methods: unknown {', '.join(unknown)}; choose from {', '.join(t2i.METHODS)}"
    if args.t2i_allow == "all":
        allow = list(rungs.names())
    else:
        allow = [a.strip() for a in args.t2i_allow.split(",")] if args.t2i_allow else list(rungs.exact_names())
    return t2i.Settings(
        dry_run=args.dry_run, cards=cards, methods=[m.strip() for m in methods.split(",") if m.strip()],
        batch=args.t2i_batch or (t2i.DRY_RUN_BATCH if args.dry_run else t2i.BATCH),
        steps=args.t2i_steps or (t2i.DRY_RUN_STEPS if args.dry_run else t2i.STEPS),
        allow=allow, case_seconds=args.t2i_case_seconds, keep_workdirs=args.keep_workdirs, out=args.out,
        stem="gpu-dry-run-t2i" if args.dry_run else "gpu-t2i", command=command, machine=machine, env=env,
        unet_config={k: list(v) if isinstance(v, tuple) else v for k, v in SD15_UNET.items()},
    )


def unet_check(args: argparse.Namespace, budget: float, machine: dict[str, Any], command: str, env: dict[str, str]) -> int:
    # Over 60 lines: the check's sequence, read top to bottom.
    """The SD 1.5 UNet through oomguard's runner, the sweep and the oracle, within ``budget``
    seconds from the check's start; writes gpu.md/json (gpu-dry-run.md/json); 1 on an error."""
    from oomguard.strategies.units import parse_size
    from oomguard.strategies import rungs
    from oomguard.strategies.plan import Plan
    from oomguard.strategies.planner import faithfulness

    model = "tiny" if args.dry_run else "sd15"
    args.batch = args.batch or (DRY_RUN_BATCH if args.dry_run else BATCH)
    args.steps = args.steps or (DRY_RUN_STEPS if args.dry_run else STEPS)
    card_names = [c.strip() for c in (args.cards or ",".join(DRY_RUN_CARDS if args.dry_run else GPU_CARDS)).split(",") if c.strip()]
    cards = [Card(name, parse_size(name)) for name in card_names]
    allow = tuple(a.strip() for a in args.allow.split(",")) if args.allow else rungs.names()
    job = make_job(model, args.batch, args.steps, allow)
    start = job.initial_plan()
    reps = representative_micro_batches(start)
    if not args.dry_run:
        too_big = [c.name for c in cards if c.nbytes > machine["gpu_total_bytes"]]
        if too_big:
            print(f"cards larger than the GPU ({fmt_bytes(machine['gpu_total_bytes'])}): {', '.join(too_big)}", file=sys.stderr)
            return 2
    threads = 1 if args.dry_run else None
    stem = "gpu-dry-run" if args.dry_run else "gpu"

    where = machine["gpu"] or "the CPU (dry run: emulated device memory)"
    log(f"{MODELS[model]['label']}; batch {args.batch}; cards {', '.join(c.label for c in cards)} on {where}"
        + (f", {fmt_bytes(machine['gpu_total_bytes'])}" if machine["gpu_total_bytes"] else ""))
    shapes = make_shapes(job, EXACT_SHAPES)
    cost = estimate(model, cards, len(shapes), args.steps)
    log(f"estimate: ~{cost['total']:.0f}s: oomguard ~{cost['oomguard']:.0f}s, sweep ~{cost['sweep']:.0f}s, oracle races ~{cost['race']:.0f}s "
        f"({cost['basis']}); budget {budget:.0f}s: phases end at {OOMGUARD_SHARE * budget:.0f}s (oomguard), {SWEEP_SHARE * budget:.0f}s "
        f"(sweep), {RACE_SHARE * budget:.0f}s (oracle races); what does not fit is skipped and listed")

    scratch = Path(tempfile.mkdtemp(prefix="oomguard-gpu-check-"))
    worker = MeasureWorker(env, scratch / "measure.log")
    worker.start()  # its imports overlap the first attempt
    measurer = Measurer(worker, job, model, args.steps)
    cards_out: list[dict[str, Any]] = []
    errors: list[str] = []
    try:
        # 1. oomguard on every card.
        phase_end = budget * OOMGUARD_SHARE
        for i, card in enumerate(cards):
            # A card may run into the next cards' shares, as long as each keeps 3/4 of its own.
            deadline = phase_end - (len(cards) - i - 1) * CARD_RESERVE * phase_end / len(cards)
            log(f"oomguard on {card.label} (until {deadline:.0f}s)")
            workdir = scratch / f"card-{card.name}"
            workdir.mkdir()
            result = run_oomguard(job, card, model, workdir, env, deadline, threads)
            if not args.keep_workdirs:
                shutil.rmtree(workdir, ignore_errors=True)  # an SD 1.5 checkpoint is 10 GB
            log(f"{card.label}: {result['state']} on [{result['landed_plan']}] with {result['ooms']} OOMs in {result['attempts']} attempt(s), "
                f"{_fmt(result['samples_per_s'])} samples/s, peak {fmt_bytes(result['peak_allocated_bytes'])} allocated, "
                f"{fmt_bytes(result['peak_reserved_bytes'])} reserved ({result['wall_s']:.0f}s)")
            fraction = card.nbytes / machine["gpu_total_bytes"] if machine["gpu_total_bytes"] else None
            cards_out.append({"card": card.label, "cap_bytes": card.nbytes, "memory_fraction": fraction, "oomguard": result})

        # 2. The sweep, uncapped: the exact shapes, and approximate tiers a card needs.
        log(f"sweep, uncapped (until {budget * SWEEP_SHARE:.0f}s)")
        in_time = sweep(measurer, shapes, budget * SWEEP_SHARE)
        extra = make_shapes(job, APPROXIMATE_SHAPES)
        for tier in sorted({s.tier for s in extra}):
            if not in_time or all(fits_somewhere(shapes, c.nbytes, reps) for c in cards):
                break
            tier_shapes = [s for s in extra if s.tier == tier]
            log(f"a card has no swept shape that fits: sweeping tier {tier} ({', '.join(s.name for s in tier_shapes)})")
            shapes += tier_shapes
            in_time = sweep(measurer, tier_shapes, budget * SWEEP_SHARE)

        # 3. The oracle, per card, under its cap.
        race_start = elapsed()
        for i, (card, out) in enumerate(zip(cards, cards_out)):
            deadline = race_start + (budget * RACE_SHARE - race_start) * (i + 1) / len(cards)
            log(f"oracle for {card.label} (until {deadline:.0f}s)")
            og = out["oomguard"]
            landed = og["landed"] if og["state"] == "finished" else None
            oracle = race(measurer, card, shapes, reps, landed, start, deadline)
            out["oracle"] = oracle
            landed_race = oracle.get("landed_race") or {}
            landed_rate = landed_race.get("samples_per_s") if landed_race.get("fits") else None
            out["ratio_source"] = "race" if landed_rate else "oomguard's own steps"
            rate = landed_rate or og.get("samples_per_s")
            if landed is None:
                rate = None
            out["ratio"] = rate / oracle["oracle_samples_per_s"] if rate and oracle.get("oracle_samples_per_s") else None
            if landed is not None:
                out["landed_faithfulness"] = faithfulness(start, Plan.from_dict(landed))
            log(f"{card.label}: oracle [{oracle.get('oracle_plan')}] {_fmt(oracle.get('oracle_samples_per_s'))} samples/s; "
                f"oomguard [{og['landed_plan']}] {_fmt(rate)}: ratio {_fmt(out['ratio'])}")
    except Exception:  # noqa: BLE001 - a GPU session's few minutes: keep what was measured
        errors.append(traceback.format_exc())
        log(f"ERROR, writing what was measured so far:\n{errors[-1]}")
    finally:
        worker.close()
        if args.keep_workdirs:
            log(f"workdirs kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)

    total = elapsed()
    machine["load_average_at_end"] = os.getloadavg()[0]
    summary = {
        "command": command,
        "machine": machine,
        "settings": {"dry_run": args.dry_run, "model": model, "model_label": MODELS[model]["label"], "unet_config": MODELS[model]["unet"],
                     "batch": args.batch, "steps": args.steps, "budget_s": budget, "cards": [c.label for c in cards],
                     "allow": list(allow), "fit_margin": FIT_MARGIN, "race_candidates": RACE_CANDIDATES},
        "total_s": total,
        "errors": errors,
        "skipped": measurer.skipped,
        "cards": cards_out,
        "sweep": {
            "shapes": [s.name for s in shapes],
            "results": [{"shape": s.name, "tier": s.tier, "points": [{**r, "plan_short": s.plan(mb).short(), "micro_batch": mb}
                                                                      for mb, r in sorted(s.points.items(), reverse=True)]} for s in shapes],
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(summary))
    log(f"wrote {args.out / (stem + '.md')} and {stem}.json; total {total:.0f}s of {budget:.0f}s")
    print(card_rows(summary), flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
