#!/usr/bin/env python
"""The ladder benchmark: which plan oomguard lands on under a memory cap, how many OOMs it
takes to get there, and how fast that plan trains compared with the best plan there is.

For every job in bench/jobs/ (unconditional ones in bench/jobs/*.toml; text-to-image ones, LoRA
and full, over tiny SD 1.x and SDXL pipelines, in bench/jobs/text_to_image/, see t2i_jobs.py)
and a few emulated device capacities derived from that job's own measurements:

1. Sweep. Every plan the job's ``ladder.allow`` can reach (``planner.candidate_plans``) is
   built fresh and trained for a warm step plus a measured one under an emulated device that
   counts bytes but never refuses: its peak over both (the first step is where the optimizer
   state appears) and a first estimate of its speed. The exact tier is swept whole; an
   approximate tier only as far as a cap needs it.
2. oomguard: the real CLI in a subprocess, ``oomguard run JOB --emulate-device-memory CAP
   --json``, with the product's defaults (probe on, in-process recovery on). From its JSON:
   the plan it ended on, the OOMs it took (every OOM, in the probe, recovered inside the
   process or ending an attempt, is one measurement with ``fits: false``), attempts, time.
3. accelerate: ``accelerate.utils.find_executable_batch_size`` starting at the job's batch,
   around a function that builds the model and trains at micro-batch == batch (no gradient
   accumulation, as it is used) under the same emulated cap.
4. Race. The oracle at a cap is the plan the product's policy wants when it knows
   everything: the most faithful tier first (``planner.faithfulness``: a plan with exact rungs
   only beats any approximate one), then the fastest plan of that tier whose peak fits. The
   sweep's fastest few fitting plans, oomguard's plan and accelerate's batch are then trained
   side by side in one process under the cap (which also checks that they fit), a step of
   each in turn, and speeds are compared from that race, so machine noise hits all alike.

Speeds are samples per CPU second of a one-thread process: work done, not how busy the
machine was. For jobs with frozen parts (text-to-image), the report also gives the frozen parts'
bytes and what each frozen-part rung saved in the sweep (frozen_savings.py). Results:
bench/results/ladder.md, ladder.json and ladder.png; a run of some jobs only (``--jobs 't2i-*'``,
or job files given) writes ladder-<selection>.md and so on, and leaves the whole set's alone.

Run it with ``make bench`` (or ``.venv/bin/python bench/ladder.py``; ``--help`` for options).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import json
import multiprocessing
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import allocator_pairs
import command_pairs
import contention_pairs
import frozen_savings
import graded_pairs
import multi_gpu_pairs
import t2i_jobs

# One thread per process, here and in every process started from here (workers, the CLI and
# its runner): CPU time then measures the work, and two processes share two cores.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
os.environ.update(THREAD_ENV)
# The text-to-image jobs' pipelines are local folders: a download attempt (nothing can be
# reached from a bench machine) fails at once instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
JOBS_DIR = ROOT / "bench" / "jobs"
RESULTS_DIR = ROOT / "bench" / "results"
MiB = 2**20
STARTED = time.monotonic()

# Caps, as fractions of the peak of the job's own plan (the whole batch at once): with
# headroom, then tighter and tighter. Fractions below TIGHT x the lowest exact peak give way to
# that one tight cap; a cap within MIN_GAP of a larger one is dropped.
CAP_FRACTIONS = (1.10, 0.70, 0.45, 0.25)
TIGHT = 1.05
MIN_GAP = 0.05
# For jobs that allow approximate rungs: a cap under every exact plan.
BELOW_EXACT = 0.85
# Oracle candidates raced per pair: the fastest fitting plans of the sweep, and the largest
# fitting micro-batch of every shape, at most this many.
RACE_CANDIDATES = 3
# On this CPU setup a plan with optimizer offload runs torch's fused AdamW on the "host" outside
# the emulator's accounting, which makes it faster than the same plan without offload (on a GPU
# the copies would make it slower). So the fastest fitting plans without offload are raced too
# (at most this many), and the fraction against them is reported as a diagnostic.
RACE_CANDIDATES_NO_OFFLOAD = 2
# An emulated device that counts and never refuses.
UNLIMITED = 2**40
TARGET_FRACTION = 0.95


def log(text: str) -> None:
    print(f"[{time.monotonic() - STARTED:6.1f}s] {text}", flush=True)


# ----------------------------------------------------------------------------- workers
# These run in the pool's processes (spawned, one thread each).

_SPECS: dict[tuple[str, int | None], Any] = {}


def _init_worker() -> None:
    # Nothing here turns diffusers' optional integrations off (jobs/run.py does, for the
    # unconditional trainer only, to start faster): the text-to-image trainer loads its text
    # encoders through transformers and its LoRA through diffusers' peft integration.
    import torch

    torch.set_num_threads(1)


def _spec(path: str, batch_size: int | None = None) -> Any:
    """The job spec (with another batch size, for accelerate), read once per worker."""
    if (path, batch_size) not in _SPECS:
        from oomguard.jobs.spec import load_job_file

        job = load_job_file(path)
        if batch_size is not None:
            job = job.replace(train=dataclasses.replace(job.train, batch_size=batch_size))
        _SPECS[path, batch_size] = job
    return _SPECS[path, batch_size]


def _job(path: str, batch_size: int | None = None) -> tuple[Any, Any]:
    """The job spec and a fresh trainer for it from the registry, as a runner makes one: a
    text-to-image trainer holds the frozen parts, which rungs may move, cast or replace by
    caches, so no two builds share one."""
    from oomguard.jobs.trainers import make_trainer

    job = _spec(path, batch_size)
    return job, make_trainer(job)


def _timed_step(trainer: Any, training: Any, step: int, memory: Any, control: Any) -> tuple[float, float]:
    """One optimizer step; (samples per CPU second, samples per wall second)."""
    from oomguard.jobs.training import one_step

    cpu = time.process_time()
    result = one_step(trainer, training, step, memory, control)
    cpu = time.process_time() - cpu
    batch = training.plan.batch_size
    return batch / max(cpu, 1e-9), batch / result.seconds


def _open_memory(cap: int, allocator: str | None, plan: Any = None) -> Any:
    """An emulated device of ``cap`` bytes: exact bytes (``allocator`` None) or the caching
    allocator's emulation (``"caching/1024"``), with expandable segments where ``plan``'s
    allocator setting asks for them (the allocator rung; the emulation reads the variable when
    the device is made, as torch does when CUDA initialises)."""
    import torch

    from oomguard.jobs.device import DeviceSpec
    from oomguard.jobs.emulated_allocator import ALLOC_CONF_VARIABLES, AllocatorEmulation
    from oomguard.jobs.memory_cap import open_device_memory
    from oomguard.jobs.sizes import CapSchedule

    spec = DeviceSpec(CapSchedule(((0, cap),)), AllocatorEmulation.parse(allocator) if allocator else None)
    saved = {name: os.environ.pop(name, None) for name in ALLOC_CONF_VARIABLES}
    try:
        if plan is not None and plan.allocator:
            os.environ[ALLOC_CONF_VARIABLES[0]] = plan.allocator
        return open_device_memory(spec, torch.device("cpu"))
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def _exact_peak(memory: Any) -> int:
    """The live bytes' peak: what the exact emulation counts (the device with the caching
    allocator counts them too)."""
    return memory.emulated.peak_bytes


def sweep_task(job_path: str, plan: Any, steps: int, allocator: str | None = None) -> dict[str, Any]:
    """Build ``plan`` fresh, train a warm step plus ``steps`` measured ones without a cap.
    Under the caching allocator's emulation (``allocator``) the live bytes are counted as by
    the exact one, and what the allocator reserved (and allocated, its rounded blocks) is
    recorded beside them."""
    import torch

    from oomguard.jobs.attempt import Control
    from oomguard.jobs.training import build_training
    from oomguard.jobs.step_oom import free

    job, trainer = _job(job_path)
    memory = _open_memory(UNLIMITED, allocator, plan)
    control = Control()
    peaks: list[int] = []
    reserved: list[int] = []
    allocated: list[int] = []
    rates: list[float] = []
    training = None
    try:
        with memory:
            training = build_training(trainer, job, plan, torch.device("cpu"), memory)
            build_peaks = (_exact_peak(memory), memory.peak_reserved(), memory.peak_bytes())
            for step in range(1 + steps):
                memory.reset_peak()
                cpu_rate, _ = _timed_step(trainer, training, step, memory, control)
                peaks.append(_exact_peak(memory))
                reserved.append(memory.peak_reserved() or 0)
                allocated.append(memory.peak_bytes() or 0)
                if step > 0:
                    rates.append(cpu_rate)
            # After the steps: the optimizer state exists, and a rung that replaces a frozen
            # part by a cache has done so.
            static = training.static_bytes()
    finally:
        training = None
        free(memory)
    result = {
        "plan": plan,
        "peak_bytes": max(build_peaks[0], *peaks),
        "first_step_peak_bytes": peaks[0],
        "steady_peak_bytes": max(peaks[1:]) if len(peaks) > 1 else None,
        "rates": rates,
        # Bytes on the device by static consumer (parameters, optimizer state, frozen parts).
        "static_bytes": static,
    }
    if allocator:
        result.update({
            "allocator": allocator,
            # torch.cuda.max_memory_reserved and max_memory_allocated over the build and all steps.
            "reserved_peak_bytes": max(build_peaks[1] or 0, *reserved),
            "allocated_peak_bytes": max(build_peaks[2] or 0, *allocated),
            "first_step_reserved_peak_bytes": reserved[0],
            "steady_reserved_peak_bytes": max(reserved[1:]) if len(reserved) > 1 else None,
        })
    return result


def race_task(job_path: str, cap: int, arms: list[tuple[str, int, Any]], rounds: int, allocator: str | None = None) -> dict[str, dict[str, Any]]:
    """Train every arm ``(label, batch_size, plan)`` under the emulated ``cap``, each with its
    own model and device counter, a step of each in turn (a warm round, then ``rounds``
    measured ones, the order rotating). Per arm: samples/s per round, peak, or the OOM. Under
    ``allocator`` (the caching allocator's emulation) each arm has its own allocator, with
    expandable segments where its plan's allocator setting asks for them."""
    import torch

    from oomguard.jobs.attempt import Control
    from oomguard.jobs.training import build_training
    from oomguard.jobs.step_oom import free

    device = torch.device("cpu")
    state: list[dict[str, Any]] = []
    for label, batch_size, plan in arms:
        job, trainer = _job(job_path, batch_size)
        memory = _open_memory(cap, allocator, plan)
        entry = {"label": label, "trainer": trainer, "memory": memory, "control": Control(), "training": None,
                 "rates": [], "wall_rates": [], "oom": None}
        try:
            with memory:
                entry["training"] = build_training(trainer, job, plan, device, memory)
        except torch.OutOfMemoryError:
            entry["oom"] = "setup"
        state.append(entry)
    order = list(range(len(state)))
    for round_ in range(1 + rounds):
        shift = round_ % len(order)
        sequence = order[shift:] + order[:shift]
        if round_ % 2:
            sequence.reverse()
        for i in sequence:
            entry = state[i]
            if entry["oom"] is not None:
                continue
            try:
                with entry["memory"]:
                    cpu_rate, wall_rate = _timed_step(entry["trainer"], entry["training"], round_, entry["memory"], entry["control"])
            except torch.OutOfMemoryError:
                entry["oom"] = f"step {round_} ({entry['control'].phase})"
                entry["training"].optimizer.zero_grad(set_to_none=True)
                continue
            if round_ > 0:
                entry["rates"].append(cpu_rate)
                entry["wall_rates"].append(wall_rate)
    results = {
        e["label"]: {"rates": e["rates"], "wall_rates": e["wall_rates"], "oom": e["oom"],
                     "peak_bytes": _exact_peak(e["memory"]), "reserved_peak_bytes": e["memory"].peak_reserved()}
        for e in state
    }
    memories = [e["memory"] for e in state]
    state.clear()
    for memory in memories:
        free(memory)
    return results


def accelerate_task(job_path: str, cap: int, steps: int, allocator: str | None = None) -> dict[str, Any]:
    """accelerate's find_executable_batch_size on the job under ``cap``, around a function that
    builds the model and trains a warm step plus ``steps`` more at micro-batch == batch (no
    gradient accumulation), as accelerate's examples use it."""
    import torch
    from accelerate.utils import find_executable_batch_size
    from accelerate.utils.memory import should_reduce_batch_size

    from oomguard.jobs.attempt import Control
    from oomguard.jobs.training import build_training
    from oomguard.jobs.step_oom import free
    from oomguard.strategies.plan import Plan

    start_batch = _spec(job_path).train.batch_size
    device = torch.device("cpu")
    ooms: list[dict[str, Any]] = []
    recognised: list[bool] = []

    @find_executable_batch_size(starting_batch_size=start_batch)
    def train(batch_size: int) -> tuple[int, list[float]]:
        job, trainer = _job(job_path, batch_size)
        memory = _open_memory(cap, allocator)
        control = Control()
        training = None
        step = 0
        try:
            with memory:
                training = build_training(trainer, job, Plan.initial(batch_size), device, memory)
                rates = []
                for step in range(1 + steps):
                    _, wall_rate = _timed_step(trainer, training, step, memory, control)
                    if step > 0:
                        rates.append(wall_rate)
                return batch_size, rates
        except torch.OutOfMemoryError as error:
            ooms.append({"batch_size": batch_size, "step": step, "phase": control.phase})
            recognised.append(should_reduce_batch_size(error))
            raise
        finally:
            training = None
            free(memory)

    started = time.perf_counter()
    try:
        landed, rates = train()
        error = None
    except RuntimeError as failure:  # "No executable batch size found, reached zero."
        landed, rates, error = None, [], str(failure)
    return {
        "batch_size": landed,
        "kept_batch": landed == start_batch,
        "ooms": len(ooms),
        "oom_details": ooms,
        "oom_recognised_by_accelerate": all(recognised) if recognised else None,
        "run_samples_per_s": statistics.median(rates) if rates else None,
        "wall_s": time.perf_counter() - started,
        "error": error,
    }


def oomguard_task(job_path: str, cap: int, workdir: str, timeout: float, allocator: str | None = None) -> dict[str, Any]:
    # Over 60 lines: one CLI run and the reading of its JSON, kept side by side.
    """The real CLI on the job under ``cap``, with the product's defaults (and
    ``--emulate-allocator ALLOCATOR`` where one is given)."""
    from oomguard.strategies.plan import Plan

    command = [str(Path(sys.executable).with_name("oomguard")), "run", job_path, "--workdir", workdir,
               "--emulate-device-memory", str(cap), *(["--emulate-allocator", allocator] if allocator else []), "--json"]
    # oomguard's own settings from this environment would change the run: left out.
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOMGUARD_") and k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    started = time.monotonic()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env={**env, **THREAD_ENV}, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        return {"command": command, "error": f"timed out after {timeout:.0f}s", "stderr": str(expired.stderr or "")[-2000:]}
    wall = time.monotonic() - started
    try:
        record = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"command": command, "rc": proc.returncode, "wall_s": wall, "error": f"exit code {proc.returncode}, no JSON on stdout",
                "stdout": proc.stdout[-2000:], "stderr": proc.stderr[-4000:]}

    attempts = record.get("attempts") or []
    ooms: list[dict[str, Any]] = []
    measured: list[str] = []
    reserved_peaks: list[int] = []
    in_process = attempt_ending = 0
    reasons: list[str] = []
    for attempt in attempts:
        outcome = attempt.get("outcome") or {}
        for m in outcome.get("measurements") or []:
            speed = f", {m['samples_per_s']:.1f} samples/s" if m.get("samples_per_s") else ""
            reserved = f", reserved {m['reserved_bytes'] / MiB:.1f} MiB" if m.get("reserved_bytes") else ""
            if m.get("fits") and m.get("reserved_bytes"):
                reserved_peaks.append(m["reserved_bytes"])
            measured.append(f"attempt {attempt['number']}: [{Plan.from_dict(m['plan']).short()}] "
                            + (f"peak {m['peak_bytes'] / MiB:.1f} MiB{reserved}{speed}" if m.get("fits")
                               else f"OOM (needed > {m['peak_bytes'] / MiB:.1f} MiB{reserved})"))
            if not m.get("fits"):
                ooms.append({
                    "attempt": attempt["number"],
                    "plan": Plan.from_dict(m["plan"]).short(),
                    "step": m.get("step"),
                    "needed_at_least_mib": round(m["peak_bytes"] / MiB, 1),
                    "capacity_mib": round(m["capacity"] / MiB, 1) if m.get("capacity") else None,
                })
        for recovery in outcome.get("recoveries") or []:
            reasons.append(f"attempt {attempt['number']}, step {recovery.get('step')}: {recovery.get('reason')}")
            if not str(recovery.get("reason", "")).startswith("probe"):
                in_process += 1
        if outcome.get("kind") == "oom":
            attempt_ending += 1
    last = attempts[-1] if attempts else None
    landed = None
    if last is not None:
        plan_dict = (last.get("outcome") or {}).get("plan") or last.get("plan")
        landed = Plan.from_dict(plan_dict) if plan_dict else None
    run_rates: list[float] = []
    if last is not None and landed is not None:
        metrics = Path(last["directory"]) / "metrics.jsonl"
        if metrics.exists():
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            # The first step of an attempt creates the optimizer state: not steady.
            run_rates = [r["samples_per_s"] for r in rows[1:] if r.get("plan") == landed.short()]
    finished = record.get("state") == "finished"
    return {
        "command": " ".join(command),
        "rc": proc.returncode,
        "wall_s": wall,
        "state": record.get("state"),
        "finished": finished,
        "attempts": len(attempts),
        "landed": landed,
        "ooms": len(ooms),
        # The planner's first choice fits: the plan it chose from the probe's measurements
        # trained to the end without an OOM (none recovered in the process, none ending an
        # attempt; the probe's own OOMs are its measurements).
        "first_choice_fits": finished and in_process == 0 and attempt_ending == 0,
        "allocator_rung": bool(landed is not None and landed.allocator),
        "reserved_peak_mib": round(max(reserved_peaks) / MiB, 2) if reserved_peaks else None,
        "oom_details": ooms,
        # In-process OOMs are followed by one recovery each, attempt-ending ones end an
        # attempt; the rest happened in the probe.
        "ooms_in_process": in_process,
        "ooms_ending_attempts": attempt_ending,
        "ooms_in_probe": len(ooms) - in_process - attempt_ending,
        "reasons": reasons,
        "measurements": measured,
        "events": [f"{e.get('kind')}: {e.get('message')}" for e in record.get("events") or []],
        "run_samples_per_s": statistics.median(run_rates) if run_rates else None,
        "stderr": proc.stderr[-2000:] if proc.returncode not in (0, 1) else "",
    }


# ----------------------------------------------------------------------------- the bench


@dataclasses.dataclass(frozen=True)
class Emulation:
    """How the emulated device allocates: ``allocator`` None counts the live bytes of tensors
    (exact); else the --emulate-allocator value of the caching allocator's emulation, whose
    figure for caps, oracles and fits is the peak *reserved* memory."""

    name: str
    allocator: str | None

    @property
    def figure(self) -> str:
        return "reserved_peak_bytes" if self.allocator else "peak_bytes"

    @property
    def slug(self) -> str:
        return "exact" if self.allocator is None else "caching"


EXACT = Emulation("exact", None)
# The bench's models are about a thousandth of a real one, their caps MiB where cards have GiB:
# the allocator's sizes (rounding, segments, pages) divided by 1024 weigh as on a card.
CACHING = Emulation("caching/1024", "caching/1024")
EMULATIONS = {"exact": (EXACT,), "caching/1024": (CACHING,), "both": (EXACT, CACHING)}


@dataclasses.dataclass
class Job:
    name: str
    path: str
    spec: Any
    start: Any  # the job's own plan
    candidates: list[Any]
    tiers: dict[int, list[Any]]  # faithfulness -> the plans of that tier the sweep may measure
    # Sweep results by plan; shared between job files that train the same thing and differ
    # only in their ladder, and between the emulations (a sweep under the caching allocator's
    # emulation records the exact bytes too).
    results: dict[Any, dict[str, Any]]
    # Whose figures peak() answers: the exact peak or, under the caching emulation, the reserved one.
    emulation: Emulation = EXACT

    def key(self, plan: Any) -> Any:
        """The plan as this emulation trains it: under the caching allocator's emulation the
        allocator setting (expandable segments) changes what is reserved, so it is kept."""
        return plan if self.emulation.allocator else key(plan)

    def peak(self, plan: Any) -> int | None:
        result = self.results.get(self.key(plan))
        return result.get(self.emulation.figure) if result else None

    def sweep_rate(self, plan: Any) -> float:
        return statistics.median(self.results[key(plan)]["rates"])

    def shapes(self, tier: int) -> dict[Any, list[Any]]:
        """The tier's plans by shape, smallest micro-batch first."""
        by_shape: dict[Any, list[Any]] = {}
        for plan in sorted(self.tiers[tier], key=lambda p: p.micro_batch):
            by_shape.setdefault(shape(plan), []).append(plan)
        return by_shape

    def floor(self, tier: int) -> list[Any]:
        """Each shape's smallest micro-batch: the tier's lowest peaks are among these."""
        return [plans[0] for plans in self.shapes(tier).values()]


def key(plan: Any) -> Any:
    """Plans that train alike on the emulated device (the allocator setting is for CUDA's
    caching allocator only)."""
    return plan.replace(allocator="")


def shape(plan: Any) -> Any:
    return plan.replace(micro_batch=1, allocator="")


def sweep_plans(candidates: list[Any], all_micro_batches: bool) -> list[Any]:
    """The plans to sweep. For one shape (every knob but the micro-batch), plans with the same
    number of slices do the same work in as many passes, and the most even split has the
    smallest largest slice, hence the lowest peak: batch 16 as [8, 8] fits wherever [9, 7] ..
    [15, 1] do. So per shape and slice count only that micro-batch is swept, unless
    ``all_micro_batches`` (a plan oomguard lands on is raced all the same)."""
    if all_micro_batches:
        return [key(p) for p in candidates]
    chosen: dict[tuple[Any, int], Any] = {}
    for plan in candidates:
        slot = (shape(plan), plan.grad_accum)
        if slot not in chosen or plan.micro_batch < chosen[slot].micro_batch:
            chosen[slot] = key(plan)
    return list(chosen.values())


def load_jobs(paths: list[Path], all_micro_batches: bool) -> list[Job]:
    from oomguard.jobs.spec import load_job_file
    from oomguard.strategies import planner

    jobs = []
    shared: dict[str, dict[Any, dict[str, Any]]] = {}
    for path in paths:
        spec = load_job_file(path)
        start = spec.initial_plan()
        # The policy's allow, as the doctor reads it: ladder.allow less the rungs whose needs
        # the job does not offer (JobSpec.features: LoRA on a LoRA job, frozen-part rungs on
        # a job without frozen parts).
        candidates = planner.candidate_plans(start, spec.policy().allow)
        tiers: dict[int, list[Any]] = {}
        for plan in sweep_plans(candidates, all_micro_batches):
            tiers.setdefault(planner.faithfulness(start, plan), []).append(plan)
        trains = json.dumps([spec.trainer, spec.data.to_dict(), spec.model.to_dict(), spec.train.to_dict()], sort_keys=True)
        jobs.append(Job(spec.name, str(path.resolve()), spec, start, candidates, tiers, shared.setdefault(trains, {})))
    return jobs


class Pool:
    """Worker processes; each result arrives with a progress line."""

    def __init__(self, workers: int) -> None:
        self.executor = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker)

    def run(self, label: str, tasks: list[tuple[Callable[..., Any], tuple[Any, ...]]], describe: Callable[[int, Any], str]) -> list[Any]:
        futures: list[Future[Any]] = [self.executor.submit(fn, *args) for fn, args in tasks]
        index = {id(f): i for i, f in enumerate(futures)}
        results: list[Any] = [None] * len(futures)
        for done, future in enumerate(as_completed(futures), start=1):
            i = index[id(future)]
            results[i] = future.result()
            log(f"{label} {done}/{len(futures)}: {describe(i, results[i])}")
        return results

    def close(self) -> None:
        self.executor.shutdown(cancel_futures=True)


def sweep(pool: Pool, steps: int, work: Iterable[tuple[Job, Any]], label: str, allocator: str | None = None) -> None:
    """Measure the plans not measured yet (once per set of shared results), under the caching
    allocator's emulation where ``allocator`` names it (then both the exact and the reserved
    peaks are recorded)."""
    todo: dict[tuple[int, Any], tuple[Job, Any]] = {}
    for job, plan in work:
        if key(plan) not in job.results:
            todo.setdefault((id(job.results), key(plan)), (job, key(plan)))
    work = list(todo.values())
    if not work:
        return
    tasks = [(sweep_task, (job.path, plan, steps, allocator)) for job, plan in work]

    def describe(i: int, r: dict[str, Any]) -> str:
        reserved = f" (reserved {r['reserved_peak_bytes'] / MiB:.1f})" if r.get("reserved_peak_bytes") is not None else ""
        return (f"{work[i][0].name} [{r['plan'].short()}] peak {r['peak_bytes'] / MiB:.1f} MiB{reserved}, "
                f"~{statistics.median(r['rates']):.1f} samples/s")

    for (job, plan), result in zip(work, pool.run(label, tasks, describe)):
        job.results[key(plan)] = result


def derive_caps(job: Job) -> list[dict[str, Any]]:
    """Caps from the job's own sweep, so that the answers differ: the whole batch fits with
    headroom; smaller micro-batches, checkpointing and the like are needed; tight."""
    full = job.peak(job.start)
    lowest = min(job.peak(p) for p in job.tiers[0])
    wanted = [(f * full, f"{f:.2f} x full-batch peak") for f in CAP_FRACTIONS if f * full >= TIGHT * lowest]
    wanted.append((TIGHT * lowest, f"tight: {TIGHT:.2f} x lowest exact peak"))
    kept: list[tuple[float, str]] = []
    for cap, rule in sorted(wanted, reverse=True):
        if all(cap < other * (1 - MIN_GAP) for other, _ in kept):
            kept.append((cap, rule))
    return [{"cap": int(cap) // 1024 * 1024, "rule": rule} for cap, rule in kept]


def approximate_cap(pool: Pool, steps: int, job: Job, allocator: str | None = None) -> dict[str, Any] | None:
    """For a job that allows approximate rungs: a cap under every exact plan, midway between
    the lowest exact peak and the lowest peak of the most faithful approximate tier that goes
    lower, so that the oracle is in that tier. None if no approximate plan goes lower."""
    from oomguard.strategies import rungs

    lowest = min(job.peak(p) for p in job.tiers[0])
    for tier in sorted(t for t in job.tiers if t > 0):
        sweep(pool, steps, [(job, p) for p in job.floor(tier)], f"sweep ({job.name}: lowest peaks of tier {tier})", allocator)
        floor = min(job.peak(p) for p in job.floor(tier))
        if floor < lowest * (1 - MIN_GAP):
            rung = rungs.names()[tier - 1]
            return {"cap": int((lowest + floor) / 2) // 1024 * 1024,
                    "rule": f"midway between the lowest exact peak and the lowest with `{rung}`: only approximate plans fit"}
    return None


def unmeasured_for(job: Job, cap: int) -> tuple[int | None, list[Any]]:
    """(the oracle's tier at ``cap``, the plans still to measure before it is known). The
    most faithful tier with a plan that fits; in it, per shape, the micro-batches in
    increasing order up to the first that does not fit (the peak grows with the micro-batch,
    so the larger ones cannot fit either). The exact tier is swept whole beforehand."""
    for tier in sorted(job.tiers):
        missing = [p for p in job.floor(tier) if job.peak(p) is None]
        if missing:
            return None, missing
        if min(job.peak(p) for p in job.floor(tier)) > cap:
            continue
        missing = []
        for plans in job.shapes(tier).values():
            for plan in plans:
                if job.peak(plan) is None:
                    missing.append(plan)
                    break
                if job.peak(plan) > cap:
                    break
        return tier, missing
    return None, []


def race_candidates(job: Job, tier: int, cap: int, *, without_offload: bool = False) -> list[Any]:
    """The fitting plans of the tier most likely to be the fastest: the sweep's two fastest and
    every shape's largest fitting micro-batch, fastest first; at most RACE_CANDIDATES, or
    RACE_CANDIDATES_NO_OFFLOAD of those without optimizer offload."""
    fitting = sorted((p for p in job.tiers[tier] if job.peak(p) is not None and job.peak(p) <= cap
                      and not (without_offload and p.offload != "none")), key=job.sweep_rate, reverse=True)
    largest: dict[Any, Any] = {}
    for plan in fitting:
        if shape(plan) not in largest or plan.micro_batch > largest[shape(plan)].micro_batch:
            largest[shape(plan)] = plan
    chosen = fitting[:2] + [p for p in fitting if p in largest.values() and p not in fitting[:2]]
    return chosen[:RACE_CANDIDATES_NO_OFFLOAD if without_offload else RACE_CANDIDATES]


def median(values: Iterable[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main() -> int:
    # Over 60 lines: the options, then the benchmark's sequence, read top to bottom.
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jobs", nargs="*", type=Path,
                        help="job files (default: bench/jobs/*.toml and the text-to-image jobs of bench/jobs/text_to_image/)")
    parser.add_argument("--jobs", dest="only", metavar="NAMES",
                        help="only the jobs whose names match one of these comma-separated names or globs, e.g. "
                             "'t2i-*' or 'attn32,t2i-sd-lora' (a job's name is its file's, without .toml)")
    parser.add_argument("--results-name", metavar="NAME",
                        help="the results files' name (default: ladder for the whole job set, else ladder-<the selection>)")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="processes at once (default: 2)")
    parser.add_argument("--steps", type=int, default=1, help="measured steps per plan in the sweep, after a warm step (default: 1)")
    parser.add_argument("--rounds", type=int, default=4, help="measured rounds of the race, after a warm round (default: 4)")
    parser.add_argument("--all-micro-batches", action="store_true", help="sweep every micro-batch, not one per slice count")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one oomguard run may take (default: 600)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the results go (default: bench/results)")
    parser.add_argument("--keep-workdirs", action="store_true", help="keep the oomguard runs' workdirs (printed)")
    parser.add_argument("--update-readme", action="store_true", help="also rewrite the summary in README.md's Benchmarks section")
    parser.add_argument("--no-command-pairs", action="store_true", help="skip the command-job pairs (bench/command_pairs.py)")
    parser.add_argument(
        "--no-contention-pairs", action="store_true", help="skip the pairs whose neighbour leaves mid-run (bench/contention_pairs.py)",
    )
    parser.add_argument("--no-multi-gpu-pairs", action="store_true", help="skip the pairs on several GPUs (bench/multi_gpu_pairs.py)")
    parser.add_argument("--no-graded-pairs", action="store_true", help="skip the checkpointing grades' pairs (bench/graded_pairs.py)")
    parser.add_argument("--no-allocator-pairs", action="store_true",
                        help="skip the fragmentation pairs and the allocator rung's effect (bench/allocator_pairs.py)")
    parser.add_argument("--allocator", choices=sorted(EMULATIONS), default="both",
                        help="which emulation of device memory the pairs run under: exact bytes, the caching allocator's "
                             "(--emulate-allocator caching/1024; caps from the reserved peaks), or both, each pair under each "
                             "(default: both)")
    parser.add_argument("--no-accelerate-under-caching", action="store_true",
                        help="skip the accelerate arm under the caching allocator's emulation")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="measure nothing: write the report (.md, .png) again from a results file this script wrote")
    args = parser.parse_args()
    if args.render is not None:
        return render(args.render, args.update_readme)
    whole = not args.jobs and not args.only
    if args.update_readme and not whole:
        parser.error("--update-readme summarises the whole job set: run it without job files and --jobs")
    results_name = args.results_name or ("ladder" if whole else "ladder-" + _slug(args.only or "-".join(p.stem for p in args.jobs)))

    import accelerate
    import diffusers
    import torch

    from oomguard.strategies import planner, rungs

    jobs = load_jobs(select_jobs(args.jobs, args.only), args.all_micro_batches)
    machine = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "workers": args.workers,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "accelerate": accelerate.__version__,
        "rungs_with_code": list(rungs.names()),
        "load_average_at_start": os.getloadavg()[0],
    }
    log(f"{len(jobs)} jobs; rungs with code: {', '.join(machine['rungs_with_code'])}; {args.workers} workers of one thread")
    for job in jobs:
        log(f"  {job.name}: {len(job.candidates)} candidate plans; "
            + ", ".join(f"{len(ps)} to sweep of faithfulness {t}" for t, ps in sorted(job.tiers.items()))
            + (" (approximate ones only as far as a cap needs them)" if len(job.tiers) > 1 else ""))

    emulations = EMULATIONS[args.allocator]
    # One sweep serves every emulation: under the caching allocator's emulation the device
    # counts the live bytes as the exact one does, and records what the allocator reserved.
    sweep_allocator = next((e.allocator for e in emulations if e.allocator), None)
    pool = Pool(args.workers)
    scratch = Path(tempfile.mkdtemp(prefix="oomguard-bench-"))
    try:
        # 1. The exact tier of every job, and the job's own plan (the caps' reference); then
        # each frozen-part rung's step from the own plan, for the savings table.
        sweep(pool, args.steps, [(job, p) for job in jobs for p in [*job.tiers[0], job.start]], "sweep", sweep_allocator)
        sweep(pool, args.steps, [(job, p) for job in jobs for p in frozen_savings.extra_plans(job.spec, job.start)],
              "sweep (frozen-part rungs at the own plans)", sweep_allocator)

        # 2. Caps, per emulation from its own figures (the same rules); then, per cap, the plans
        # the oracle needs.
        sides: dict[str, dict[str, Any]] = {}
        for emulation in emulations:
            side_jobs = [dataclasses.replace(job, emulation=emulation) for job in jobs]
            pairs: list[dict[str, Any]] = []
            for job in side_jobs:
                caps = derive_caps(job)
                if len(job.tiers) > 1 and (extra := approximate_cap(pool, args.steps, job, sweep_allocator)) is not None:
                    caps.append(extra)
                pairs += [{"job": job, **cap} for cap in caps]
            while missing := [(pair["job"], p) for pair in pairs for p in unmeasured_for(pair["job"], pair["cap"])[1]]:
                sweep(pool, args.steps, missing, "sweep (up to the caps)", sweep_allocator)
            for n, pair in enumerate(pairs, 1):
                pair["n"] = n
                pair["tier"] = unmeasured_for(pair["job"], pair["cap"])[0]
                pair["candidates"], pair["no_offload"] = [], []
                if pair["tier"] is not None:
                    pair["candidates"] = race_candidates(pair["job"], pair["tier"], pair["cap"])
                    if any(p.offload != "none" for p in pair["job"].tiers[pair["tier"]]):
                        pair["no_offload"] = race_candidates(pair["job"], pair["tier"], pair["cap"], without_offload=True)
                        pair["candidates"] += [p for p in pair["no_offload"] if p not in pair["candidates"]]
                log(f"{emulation.name} pair {n}/{len(pairs)}: {pair['job'].name} at {pair['cap'] / MiB:.1f} MiB ({pair['rule']}): "
                    + (f"oracle among {', '.join(f'[{p.short()}]' for p in pair['candidates'])}" if pair["candidates"] else "no plan fits"))
            sides[emulation.name] = {"emulation": emulation, "jobs": side_jobs, "pairs": pairs}

        # 3. oomguard and accelerate on every pair of every emulation.
        tasks: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        slots: list[tuple[dict[str, Any], str]] = []
        for side in sides.values():
            emulation = side["emulation"]
            for pair in side["pairs"]:
                job = pair["job"]
                workdir = scratch / f"{emulation.slug}-pair-{pair['n']:02d}-{job.name}"
                tasks.append((oomguard_task, (job.path, pair["cap"], str(workdir), args.timeout, emulation.allocator)))
                slots.append((pair, "oomguard"))
                if emulation.allocator and args.no_accelerate_under_caching:
                    pair["accelerate"] = None
                    continue
                tasks.append((accelerate_task, (job.path, pair["cap"], 1, emulation.allocator)))
                slots.append((pair, "accelerate"))

        def describe_run(i: int, r: dict[str, Any]) -> str:
            pair, arm = slots[i]
            head = f"{pair['job'].emulation.name} pair {pair['n']} {pair['job'].name} @ {pair['cap'] / MiB:.1f} MiB: "
            if arm == "oomguard":
                if r.get("error"):
                    return head + f"oomguard ERROR: {r['error']}"
                landed = r["landed"].short() if r.get("landed") else "?"
                return head + f"oomguard {r['state']} on [{landed}], {r['ooms']} OOMs, {r['attempts']} attempt(s), {r['wall_s']:.0f}s"
            return head + f"accelerate batch {r['batch_size'] or 'none'}, {r['ooms']} OOMs"

        for (pair, arm), result in zip(slots, pool.run("run", tasks, describe_run)):
            pair[arm] = result

        # 4. The race: oracle candidates, oomguard's plan and accelerate's batch side by side,
        # under the pair's emulation.
        tasks, raced = [], []
        for side in sides.values():
            for pair in side["pairs"]:
                job = pair["job"]
                arms = [(f"plan:{p.short()}", job.spec.train.batch_size, p) for p in pair["candidates"]]
                landed = pair["oomguard"].get("landed")
                if landed is not None and pair["oomguard"].get("finished") and job.key(landed) not in pair["candidates"]:
                    arms.append((f"plan:{job.key(landed).short()}", job.spec.train.batch_size, job.key(landed)))
                batch = pair["accelerate"]["batch_size"] if pair["accelerate"] else None
                # accelerate at the job's own batch runs the job's own plan: no arm of its own.
                if batch is not None and not (batch == job.spec.train.batch_size and any(key(_initial(batch)) == job.key(p) for _, _, p in arms)):
                    arms.append(("accelerate", batch, _initial(batch)))
                if arms:
                    tasks.append((race_task, (job.path, pair["cap"], arms, args.rounds, job.emulation.allocator)))
                    raced.append(pair)

        def describe_race(i: int, r: dict[str, Any]) -> str:
            pair = raced[i]
            return f"{pair['job'].emulation.name} pair {pair['n']} {pair['job'].name} @ {pair['cap'] / MiB:.1f} MiB: " + ", ".join(
                f"{label.removeprefix('plan:')} " + (f"OOM {a['oom']}" if a["oom"] else f"{statistics.median(a['rates']):.1f}")
                for label, a in r.items())

        for pair, result in zip(raced, pool.run("race", tasks, describe_race)):
            pair["race"] = result
        # Scripts run unchanged as command jobs: one process at a time, after the pool's work.
        # They are part of the whole job set, not of a selection.
        commands = None if args.no_command_pairs or not whole else command_pairs.measure(scratch / "command-pairs")
        contention = None if args.no_contention_pairs or not whole else contention_pairs.measure(scratch / "contention-pairs")
        multi_gpu = None if args.no_multi_gpu_pairs or not whole else multi_gpu_pairs.measure(scratch / "multi-gpu-pairs")
        graded = None if args.no_graded_pairs or not whole else graded_pairs.measure(scratch / "graded-pairs")
        fragmentation = None if args.no_allocator_pairs or not whole else allocator_pairs.measure(scratch / "allocator-pairs")
    finally:
        pool.close()
        if args.keep_workdirs:
            log(f"oomguard workdirs kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)

    # The first emulation's results are the report's top level (as before the caching one
    # existed); every emulation's are under "emulations".
    by_emulation = {name: summarise(side["jobs"], side["pairs"], machine, args, planner) for name, side in sides.items()}
    summary = dict(next(iter(by_emulation.values())))
    summary["emulations"] = {name: {k: s[k] for k in ("emulation", "medians", "offload_speedup", "pairs")} for name, s in by_emulation.items()}
    summary["reserved_check"] = reserved_check(jobs) if sweep_allocator else None
    summary["command_pairs"] = commands
    summary["contention_pairs"] = contention
    summary["multi_gpu_pairs"] = multi_gpu
    summary["graded_pairs"] = graded
    summary["allocator_pairs"] = fragmentation
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{results_name}.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    plotted = write_report(summary, args.out, results_name)
    if fragmentation is not None:
        allocator_pairs.write(fragmentation, args.out)
    if args.update_readme:
        update_readme(summary)
    for name, side in summary["emulations"].items():
        s = side["medians"]
        log(f"{name}: median OOMs per pair: oomguard {s['oomguard_ooms']}, accelerate {s['accelerate_ooms']}; "
            f"median fraction of the oracle: oomguard {_fmt(s['oomguard_fraction'])}, accelerate {_fmt(s['accelerate_fraction'])}; "
            f"first choice fits in {s['oomguard_first_choice_fits']} of {s['pairs']}; finished {s['oomguard_finished']}")
    if summary["reserved_check"]:
        c = summary["reserved_check"]
        log(f"reserved >= exact peak: {c['plans'] - len(c['violations'])} of {c['plans']} plans")
    log(f"wrote {args.out / results_name}.md, .json" + (", .png" if plotted else " (no plot: matplotlib is missing)")
        + f"; total {(time.monotonic() - STARTED) / 60:.1f} min")
    return 0


def write_report(summary: dict[str, Any], out: Path, results_name: str) -> bool:
    """NAME.md and a plot per emulation: NAME.png for the first (the exact one under both),
    NAME-caching.png beside it. False if matplotlib is missing (no plots)."""
    plots: dict[str, str] = {}
    for n, (name, side) in enumerate(summary["emulations"].items()):
        png = f"{results_name}.png" if n == 0 else f"{results_name}-{EMULATIONS[name][0].slug}.png"
        if plot({**side, "emulation": name}, out / png):
            plots[name] = png
    (out / f"{results_name}.md").write_text(markdown(summary, plots))
    return bool(plots)


def render(path: Path, readme: bool) -> int:
    """The report again from ``path`` (a results file of this script), beside it."""
    summary = json.loads(path.read_text())
    summary.setdefault("emulations", {summary.get("emulation") or "exact": {
        "emulation": "exact", **{k: summary[k] for k in ("medians", "offload_speedup", "pairs")}}})
    write_report(summary, path.parent, path.stem)
    if readme:
        update_readme(summary)
    log(f"wrote {path.with_suffix('.md')} from {path}")
    return 0


def reserved_check(jobs: list[Job]) -> dict[str, Any]:
    """Every plan swept under the caching allocator's emulation: its peak reserved memory
    against the exact emulation's peak (the live bytes, counted in the same run). The caching
    allocator reserves at least what is live, so reserved < exact would be a bug."""
    rows: list[dict[str, Any]] = []
    seen: set[int] = set()
    for job in jobs:
        if id(job.results) in seen:
            continue
        seen.add(id(job.results))
        for result in job.results.values():
            if result.get("reserved_peak_bytes") is None:
                continue
            rows.append({"job": job.name, "plan": result["plan"].short(), "exact_peak_bytes": result["peak_bytes"],
                         "allocated_peak_bytes": result["allocated_peak_bytes"], "reserved_peak_bytes": result["reserved_peak_bytes"],
                         "ratio": result["reserved_peak_bytes"] / result["peak_bytes"] if result["peak_bytes"] else None})
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    return {
        "plans": len(rows),
        "violations": [r for r in rows if r["reserved_peak_bytes"] < r["exact_peak_bytes"]],
        "ratio_min": min(ratios, default=None),
        "ratio_median": median(ratios),
        "ratio_max": max(ratios, default=None),
        "rows": rows,
    }


def select_jobs(files: list[Path], only: str | None) -> list[Path]:
    """The job files to run: ``files``, or bench/jobs/*.toml and the text-to-image templates
    (filled in by t2i_jobs, which makes their pipelines when one is chosen); of those, the
    ones whose name (the file's, without .toml) matches a pattern of ``only``."""
    templates = [] if files else t2i_jobs.templates()
    candidates = list(files) or [*sorted(JOBS_DIR.glob("*.toml")), *templates]
    if only is not None:
        patterns = [p.strip() for p in only.split(",") if p.strip()]
        unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(c.stem, p) for c in candidates)]
        if unmatched or not patterns:
            raise SystemExit(f"--jobs {only!r}: {', '.join(unmatched) or 'no name'} matches none of the jobs: "
                             f"{', '.join(c.stem for c in candidates)}")
        candidates = [c for c in candidates if any(fnmatch.fnmatchcase(c.stem, p) for p in patterns)]
    rendered = iter(t2i_jobs.prepare([c for c in candidates if c in templates]))
    return [next(rendered) if c in templates else c for c in candidates]


def _slug(text: str) -> str:
    """A file-name part for a job selection: 't2i-*' -> 't2i', 'a,b' -> 'a-b'."""
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-") or "selection"


def _initial(batch_size: int) -> Any:
    from oomguard.strategies.plan import Plan

    return Plan.initial(batch_size)


def summarise(jobs: list[Job], pairs: list[dict[str, Any]], machine: dict[str, Any], args: argparse.Namespace, planner: Any) -> dict[str, Any]:
    # Over 60 lines: every column of a pair's row computed in one place.
    whole = not args.jobs and not args.only
    rows = []
    for pair in pairs:
        job, og, race = pair["job"], pair["oomguard"], pair.get("race", {})
        # The accelerate arm may be skipped under the caching emulation (--no-accelerate-under-caching).
        acc = pair["accelerate"] or {"batch_size": None, "kept_batch": None, "ooms": None, "oom_recognised_by_accelerate": None, "skipped": True}

        def race_rate(label: str) -> float | None:
            arm = race.get(label)
            return statistics.median(arm["rates"]) if arm and arm["rates"] and not arm["oom"] else None

        landed = og.get("landed")
        landed_key = job.key(landed) if landed is not None else None
        # The oracle: the fastest raced plan of the oracle tier that fitted under the cap
        # (oomguard's plan competes when it is of that tier and fits).
        contenders = list(pair["candidates"])
        if landed_key is not None and landed_key not in contenders and pair["tier"] is not None \
                and planner.faithfulness(job.start, landed_key) == pair["tier"] and race_rate(f"plan:{landed_key.short()}"):
            contenders.append(landed_key)
        timed = [(race_rate(f"plan:{p.short()}"), p) for p in contenders]
        timed = [(r, p) for r, p in timed if r is not None]
        best_rate, best = max(timed, key=lambda t: t[0]) if timed else (None, None)
        # Diagnostic: the same without optimizer offload (see RACE_CANDIDATES_NO_OFFLOAD).
        plain = [(r, p) for r, p in timed if p.offload == "none"] if pair["no_offload"] else []
        plain_rate, plain_best = max(plain, key=lambda t: t[0]) if plain else (None, None)
        failed_checks = [p.short() for p in pair["candidates"] if (race.get(f"plan:{p.short()}") or {}).get("oom")]
        landed_rate = race_rate(f"plan:{landed_key.short()}") if landed_key is not None else None
        fraction = plain_fraction = None
        if best_rate:
            fraction = landed_rate / best_rate if og.get("finished") and landed_rate else 0.0
        if plain_rate:
            # oomguard's own plan competes here too (it may have offload): at most 1.
            plain_fraction = min(1.0, landed_rate / plain_rate) if og.get("finished") and landed_rate else 0.0
        acc_batch = acc["batch_size"]
        acc_rate = None if acc.get("skipped") else race_rate("accelerate") if "accelerate" in race or acc_batch != job.spec.train.batch_size \
            else race_rate(f"plan:{key(_initial(acc_batch)).short()}")
        acc_fraction = None if acc.get("skipped") else (acc_rate / best_rate if acc_rate else 0.0) if best_rate else None
        rows.append({
            "pair": pair["n"],
            "job": job.name,
            "batch_size": job.spec.train.batch_size,
            "cap_bytes": pair["cap"],
            "cap_mib": round(pair["cap"] / MiB, 1),
            "cap_rule": pair["rule"],
            "oracle_plan": best.short() if best else None,
            "oracle_faithfulness": pair["tier"],
            "oracle_peak_mib": round(job.peak(best) / MiB, 1) if best is not None and job.peak(best) else None,
            # The race's peaks under the cap: live bytes, and under the caching emulation reserved.
            "oracle_race_peak_mib": _race_peak(race, best, "peak_bytes"),
            "oracle_race_reserved_mib": _race_peak(race, best, "reserved_peak_bytes"),
            "oracle_samples_per_s": best_rate,
            "oracle_without_offload": plain_best.short() if plain_best else None,
            "oracle_without_offload_samples_per_s": plain_rate,
            "raced_plans": {p.short(): race_rate(f"plan:{p.short()}") for p in contenders},
            "oracle_checks_failed": failed_checks,
            "oomguard": {
                **{k: v for k, v in og.items() if k != "landed"},
                "landed_plan": landed.short() if landed is not None else None,
                "landed_faithfulness": planner.faithfulness(job.start, landed) if landed is not None else None,
                "landed_peak_mib": round(job.peak(landed) / MiB, 1) if landed is not None and job.peak(landed) else None,
                "landed_samples_per_s": landed_rate,
                "fraction_of_oracle": fraction,
                "fraction_of_oracle_without_offload": plain_fraction,
            },
            "accelerate": {**acc, "samples_per_s": acc_rate, "fraction_of_oracle": acc_fraction},
        })
    sweeps: dict[str, Any] = {}
    shown: dict[int, tuple[str, set[Any]]] = {}  # id(shared results) -> (first job, plans shown)
    for job in jobs:
        own = {p for plans in job.tiers.values() for p in plans} | {key(job.start)}
        measured = [r for k, r in job.results.items() if k in own]
        first, done = shown.setdefault(id(job.results), (job.name, set()))
        sweeps[job.name] = {
            "file": t2i_jobs.shown_path(Path(job.path)),
            "allow": list(job.spec.policy().allow),
            "candidate_plans": len(job.candidates),
            "swept_plans": len(measured),
            "same_training_as": first if first != job.name else None,
            # The frozen parts on the device under the job's own plan (0 for a job without any).
            "frozen_bytes": (job.results[key(job.start)].get("static_bytes") or {}).get("frozen"),
            "plans": [
                {
                    "plan": r["plan"].short(),
                    "faithfulness": planner.faithfulness(job.start, r["plan"]),
                    "peak_mib": round(r["peak_bytes"] / MiB, 2),
                    "first_step_peak_mib": round(r["first_step_peak_bytes"] / MiB, 2),
                    "steady_peak_mib": round(r["steady_peak_bytes"] / MiB, 2) if r["steady_peak_bytes"] else None,
                    "samples_per_s": statistics.median(r["rates"]),
                    "frozen_mib": round(r["static_bytes"]["frozen"] / MiB, 3) if r.get("static_bytes") else None,
                    "allocated_peak_mib": round(r["allocated_peak_bytes"] / MiB, 2) if r.get("allocated_peak_bytes") is not None else None,
                    "reserved_peak_mib": round(r["reserved_peak_bytes"] / MiB, 2) if r.get("reserved_peak_bytes") is not None else None,
                }
                for r in sorted(measured, key=lambda r: (planner.faithfulness(job.start, r["plan"]), -r["peak_bytes"], r["plan"].short()))
                if key(r["plan"]) not in done
            ],
        }
        done.update(key(r["plan"]) for r in measured)
    with_oracle = [r for r in rows if r["oracle_plan"] is not None]
    # How much faster optimizer offload made a plan in the races (same plan without it raced too).
    offload_ratios = []
    for pair in pairs:
        arms = {label: statistics.median(a["rates"]) for label, a in pair.get("race", {}).items() if a["rates"] and not a["oom"]}
        for plan in pair["candidates"]:
            twin = plan.replace(offload="none")
            if plan.offload != "none" and f"plan:{plan.short()}" in arms and f"plan:{twin.short()}" in arms:
                offload_ratios.append(arms[f"plan:{plan.short()}"] / arms[f"plan:{twin.short()}"])
    return {
        "command": "make bench   # = .venv/bin/python bench/ladder.py" if whole and not sys.argv[1:]
        else shlex.join([".venv/bin/python", "bench/ladder.py", *sys.argv[1:]]),
        "arguments": sys.argv[1:],
        "machine": {**machine, "load_average_at_end": os.getloadavg()[0], "total_minutes": round((time.monotonic() - STARTED) / 60, 1)},
        "settings": {"whole_job_set": whole, "sweep_steps": args.steps, "race_rounds": args.rounds, "all_micro_batches": args.all_micro_batches,
                     "cap_fractions": CAP_FRACTIONS, "tight": TIGHT, "below_exact": BELOW_EXACT},
        "emulation": jobs[0].emulation.name if jobs else None,
        "medians": {
            "pairs": len(rows),
            "oomguard_ooms": median(r["oomguard"].get("ooms") for r in rows),
            "oomguard_first_choice_fits": sum(bool(r["oomguard"].get("first_choice_fits")) for r in rows),
            "oomguard_at_most_one_oom": sum((r["oomguard"].get("ooms") is not None and r["oomguard"]["ooms"] <= 1) for r in rows),
            "oomguard_allocator_rung": sum(bool(r["oomguard"].get("allocator_rung")) for r in rows),
            "accelerate_ooms": median(r["accelerate"]["ooms"] for r in rows),
            "oomguard_fraction": median(r["oomguard"]["fraction_of_oracle"] for r in with_oracle),
            "oomguard_fraction_without_offload": median(r["oomguard"]["fraction_of_oracle_without_offload"] for r in with_oracle),
            "accelerate_fraction": median(r["accelerate"]["fraction_of_oracle"] for r in with_oracle),
            "oomguard_finished": sum(bool(r["oomguard"].get("finished")) for r in rows),
            "accelerate_found_a_batch": sum(r["accelerate"]["batch_size"] is not None for r in rows),
            "accelerate_kept_batch": sum(bool(r["accelerate"]["kept_batch"]) for r in rows),
        },
        "offload_speedup": {"median": median(offload_ratios), "min": min(offload_ratios, default=None),
                            "max": max(offload_ratios, default=None), "count": len(offload_ratios)},
        "pairs": rows,
        "sweeps": sweeps,
        "frozen_parts": {job.name: {"frozen_bytes": sweeps[job.name]["frozen_bytes"], "peak_bytes": job.peak(job.start)}
                         for job in jobs if frozen_savings.FEATURE in job.spec.features()},
        "frozen_part_rungs": [r.name for r in frozen_savings.frozen_part_rungs()],
        "frozen_savings": [row for job in jobs if frozen_savings.FEATURE in job.spec.features()
                           for row in frozen_savings.job_savings(job.name, job.spec, job.start, job.results, key)],
    }


def _race_peak(race: dict[str, Any], plan: Any, figure: str) -> float | None:
    arm = race.get(f"plan:{plan.short()}") if plan is not None else None
    value = arm.get(figure) if arm else None
    return round(value / MiB, 2) if value else None


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "—" if value is None else format(value, spec)


def summary_table(summary: dict[str, Any]) -> str:
    """The medians of one emulation, or of each emulation side by side (``summary`` with
    "emulations" of more than one)."""
    sides = summary.get("emulations") or {summary.get("emulation") or "exact": summary}
    head = ["|"]
    rule = ["|---|"]
    for name, side in sides.items():
        suffix = f" ({name})" if len(sides) > 1 else ""
        head.append(f" oomguard{suffix} | accelerate `find_executable_batch_size`{suffix} |")
        rule.append("---|---|")

    def row(label: str, cell: Callable[[dict[str, Any]], tuple[str, str]]) -> str:
        cells = [cell(side["medians"]) for side in sides.values()]
        return f"| {label} | " + " | ".join(f"{a} | {b}" for a, b in cells) + " |"

    def skipped(s: dict[str, Any]) -> bool:
        return s["accelerate_ooms"] is None and s["accelerate_found_a_batch"] == 0

    pairs = {side["medians"]["pairs"] for side in sides.values()}
    lines = [
        f"| {'/'.join(map(str, sorted(pairs)))} (job, cap) pairs |" + "".join(head[1:]),
        "".join(rule),
        row("median OOMs per pair", lambda s: (_fmt(s["oomguard_ooms"], "g"), "skipped" if skipped(s) else _fmt(s["accelerate_ooms"], "g"))),
        row("median samples/s as a fraction of the oracle's", lambda s: (_fmt(s["oomguard_fraction"]), _fmt(s["accelerate_fraction"]))),
    ]
    if any(side["medians"].get("oomguard_fraction_without_offload") is not None for side in sides.values()):
        lines.append(row("the same against the fastest plan without optimizer offload (diagnostic: see 'Optimizer offload' in ladder.md)",
                         lambda s: (_fmt(s.get("oomguard_fraction_without_offload")), "")))
    lines += [
        row("the planner's first choice fits (no OOM after the probe's)",
            lambda s: (f"{s['oomguard_first_choice_fits']} of {s['pairs']}" if "oomguard_first_choice_fits" in s else "—", "")),
        row("landed with at most one OOM",
            lambda s: (f"{s['oomguard_at_most_one_oom']} of {s['pairs']}" if "oomguard_at_most_one_oom" in s else "—", "")),
        row("finished", lambda s: (f"{s['oomguard_finished']} of {s['pairs']}",
                                   "skipped" if skipped(s) else f"{s['accelerate_found_a_batch']} of {s['pairs']} found a batch that runs")),
        row("kept the effective batch", lambda s: ("always (exact rungs keep it)", "skipped" if skipped(s) else f"{s['accelerate_kept_batch']} of {s['pairs']}")),
    ]
    return "\n".join(lines)


def both_section(sides: dict[str, dict[str, Any]]) -> list[str]:
    """The pairs of two emulations side by side, matched by (job, cap rule). The rules are the
    same, but each emulation's caps come from its own peaks, so the gap rule (MIN_GAP) or the
    tight cap may keep a cap in one and drop it in the other."""
    if len(sides) != 2:
        return []
    (a_name, a), (b_name, b) = sides.items()
    a_rows = {(r["job"], r["cap_rule"]): r for r in a["pairs"]}
    b_rows = {(r["job"], r["cap_rule"]): r for r in b["pairs"]}
    keys = list(dict.fromkeys([*a_rows, *b_rows]))

    def cells(r: dict[str, Any] | None) -> str:
        if r is None:
            return "— | (no such cap) | |"
        og = r["oomguard"]
        plan = f"`{og['landed_plan']}`" if og.get("landed_plan") else "—"
        if og.get("error"):
            plan = f"error: {og['error']}"
        elif not og.get("finished"):
            plan += f" ({og.get('state')})"
        first = "yes" if og.get("first_choice_fits") else "no"
        return f"{r['cap_mib']} | {plan} | {og.get('ooms', '—')} ({first}) | {_fmt(og.get('fraction_of_oracle'))}"

    out = ["## Both emulations, pair by pair", "",
           f"The same (job, cap rule) under {a_name} and {b_name}: each cap from that emulation's own peaks (exact, reserved), "
           "so a rule's cap differs, and the gap rule or the tight cap may keep a cap in one emulation and drop it in the other. "
           "*OOMs (first choice fits)*: all OOMs, and whether the planner's first choice after the probe trained to the end.", "",
           f"| job | cap rule | {a_name} cap MiB | oomguard plan | OOMs (first choice fits) | fraction | {b_name} cap MiB | oomguard plan | "
           "OOMs (first choice fits) | fraction |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    out += [f"| {job} | {rule} | {cells(a_rows.get((job, rule)))} | {cells(b_rows.get((job, rule)))} |" for job, rule in keys]
    return [*out, ""]


def reserved_section(check: dict[str, Any] | None) -> list[str]:
    if not check:
        return []
    out = ["## Reserved (caching allocator) against exact peaks", "",
           f"Every plan swept under `--emulate-allocator caching/1024` also counted its live bytes as the exact emulation does "
           f"(one run, both figures). Peak reserved ≥ exact peak in **{check['plans'] - len(check['violations'])} of "
           f"{check['plans']}** plans; reserved / exact from {_fmt(check['ratio_min'], '.3f')} to {_fmt(check['ratio_max'], '.3f')} "
           f"(median {_fmt(check['ratio_median'], '.3f')}). Each plan's figures are in the sweeps' tables below.", ""]
    if check["violations"]:
        out += ["Plans where reserved < exact:", "", "| job | plan | exact MiB | reserved MiB |", "|---|---|---|---|"]
        out += [f"| {v['job']} | `{v['plan']}` | {v['exact_peak_bytes'] / MiB:.2f} | {v['reserved_peak_bytes'] / MiB:.2f} |" for v in check["violations"]]
        out.append("")
    return out


def pair_table(summary: dict[str, Any]) -> str:
    lines = [
        "| # | job | cap MiB | cap rule | oracle plan | oracle samples/s | oomguard plan | OOMs | attempts | fraction | wall s | accelerate batch | kept | OOMs | fraction |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["pairs"]:
        og, acc = r["oomguard"], r["accelerate"]
        plan = f"`{og['landed_plan']}`" if og.get("landed_plan") else "—"
        if og.get("reserved_peak_mib") is not None:
            plan += f" (reserved {og['reserved_peak_mib']:g} MiB)"
        if og.get("error"):
            plan = f"error: {og['error']}"
        elif not og.get("finished"):
            plan += f" ({og.get('state')})"
        oracle = f"`{r['oracle_plan']}`" if r["oracle_plan"] else "none fits"
        lines.append(
            f"| {r['pair']} | {r['job']} | {r['cap_mib']} | {r['cap_rule']} | {oracle} | {_fmt(r['oracle_samples_per_s'], '.1f')} | "
            f"{plan} | {og.get('ooms', '—')} | {og.get('attempts', '—')} | {_fmt(og.get('fraction_of_oracle'))} | {_fmt(og.get('wall_s'), '.0f')} | "
            + ("skipped | | | |" if acc.get("skipped") else
               f"{acc['batch_size'] or 'none'} | {'yes' if acc['kept_batch'] else 'no'} | {acc['ooms']} | {_fmt(acc['fraction_of_oracle'])} |")
        )
    return "\n".join(lines)


def flagged_section(side: dict[str, Any], suffix: str) -> list[str]:
    """The pairs where oomguard fell short (under TARGET_FRACTION of the oracle, over one OOM,
    an error), each with what it measured and why it changed plans."""
    out: list[str] = []
    flagged = [r for r in side["pairs"]
               if (r["oomguard"].get("fraction_of_oracle") is not None and r["oomguard"]["fraction_of_oracle"] < TARGET_FRACTION)
               or (r["oomguard"].get("ooms") or 0) > 1 or r["oomguard"].get("error")]
    out += [f"## Pairs where oomguard reached less than {TARGET_FRACTION} of the oracle or took more than one OOM{suffix}", ""]
    if not flagged:
        out += ["None.", ""]
    for r in flagged:
        og = r["oomguard"]
        out += [f"### Pair {r['pair']}: {r['job']} at {r['cap_mib']} MiB: oracle `{r['oracle_plan']}`, oomguard "
                f"`{og.get('landed_plan')}` ({og.get('state')}), {og.get('ooms')} OOMs, fraction {_fmt(og.get('fraction_of_oracle'))}", ""]
        if og.get("error"):
            out += ["```", str(og["error"]), str(og.get("stderr", ""))[-1500:], "```", ""]
            continue
        raced = ", ".join(f"`{p}` {_fmt(v, '.1f')}" for p, v in r["raced_plans"].items())
        plain = (f" Against the fastest raced plan without optimizer offload (`{r['oracle_without_offload']}`, "
                 f"{_fmt(r['oracle_without_offload_samples_per_s'], '.1f')}): {_fmt(og.get('fraction_of_oracle_without_offload'))}."
                 if r.get("oracle_without_offload") else "")
        out += [f"Raced (samples/s): {raced}; oomguard's plan {_fmt(og.get('landed_samples_per_s'), '.1f')}.{plain}", "",
                f"OOMs: {og['ooms_in_probe']} in the probe, {og['ooms_in_process']} recovered in the process, "
                f"{og['ooms_ending_attempts']} ending an attempt.", ""]
        out += [f"- OOM in attempt {d['attempt']} at step {d['step']}: `[{d['plan']}]` needed at least "
                f"{d['needed_at_least_mib']} MiB of {d['capacity_mib']} MiB" for d in og.get("oom_details", [])]
        out += [f"- oomguard measured: {m}" for m in og.get("measurements", [])]
        out += [f"- plan change: {reason}" for reason in og.get("reasons", [])]
        out += [f"- event: {e}".replace("\n", "\n  ") for e in og.get("events", [])
                if not e.startswith(("queued", "started", "finished")) and "in the runner:" not in e]  # those are the plan changes
        out.append("")
    return out


def markdown(summary: dict[str, Any], plots: dict[str, str]) -> str:
    # Over 60 lines: the report's text, in the order it is read.
    m, st = summary["machine"], summary["settings"]
    sides = summary.get("emulations") or {summary.get("emulation") or "exact": summary}
    recognised = all(r["accelerate"]["oom_recognised_by_accelerate"] in (True, None) for side in sides.values() for r in side["pairs"])
    whole = st["whole_job_set"]
    out = [
        "# Ladder benchmark" + ("" if whole else f": {', '.join(summary['sweeps'])}"),
        "",
        "Written by `bench/ladder.py`; rerun with `make bench` (or `.venv/bin/python bench/ladder.py`)." if whole else
        f"Written by `bench/ladder.py` for these jobs only; rerun with `{summary['command']}`.",
        "",
        f"Measured {m['date']} on {m['cpus']} CPUs ({m['platform']}), Python {m['python']}, torch {m['torch']}, "
        f"diffusers {m['diffusers']}, accelerate {m['accelerate']}; {m['workers']} worker processes of one thread each; "
        f"load average {m['load_average_at_start']:.1f} at the start and {m['load_average_at_end']:.1f} at the end. "
        f"Rungs with code: {', '.join(m['rungs_with_code'])}. Total {m['total_minutes']} min. "
        "Device memory is emulated (`--emulate-device-memory`): the training is real, on the CPU; only the capacity is emulated"
        + (f", under {' and '.join(f'the {n} emulation' for n in sides)} (`--emulate-allocator`; see *Emulations* below)." if len(sides) > 1 or "exact" not in sides else "."),
        "",
        "## Summary",
        "",
        summary_table(summary),
        "",
    ]
    for name, plot_name in plots.items():
        out += [f"![samples/s as a fraction of the oracle's, and OOMs, per (job, cap), {name} emulation]({plot_name})", ""]
    out += [
        "## How it is measured",
        "",
        "- **Jobs**: the unconditional ones of `bench/jobs/*.toml` and the text-to-image ones of `bench/jobs/text_to_image/` "
        "(LoRA and full fine-tuning over tiny random SD 1.x and SDXL pipelines and random captioned images, made offline by "
        "`bench/t2i_jobs.py`; their frozen VAE encoder and text encoders sit on the device beside the UNet). Each job "
        "allows what its `ladder.allow` and features allow (`JobSpec.policy()`).",
        "- **Caps** come from each job's own sweep: 1.10, 0.70, 0.45 and 0.25 times the peak of the job's own plan (the "
        f"whole batch at once); fractions under {TIGHT} x the lowest peak of any exact plan give way to that one *tight* cap; "
        f"caps within {MIN_GAP:.0%} of a larger one are dropped. A job that allows approximate rungs also gets a cap midway "
        "between the lowest exact peak and the lowest peak of the most faithful approximate tier that goes lower, so that "
        "only approximate plans fit.",
        f"- **Sweep**: the plans `planner.candidate_plans(job.initial_plan(), job.policy().allow)` yields are built fresh and "
        f"trained for a warm step plus {st['sweep_steps']} more under an emulated device that counts bytes and never "
        "refuses; a plan's peak is the highest over all steps, the first included (where the optimizer state appears). "
        + ("Every micro-batch is swept. " if st["all_micro_batches"] else
           "Per shape (every knob but the micro-batch), one micro-batch per number of slices is swept: the most even "
           "split, which has the lowest peak and does the same work in as many passes as the uneven ones "
           "(`--all-micro-batches` sweeps them all). ")
        + "The exact tier is swept whole. An approximate tier is swept only for a cap where no more faithful plan fits: "
        "first each shape's smallest micro-batch (the tier's lowest peaks), then, in a tier that can fit, each shape's "
        "micro-batches upwards until one does not fit (the peak grows with the micro-batch).",
        "- **Oracle**: from the most faithful tier that has a plan whose peak fits the cap (`planner.faithfulness`: a plan "
        "with exact rungs only beats any approximate one, the product's own policy), the fastest such plan. The sweep's "
        f"two fastest fitting plans and each shape's largest fitting micro-batch (at most {RACE_CANDIDATES} plans, the "
        f"sweep's fastest first, and as many as {RACE_CANDIDATES_NO_OFFLOAD} more chosen the same way among plans without "
        "optimizer offload) are raced and the fastest in the race is the oracle; a plan oomguard landed on that is of the "
        "same tier races too, so a fraction is at most 1.",
        f"- **Race**: per pair, those plans, oomguard's plan and accelerate's batch are trained in one process under the "
        f"cap (which also checks that each fits: a failure would be listed as *oracle checks failed* in ladder.json), each "
        f"with its own model, one step of each in turn: a warm round, then {st['race_rounds']} measured rounds. Speeds are "
        "samples per CPU second of the one-thread process, median over rounds, so other work on the machine does not "
        "favour one plan over another; two arms of one plan still differ by a few per cent.",
        "- **oomguard**: `oomguard run JOB --workdir TMP --emulate-device-memory CAP --json` in a subprocess, product "
        "defaults (probe on, in-process recovery on). Landed plan: the last attempt's `outcome.plan`. OOMs: measurements "
        "with `fits: false` over all attempts (an OOM in the probe, one recovered in the process and one that ends an "
        "attempt each record one). Fraction: race samples/s of the landed plan over the oracle's; 0 if the job did not "
        "finish. *wall s*: the whole `oomguard run`, probe, checkpoints and process starts included.",
        "- **Emulations** (`--allocator`, default both): *exact* counts the live bytes of tensors against the cap. *caching/1024* "
        "(`--emulate-allocator caching/1024`) runs the model of PyTorch's CUDA caching allocator (jobs/caching_allocator.py: "
        "rounding, pools, segments, splitting, the release-and-retry, expandable segments), every size divided by 1024 "
        "since these models are about a thousandth of a real one; the cap is the per-process limit on *reserved* memory "
        "(set_per_process_memory_fraction on a card). One sweep, under the caching emulation, records each plan's exact "
        "peak (the live bytes, counted as the exact emulation counts them) and its reserved peak; each emulation derives "
        "its caps by the same rules from its own figure (exact peaks, reserved peaks), so both have the same (job, cap rule) "
        "pairs, and its oracle fits by that figure. A plan's reserved peak is measured without a cap: under one, the "
        "allocator frees its cache and retries before it refuses, so a plan may fit a little below it (the race checks). "
        "oomguard runs with `--emulate-allocator caching/1024`; the race and accelerate run under the same emulation, "
        "a plan with the allocator rung (`expandable`) with expandable segments. Pairs where fragmentation, not total "
        "size, is the cause, and the allocator rung's effect: bench/allocator_pairs.py "
        "([allocator_pairs.md](allocator_pairs.md)).",
        "- **First choice fits**: the plan the planner chose from the probe's measurements trained to the end with no "
        "further OOM (none recovered in the process, none ending an attempt); the probe's own OOMs are measurements.",
        "- **accelerate**: `find_executable_batch_size(starting_batch_size=job batch)` around a function that builds the "
        "model and trains at micro-batch == batch (no gradient accumulation) under the same emulated cap; the emulated OOM "
        "is a `torch.OutOfMemoryError` with CUDA's message, which accelerate's `should_reduce_batch_size` "
        + ("recognised every time in this run" if recognised else "did NOT recognise in some pairs (see ladder.json)")
        + ". Fraction: race samples/s at the batch it found over the oracle's; 0 if none ran. A smaller batch is another "
        "training (other gradient noise and learning-rate scale): *kept* says whether it kept the job's batch.",
        "",
    ]
    o = summary["offload_speedup"]
    if o["count"]:
        out += ["## Optimizer offload on this machine", "",
                f"In the races, a plan with `offload=optimizer` ran at {o['median']:.2f}x the samples/s of the same plan without it "
                f"(median of {o['count']} side-by-side pairs, {o['min']:.2f}x to {o['max']:.2f}x). Here the offloaded update is "
                "torch's fused CPU AdamW on the same memory, outside the emulated device's accounting, while the plain plan runs "
                "torch's default AdamW under it; on a GPU, offload adds host-device copies every step and would be slower. "
                "Where the oracle is an offload plan, part of oomguard's shortfall is this effect: the diagnostic row of the "
                "summary compares against the fastest raced plan without offload (or oomguard's own plan, if faster).", ""]
    out += both_section(sides)
    for name, side in sides.items():
        suffix = f": {name} emulation" if len(sides) > 1 or name != "exact" else ""
        out += [f"## Per (job, cap){suffix}", "", pair_table(side), ""]
        out += flagged_section(side, suffix)
    out += reserved_section(summary.get("reserved_check"))
    if summary.get("command_pairs"):
        out += [*command_pairs.markdown_section(summary["command_pairs"]), ""]
    if summary.get("contention_pairs"):
        out += [*contention_pairs.markdown_section(summary["contention_pairs"]), ""]
    if summary.get("multi_gpu_pairs"):
        out += [*multi_gpu_pairs.markdown_section(summary["multi_gpu_pairs"]), ""]
    if summary.get("graded_pairs"):
        out += [*graded_pairs.markdown_section(summary["graded_pairs"]), ""]
    if summary.get("allocator_pairs"):
        out += [*allocator_pairs.markdown_section(summary["allocator_pairs"]), ""]
    out += frozen_savings.markdown_section(summary["frozen_savings"], summary["frozen_parts"])
    out += ["## Sweeps", ""]
    for name, s in summary["sweeps"].items():
        same = f" The plans it shares with {s['same_training_as']} (same model, data and training) are listed there." if s["same_training_as"] else ""
        out += [f"### {name} (`{s['file']}`, allow = {', '.join(s['allow'])})", "",
                f"{s['candidate_plans']} candidate plans, {s['swept_plans']} swept.{same}", ""]
        if not s["plans"]:
            continue
        # The frozen parts' column only for jobs that have some (a text-to-image job's encoders).
        frozen = s["frozen_bytes"] is not None and s["frozen_bytes"] > 0
        # The caching emulation's figures where the sweep ran under it.
        caching = any(p.get("reserved_peak_mib") is not None for p in s["plans"])
        out += ["| plan | faithfulness | peak MiB | first step MiB | steady MiB |" + (" frozen MiB |" if frozen else "")
                + (" allocated MiB (caching) | reserved MiB (caching) | reserved / peak |" if caching else "") + " ~samples/s |",
                "|---|---|---|---|---|" + ("---|" if frozen else "") + ("---|---|---|" if caching else "") + "---|"]
        out += [f"| `{p['plan']}` | {p['faithfulness']} | {p['peak_mib']} | {p['first_step_peak_mib']} | {_fmt(p['steady_peak_mib'])} | "
                + (f"{_fmt(p['frozen_mib'], '.3f')} | " if frozen else "")
                + (f"{_fmt(p.get('allocated_peak_mib'))} | {_fmt(p.get('reserved_peak_mib'))} | "
                   f"{_fmt(p['reserved_peak_mib'] / p['peak_mib'] if p.get('reserved_peak_mib') and p['peak_mib'] else None, '.3f')} | " if caching else "")
                + f"{_fmt(p['samples_per_s'], '.1f')} |" for p in s["plans"]]
        out.append("")
    return "\n".join(out)


def plot(summary: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = summary["pairs"]
    x = list(range(len(rows)))
    width = 0.38
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8.0, 0.7 * len(rows) + 2), 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    og = [r["oomguard"].get("fraction_of_oracle") or 0.0 for r in rows]
    acc = [r["accelerate"].get("fraction_of_oracle") or 0.0 for r in rows]
    top.bar([i - width / 2 for i in x], og, width, color="#2b7bba", label="oomguard (effective batch kept)")
    top.bar([i + width / 2 for i in x], acc, width, color=["#e08a2c" if r["accelerate"]["kept_batch"] else "#f5cfa3" for r in rows],
            label="accelerate find_executable_batch_size (pale: smaller batch)")
    plain = [(i - width / 2, r["oomguard"]["fraction_of_oracle_without_offload"]) for i, r in zip(x, rows)
             if r["oomguard"].get("fraction_of_oracle_without_offload") is not None]
    if plain:
        top.scatter([p[0] for p in plain], [p[1] for p in plain], marker="_", s=160, color="black", zorder=3,
                    label="oomguard vs the fastest plan without optimizer offload (diagnostic)")
    top.axhline(1.0, color="black", linewidth=0.8)
    top.axhline(TARGET_FRACTION, color="grey", linewidth=0.8, linestyle="--", label=f"{TARGET_FRACTION} of the oracle")
    top.set_ylabel("samples/s ÷ oracle's")
    top.set_ylim(0, max([1.1, *og, *acc]) + 0.05)
    top.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=7, ncols=2, frameon=False)
    s = summary["medians"]
    emulation = f" ({summary['emulation']} emulation)" if summary.get("emulation") and summary["emulation"] != "exact" else ""
    fig.suptitle(f"Ladder benchmark{emulation}: medians oomguard {_fmt(s['oomguard_fraction'])} of the oracle, {_fmt(s['oomguard_ooms'], 'g')} OOMs; "
                  f"accelerate {_fmt(s['accelerate_fraction'])}, {_fmt(s['accelerate_ooms'], 'g')} OOMs", fontsize=10)
    ooms_og = [r["oomguard"].get("ooms") or 0 for r in rows]
    ooms_acc = [r["accelerate"].get("ooms") or 0 for r in rows]
    bottom.bar([i - width / 2 for i in x], ooms_og, width, color="#2b7bba")
    bottom.bar([i + width / 2 for i in x], ooms_acc, width, color="#e08a2c")
    for i, (a, b) in enumerate(zip(ooms_og, ooms_acc)):
        bottom.text(i - width / 2, a, str(a), ha="center", va="bottom", fontsize=7)
        bottom.text(i + width / 2, b, str(b), ha="center", va="bottom", fontsize=7)
    bottom.set_ylabel("OOMs")
    bottom.yaxis.get_major_locator().set_params(integer=True)
    bottom.set_ylim(0, max([1, *ooms_og, *ooms_acc]) * 1.35)
    bottom.set_xticks(x)
    bottom.set_xticklabels([f"{r['pair']}. {r['job']}\n{r['cap_mib']:g} MiB" for r in rows], fontsize=7, rotation=45, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True



def _reserved_sentence(c: dict[str, Any]) -> str:
    return (
        f"Under the caching allocator's emulation (`--emulate-allocator caching/1024`: caps from each plan's peak *reserved* memory, "
        f"by the same rules), every swept plan's reserved peak is at least its exact peak in {c['plans'] - len(c['violations'])} of "
        f"{c['plans']} plans (reserved / exact {_fmt(c['ratio_min'], '.2f')} to {_fmt(c['ratio_max'], '.2f')}, median {_fmt(c['ratio_median'], '.2f')})."
    )


def _allocator_sentence(pairs: list[dict[str, Any]]) -> str:
    c = allocator_pairs.medians(pairs)
    return (
        f"Fragmentation pairs (bench/allocator_pairs.py: scripts whose cache fragments, under caps their bytes fit): "
        f"{c['landed_at_batch']} of {c['pairs']} kept their micro-batch with the allocator rung (median {_fmt(c['ooms'], 'g')} OOM to land); "
        f"without it {c['without_kept_batch']} of {c['pairs']} kept it, {c['without_failed']} failed (their scripts offer no other rung), "
        f"the rest halved the micro-batch. See bench/results/allocator_pairs.md."
    )


def _command_sentence(pairs: list[dict[str, Any]]) -> str:
    c = command_pairs.medians(pairs)
    return (
        f"Command jobs (scripts like diffusers' examples, run unchanged; a cap that drops mid-run or holds from the start): "
        f"median {c['ooms']} OOM to land over {c['pairs']} pairs, end state passed in {c['end_state_passed']} of {c['pairs']}, "
        f"median {_fmt(c['fraction_of_oracle'])} of the oracle's samples/s."
    )


def _contention_sentence(pairs: list[dict[str, Any]]) -> str:
    c = contention_pairs.medians(pairs)
    return (
        f"A neighbour that leaves mid-run (bench/contention_pairs.py): stepped back up in {c['stepped_up']} of {c['pairs']} pairs; "
        f"after it left, median {_fmt(c['after_vs_reference'], '.3f')} of the samples/s of the same job that never had a neighbour."
    )


def _multi_gpu_sentence(result: dict[str, Any]) -> str:
    c = multi_gpu_pairs.medians(result)
    return (
        f"Several GPUs (bench/multi_gpu_pairs.py: built-in jobs on 2 and 4 emulated devices): median {c['ooms']} OOM to land over "
        f"{c['pairs']} pairs, median {_fmt(c['fraction_of_oracle'])} of the oracle's samples/s, {c['finished']} of {c['pairs']} finished."
    )


def _graded_sentence(result: dict[str, Any]) -> str:
    c = graded_pairs.medians(result)
    return (
        f"Finer rungs (bench/graded_pairs.py: checkpointing grades, the step in backward, layer offload, jobs a little over their cap): median {c['ooms']} OOM to land over {c['pairs']} pairs, "
        f"median {_fmt(c['fraction_of_oracle'])} of the oracle's samples/s (the grades included), {c['finished']} of {c['pairs']} finished; "
        f"in {c['graded_wins']} pairs a finer rung's plan is the fastest that fits and beats the best on/off plan."
    )


# The README block's sentences after the table: the summary's key, and what it says of it.
SECTION_SENTENCES: tuple[tuple[str, Any], ...] = (
    ("reserved_check", _reserved_sentence),
    ("allocator_pairs", _allocator_sentence),
    ("command_pairs", _command_sentence),
    ("contention_pairs", _contention_sentence),
    ("multi_gpu_pairs", _multi_gpu_sentence),
    ("graded_pairs", _graded_sentence),
)

def update_readme(summary: dict[str, Any]) -> None:
    from readme_block import replace_block

    m = summary["machine"]
    lines = [
        f"Measured {m['date']} on {m['cpus']} CPUs, torch {m['torch']}, accelerate {m['accelerate']}; "
        f"rungs with code: {', '.join(m['rungs_with_code'])}.",
        "",
        summary_table(summary),
    ]
    for key, sentence in SECTION_SENTENCES:
        if summary.get(key):
            lines += ["", sentence(summary[key])]
    if not replace_block("bench/ladder.py", lines):
        log("README.md has no summary markers in its Benchmarks section: not updated")
        return
    log("updated the summary in README.md")


if __name__ == "__main__":
    sys.exit(main())
