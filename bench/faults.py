#!/usr/bin/env python
"""Fault injection: how much abuse oomguard survives, and what it costs.

For every fault, one real ``oomguard daemon`` (its own state directory, two attempts at once)
trains one small job per seed (a UNet of a few thousand weights, 24 optimizer steps, a
checkpoint every 4) while this script does the damage, chosen by the seed:

- ``kill-runner``: SIGKILL the runner one to three times per job, at a random step or the
  moment it starts writing a checkpoint (seen through inotify on its checkpoints folder).
- ``kill-daemon``: SIGKILL the daemon at random moments and start a new one at once; the
  attempts run on under their shims and the new daemon adopts them.
- ``corrupt-checkpoint``: truncate, overwrite or delete a file of a job's newest checkpoint
  (the weights, the optimizer state, the manifest), then SIGKILL its runner so that the next
  attempt has to choose a checkpoint.
- ``disk-full``: the jobs' workdirs on a small tmpfs; when a job starts writing a checkpoint,
  fill the disk, and free it again once that attempt has ended (root only: it mounts).
- ``host-memory``: host RAM runs out while jobs offload their optimizer state to it (root
  only: a memory cgroup). The daemon and everything it starts run in a memory cgroup; a job
  whose emulated device (30 MiB) fits only with the offload rung trains with its optimizer in
  host memory, and at a step chosen by its seed the cgroup's limit is lowered to what it uses
  plus 48 MiB while a hog process allocates 96 MiB there: the kernel's OOM killer ends a
  runner (bench/host_pressure.py). The limit is lifted a second later. The attempt must be
  recorded as host_oom and the job resume from its checkpoint.
- ``nan-after-precision``: a job that must take the precision rung while memory is short
  (its device has 2.1 MiB for 4 steps, then 64 MiB); after its 8th step under bf16 the runner
  turns a weight into NaN (OOMGUARD_INJECT_FAULT, jobs/faults.py), so the checkpoint of that
  step holds NaN and the next loss is NaN. Its final weights differ from the reference by
  design (bf16 for a while), so only their finiteness is checked; so are the host-memory
  jobs' (a larger model, with no run without faults to compare with).

Measured for each fault: jobs finished; jobs lost (not finished, or finished without a
complete, finite final model; must be 0); losses diverged; optimizer steps recomputed (steps
trained beyond the job's max_steps: the work a fault threw away); damaged or NaN checkpoints
the runner skipped; corrupt checkpoints loaded (an attempt resumed from a checkpoint after
this script damaged it; must be 0); and final weights equal to those of the same job trained
without faults (``none``, run first as the reference).

Run it with ``make faults`` (``bench/faults.py --help`` for options). Results:
bench/results/faults.md and faults.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import host_pressure
from host_pressure import MemoryCgroup, squeeze
from tiny_job import TINY_JOB

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
FAULTS = ("kill-runner", "kill-daemon", "corrupt-checkpoint", "disk-full", "host-memory", "nan-after-precision")
MAX_STEPS = 24
CHECKPOINT_EVERY = 4
# One thread per process: two attempts share the two cores without oversubscribing them.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# The benchmarks' tiny job (bench/tiny_job.py), every run at batch 8, without a probe, with
# crash retries enough for the faults that look like crashes.
JOB = (
    TINY_JOB.replace('name = "{name}"', 'name = "seed-{seed}"').replace("batch_size = {batch_size}", "batch_size = 8")
    + "\n[ladder]\nprobe = false\ncrash_retries = 5\n"
)


# The NaN fault needs a job that takes the precision rung: activations dominate its memory
# (32x32 images, few channels), and for its first 4 steps a 2.1 MiB device fits no
# micro-batch in full precision (micro-batch 1 peaks at 2.4 MiB) but micro-batch 1 under bf16
# (1.6 MiB; measured). From step 4 on the device has 64 MiB again, as when another job ends.
# The NaN comes after the 8th step under bf16, so the checkpoint of step 8 holds NaN weights;
# the doctor marks precision unsafe and, with the memory back, goes on in full precision from
# the newest checkpoint with finite weights (step 4: the runner skips step 8's).
NAN_JOB = (
    JOB.replace("resolution = 16", "resolution = 32")
    .replace("[ladder]\nprobe = false", '[ladder]\nallow = ["micro_batch", "precision"]')
)


# The host-memory fault needs a job that offloads: its weights (2.3 M, 64 and 128 channels at
# 8x8) dominate, so on a 30 MiB device the full plan runs out in the optimizer step (40.7 MiB
# peak, measured) and the doctor takes the offload rung (19.8 MiB predicted), which keeps the
# AdamW state (18 MiB) in host memory.
OFFLOAD_JOB = (
    JOB.replace("resolution = 16", "resolution = 8")
    .replace("block_out_channels = [8, 16]", "block_out_channels = [64, 128]")
    .replace("norm_num_groups = 4", "norm_num_groups = 8")
    .replace("[ladder]\nprobe = false", '[ladder]\nallow = ["offload"]\nprobe = false')
)


@dataclass(frozen=True)
class Setting:
    """How one fault's jobs and daemon are set up (default: the small job, no cap)."""

    job: str = JOB
    daemon_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    in_memory_cgroup: bool = False  # the daemon and all it starts (host-memory)


SETTINGS: dict[str, Setting] = {
    "host-memory": Setting(job=OFFLOAD_JOB, daemon_args=("--emulate-device-memory", "30MiB"), in_memory_cgroup=True),
    "nan-after-precision": Setting(
        job=NAN_JOB,
        daemon_args=("--emulate-device-memory", "2.1MiB,64MiB@4"),
        env=(("OOMGUARD_INJECT_FAULT", "nan_under_reduced_precision@8"),),
    ),
}


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def oomguard(state_dir: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "oomguard.daemon.cli", "--state-dir", str(state_dir), *args], capture_output=True, text=True, timeout=timeout
    )


class Daemon:
    """One `oomguard daemon` at a time on a state directory; kill() and start() again."""

    def __init__(self, state_dir: Path, env: dict[str, str], extra: tuple[str, ...] = (), cgroup: MemoryCgroup | None = None) -> None:
        self.state_dir = state_dir
        self.env = env
        self.extra = extra
        self.cgroup = cgroup
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with (self.state_dir / "daemon.out").open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "oomguard.daemon.cli", "--state-dir", str(self.state_dir), "daemon", "--poll-interval", "0.1", "--max-parallel", "2", *self.extra],
                stdout=out, stderr=subprocess.STDOUT, env=self.env,
                preexec_fn=self._prepare,
            )
        self.starts += 1
        # Wait until it has taken the lock and watches the spool (a new daemon after a kill
        # may wait for the old one's lock to go).
        deadline = time.monotonic() + 60
        while (self.state_dir / "daemon.out").read_text().count("watching") < self.starts:
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"the daemon did not start: {(self.state_dir / 'daemon.out').read_text()[-2000:]}")
            time.sleep(0.05)

    def _prepare(self) -> None:
        """In the daemon's process before it runs: join the cgroup before it starts anything
        (its shims and runners inherit it). Its OOM score stays at the default 0 (lowering it,
        as systemd/oomguard.service does, needs CAP_SYS_RESOURCE): the runners' raised score
        alone must make the kernel pick a runner rather than the daemon or a shim."""
        if self.cgroup is not None:
            self.cgroup.add(os.getpid())

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Damage:
    """A checkpoint this script damaged: its job, step, what was done and when."""

    job: str
    step: int
    how: str
    at: float


@dataclass
class Run:
    fault: str
    state_dir: Path
    workdirs: Path
    seeds: list[int]
    rng_seed: int
    daemon: Daemon
    injected: list[dict[str, Any]] = field(default_factory=list)
    damages: list[Damage] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def job_dir(self, seed: int) -> Path:
        return self.workdirs / f"seed-{seed}"

    def rng(self, seed: int) -> random.Random:
        """The choices for one job: the same for every run with the same seeds."""
        return random.Random(self.rng_seed * 100_003 + seed)

    def job_over(self, seed: int) -> bool:
        return self.done.is_set() or (self.job_dir(seed) / "final").is_dir()

    def newest_attempt(self, seed: int) -> Path | None:
        attempts = sorted((self.job_dir(seed) / "attempts").glob("[0-9]*"))
        return attempts[-1] if attempts else None

    def record(self, seed: int | None, what: str, during_checkpoint: bool = False) -> None:
        with self.lock:
            self.injected.append({"job": f"seed-{seed}" if seed is not None else None, "what": what, "at": time.time(), "during_checkpoint": during_checkpoint})


def steps_done(attempt_dir: Path) -> int:
    """Optimizer steps the attempt has reported (its metrics.jsonl gets a line per step)."""
    try:
        return (attempt_dir / "metrics.jsonl").read_bytes().count(b"\n")
    except OSError:
        return 0


def live_processes(attempt: Path | None) -> set[int]:
    """The processes of an attempt that has not ended (found by the attempt's mark in their
    environment); none once its shim has recorded how it ended."""
    from oomguard.daemon import processes

    if attempt is None or (attempt / "exit.json").exists():
        return set()
    return processes.marked_with(str(attempt))


def kill_runner(run: Run, seed: int, reason: str, during_checkpoint: bool = False) -> Path | None:
    """SIGKILL the runner of the job's newest attempt; the attempt directory, or None when no
    runner was there to kill."""
    from oomguard.daemon import processes

    attempt = run.newest_attempt(seed)
    pids = live_processes(attempt)
    if not pids:
        return None
    processes.send(pids, signal.SIGKILL)
    run.record(seed, f"SIGKILL runner ({reason})", during_checkpoint)
    return attempt


def wait_until(run: Run, seed: int, condition: Callable[[], Any], poll: float = 0.05) -> Any:
    """The first true value of ``condition``, or None once the job is over."""
    while not run.job_over(seed):
        value = condition()
        if value:
            return value
        time.sleep(poll)
    return None


class CheckpointWatch:
    """inotify on every job's checkpoints folder. ``on_start(seed)`` runs in the watcher's
    thread the moment a checkpoint write begins (its temporary folder appears), as does the
    action given to ``at_next_start``; ``written[seed]`` holds the steps of the checkpoints
    completed (renamed into place), and ``wait_written`` waits for one without polling."""

    def __init__(self, run: Run, on_start: Callable[[int], None] | None = None) -> None:
        from watchdog.events import FileSystemEventHandler
        from watchdog.observers import Observer

        self.run = run
        self.written: dict[int, list[int]] = {seed: [] for seed in run.seeds}
        self.changed = {seed: threading.Event() for seed in run.seeds}
        self.armed: dict[int, Callable[[], None]] = {}
        watch = self

        class Handler(FileSystemEventHandler):
            def __init__(self, seed: int) -> None:
                self.seed = seed

            def on_created(self, event: Any) -> None:
                if event.is_directory and Path(event.src_path).name.startswith(".tmp-step-"):
                    action = watch.armed.pop(self.seed, None)
                    if action is not None:
                        action()
                    if on_start is not None:
                        on_start(self.seed)

            def on_moved(self, event: Any) -> None:
                name = Path(event.dest_path).name
                if name.startswith("step-") and name[5:].isdigit():
                    watch.written[self.seed].append(int(name[5:]))
                    watch.changed[self.seed].set()

        self.observer = Observer()
        for seed in run.seeds:
            folder = run.job_dir(seed) / "checkpoints"
            folder.mkdir(parents=True, exist_ok=True)
            self.observer.schedule(Handler(seed), str(folder), recursive=False)

    def at_next_start(self, seed: int, action: Callable[[], Any]) -> Any:
        """Run ``action`` in the watcher's thread the moment the job's next checkpoint write
        begins; its result, or None when the job is over first."""
        results: list[Any] = []
        done = threading.Event()

        def fire() -> None:
            results.append(action())
            done.set()

        self.armed[seed] = fire
        while not done.wait(0.2):
            if self.run.job_over(seed):
                self.armed.pop(seed, None)
                break
        return results[0] if results else None

    def wait_written(self, seed: int, step: int) -> bool:
        """Wait until the job's checkpoint of ``step`` is complete; False when the job is over first."""
        while step not in self.written[seed]:
            if self.run.job_over(seed):
                return False
            self.changed[seed].wait(0.2)
            self.changed[seed].clear()
        return True

    def __enter__(self) -> CheckpointWatch:
        self.observer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.observer.stop()
        self.observer.join()


def per_job(run: Run, injector: Callable[[Run, int, random.Random], None]) -> None:
    """Run ``injector`` for every job at once, one thread each."""
    threads = [threading.Thread(target=injector, args=(run, seed, run.rng(seed)), daemon=True) for seed in run.seeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def inject_kill_runner(run: Run) -> None:
    with CheckpointWatch(run) as watch:

        def one_job(run: Run, seed: int, rng: random.Random) -> None:
            killed: Path | None = None
            for _ in range(rng.randint(1, 2)):
                if rng.random() < 0.5:
                    # At a random moment of training: a new attempt that has done a step.
                    attempt = wait_until(run, seed, lambda: (a := run.newest_attempt(seed)) and a != killed and steps_done(a) > 0 and a)
                    if attempt is None:
                        return
                    time.sleep(rng.uniform(0.0, 0.5))
                    killed = kill_runner(run, seed, f"after step {steps_done(attempt)}") or killed
                else:
                    # The moment its next checkpoint write begins.
                    killed = watch.at_next_start(seed, lambda: kill_runner(run, seed, "while it writes a checkpoint", during_checkpoint=True)) or killed

        per_job(run, one_job)


def inject_kill_daemon(run: Run) -> None:
    rng = run.rng(-1)
    while not run.done.wait(rng.uniform(0.3, 2.0)):
        run.daemon.kill()
        run.record(None, "SIGKILL daemon")
        run.daemon.start()


def damage(run: Run, seed: int, rng: random.Random, checkpoint: Path) -> Damage:
    files = sorted(p for p in checkpoint.iterdir() if p.is_file())
    target = rng.choice(files)
    how = rng.choice(["truncate", "overwrite", "delete"])
    if how == "truncate":
        with target.open("r+b") as f:
            f.truncate(target.stat().st_size // 2)
    elif how == "overwrite":
        data = bytearray(target.read_bytes())
        if data:
            data[rng.randrange(len(data))] ^= 0xFF
        target.write_bytes(bytes(data))
    else:
        target.unlink()
    return Damage(job=f"seed-{seed}", step=int(checkpoint.name[5:]), how=f"{how} {target.name}", at=time.time())


def inject_corrupt_checkpoint(run: Run) -> None:
    from oomguard.jobs import checkpoints

    with CheckpointWatch(run) as watch:

        def one_job(run: Run, seed: int, rng: random.Random) -> None:
            # Right after a checkpoint chosen by the seed is written: stop the runner (so that
            # it cannot prune or rewrite it), damage the newest checkpoint, and let the next
            # attempt choose.
            # No later than two checkpoints before the end: the runner must still be training
            # (not already exiting) when it is killed.
            target = rng.choice(range(CHECKPOINT_EVERY, MAX_STEPS - CHECKPOINT_EVERY, CHECKPOINT_EVERY))
            if not watch.wait_written(seed, target):
                return
            if kill_runner(run, seed, f"after its checkpoint of step {target}") is None:
                return
            newest = checkpoints.candidates(run.job_dir(seed) / "checkpoints")[0]
            broken = damage(run, seed, rng, newest)
            with run.lock:
                run.damages.append(broken)
            run.record(seed, f"damaged checkpoint step {broken.step}: {broken.how}")

        per_job(run, one_job)


def inject_disk_full(run: Run) -> None:
    filler = run.workdirs / "filler"
    full_during: list[tuple[Path, float]] = []  # the attempt whose checkpoint write found the disk full, and when

    def fill(seed: int) -> None:
        with run.lock:
            attempt = run.newest_attempt(seed)
            if attempt is None or any(i["job"] == f"seed-{seed}" for i in run.injected):
                return  # one full disk per job
            if full_during:
                # Still full from another job's fill: this checkpoint write meets it too.
                run.injected.append({"job": f"seed-{seed}", "what": "its checkpoint write met the disk filled for another job", "at": time.time(), "during_checkpoint": True})
                return
            with filler.open("ab") as out:
                try:
                    while True:
                        out.write(b"\0" * (1 << 20))
                        out.flush()
                except OSError:
                    pass  # the disk is full
            full_during.append((attempt, time.monotonic()))
            run.injected.append({"job": f"seed-{seed}", "what": "filled the disk while it writes a checkpoint", "at": time.time(), "during_checkpoint": True})

    from oomguard.daemon import processes

    with CheckpointWatch(run, on_start=fill):
        while not run.done.is_set():
            with run.lock:
                # Free the disk once the attempt that met the full disk has ended (its
                # processes are gone: with the disk full its shim may write no exit.json).
                if full_during and (not processes.marked_with(str(full_during[0][0])) or time.monotonic() - full_during[0][1] > 60):
                    filler.unlink(missing_ok=True)
                    full_during.clear()
            time.sleep(0.05)
    filler.unlink(missing_ok=True)


def offloads(attempt_dir: Path) -> bool:
    try:
        return json.loads((attempt_dir / "attempt.json").read_text())["plan"]["offload"] != "none"
    except (OSError, ValueError, KeyError):
        return False


def inject_host_memory(run: Run) -> None:
    """Once per job: when an attempt of it that keeps its optimizer in host memory has trained
    a few steps (chosen by the seed), squeeze the host memory of the daemon's cgroup, one
    squeeze at a time. The kernel ends the runner it scores highest (often this job's, maybe
    the other one running)."""
    one_at_a_time = threading.Lock()
    cgroup = run.daemon.cgroup
    assert cgroup is not None

    def one_job(run: Run, seed: int, rng: random.Random) -> None:
        steps = rng.randint(1, 3)
        while True:
            attempt = wait_until(run, seed, lambda: (a := run.newest_attempt(seed)) and offloads(a) and steps_done(a) >= steps and a)
            if attempt is None:
                return
            with one_at_a_time:
                if not live_processes(attempt) or steps_done(attempt) > MAX_STEPS - CHECKPOINT_EVERY:
                    continue  # it ended (or nearly) while another squeeze went on: wait for its next attempt
                episode = squeeze(cgroup)
            run.record(
                seed,
                f"host memory squeezed after step {steps_done(attempt)} of an offloading attempt "
                f"(limit {episode.limit >> 20} MiB, {episode.usage_before >> 20} MiB in use): {episode.kills} OOM kill(s)",
            )
            return

    per_job(run, one_job)


INJECTORS: dict[str, Callable[[Run], None]] = {
    "none": lambda run: None,
    "kill-runner": inject_kill_runner,
    "kill-daemon": inject_kill_daemon,
    "corrupt-checkpoint": inject_corrupt_checkpoint,
    "disk-full": inject_disk_full,
    "host-memory": inject_host_memory,
    # Injected inside the runner (OOMGUARD_INJECT_FAULT, jobs/faults.py); read from the logs.
    "nan-after-precision": lambda run: None,
}


def can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


def run_fault(fault: str, seeds: list[int], base: Path, rng_seed: int, deadline_s: float) -> dict[str, Any]:
    state_dir = base / fault / "state"
    workdirs = base / fault / "work"
    workdirs.mkdir(parents=True)
    mounted = False
    if fault == "disk-full":
        # Room for the jobs' checkpoints and finals, not for the filler.
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(workdirs)], check=True)
        mounted = True
    setting = SETTINGS.get(fault, Setting())
    env = {**os.environ, **THREAD_ENV, **dict(setting.env)}
    cgroup = MemoryCgroup.create(f"oomguard-faults-{os.getpid()}") if setting.in_memory_cgroup else None
    daemon = Daemon(state_dir, env, setting.daemon_args, cgroup)
    run = Run(fault, state_dir, workdirs, seeds, rng_seed, daemon)
    started = time.monotonic()
    try:
        daemon.start()
        # The injector watches before the first job is submitted: a job may write its first
        # checkpoint before the last one is in.
        injector = threading.Thread(target=INJECTORS[fault], args=(run,), daemon=True)
        injector.start()
        for seed in seeds:
            job_file = base / fault / f"seed-{seed}.toml"
            job_file.write_text(setting.job.format(seed=seed, workdir=f'workdir = "{run.job_dir(seed)}"', max_steps=MAX_STEPS, checkpoint_every=CHECKPOINT_EVERY))
            result = oomguard(state_dir, "submit", str(job_file))
            if result.returncode != 0:
                raise RuntimeError(f"submit failed: {result.stdout}{result.stderr}")
        ended = wait_for_jobs(state_dir, len(seeds), started + deadline_s)
        run.done.set()
        injector.join(timeout=120)
        elapsed = time.monotonic() - started
        return measure(run, ended, elapsed, setting)
    finally:
        run.done.set()
        daemon.stop()
        if mounted:
            subprocess.run(["umount", "-l", str(workdirs)], check=False)
        if cgroup is not None:
            try:
                cgroup.remove()
            except OSError as error:
                log(f"{fault}: could not remove {cgroup.path}: {error}")


def wait_for_jobs(state_dir: Path, count: int, deadline: float) -> list[dict[str, Any]]:
    """Every job's record (as `oomguard show --json` prints it) once all have ended, read from
    the store in this process: not one CLI process per job every second beside the jobs."""
    from oomguard.daemon.cli.state import job_record
    from oomguard.daemon.store import TERMINAL_STATES, Store

    while True:
        store = Store(state_dir / "oomguard.db", readonly=True)
        try:
            jobs = store.jobs()
            if len(jobs) >= count and (all(j.state in TERMINAL_STATES for j in jobs) or time.monotonic() > deadline):
                return [json.loads(json.dumps(job_record(store, job))) for job in jobs]
        finally:
            store.close()
        time.sleep(1.0)


_RESUMED = re.compile(r"resumed from checkpoint at step (\d+)")


def measure(run: Run, records: list[dict[str, Any]], elapsed: float, setting: Setting) -> dict[str, Any]:
    jobs = []
    for record in records:
        steps_trained = 0
        resumes: list[tuple[float, int]] = []
        skipped = 0
        for attempt in record["attempts"]:
            directory = Path(attempt["directory"])
            metrics = directory / "metrics.jsonl"
            if metrics.exists():
                steps_trained += sum(1 for line in metrics.read_text().splitlines() if line.strip())
            log_text = (directory / "output.log").read_text(errors="replace") if (directory / "output.log").exists() else ""
            for found in _RESUMED.finditer(log_text):
                resumes.append((attempt["started_at"], int(found.group(1))))
            skipped += log_text.count("skipping damaged checkpoint") + log_text.count("its weights hold NaN or inf")
            for line in log_text.splitlines():
                if line.startswith("oomguard fault injection: "):
                    run.injected.append({"job": record["name"], "what": line.removeprefix("oomguard fault injection: "), "at": attempt["started_at"]})
        final = Path(record["workdir"]) / "final" / "diffusion_pytorch_model.safetensors"
        finished = record["state"] == "finished" and final.is_file() and all_finite(final)
        if finished:  # kept beside the state directory: the workdirs may be on a tmpfs that goes
            kept = run.state_dir.parent / "finals" / f"{record['name']}.safetensors"
            kept.parent.mkdir(exist_ok=True)
            shutil.copyfile(final, kept)
            final = kept
        corrupt_loaded = sum(
            1 for started_at, step in resumes for d in run.damages if d.job == record["name"] and d.step == step and d.at < started_at
        )
        jobs.append({
            "name": record["name"], "state": record["state"], "finished": finished,
            "diverged": sum(1 for a in record["attempts"] if (a.get("outcome") or {}).get("kind") == "diverged"),
            "host_oom": sum(1 for a in record["attempts"] if (a.get("outcome") or {}).get("kind") == "host_oom"),
            "attempts": len(record["attempts"]),
            "steps_trained": steps_trained, "recomputed": max(0, steps_trained - MAX_STEPS), "damaged_skipped": skipped,
            "corrupt_loaded": corrupt_loaded, "final": str(final) if finished else None, "result": record.get("result"),
        })
    return {
        "fault": run.fault, "jobs": jobs, "injected": run.injected, "damages": [vars(d) for d in run.damages],
        "daemon_starts": run.daemon.starts, "seconds": round(elapsed, 1),
    }


def all_finite(path: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    return all(bool(torch.isfinite(t).all()) for t in load_file(str(path)).values() if t.is_floating_point())


def same_weights(a: str | None, b: str | None) -> bool | None:
    if a is None or b is None:
        return None
    import torch
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(torch.allclose(x[k], y[k], rtol=1e-5, atol=1e-6) for k in x)


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    reference = {job["name"]: job["final"] for r in results if r["fault"] == "none" for job in r["jobs"]}
    rows = []
    for r in results:
        jobs = r["jobs"]
        comparable = r["fault"] != "none" and SETTINGS.get(r["fault"], Setting()).job == JOB
        equal = [same_weights(job["final"], reference.get(job["name"])) for job in jobs] if comparable else []
        rows.append({
            "fault": r["fault"],
            "jobs": len(jobs),
            "injected": len(r["injected"]),
            "during_checkpoint": sum(1 for i in r["injected"] if i.get("during_checkpoint")),
            "finished": sum(job["finished"] for job in jobs),
            "lost": sum(not job["finished"] for job in jobs),
            "diverged": sum(job["diverged"] for job in jobs),
            "host_oom": sum(job["host_oom"] for job in jobs),
            "recomputed": sum(job["recomputed"] for job in jobs),
            "damaged_skipped": sum(job["damaged_skipped"] for job in jobs),
            "corrupt_loaded": sum(job["corrupt_loaded"] for job in jobs),
            "same_weights": f"{sum(e is True for e in equal)} of {len(equal)}" if comparable else "reference" if r["fault"] == "none" else "n/a",
            "seconds": r["seconds"],
        })
    return rows


def write_report(
    out: Path, rows: list[dict[str, Any]], results: list[dict[str, Any]], command: str, skipped: dict[str, str], update_readme: bool = False,
) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Fault injection",
        "",
        f"Measured {when} on {os.cpu_count()} CPUs ({platform.platform()}), torch {torch.__version__}. Command: `{command}`.",
        "",
        f"Each job: a small UNet, batch 8, {MAX_STEPS} optimizer steps, a checkpoint every {CHECKPOINT_EVERY} (2 kept), "
        "one job per seed, two attempts at once under one real daemon. 'recomputed' is optimizer steps trained beyond "
        "the jobs' max_steps (work a fault threw away); 'same weights' compares each job's final weights with the same "
        "job trained without faults (rtol 1e-5). The host-memory jobs are a larger UNet (64 and 128 channels at 8x8) "
        "that fits its 30 MiB emulated device only with its optimizer offloaded to host memory.",
        "",
        "| fault | jobs | faults injected | of them during a checkpoint write | finished | lost | losses diverged | attempts ended host_oom | steps recomputed | damaged or NaN checkpoints skipped | corrupt checkpoints loaded | same final weights | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['fault']} | {row['jobs']} | {row['injected']} | {row['during_checkpoint']} | {row['finished']} | {row['lost']} | "
            f"{row['diverged']} | {row['host_oom']} | {row['recomputed']} | {row['damaged_skipped']} | {row['corrupt_loaded']} | {row['same_weights']} | {row['seconds']} |"
        )
    for fault, why in skipped.items():
        lines.append(f"| {fault} | skipped: {why} | | | | | | | | | | | |")
    lines += ["", "## What was done to each job", ""]
    for r in results:
        if r["fault"] == "none":
            continue
        lines.append(f"### {r['fault']}")
        lines.append("")
        for job in r["jobs"]:
            what = [i["what"] for i in r["injected"] if i["job"] == job["name"]]
            ending = f" ({job['result']})" if job["state"] != "finished" else ""
            lines.append(
                f"- {job['name']}: {job['state']}{ending} after {job['attempts']} attempt(s), {job['steps_trained']} steps trained; " + ("; ".join(what) or "—")
            )
        daemon_kills = sum(1 for i in r["injected"] if i["job"] is None)
        if daemon_kills:
            lines.append(f"- the daemon was killed {daemon_kills} times and started {r['daemon_starts']} times")
        lines.append("")
    (out / "faults.md").write_text("\n".join(lines) + "\n")
    if update_readme:
        from readme_block import replace_block

        table_end = lines.index("## What was done to each job")
        replace_block("bench/faults.py", lines[2:table_end - 1])
    (out / "faults.json").write_text(json.dumps({"measured": when, "command": command, "summary": rows, "runs": results}, indent=1))


def _stop_on_sigterm(signum: int, frame: object) -> None:
    # The finally blocks stop the daemon and unmount; the temporary directory goes with them.
    raise SystemExit(f"stopped by {signal.Signals(signum).name}")


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="jobs (seeds) per fault (default 20)")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)} (default: all)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where faults.md and faults.json go (default bench/results)")
    parser.add_argument("--deadline", type=float, default=600, help="seconds a fault's jobs may take in all (default 600)")
    parser.add_argument("--update-readme", action="store_true", help="also rewrite the summary in README.md's Benchmarks section")
    args = parser.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        parser.error(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(FAULTS)}")
    skipped: dict[str, str] = {}
    if "disk-full" in faults and not can_mount():
        faults.remove("disk-full")
        skipped["disk-full"] = "needs root to mount a small tmpfs"
    if "host-memory" in faults and (why := host_pressure.unavailable()):
        faults.remove("host-memory")
        skipped["host-memory"] = why
    seeds = list(range(args.seeds))
    command = "python bench/faults.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results = []
    with tempfile.TemporaryDirectory(prefix="oomguard-faults-") as base:
        for number, fault in enumerate(["none", *faults]):
            log(f"{fault}: {len(seeds)} jobs")
            result = run_fault(fault, seeds, Path(base), rng_seed=1000 + number, deadline_s=args.deadline)
            results.append(result)
            log(f"{fault}: done in {result['seconds']} s, {sum(j['finished'] for j in result['jobs'])} of {len(seeds)} finished")
        rows = summarize(results)
        write_report(args.out, rows, results, command.strip(), skipped, update_readme=args.update_readme)
    for row in rows:
        log(json.dumps(row))
    bad = [row for row in rows if row["lost"] or row["corrupt_loaded"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
