#!/usr/bin/env python
"""The speed benchmark: how long oomguard takes to get a job stepping again after an OOM, what
supervising a job costs it per step, and how the daemon copes with a long queue.

1. Recovery latency, from an OOM to the next optimizer step:
   a. in the process: ``oomguard run JOB --emulate-device-memory CAP --json`` on a job whose
      emulated capacity drops before a step; the built-in runner recovers inside the process
      (micro-batch rung). Timestamps: metrics.jsonl's per-step ``time`` and the moment the
      runner's "out of memory ... in-process -> ..." line appears in output.log (read as it
      is written, every 10 ms): the OOM's own moment is not recorded.
   b. with a restart: a real ``oomguard daemon --state-dir DIR`` process and a
      ``trainer = "command"`` job running a small PyTorch script (RESTART_SCRIPT) whose
      micro-batch, for a script, only a new process can change; the attempt ends with the
      OOM, the next attempt (shim, interpreter, torch import, model, checkpoint load) steps
      again. Timestamps: the bootstrap's rank-failed mark (the OOM), the shim's exit.json,
      the store's attempt rows and events, the new attempt's attempt.json, and the moments the
      script prints with time.time().
2. Supervisor overhead: the same job under the daemon (A: daemon + shim + runner) and bare
   twice (B and C: ``python -m oomguard.jobs.run ATTEMPT_DIR`` on copies of the attempt.json
   the daemon wrote, with the environment the daemon gives it). All train at once but take
   turns of a second: the arms not running are stopped whole (SIGSTOP), turns in rounds that
   go through every order of the three, so the shared machine's drift hits all alike. A over
   the bare runs together is the overhead; C over B, two identical bare processes, is the
   control: how far apart two runs of the same process land in this measurement. Median step
   times, ratios with bootstrap intervals over rounds, the runner's CPU time per step and the
   supervisor's own CPU.
3. Queue scale: one daemon with one emulated GPU that a neighbour process has nearly filled,
   so every queued job waits (a job that has not measured its need waits for a 90 % free
   GPU): a sample through ``oomguard submit``, the rest dropped into spool/inbox the way
   submit does it, until the daemon has queued them all; then ``oomguard status`` (the head
   of the queue), ``oomguard status --all`` and ``oomguard show`` wall times, the store's size, and the daemon's CPU use while it idles
   with the whole queue.

Every process the benchmark starts runs with one thread (OMP_NUM_THREADS=1), as in
bench/ladder.py. Results: bench/results/speed.md and speed.json (``--out`` elsewhere).

Run it with ``.venv/bin/python bench/speed.py`` (``--quick`` for a small run of under a
minute; ``--help`` for options).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
os.environ.update(THREAD_ENV)

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
PYTHON = sys.executable
OOMGUARD = str(Path(sys.executable).with_name("oomguard"))
QUEUE_JOB_FILE = ROOT / "jobs" / "examples" / "quickstart.toml"
MiB = 2**20
STARTED = time.monotonic()
# Issue 18's targets for the queue: `oomguard status` of a 10,000-job queue, one `oomguard
# submit` of 1,000 files, and an idle daemon with 100 queued and 4 running jobs.
TARGET_STATUS_S = 0.2
TARGET_SUBMIT_BATCH_S = 10.0
TARGET_IDLE_CPU_PERCENT = 1.0
# The idle measurement: a daemon with 4 emulated GPUs, a slow script on each, 100 jobs queued.
IDLE_RUNNING = 4
IDLE_QUEUED = 100
IDLE_SCRIPT = '''"""A job that trains nothing: a step line every second, for bench/speed.py's idle daemon."""
import sys
import time

for step in range(1, 100_000):
    time.sleep(1.0)
    print(f"step={step}", flush=True)
'''
IDLE_JOB = """name = "idle-{n}"
trainer = "command"

[command]
argv = ["{python}", "{script}", "--micro_batch={{micro_batch}}"]

[train]
batch_size = 8
max_steps = 100000

[resources]
gpus = 1
memory = "8MiB"
"""
TAIL_SECONDS = 0.01
TARGET_OVERHEAD = 1.01

# The jobs. Small models at 16x16 so that the steps are short on two shared cores.
MODEL_QUICKSTART = """[model]
block_out_channels = [32, 64]
layers_per_block = 1
down_block_types = ["DownBlock2D", "AttnDownBlock2D"]
up_block_types = ["AttnUpBlock2D", "UpBlock2D"]
norm_num_groups = 8
"""
JOB = """name = "{name}"
trainer = "unconditional"

[data]
source = "synthetic:64"
resolution = 16

{model}
[train]
batch_size = {batch_size}
max_steps = {max_steps}
learning_rate = 1e-4
seed = 0
mixed_precision = "no"
checkpoint_every_steps = {checkpoint_every_steps}

[ladder]
allow = {allow}
"""

# 1a: the quickstart model; the full batch of 16 peaks at about 43 MiB, micro-batch 8 at 28.
IN_PROCESS_DROP = 4
IN_PROCESS_CAP = f"60MiB,32MiB@{IN_PROCESS_DROP}"
# 1b: a command job running RESTART_SCRIPT; the emulated capacity is counted in optimizer steps
# of each process. Measured: the whole batch of 1024 needs 14-16 MiB, 512 x 2 fits 12 MiB.
RESTART_DROP = 4
RESTART_CAP = f"64MiB,13MiB@{RESTART_DROP}"
RESTART_JOB = """name = "speed-restart"
trainer = "command"

[command]
argv = ["{python}", "{script}", "--micro_batch={{micro_batch}}", "--grad_accum={{grad_accum}}",
        "--max_steps={max_steps}", "--checkpoint_every=2", "--output_dir={{workdir}}/out"]

[train]
batch_size = 1024
max_steps = {max_steps}
"""
# A small PyTorch script that knows nothing of oomguard: its own checkpoints (resumed from the
# newest), a "step=N" progress line per optimizer step (which oomguard reads), and the moments
# it reaches (after Python started, after import torch, after building the model, after loading
# the checkpoint, after each step) printed with time.time().
RESTART_SCRIPT = '''"""A small training script for bench/speed.py: a restart's parts, timed from inside."""
import time

START = time.time()
print(f"speed-script: start {START:.6f}", flush=True)
import argparse  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402

import torch  # noqa: E402

print(f"speed-script: imported torch {time.time():.6f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--micro_batch", type=int, required=True)
    parser.add_argument("--grad_accum", type=int, required=True)
    parser.add_argument("--max_steps", type=int, required=True)
    parser.add_argument("--checkpoint_every", type=int, default=2)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.SiLU(), torch.nn.Linear(512, 512), torch.nn.SiLU(), torch.nn.Linear(512, 64)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(4096, 64)
    micro, accum = args.micro_batch, args.grad_accum
    print(f"speed-script: built {time.time():.6f} micro_batch={micro} grad_accum={accum}", flush=True)
    step = 0
    os.makedirs(args.output_dir, exist_ok=True)
    found = [name for name in os.listdir(args.output_dir) if re.fullmatch(r"checkpoint-\\d+\\.pt", name)]
    if found:
        newest = max(found, key=lambda name: int(name[len("checkpoint-"):-len(".pt")]))
        state = torch.load(os.path.join(args.output_dir, newest))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        print(f"speed-script: resumed step {step} {time.time():.6f}", flush=True)
    while step < args.max_steps:
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(step))[: micro * accum]
        for i in range(accum):
            batch = data[order[i * micro:(i + 1) * micro]]
            loss = (model(batch) - batch).pow(2).mean() / accum
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        print(f"step={step} time={time.time():.6f} loss={loss.item():.5f}", flush=True)
        if step % args.checkpoint_every == 0 and step < args.max_steps:
            path = os.path.join(args.output_dir, f"checkpoint-{step}.pt")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path + ".tmp")
            os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
'''


def log(text: str) -> None:
    print(f"[{time.monotonic() - STARTED:6.1f}s] {text}", flush=True)


class BenchError(RuntimeError):
    """Something the benchmark needs did not happen (a run failed, timed out, ...)."""


# ----------------------------------------------------------------------------- processes


class Processes:
    """Every process the benchmark starts, each in a session of its own, so that it and what
    it started can be ended; at the end, also whatever still names the scratch folder (the
    daemon's shims and runners run in sessions of their own)."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.started: list[subprocess.Popen[bytes]] = []
        self.closed = False
        self._lock = threading.Lock()

    def popen(self, argv: list[str], *, stdout: Any, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.Popen[bytes]:
        with self._lock:  # after cleanup() has begun, nothing new starts
            if self.closed:
                raise BenchError("the benchmark is stopping")
            process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
            )
            self.started.append(process)
        return process

    def stop(self, process: subprocess.Popen[bytes], timeout: float = 20.0) -> int | None:
        if process.poll() is None:
            _killpg(process.pid, signal.SIGTERM)
            _killpg(process.pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        return process.returncode

    def cleanup(self) -> int:
        """End everything; returns how many stray processes had to be killed at the end."""
        with self._lock:
            self.closed = True
        for process in reversed(self.started):
            try:
                self.stop(process, timeout=10)
            except Exception as error:  # noqa: BLE001 - go on with the others
                log(f"could not stop pid {process.pid}: {error}")
        return self.sweep()

    def sweep(self) -> int:
        """SIGKILL every process whose command line or environment names the scratch folder
        (shims, runners, neighbours), other than this one."""
        mark = str(self.scratch).encode()
        killed = 0
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
                continue
            try:
                found = mark in (pid_dir / "cmdline").read_bytes() or mark in (pid_dir / "environ").read_bytes()
            except OSError:
                continue
            if found:
                try:
                    os.kill(int(pid_dir.name), signal.SIGKILL)
                    killed += 1
                except (ProcessLookupError, PermissionError):
                    pass
        return killed


def _killpg(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int | None:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


# ----------------------------------------------------------------------------- reading files as they are written


class Tailer:
    """Reads files as they grow and stamps each line with the wall-clock time it was first
    seen (time.time(), like the runner's own timestamps), every TAIL_SECONDS."""

    def __init__(self) -> None:
        self._files: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tailer", daemon=True)
        self._thread.start()

    def watch(self, path: Path) -> None:
        with self._lock:
            self._files.setdefault(str(path), {"offset": 0, "partial": b"", "lines": []})

    def _run(self) -> None:
        while not self._stop.wait(TAIL_SECONDS):
            self.poll()

    def poll(self) -> None:
        with self._lock:
            for path, state in self._files.items():
                if state.get("done"):
                    continue
                now = time.time()
                try:
                    if os.stat(path).st_size <= state["offset"]:
                        continue
                    with open(path, "rb") as handle:
                        handle.seek(state["offset"])
                        data = handle.read()
                except OSError:
                    continue
                state["offset"] += len(data)
                *complete, state["partial"] = (state["partial"] + data).split(b"\n")
                state["lines"].extend((now, line.decode("utf-8", "replace")) for line in complete)

    def first(self, path: Path, pattern: str) -> float | None:
        """When the first line of ``path`` matching the regular expression was seen."""
        self.poll()
        with self._lock:
            lines = self._files.get(str(path), {}).get("lines", [])
            return next((t for t, line in lines if re.search(pattern, line)), None)

    def done(self, path: Path) -> None:
        """Read what is there and stop reading ``path`` (its lines stay)."""
        self.poll()
        with self._lock:
            if str(path) in self._files:
                self._files[str(path)]["done"] = True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


# ----------------------------------------------------------------------------- helpers


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def store_rows(database: Path, sql: str, args: Iterable[Any] = ()) -> list[dict[str, Any]]:
    """Rows of the daemon's SQLite store, read-only (the daemon keeps writing)."""
    connection = sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=10)
    connection.row_factory = sqlite3.Row
    try:
        return [dict(row) for row in connection.execute(sql, list(args))]
    finally:
        connection.close()


def metrics_rows(attempt_dir: Path) -> dict[int, dict[str, Any]]:
    """metrics.jsonl by step (the step count after the step: row N ends step index N-1)."""
    path = attempt_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass  # a line cut short by a kill
    return {row["step"]: row for row in rows}


def intervals(rows: dict[int, dict[str, Any]], first: int, last: int) -> list[float]:
    """Wall time between consecutive metrics rows, for rows first+1 .. last."""
    return [rows[n]["time"] - rows[n - 1]["time"] for n in range(first + 1, last + 1) if n in rows and n - 1 in rows]


def mtime(path: Path) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def med(values: Iterable[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def spread(values: Iterable[float | None]) -> dict[str, Any]:
    values = [v for v in values if v is not None]
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values)}


def cli(processes: Processes, args: list[str], out: Path, timeout: float) -> tuple[float, int, str]:
    """One `oomguard` command: (wall seconds, exit code, its output)."""
    with out.open("wb") as handle:
        started = time.perf_counter()
        process = processes.popen([OOMGUARD, *args], stdout=handle)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            processes.stop(process)
            raise BenchError(f"`oomguard {' '.join(args)}` took more than {timeout:.0f} s") from None
        wall = time.perf_counter() - started
    return wall, code, out.read_text(errors="replace")


class Daemon:
    """A real `oomguard daemon` process; its output goes to STATE/daemon.out."""

    def __init__(self, processes: Processes, state_dir: Path, *options: str) -> None:
        self.processes = processes
        self.state_dir = state_dir
        self.database = state_dir / "oomguard.db"
        state_dir.mkdir(parents=True, exist_ok=True)
        self.output_path = state_dir / "daemon.out"
        with self.output_path.open("ab") as output:
            self.process = processes.popen([OOMGUARD, "--state-dir", str(state_dir), "daemon", *options], stdout=output)
        wait_for(lambda: "watching" in self.output() or self.process.poll() is not None, 60, "the daemon to start")
        if self.process.poll() is not None:
            raise BenchError(f"the daemon exited with {self.process.returncode}:\n{self.output()[-2000:]}")

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.output_path.read_text(errors="replace") if self.output_path.exists() else ""

    def submit(self, job_file: Path, scratch: Path, wait: float = 120) -> tuple[float, int]:
        """`oomguard submit --wait`: (wall seconds until it says the daemon queued the job, job id)."""
        wall, code, text = cli(self.processes, ["--state-dir", str(self.state_dir), "submit", str(job_file), "--wait", str(wait)],
                               scratch / "submit.out", wait + 30)
        found = re.search(r"job (\d+) \(.*\) queued", text)
        if code != 0 or not found:
            raise BenchError(f"oomguard submit {job_file} exited {code}: {text[-1000:]}")
        return wall, int(found.group(1))

    def job(self, job_id: int) -> dict[str, Any]:
        return store_rows(self.database, "select * from jobs where id = ?", [job_id])[0]

    def wait_job(self, job_id: int, timeout: float) -> dict[str, Any]:
        def ended() -> dict[str, Any] | None:
            job = self.job(job_id)
            if self.process.poll() is not None:
                raise BenchError(f"the daemon exited with {self.process.returncode}:\n{self.output()[-2000:]}")
            return job if job["state"] in ("finished", "failed", "cancelled") else None

        return wait_for(ended, timeout, f"job {job_id} to end", interval=0.1)

    def stop(self) -> int | None:
        return self.processes.stop(self.process, timeout=30)


def write_job(folder: Path, name: str, model: str, batch_size: int, max_steps: int, checkpoint_every_steps: int, allow: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    path.write_text(JOB.format(name=name, model=model, batch_size=batch_size, max_steps=max_steps,
                               checkpoint_every_steps=checkpoint_every_steps, allow=json.dumps(allow)))
    return path


# ----------------------------------------------------------------------------- 1a. in-process recovery


def in_process_recovery(processes: Processes, tailer: Tailer, scratch: Path, reps: int, timeout: float) -> dict[str, Any]:
    # Over 60 lines: one measurement's set-up, runs and figures, in the order they happen.
    folder = scratch / "in-process"
    max_steps = IN_PROCESS_DROP + 4
    job_file = write_job(folder, "speed-in-process", MODEL_QUICKSTART, 16, max_steps, 1000, ["allocator", "micro_batch", "checkpointing"])
    runs = []
    for rep in range(1, reps + 1):
        workdir = folder / f"run-{rep}"
        attempt_dir = workdir / "attempts" / "001"
        tailer.watch(attempt_dir / "output.log")
        arguments = ["run", str(job_file), "--workdir", str(workdir), "--emulate-device-memory", IN_PROCESS_CAP, "--json"]
        wall, code, text = cli(processes, arguments, folder / f"run-{rep}.out", timeout)
        try:
            record = json.loads(text[re.search(r"^\{", text, re.M).start():])
        except (ValueError, AttributeError):
            raise BenchError(f"in-process run {rep}: exit code {code}, no JSON:\n{text[-2000:]}") from None
        attempts = record["attempts"]
        recoveries = [r for a in attempts for r in (a["outcome"] or {}).get("recoveries") or [] if r["reason"].startswith("in-process")]
        rows = metrics_rows(attempt_dir)
        problems = []
        if record["state"] != "finished":
            problems.append(f"the job ended {record['state']}")
        if len(attempts) != 1:
            problems.append(f"{len(attempts)} attempts (expected 1: the recovery is in-process)")
        if [r["step"] for r in recoveries] != [IN_PROCESS_DROP]:
            problems.append(f"in-process recoveries at steps {[r['step'] for r in recoveries]} (expected one at {IN_PROCESS_DROP})")
        tailer.done(attempt_dir / "output.log")
        line_at = tailer.first(attempt_dir / "output.log", rf"out of memory in \w+ at step {IN_PROCESS_DROP}; in-process")
        last_good = rows.get(IN_PROCESS_DROP, {}).get("time")
        next_step = rows.get(IN_PROCESS_DROP + 1, {}).get("time")
        if None in (line_at, last_good, next_step):
            problems.append("a timestamp is missing (metrics row or the recovery line)")
        if problems:
            raise BenchError(f"in-process run {rep}: " + "; ".join(problems) + f"\n{text[-1500:]}")
        step_before = med(intervals(rows, 1, IN_PROCESS_DROP))
        step_after = med(intervals(rows, IN_PROCESS_DROP + 1, max_steps))
        total = next_step - last_good
        run = {
            "rep": rep,
            "wall_s": wall,
            "from_plan": _short(recoveries[0]["from"]),
            "to_plan": _short(recoveries[0]["to"]),
            "reason": recoveries[0]["reason"],
            "step_before_s": step_before,
            "step_after_s": step_after,
            "parts_s": {
                # The OOM's own moment is recorded nowhere: these two parts split at the
                # recovery line, which the runner prints after freeing and deciding.
                "failed_step_free_decide": line_at - last_good,
                "switch_and_rerun_step": next_step - line_at,
            },
            "total_s": total,
            "lost_s": total - step_after if step_after is not None else None,
        }
        runs.append(run)
        log(f"in-process {rep}/{reps}: [{run['from_plan']}] -> [{run['to_plan']}]: last good step -> next step {total:.2f} s "
            f"(recovery line after {run['parts_s']['failed_step_free_decide']:.2f} s; a step of the new plan takes {step_after:.2f} s)")
    parts = {name: spread(r["parts_s"][name] for r in runs) for name in runs[0]["parts_s"]}
    return {
        "job": job_file.read_text(),
        "cap": IN_PROCESS_CAP,
        "command": f"oomguard run JOB --workdir DIR --emulate-device-memory {IN_PROCESS_CAP} --json",
        "runs": runs,
        "parts": parts,
        "total": spread(r["total_s"] for r in runs),
        "lost": spread(r["lost_s"] for r in runs),
        "step_before": spread(r["step_before_s"] for r in runs),
        "step_after": spread(r["step_after_s"] for r in runs),
    }


def _short(plan: dict[str, Any]) -> str:
    from oomguard.strategies.plan import Plan

    return Plan.from_dict(plan).short()


# ----------------------------------------------------------------------------- 1b. recovery with a restart

RESTART_PARTS = [
    ("failed_step", "last good step -> the OOM reaches the script's top level (the bootstrap's mark: rank-failed `at`)"),
    ("process_exit", "-> the process is gone (the shim's exit.json `ended_at`: interpreter teardown, the shim ending the attempt)"),
    ("daemon_notices", "-> the daemon has collected the attempt (its `ended_at`; the daemon polls every 0.5 s)"),
    ("decision", "-> the doctor has decided (the `escalated` event)"),
    ("start_bookkeeping", "-> the next attempt is recorded and its shim about to start (its `started_at`)"),
    ("shim_start", "-> the shim runs (it has written attempt.json: its mtime)"),
    ("interpreter_start", "-> the script's first line (Python and oomguard's bootstrap sitecustomize)"),
    ("torch_import", "-> `import torch` done (the emulated device installed with it)"),
    ("model_build", "-> model, optimizer and data built"),
    ("checkpoint_load", "-> checkpoint loaded"),
    ("first_step", "-> first optimizer step of the new attempt done"),
]


def _stamp(text: str, pattern: str) -> float | None:
    """The time a script line matching ``pattern`` (its first group) carries."""
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else None


def restart_recovery(processes: Processes, scratch: Path, reps: int, timeout: float) -> dict[str, Any]:
    # Over 60 lines: one measurement's set-up, runs and figures, in the order they happen.
    folder = scratch / "restart"
    folder.mkdir(parents=True)
    max_steps = RESTART_DROP + 2
    script = folder / "train.py"
    script.write_text(RESTART_SCRIPT)
    job_file = folder / "speed-restart.toml"
    job_file.write_text(RESTART_JOB.format(python=PYTHON, script=script, max_steps=max_steps))
    state_dir = folder / "state"
    daemon = Daemon(processes, state_dir, "--emulate-device-memory", RESTART_CAP, "--stop-jobs")
    runs = []
    try:
        for rep in range(1, reps + 1):
            _, job_id = daemon.submit(job_file, folder)
            job = daemon.wait_job(job_id, timeout)
            attempts = store_rows(daemon.database, "select * from attempts where job_id = ? order by number", [job_id])
            events = store_rows(daemon.database, "select * from events where job_id = ? order by id", [job_id])
            if job["state"] != "finished" or len(attempts) != 2:
                raise BenchError(f"restart run {rep}: the job ended {job['state']} after {len(attempts)} attempts (expected finished "
                                 f"after 2): {job['result']}\n{daemon.output()[-2000:]}")
            first, second = attempts
            outcome = json.loads(first["outcome"])
            if outcome["kind"] != "oom" or outcome["step"] != RESTART_DROP:
                raise BenchError(f"restart run {rep}: attempt 1 ended {outcome['kind']} at step {outcome['step']} (expected an OOM after step {RESTART_DROP})")
            first_dir, second_dir = Path(first["directory"]), Path(second["directory"])
            log1, log2 = (first_dir / "output.log").read_text(errors="replace"), (second_dir / "output.log").read_text(errors="replace")
            exit_status = json.loads((first_dir / "exit.json").read_text())
            escalated = [e["at"] for e in events if e["kind"] == "escalated" and e["at"] >= first["ended_at"]]
            number = r"(\d+\.\d+)"
            stamps = {
                "last_good": _stamp(log1, rf"^step={RESTART_DROP} time={number}"),
                "oom": (exit_status.get("failed_process") or {}).get("at"),
                "exit": exit_status.get("ended_at"),
                "collected": first["ended_at"],
                "decided": escalated[0] if escalated else None,
                "started": second["started_at"],
                "shim_up": mtime(second_dir / "attempt.json"),
                "script_start": _stamp(log2, rf"^speed-script: start {number}"),
                "imported": _stamp(log2, rf"^speed-script: imported torch {number}"),
                "built": _stamp(log2, rf"^speed-script: built {number}"),
                "resumed": _stamp(log2, rf"^speed-script: resumed step {RESTART_DROP} {number}"),
                "first_step": _stamp(log2, rf"^step={RESTART_DROP + 1} time={number}"),
            }
            missing = [k for k, v in stamps.items() if v is None]
            if missing:
                raise BenchError(f"restart run {rep}: timestamps missing: {', '.join(missing)}\n{log1[-1500:]}\n{log2[-1500:]}")
            order = list(stamps.values())
            parts = {name: order[i + 1] - order[i] for i, (name, _) in enumerate(RESTART_PARTS)}
            steps1 = [_stamp(log1, rf"^step={n} time={number}") for n in range(1, RESTART_DROP + 1)]
            steps2 = [_stamp(log2, rf"^step={n} time={number}") for n in range(RESTART_DROP + 1, max_steps + 1)]
            step_before = med(b - a for a, b in zip(steps1[1:], steps1[2:]) if a and b)
            step_after = med(b - a for a, b in zip(steps2, steps2[1:]) if a and b)
            total = stamps["first_step"] - stamps["last_good"]
            run = {
                "rep": rep,
                "job_id": job_id,
                "from_plan": _short(json.loads(first["plan"])),
                "to_plan": _short(json.loads(second["plan"])),
                "rung": second["rung"],
                "stamps": stamps,
                "parts_s": parts,
                "total_s": total,
                "oom_to_next_step_s": stamps["first_step"] - stamps["oom"],
                "step_before_s": step_before,
                "step_after_s": step_after,
                "lost_s": total - step_after if step_after is not None else None,
            }
            runs.append(run)
            log(f"restart {rep}/{reps}: [{run['from_plan']}] -> [{run['to_plan']}]: OOM -> first step of attempt 2 "
                f"{run['oom_to_next_step_s']:.2f} s (daemon: notices {parts['daemon_notices']:.2f} s, decides {parts['decision']:.3f} s; "
                f"process exit {parts['process_exit']:.2f} s, torch import {parts['torch_import']:.2f} s)")
    finally:
        daemon.stop()
    return {
        "job": job_file.read_text(),
        "script": RESTART_SCRIPT,
        "cap": RESTART_CAP,
        "command": f"oomguard --state-dir DIR daemon --emulate-device-memory {RESTART_CAP} --stop-jobs; oomguard submit JOB",
        "runs": runs,
        "parts": {name: spread(r["parts_s"][name] for r in runs) for name, _ in RESTART_PARTS},
        "part_labels": dict(RESTART_PARTS),
        "total": spread(r["total_s"] for r in runs),
        "oom_to_next_step": spread(r["oom_to_next_step_s"] for r in runs),
        "lost": spread(r["lost_s"] for r in runs),
        "step_before": spread(r["step_before_s"] for r in runs),
        "step_after": spread(r["step_after_s"] for r in runs),
    }


# ----------------------------------------------------------------------------- 2. supervisor overhead

# Steps at the start of each run that are left out: the first builds the optimizer state.
WARM_STEPS = 2
# The orders of the three arms' turns, one per round in turn: each arm goes first, second and
# third equally often, after each of the others equally often.
ROUND_ORDERS = ("ABC", "CBA", "BCA", "ACB", "CAB", "BAC")


def supervisor_overhead(
    processes: Processes, tailer: Tailer, scratch: Path, pairs: int, window: float, timeout: float, deadline: float | None = None, min_pairs: int = 2,
    overlap_start: bool = False,
) -> dict[str, Any]:
    # Over 60 lines: the three arms take turns in one loop, so that machine noise hits all alike.
    """Arm A (daemon + shim + runner) and arms B and C (the runner alone, twice: C is the
    control) train the same job at the same time, but only one arm runs at any moment: the
    others' processes are stopped (SIGSTOP, all of them: daemon, shim and runner), and the arms
    take turns of ``window`` seconds, ``pairs`` rounds of one turn each, the rounds going
    through the six orders of the three arms in turn. Drift of the shared machine's load then
    hits all arms alike, and each arm's start-up is paid once. ``overlap_start`` (--quick)
    starts the arms at once, which saves time and spoils the start-up figures."""
    from oomguard.daemon.as_user import child_environment
    from oomguard.daemon.users import Account
    from oomguard.jobs.attempt import AttemptConfig
    from oomguard.strategies import rungs

    folder = scratch / "overhead"
    # More steps than the benchmark takes: both runs are killed at the end.
    job_file = write_job(folder, "speed-overhead", MODEL_QUICKSTART, 8, 100000, 100000, ["allocator", "micro_batch", "checkpointing"])
    arms: dict[str, dict[str, Any]] = {}
    daemon: Daemon | None = None
    bare: dict[str, subprocess.Popen[bytes]] = {}
    turns: list[dict[str, Any]] = []
    try:
        # A: a daemon, the job submitted to it; once it has trained its warm steps, stopped.
        state_dir = folder / "daemon"
        daemon = Daemon(processes, state_dir, "--stop-jobs")
        a_dir = state_dir / "jobs" / "1" / "attempts" / "001"  # the first job of a fresh daemon
        tailer.watch(a_dir / "output.log")
        _, job_id = daemon.submit(job_file, folder)
        if job_id != 1:
            raise BenchError(f"overhead: the daemon's first job is {job_id}")
        attempt = wait_for(lambda: store_rows(daemon.database, "select * from attempts where job_id = 1 and pid is not null"), 30,
                           "the attempt to start")[0]
        arms["A"] = {"dir": a_dir, "started": attempt["started_at"], "groups": [daemon.pid, attempt["pid"]],
                     "alive": lambda: daemon.process.poll() is None and daemon.job(1)["state"] == "running"}
        wait_for(lambda: (a_dir / "attempt.json").exists(), timeout, "the shim to write attempt.json")

        def hold_a() -> None:
            _warm(arms["A"], timeout)
            arms["A"]["pids"] = {"runner": _runner_pid(a_dir), "daemon": daemon.pid, "shim": attempt["pid"]}
            _signal_groups(arms["A"]["groups"], signal.SIGSTOP)

        if not overlap_start:
            hold_a()
        # B and C: the same runner on copies of the attempt.json the daemon wrote, with the
        # environment the daemon gives an attempt of this user; no daemon, no shim.
        for arm, workdir in (("B", folder / "bare"), ("C", folder / "bare-control")):
            arm_dir = workdir / "attempts" / "001"
            config = AttemptConfig.from_dict({**json.loads((a_dir / "attempt.json").read_text()), "workdir": str(workdir)})
            config.write(arm_dir)
            env = rungs.process_environment(config.plan, child_environment(Account.current(), os.environ))
            tailer.watch(arm_dir / "output.log")
            with (arm_dir / "output.log").open("ab") as output:
                started = time.time()
                process = bare[arm] = processes.popen([PYTHON, "-m", "oomguard.jobs.run", str(arm_dir)], stdout=output, env=env, cwd=workdir)
            arms[arm] = {"dir": arm_dir, "started": started, "groups": [process.pid], "alive": lambda process=process: process.poll() is None}
        if overlap_start:
            hold_a()
        for arm in ("B", "C"):
            _warm(arms[arm], timeout)
            arms[arm]["pids"] = {"runner": bare[arm].pid}
            _signal_groups(arms[arm]["groups"], signal.SIGSTOP)
        for arm in arms.values():  # the start-up lines are in; no more reading during the turns
            tailer.done(arm["dir"] / "output.log")
        if deadline is not None:
            # The turns fit in what is left of the time budget (a loaded machine gets fewer).
            affordable = int((deadline - time.monotonic() - 15) / (len(arms) * (window + 0.15)))
            if affordable < pairs:
                pairs = max(min_pairs, affordable)
                log(f"overhead: {pairs} turns per arm, to keep to the time budget")
        log(f"overhead: the three arms warm; {3 * pairs} turns of {window:g} s, rounds in every order of A, B, C")

        order = [arm for k in range(pairs) for arm in ROUND_ORDERS[k % len(ROUND_ORDERS)]]
        for number, arm in enumerate(order, 1):
            group = arms[arm]
            load_from = os.getloadavg()[0]
            cpu_before = {name: cpu_seconds(pid) for name, pid in group["pids"].items()}
            from_wall = time.time()
            _signal_groups(group["groups"], signal.SIGCONT)
            time.sleep(window)
            _signal_groups(group["groups"], signal.SIGSTOP)
            to_wall = time.time()
            time.sleep(0.05)  # let the stop land before reading the counters
            cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in group["pids"].items()}
            if not group["alive"]():
                raise BenchError(f"overhead: arm {arm} ended:\n{(group['dir'] / 'output.log').read_text()[-2000:]}")
            turns.append({"turn": number, "arm": arm, "from": from_wall, "to": to_wall, "cpu_s": cpu,
                          "load_average": [load_from, os.getloadavg()[0]]})
            if number % 4 == 0 or number == len(order):
                log(f"overhead: {number} of {len(order)} turns")
    finally:
        # Throwaway runs: every process of both arms is killed at once (a checkpoint and a
        # clean exit would only make the benchmark longer); metrics.jsonl has every step.
        for arm in arms.values():
            _signal_groups(arm["groups"], signal.SIGKILL)
        for process in (daemon.process if daemon is not None else None, *bare.values()):
            if process is not None:
                processes.stop(process)

    for arm, group in arms.items():
        group["rows"] = metrics_rows(group["dir"])
    for turn in turns:
        rows = arms[turn["arm"]]["rows"]
        # Steps that began and ended within the turn (the one cut by the stop is left out).
        turn["step_s"] = [rows[n]["time"] - rows[n - 1]["time"] for n in rows
                          if n - 1 in rows and n - 1 > WARM_STEPS and turn["from"] <= rows[n - 1]["time"] and rows[n]["time"] <= turn["to"]]
        turn["compute_s"] = [8 / rows[n]["samples_per_s"] for n in rows
                             if n - 1 in rows and n - 1 > WARM_STEPS and turn["from"] <= rows[n - 1]["time"] and rows[n]["time"] <= turn["to"]]
        turn["steps"] = len(turn["step_s"])
        turn["median_step_s"] = statistics.median(turn["step_s"]) if turn["step_s"] else None
        turn["runner_core_share"] = turn["cpu_s"]["runner"] / (turn["to"] - turn["from"])
    startup = {}
    for arm, group in arms.items():
        first_line = tailer.first(group["dir"] / "output.log", r"^attempt 1 of job")
        ready = tailer.first(group["dir"] / "output.log", r"^no checkpoint: starting at step 0")
        if first_line is not None and ready is not None:
            startup[arm] = {"interpreter": first_line - group["started"], "imports_and_build": ready - first_line,
                            "first_step": group["rows"][1]["time"] - ready}
    a, b, c = ([t for t in turns if t["arm"] == arm] for arm in "ABC")
    if not all(t["step_s"] for t in turns):
        raise BenchError("overhead: a turn had no whole step (make --window longer)")
    # The turns of one round are next to each other in time: the unit the intervals resample.
    rounds = list(zip(a, b, c))
    overhead_blocks = [([x], [y, z]) for x, y, z in rounds]
    control_blocks = [([z], [y]) for x, y, z in rounds]

    def median_of(group: list[dict[str, Any]], key: str = "step_s") -> float:
        return statistics.median([x for t in group for x in t[key]])

    ratio = median_of(a) / median_of(b + c)
    low, high = _bootstrap_ratio(overhead_blocks, "step_s")
    compute_ratio = median_of(a, "compute_s") / median_of(b + c, "compute_s")
    compute_low, compute_high = _bootstrap_ratio(overhead_blocks, "compute_s")
    control = median_of(c) / median_of(b)
    control_low, control_high = _bootstrap_ratio(control_blocks, "step_s")
    steps = {arm: sum(t["steps"] for t in group) for arm, group in (("A", a), ("B", b), ("C", c))}
    cpu_per_step = {arm: sum(t["cpu_s"]["runner"] for t in group) / steps[arm] for arm, group in (("A", a), ("B", b), ("C", c))}
    supervisor_cpu = sum(t["cpu_s"]["daemon"] + t["cpu_s"]["shim"] for t in a) / sum(t["cpu_s"]["runner"] for t in a)
    seconds_a = sum(t["to"] - t["from"] for t in a)
    result = {
        "job": job_file.read_text(),
        "order": "".join(order),
        "window_s": window,
        "turns": turns,
        "steps": steps,
        "daemon_median_step_s": median_of(a),
        "bare_median_step_s": median_of(b + c),
        "median_step_s": {"A": median_of(a), "B": median_of(b), "C": median_of(c)},
        "ratio": ratio,
        "ratio_ci95": [low, high],
        "round_ratios": [x["median_step_s"] / statistics.median([y["median_step_s"], z["median_step_s"]]) for x, y, z in rounds],
        "control_ratio": control,
        "control_ratio_ci95": [control_low, control_high],
        "compute_ratio": compute_ratio,
        "compute_ratio_ci95": [compute_low, compute_high],
        "runner_cpu_per_step_s": cpu_per_step,
        "cpu_per_step_ratio": cpu_per_step["A"] / ((cpu_per_step["B"] + cpu_per_step["C"]) / 2),
        "supervisor_cpu_fraction": supervisor_cpu,
        "daemon_cpu_percent": 100 * sum(t["cpu_s"]["daemon"] for t in a) / seconds_a,
        "shim_cpu_percent": 100 * sum(t["cpu_s"]["shim"] for t in a) / seconds_a,
        "runner_core_share": {arm: sum(t["cpu_s"]["runner"] for t in group) / sum(t["to"] - t["from"] for t in group)
                              for arm, group in (("A", a), ("B", b), ("C", c))},
        "target": TARGET_OVERHEAD,
        "startup": startup,
    }
    log(f"overhead: median step {ms(result['daemon_median_step_s'])} ms under the daemon, {ms(result['bare_median_step_s'])} ms bare: "
        f"ratio {ratio:.3f} ({low:.3f} - {high:.3f}); control (two bare runs) {control:.3f} ({control_low:.3f} - {control_high:.3f}); "
        f"runner CPU per step ratio {result['cpu_per_step_ratio']:.3f}; "
        f"supervisor CPU {100 * supervisor_cpu:.2f} % of the runner's")
    return result


def _warm(arm: dict[str, Any], timeout: float) -> None:
    wait_for(lambda: len(metrics_rows(arm["dir"])) >= WARM_STEPS or not arm["alive"](), timeout, "the warm steps")
    if not arm["alive"]():
        raise BenchError(f"overhead: a run ended early:\n{(arm['dir'] / 'output.log').read_text()[-2000:]}")


def _signal_groups(groups: list[int], signum: int) -> None:
    for group in groups:
        _killpg(group, signum)


def _bootstrap_ratio(blocks: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]], key: str, rounds: int = 2000) -> tuple[float, float]:
    """95 % interval of median(numerator turns) / median(denominator turns) over their steps,
    resampling the blocks (the turns of one round: the round-to-round swings of the shared
    machine count), then the steps within each chosen turn; fixed seed."""
    rng = random.Random(0)
    ratios = []
    for _ in range(rounds):
        chosen = rng.choices(blocks, k=len(blocks))
        top = [x for numerator, _ in chosen for turn in numerator for x in rng.choices(turn[key], k=len(turn[key]))]
        bottom = [x for _, denominator in chosen for turn in denominator for x in rng.choices(turn[key], k=len(turn[key]))]
        ratios.append(statistics.median(top) / statistics.median(bottom))
    ratios.sort()
    return ratios[int(0.025 * rounds)], ratios[int(0.975 * rounds) - 1]


def _runner_pid(attempt_dir: Path) -> int | None:
    """The runner of ``attempt_dir``, by its command line."""
    wanted = ["-m", "oomguard.jobs.run", str(attempt_dir)]
    for pid_dir in Path("/proc").iterdir():
        if pid_dir.name.isdigit():
            try:
                arguments = (pid_dir / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if arguments[1:4] == wanted:
                return int(pid_dir.name)
    return None


# ----------------------------------------------------------------------------- 3. queue scale


def queue_scale(
    processes: Processes, scratch: Path, jobs: int, batch: int, cli_sample: int, repeats: int, status_repeats: int, idle_seconds: float,
    timeout: float,
) -> dict[str, Any]:
    # Over 60 lines: one measurement's set-up, runs and figures, in the order they happen.
    from oomguard.daemon.inbox import spool_text, write_to_inbox

    folder = scratch / "queue"
    state_dir = folder / "state"
    daemon = Daemon(processes, state_dir, "--emulate-gpus", "1x64MiB")
    result: dict[str, Any] = {"jobs": jobs, "job_file": str(QUEUE_JOB_FILE.relative_to(ROOT)), "daemon": "oomguard daemon --emulate-gpus 1x64MiB"}
    try:
        # The daemon idle with an empty queue: the baseline for its CPU use.
        result["idle_empty"] = _idle(daemon, min(idle_seconds, 5.0))
        log(f"queue: daemon idle with an empty queue: {result['idle_empty']['cpu_percent']:.1f} % of a core")
        # A neighbour holds 60 of the GPU's 64 MiB: nothing can be placed while it does.
        with (folder / "neighbour.out").open("ab") as output:
            neighbour = processes.popen([OOMGUARD, "--state-dir", str(state_dir), "neighbour", "--gpu", "0", "--take", "60MiB",
                                         "--seconds", "86400"], stdout=output)
        wait_for(lambda: "holds" in (folder / "neighbour.out").read_text(), 30, "the neighbour to take the GPU")

        def queued() -> int:
            return store_rows(daemon.database, "select count(*) as n from jobs where state = 'queued'")[0]["n"]

        def waiting() -> int:
            return store_rows(daemon.database, "select count(*) as n from jobs where waiting is not null")[0]["n"]

        # One `oomguard submit` of `batch` job files (it waits until the daemon has queued them all).
        batch_dir = folder / "batch"
        batch_dir.mkdir()
        for i in range(batch):
            shutil.copy(QUEUE_JOB_FILE, batch_dir / f"b{i:04d}.toml")
        files = sorted(str(path) for path in batch_dir.glob("*.toml"))
        wall, code, out = cli(processes, ["--state-dir", str(state_dir), "submit", *files], folder / "submit-batch.out", timeout)
        said = len(re.findall(r"^job \d+ \(.*\) queued$", out, flags=re.M))
        if code != 0 or said != batch or queued() != batch:
            raise BenchError(f"oomguard submit of {batch} files exited {code}, said {said} queued, {queued()} in the store: {out[-1000:]}")
        result["submit_batch"] = {"files": batch, "seconds": wall, "jobs_per_s": batch / wall, "target_s": TARGET_SUBMIT_BATCH_S}
        log(f"queue: one oomguard submit of {batch} files: {wall:.1f} s ({batch / wall:.0f} jobs/s)")

        # The rest: dropped into the inbox as `oomguard submit` writes them (temp name, rename).
        text = spool_text(QUEUE_JOB_FILE, QUEUE_JOB_FILE.parent)
        rest = jobs - batch
        dropped_from = time.time()
        for i in range(rest):
            write_to_inbox(state_dir / "spool" / "inbox", f"q{i:05d}", text)
        dropped_in = time.time() - dropped_from
        log(f"queue: dropped {rest} files into the inbox in {dropped_in:.1f} s")
        last_said = time.monotonic()
        progress: list[tuple[float, int]] = []  # (seconds since the first file, jobs queued)
        while (count := queued()) < jobs:
            progress.append((time.time() - dropped_from, count))
            if daemon.process.poll() is not None:
                raise BenchError(f"the daemon exited:\n{daemon.output()[-2000:]}")
            if time.time() - dropped_from > max(timeout, 900):
                raise BenchError(f"after {max(timeout, 900):.0f} s the daemon had queued {count} of {jobs} jobs")
            if time.monotonic() - last_said > 10:
                log(f"queue: {count} of {jobs} queued, {(count - batch) / (time.time() - dropped_from):.0f} jobs/s")
                last_said = time.monotonic()
            time.sleep(0.1)
        queued_in = time.time() - dropped_from
        progress.append((queued_in, count))
        wait_for(lambda: waiting() >= jobs, max(timeout, 900), "every queued job to be marked waiting", interval=0.2)
        waiting_in = time.time() - dropped_from
        # When a quarter, half, three quarters of the inbox files were queued.
        quarters = {f"{q}%": next(t for t, n in progress if n - batch >= rest * q / 100) for q in (25, 50, 75, 100)}
        result["inbox"] = {"files": rest, "drop_s": dropped_in, "queued_s": queued_in, "jobs_per_s": rest / queued_in,
                           "all_waiting_s": waiting_in, "queued_after_s": quarters, "progress": progress[::10] + progress[-1:]}
        log(f"queue: the daemon queued {rest} inbox files in {queued_in:.1f} s ({rest / queued_in:.0f} jobs/s); "
            f"all {jobs} marked waiting after {waiting_in:.1f} s")
        if any(r["state"] != "queued" for r in store_rows(daemon.database, "select distinct state from jobs")):
            raise BenchError("a job left the queue: the benchmark needs them all waiting")

        result["idle_full"] = _idle(daemon, idle_seconds)
        log(f"queue: daemon idle with {jobs} queued jobs: {result['idle_full']['cpu_percent']:.1f} % of a core")

        sizes = {suffix or "db": os.path.getsize(f"{daemon.database}{suffix}") for suffix in ("", "-wal", "-shm")
                 if os.path.exists(f"{daemon.database}{suffix}")}
        result["store_bytes"] = sizes
        result["store_bytes_total"] = sum(v for k, v in sizes.items() if k != "-shm")
        result["events"] = store_rows(daemon.database, "select count(*) as n from events")[0]["n"]
        result["daemon_rss_bytes"] = rss_bytes(daemon.pid)
        log(f"queue: store {result['store_bytes_total'] / MiB:.1f} MiB (db + wal), daemon RSS {result['daemon_rss_bytes'] / MiB:.0f} MiB")

        # `status` lists the head of the queue (STATUS_QUEUED_SHOWN jobs) with the counts of
        # all; `status --all` lists every job.
        from oomguard.daemon.cli.status_limits import STATUS_QUEUED_SHOWN
        from oomguard.daemon.cli.status_limits import STATUS_PAGE_SIZE

        middle = max(1, jobs // STATUS_PAGE_SIZE // 2)
        listings = (
            ("status", [], min(jobs, STATUS_QUEUED_SHOWN)), ("status_page", ["--page", str(middle)], min(jobs, STATUS_PAGE_SIZE)),
            ("status_all", ["--all"], jobs),
        )
        for key, extra, expected in listings:
            walls = []
            for r in range(status_repeats):
                wall, code, out = cli(processes, ["--state-dir", str(state_dir), "status", *extra], folder / f"{key}.out", timeout)
                rows = sum(1 for line in out.splitlines() if re.search(r"│\s*queued\s*│", line))
                if code != 0 or rows != expected or f"{jobs} queued" not in out.replace("\n", " "):
                    raise BenchError(f"oomguard status {' '.join(extra)} exited {code} with {rows} queued rows (expected {expected})")
                walls.append(wall)
            result[key] = spread(walls)
            log(f"queue: oomguard status {' '.join(extra)} with {jobs} queued jobs: median {result[key]['median']:.2f} s")

        show = []
        result["show_jobs"] = sorted({1, jobs // 2, jobs}) if repeats > 1 else [jobs]
        for job_id in result["show_jobs"]:
            for r in range(repeats):
                wall, code, out = cli(processes, ["--state-dir", str(state_dir), "show", str(job_id)], folder / "show.out", timeout)
                if code != 0 or f"job {job_id} " not in out:
                    raise BenchError(f"oomguard show {job_id} exited {code}: {out[-500:]}")
                show.append(wall)
        result["show"] = spread(show)
        log(f"queue: oomguard show JOB: median {result['show']['median']:.2f} s")

        late = [daemon.submit(QUEUE_JOB_FILE, folder)[0] for _ in range(max(1, cli_sample // 3))]
        result["submit_cli_full"] = {**spread(late), "jobs_per_s": len(late) / sum(late)}
        log(f"queue: oomguard submit x{len(late)} into the full queue: {result['submit_cli_full']['jobs_per_s']:.2f} jobs/s")

        processes.stop(neighbour)
    finally:
        daemon.stop()
    return result


def idle_daemon(processes: Processes, scratch: Path, idle_seconds: float, timeout: float) -> dict[str, Any]:
    """The daemon's own CPU while nothing happens but its attempts running: IDLE_RUNNING command
    jobs (a script that prints a step a second) on as many emulated GPUs, IDLE_QUEUED more
    queued behind them (--max-parallel), measured over at least 10 s."""
    folder = scratch / "idle"
    folder.mkdir()
    script = folder / "idle_script.py"
    script.write_text(IDLE_SCRIPT)
    job_files = []
    for n in range(IDLE_RUNNING + IDLE_QUEUED):
        job_files.append(folder / f"idle-{n:03d}.toml")
        job_files[-1].write_text(IDLE_JOB.format(n=n, python=sys.executable, script=script))
    # --stop-jobs: the attempts end with the daemon (the script runs for a day otherwise).
    daemon = Daemon(processes, folder / "state", "--emulate-gpus", f"{IDLE_RUNNING}x256MiB", "--max-parallel", str(IDLE_RUNNING), "--stop-jobs")
    try:
        wall, code, out = cli(processes, ["--state-dir", str(daemon.state_dir), "submit", *map(str, job_files)], folder / "submit.out", timeout)
        if code != 0:
            raise BenchError(f"oomguard submit exited {code}: {out[-1000:]}")

        def steady() -> bool:
            running = store_rows(daemon.database, "select count(*) as n from jobs where state = 'running'")[0]["n"]
            return running == IDLE_RUNNING and all(
                "step=2" in (Path(a["directory"]) / "output.log").read_text(errors="replace")
                for a in store_rows(daemon.database, "select directory from attempts where ended_at is null")
            )

        wait_for(steady, timeout, f"{IDLE_RUNNING} attempts running and stepping", interval=0.2)
        result = _idle(daemon, max(idle_seconds, 10.0))
        states = {row["state"]: row["n"] for row in store_rows(daemon.database, "select state, count(*) as n from jobs group by state")}
        if states != {"running": IDLE_RUNNING, "queued": IDLE_QUEUED}:
            raise BenchError(f"the jobs changed state while the daemon idled: {states}")
        result.update({"running": IDLE_RUNNING, "queued": IDLE_QUEUED, "target_percent": TARGET_IDLE_CPU_PERCENT,
                       "daemon": f"oomguard daemon --emulate-gpus {IDLE_RUNNING}x256MiB --max-parallel {IDLE_RUNNING}"})
        log(f"idle: daemon with {IDLE_QUEUED} queued and {IDLE_RUNNING} running: {result['cpu_percent']:.2f} % of a core")
        return result
    finally:
        daemon.stop()


def _idle(daemon: Daemon, seconds: float) -> dict[str, Any]:
    time.sleep(min(2.0, seconds / 4))  # let the daemon finish what it was doing
    cpu, wall = cpu_seconds(daemon.pid), time.monotonic()
    time.sleep(seconds)
    cpu, wall = cpu_seconds(daemon.pid) - cpu, time.monotonic() - wall
    return {"seconds": wall, "cpu_s": cpu, "cpu_percent": 100 * cpu / wall}


# ----------------------------------------------------------------------------- report


def n_runs(n: int, word: str = "run") -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "—" if value is None else format(value, spec)


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.0f}"


def overhead_verdict(ov: dict[str, Any], short: bool = False) -> str:
    low, high = ov["ratio_ci95"]
    if high <= TARGET_OVERHEAD:
        return "met" if short else f"within the target of {TARGET_OVERHEAD}"
    if low > TARGET_OVERHEAD:
        return "missed" if short else f"MISSES the target of {TARGET_OVERHEAD}"
    # How far apart two identical bare runs landed: differences smaller than that are noise.
    control = ov.get("control_ratio")
    noise = f"; two identical bare runs differed by {abs(control - 1):.1%} in the same run" if control is not None else ""
    return "not resolved" if short else f"not resolved against the target of {TARGET_OVERHEAD} (the interval straddles it{noise})"


def summary_table(r: dict[str, Any]) -> str:
    ip, rs, ov, q, idle = r.get("in_process"), r.get("restart"), r.get("overhead"), r.get("queue"), r.get("idle")
    lines = ["| measure | median | max (or range) | n | target |", "|---|---|---|---|---|"]
    if ip:
        lines.append(f"| recovery in the process: last good step → next optimizer step, s | {fmt(ip['total']['median'])} | "
                     f"{fmt(ip['total']['max'])} | {ip['total']['n']} | |")
        lines.append(f"| … of which more than one normal step of the new plan, s | {fmt(ip['lost']['median'])} | {fmt(ip['lost']['max'])} | "
                     f"{ip['lost']['n']} | |")
    if rs:
        lines.append(f"| recovery with a restart: the OOM → first step of the next attempt (new process), s | "
                     f"{fmt(rs['oom_to_next_step']['median'])} | {fmt(rs['oom_to_next_step']['max'])} | {rs['total']['n']} | |")
        for name, label in (("daemon_notices", "the daemon noticing the attempt ended"), ("decision", "the doctor's decision"),
                            ("process_exit", "the failed process exiting"), ("torch_import", "the new process importing torch")):
            lines.append(f"| … of which {label}, s | {fmt(rs['parts'][name]['median'])} | {fmt(rs['parts'][name]['max'])} | {rs['total']['n']} | |")
    if ov:
        lines.append(f"| supervisor overhead: median step under the daemon ÷ two bare runners | {ov['ratio']:.3f} | "
                     f"95 % CI {ov['ratio_ci95'][0]:.3f} – {ov['ratio_ci95'][1]:.3f} | {ov['steps']['A']} + {ov['steps']['B']} + "
                     f"{ov['steps']['C']} steps in {len(ov['turns'])} turns | ≤ {TARGET_OVERHEAD}: {overhead_verdict(ov, short=True)} |")
        lines.append(f"| … control: one bare runner ÷ the other (same process, same run) | {ov['control_ratio']:.3f} | "
                     f"95 % CI {ov['control_ratio_ci95'][0]:.3f} – {ov['control_ratio_ci95'][1]:.3f} | | the measurement's own spread |")
        lines.append(f"| … the runner's CPU time per step, under the daemon ÷ bare (mean of the two) | {ov['cpu_per_step_ratio']:.3f} | | | |")
        lines.append(f"| … supervisor CPU (daemon + shim) ÷ the runner's CPU while training, % | {100 * ov['supervisor_cpu_fraction']:.2f} | | | |")
    if q:
        n = q["jobs"]
        lines += [
            f"| one `oomguard submit` of {q['submit_batch']['files']} job files, until the daemon queued them all, s | "
            f"{fmt(q['submit_batch']['seconds'], '.1f')} | {fmt(q['submit_batch']['jobs_per_s'], '.0f')} jobs/s | 1 | "
            f"≤ {TARGET_SUBMIT_BATCH_S:g}: {_met(q['submit_batch']['seconds'] <= TARGET_SUBMIT_BATCH_S)} |",
            f"| inbox files queued by the daemon, jobs/s (until all {n} queued) | {fmt(q['inbox']['jobs_per_s'], '.0f')} | "
            f"{q['inbox']['files']} files in {fmt(q['inbox']['queued_s'], '.1f')} s | 1 | |",
            f"| `oomguard submit` with {n} queued, jobs/s | {fmt(q['submit_cli_full']['jobs_per_s'], '.2f')} | "
            f"{fmt(q['submit_cli_full']['min'])} – {fmt(q['submit_cli_full']['max'])} s each | {q['submit_cli_full']['n']} | |",
            f"| `oomguard status` with {n} queued (the next 20 listed), s | {fmt(q['status']['median'])} | {fmt(q['status']['max'])} | "
            f"{q['status']['n']} | ≤ {TARGET_STATUS_S:g}: {_met(q['status']['median'] <= TARGET_STATUS_S)} |",
            *([f"| `oomguard status --page N` with {n} queued (50 listed), s | {fmt(q['status_page']['median'])} | "
               f"{fmt(q['status_page']['max'])} | {q['status_page']['n']} | |"] if "status_page" in q else []),
            f"| `oomguard status --all` with {n} queued (all listed), s | {fmt(q['status_all']['median'])} | {fmt(q['status_all']['max'])} | {q['status_all']['n']} | |",
            f"| `oomguard show JOB` with {n} queued, s | {fmt(q['show']['median'])} | {fmt(q['show']['max'])} | {q['show']['n']} | |",
            f"| store size with {n} jobs (oomguard.db + -wal), MiB | {q['store_bytes_total'] / MiB:.1f} | "
            f"{', '.join(f'{k} {v / MiB:.1f}' for k, v in q['store_bytes'].items())} | 1 | |",
            f"| daemon CPU while idle with {n} queued jobs, % of a core | {q['idle_full']['cpu_percent']:.1f} | "
            f"empty queue: {q['idle_empty']['cpu_percent']:.1f} % | {q['idle_full']['seconds']:.0f} s | |",
        ]
    if idle:
        lines.append(
            f"| daemon CPU with {idle['queued']} queued and {idle['running']} running jobs, % of a core | {idle['cpu_percent']:.2f} | | "
            f"{idle['seconds']:.0f} s | ≤ {TARGET_IDLE_CPU_PERCENT:g}: {_met(idle['cpu_percent'] <= TARGET_IDLE_CPU_PERCENT)} |"
        )
    return "\n".join(lines)


def _met(held: bool) -> str:
    return "met" if held else "NOT met"


def markdown(r: dict[str, Any]) -> str:
    # Over 60 lines: the report's text, in the order it is read.
    m, s = r["machine"], r["settings"]
    out = [
        "# Speed benchmark",
        "",
        f"Written by `bench/speed.py`; rerun with `{r['command']}`.",
        "",
        f"Measured {m['date']}{' at commit ' + m['commit'] if m.get('commit') else ''} on {m['cpus']} CPUs ({m['platform']}), "
        f"Python {m['python']}, torch {m['torch']}, "
        f"diffusers {m['diffusers']}; every process with one thread (OMP_NUM_THREADS=1); load average "
        f"{m['load_average_at_start']:.1f} at the start and {m['load_average_at_end']:.1f} at the end (the machine is shared). "
        f"Total {r['total_seconds'] / 60:.1f} min{' (--quick: tiny sizes, the figures are not meaningful)' if s['quick'] else ''}. "
        "Device memory is emulated (`--emulate-device-memory`): training is real, on the CPU.",
        "",
        "Time per part (load average at its start → end): " + "; ".join(
            f"{name} {t['seconds']:.0f} s ({t['load_average_at_start']:.1f} → {t['load_average_at_end']:.1f})" for name, t in r.get("timing", {}).items()
        ) + ".",
        "",
        "## Summary",
        "",
        summary_table(r),
        "",
        "## Recovery latency",
        "",
    ]
    ip = r.get("in_process")
    if ip:
        out += [
            "### In the process",
            "",
            f"`{ip['command']}` on the quickstart model at 16x16 (batch 16; the job below): the emulated device shrinks "
            f"to 32 MiB at step {IN_PROCESS_DROP}, the full batch (about 43 MiB) runs out of memory in that step and the runner "
            f"switches to a smaller micro-batch and runs the same step again. {n_runs(len(ip['runs']))}.",
            "",
            "| part | median s | max s |",
            "|---|---|---|",
            f"| last good step → the runner's recovery line (the failed part of the step, freeing it, the doctor's decision) | "
            f"{fmt(ip['parts']['failed_step_free_decide']['median'])} | {fmt(ip['parts']['failed_step_free_decide']['max'])} |",
            f"| → the step done again under the new plan (metrics.jsonl) | {fmt(ip['parts']['switch_and_rerun_step']['median'])} | "
            f"{fmt(ip['parts']['switch_and_rerun_step']['max'])} |",
            f"| **total: last good step → next optimizer step** | **{fmt(ip['total']['median'])}** | **{fmt(ip['total']['max'])}** |",
            f"| a normal step before (old plan) / after (new plan) | {fmt(ip['step_before']['median'])} / {fmt(ip['step_after']['median'])} | |",
            f"| time lost to the OOM (total less one normal step of the new plan) | {fmt(ip['lost']['median'])} | {fmt(ip['lost']['max'])} |",
            "",
            "Plans: " + "; ".join(sorted({f"[{x['from_plan']}] → [{x['to_plan']}]" for x in ip["runs"]})) + ".",
            "",
        ]
    rs = r.get("restart")
    if rs:
        out += [
            "### With a restart",
            "",
            f"A real daemon (`{rs['command']}`) and a `trainer = \"command\"` job running a small PyTorch script (below: its own "
            "checkpoints, a `step=N` progress line, and the moments it reaches printed with `time.time()`). The emulated device "
            f"shrinks from 64 to 13 MiB after {RESTART_DROP} optimizer steps of the process; the script's whole batch of 1024 "
            f"(14-16 MiB) runs out of memory in step {RESTART_DROP + 1}; the daemon reads the OOM from the log and the doctor "
            "halves the micro-batch, which for a script means a new process: attempt 2 resumes from the script's checkpoint "
            f"at step {RESTART_DROP} and does step {RESTART_DROP + 1} again. {n_runs(len(rs['runs']))}.",
            "",
            "| part | median s | max s |",
            "|---|---|---|",
        ]
        out += [f"| {label} | {fmt(rs['parts'][name]['median'], '.3f')} | {fmt(rs['parts'][name]['max'], '.3f')} |"
                for name, label in RESTART_PARTS]
        out += [
            f"| **the OOM → first step of the next attempt** | **{fmt(rs['oom_to_next_step']['median'])}** | "
            f"**{fmt(rs['oom_to_next_step']['max'])}** |",
            f"| last good step → first step of the next attempt | {fmt(rs['total']['median'])} | {fmt(rs['total']['max'])} |",
            f"| a normal step before / after | {fmt(rs['step_before']['median'], '.3f')} / {fmt(rs['step_after']['median'], '.3f')} | |",
            "",
            "Plans: " + "; ".join(sorted({f"[{x['from_plan']}] → [{x['to_plan']}] (rung {x['rung']})" for x in rs["runs"]})) + ". "
            "Most of the model-build part is the script's first `torch.optim.AdamW`, which imports torch._dynamo, sympy and "
            "mpmath (about 800 modules) on first use; the built-in runner pays the same inside its start-up.",
            "",
        ]
    ov = r.get("overhead")
    if ov:
        a, b, c = ([x for x in ov["turns"] if x["arm"] == arm] for arm in "ABC")
        out += [
            "## Supervisor overhead",
            "",
            "The same job (quickstart model at 16x16, batch 8, no memory cap, no periodic checkpoints; below) trains in three "
            "arms at once, but only one arm runs at any moment: A, under a daemon (`oomguard daemon --stop-jobs`, `oomguard "
            "submit`: daemon + shim + runner), and B and C, bare (the runner alone, twice: C is the control). The arms not "
            f"running have all their processes stopped (SIGSTOP: daemon, shim and runner). They take turns of {ov['window_s']:g} s, "
            f"{len(a)} each, in rounds that go through the six orders of the three (here {ov['order'][:18]}...), after "
            f"{WARM_STEPS} warm steps each. A step's time is the wall time between consecutive metrics.jsonl "
            "rows (everything the runner's loop does per step); only steps that began and ended within one turn count.",
            "",
            "| arm | turns | steps | median step ms | runner CPU ms per step | the runner's share of a core while its arm ran |",
            "|---|---|---|---|---|---|",
            f"| A: daemon + shim + runner | {len(a)} | {ov['steps']['A']} | {ms(ov['daemon_median_step_s'])} | "
            f"{1000 * ov['runner_cpu_per_step_s']['A']:.1f} | {100 * ov['runner_core_share']['A']:.0f} % |",
            f"| B: the runner alone | {len(b)} | {ov['steps']['B']} | {ms(ov['median_step_s']['B'])} | "
            f"{1000 * ov['runner_cpu_per_step_s']['B']:.1f} | {100 * ov['runner_core_share']['B']:.0f} % |",
            f"| C: the runner alone, again (control) | {len(c)} | {ov['steps']['C']} | {ms(ov['median_step_s']['C'])} | "
            f"{1000 * ov['runner_cpu_per_step_s']['C']:.1f} | {100 * ov['runner_core_share']['C']:.0f} % |",
            "",
            f"Ratio of the median step, A ÷ B and C together: **{ov['ratio']:.3f}**, 95 % bootstrap interval "
            f"{ov['ratio_ci95'][0]:.3f} – {ov['ratio_ci95'][1]:.3f} (rounds resampled, then steps within their turns): "
            f"{overhead_verdict(ov)}. Control, C ÷ B: {ov['control_ratio']:.3f} ({ov['control_ratio_ci95'][0]:.3f} – "
            f"{ov['control_ratio_ci95'][1]:.3f}): two processes of the same runner on the same job differ this much here, "
            f"so a smaller difference between A and the bare runs is not the supervisor's. Per round, A ÷ the median of B and "
            f"C: {', '.join(f'{x:.3f}' for x in ov['round_ratios'])}. The same ratio of the runner's own step timer "
            f"(`one_step`, without the loop's reporting): {ov['compute_ratio']:.3f} ({ov['compute_ratio_ci95'][0]:.3f} – "
            f"{ov['compute_ratio_ci95'][1]:.3f}). The runner's CPU time per step, A ÷ the mean of B and C: {ov['cpu_per_step_ratio']:.3f}.",
            "",
            f"What the supervisor itself uses while the job trains (A turns): the daemon {ov['daemon_cpu_percent']:.2f} % of a core, "
            f"the shim {ov['shim_cpu_percent']:.2f} %; together {100 * ov['supervisor_cpu_fraction']:.2f} % of the runner's own CPU "
            "time. CPU times come from /proc in clock ticks (10 ms). On a machine whose cores are all busy that is about what the "
            "supervisor can take from the training; with a core to spare, it takes nothing from it.",
            "",
            "| turn | arm | steps | median step ms | the runner's share of a core | load average |",
            "|---|---|---|---|---|---|",
            *[f"| {t['turn']} | {t['arm']} | {t['steps']} | {ms(t['median_step_s'])} | {100 * t['runner_core_share']:.0f} % | "
              f"{t['load_average'][0]:.1f} |" for t in ov["turns"]],
            "",
        ]
        if ov["startup"]:
            overlapped = " (--quick starts both arms at once: these figures include each other's start-up)" if r["settings"]["quick"] else ""
            out += [
                "What a new process of the built-in runner costs before its first step (each arm's start, before the turns; a "
                "restart of a built-in job pays this, plus its checkpoint load, where the small script above pays its own)"
                f"{overlapped}:",
                "",
                "| part | A s | B s | C s |",
                "|---|---|---|---|",
            ]
            for part, label in (("interpreter", "process started (A: the attempt's `started_at`; B: just before it is started) → the "
                                 "runner's first line (Python and oomguard's imports, before torch)"),
                                ("imports_and_build", "→ 'no checkpoint: starting at step 0' (torch, diffusers and the trainer "
                                 "imported, data and model built)"),
                                ("first_step", "→ first optimizer step done (it also creates the optimizer state)")):
                out.append(f"| {label} | " + " | ".join(fmt(ov["startup"].get(arm, {}).get(part)) for arm in "ABC") + " |")
            out.append("")
    q = r.get("queue")
    if q:
        n = q["jobs"]
        out += [
            "## Queue scale",
            "",
            f"`{q['daemon']}`, and `oomguard neighbour --take 60MiB` holding 60 of the GPU's 64 MiB for the whole test: every job "
            f"(`{q['job_file']}`, which has not measured its need) waits for a GPU with 90 % free, so the daemon queues them and "
            f"runs none. {q['submit_batch']['files']} job files through one `oomguard submit` "
            f"(it returns once the daemon has queued them all), then {q['inbox']['files']} files written into `spool/inbox` with "
            f"`write_to_inbox` (what submit does: a hidden temporary name, then a rename) in {q['inbox']['drop_s']:.1f} s, "
            f"while the daemon takes them in.",
            "",
            "| measure | value |",
            "|---|---|",
            f"| one `oomguard submit` of {q['submit_batch']['files']} files | {q['submit_batch']['seconds']:.1f} s ({q['submit_batch']['jobs_per_s']:.0f} jobs/s) |",
            f"| inbox → queued ({q['inbox']['files']} files) | {q['inbox']['jobs_per_s']:.0f} jobs/s; all queued after {q['inbox']['queued_s']:.1f} s, "
            f"all marked waiting after {q['inbox']['all_waiting_s']:.1f} s; queued after "
            + ", ".join(f"{k}: {v:.1f} s" for k, v in q["inbox"]["queued_after_s"].items()) + " |",
            f"| `oomguard submit`, {n} queued | {fmt(q['submit_cli_full']['jobs_per_s'], '.2f')} jobs/s (median {fmt(q['submit_cli_full']['median'])} s each) |",
            f"| `oomguard status`, {n} queued (the next 20 listed) | median {fmt(q['status']['median'])} s, max {fmt(q['status']['max'])} s ({n_runs(q['status']['n'])}) |",
            *([f"| `oomguard status --page N`, {n} queued (50 listed) | median {fmt(q['status_page']['median'])} s, max {fmt(q['status_page']['max'])} s "
               f"({n_runs(q['status_page']['n'])}) |"] if "status_page" in q else []),
            f"| `oomguard status --all`, {n} queued | median {fmt(q['status_all']['median'])} s, max {fmt(q['status_all']['max'])} s ({n_runs(q['status_all']['n'])}) |",
            f"| `oomguard show JOB` (jobs {', '.join(map(str, q['show_jobs']))}) | median {fmt(q['show']['median'])} s, max {fmt(q['show']['max'])} s ({n_runs(q['show']['n'])}) |",
            f"| store | {', '.join(f'{k}: {v / MiB:.2f} MiB' for k, v in q['store_bytes'].items())}; {q['events']} events |",
            f"| daemon idle, empty queue | {q['idle_empty']['cpu_percent']:.1f} % of a core over {q['idle_empty']['seconds']:.0f} s |",
            f"| daemon idle, {n} queued | {q['idle_full']['cpu_percent']:.1f} % of a core over {q['idle_full']['seconds']:.0f} s |",
            f"| daemon memory (RSS), {n} queued | {fmt((q['daemon_rss_bytes'] or 0) / MiB, '.0f')} MiB |",
            "",
        ]
    idle = r.get("idle")
    if idle:
        out += [
            "## The daemon idle with running jobs",
            "",
            f"`{idle['daemon']}`: {idle['running']} command jobs running a script that prints a step line every second (it trains "
            f"nothing, so the machine is quiet), {idle['queued']} more queued behind them. The daemon's own CPU time over "
            f"{idle['seconds']:.0f} s: **{idle['cpu_percent']:.2f} % of a core** (target ≤ {idle['target_percent']:g} %).",
            "",
        ]
    out += ["## Method", "", *METHOD, ""]
    out += ["## Jobs", ""]
    for key, title in (("in_process", "In-process recovery"), ("restart", "Recovery with a restart"), ("overhead", "Supervisor overhead")):
        if r.get(key):
            out += [f"{title}:", "", "```toml", r[key]["job"].rstrip(), "```", ""]
            if key == "restart":
                out += ["The script (the job runs it with the venv's Python):", "", "```python", r[key]["script"].rstrip(), "```", ""]
    return "\n".join(out)


METHOD = [
    "- **Clock.** Every timestamp is `time.time()` on this machine: oomguard's own where it records one (metrics.jsonl `time`, "
    "written right after each optimizer step; the bootstrap's rank-failed mark `at`, when the OOM reached the script's top "
    "level; the shim's exit.json `ended_at`; the store's attempt `started_at`/`ended_at` and event `at`), the small script's "
    "own prints, a file's mtime where nothing else records the moment (attempt.json: when the shim was running), and, for "
    "lines of the built-in runner's output.log, the moment this benchmark first read the line (it reads the growing file "
    "every 10 ms, so such a time is late by up to about 10 ms).",
    "- **What is not recorded.** For the built-in runner the moment of the OOM is written nowhere: outcome.json has no time, "
    "the in-process recovery entry (heartbeat.json and outcome.json `recoveries`) has the step but no time, and output.log "
    "lines carry no timestamps. So the in-process recovery is measured from the end of the last good step (the OOM comes "
    "during the next one, partway through its forward pass), and the failed part of the step, freeing it and the doctor's "
    "decision are one part, ended by the recovery line the runner prints. Likewise the runner prints nothing between its first "
    "line and 'resumed from checkpoint' / 'no checkpoint', so torch's and diffusers' imports, the model build and a "
    "checkpoint's verification and load are one part for a built-in job. *Time lost* subtracts one normal step of the new "
    "plan (the median of that run's later steps) from the total: what the OOM cost beyond the step that had to be done anyway.",
    "- **In-process recovery** runs the real `oomguard run` CLI (the same Supervisor the daemon uses; product defaults: probe "
    "on, in-process recovery on), one run after the other.",
    "- **Restart** uses one real `oomguard daemon` (default 0.5 s poll) for all runs, one job after the other. It is a "
    "command job because a script's micro-batch can change only in a new process, and because oomguard's bootstrap records "
    "the moment of the OOM for it; the script (below) prints the moments a restart goes through, which the built-in runner "
    "does not. The built-in runner's own start-up (imports, model build, first step) is measured in the overhead section.",
    "- **Overhead.** Arm A: `oomguard daemon --stop-jobs`, `oomguard submit`; the daemon starts shim and runner. Arm B, the "
    "barest faithful baseline: the same runner (`python -m oomguard.jobs.run ATTEMPT_DIR`) on a copy of the attempt.json the "
    "daemon wrote for A (only the workdir changed), with the environment the daemon gives an attempt "
    "(`rungs.process_environment` over `users.child_environment`), its output going to output.log as the shim does it; no "
    "daemon, no shim. Both arms are started once and warmed up; then they take turns: the running arm's processes are "
    "continued (SIGCONT) for a turn and stopped (SIGSTOP) again, all of them (daemon, shim, runner), so only one arm ever runs "
    "and each arm's turns see the machine as the other's do. Turns go ABBA, so a steady drift cancels. The step time is the "
    "interval between consecutive metrics.jsonl rows (the whole loop: the step, the metrics and heartbeat writes); only steps "
    "that began and ended within one turn count. The ratio is median(A steps) ÷ median(B steps); its 95 % interval comes from "
    "2000 bootstrap resamples (seed 0) of the pairs of neighbouring turns and of the steps within them, so that the swings of "
    "the shared machine from turn to turn widen it. The runner's CPU time per step (its user + system time over the turns, "
    "from /proc, divided by the steps) is not inflated by other processes taking the CPU. The supervisor's CPU is the daemon's "
    "and the shim's over A's turns. Without a memory cap and without a GPU the probe has nothing to measure against and does "
    "nothing in either arm. This part runs last and takes fewer turns when the time budget (`--budget`) is running out.",
    "- **Queue.** The daemon runs with one emulated GPU (`--emulate-gpus 1x64MiB`) that `oomguard neighbour` fills to "
    "60 MiB, the way another user's process would; placement then refuses every job (unknown need: it waits for 90 % free), "
    "so each queued job is looked at by every scheduling pass, as on a busy box. (Without GPUs the daemon runs one attempt "
    "at a time and would start the first job.) The inbox rate is the files written by this benchmark divided by the time "
    "from the first write until the store counts them all as queued. `status` and `show` are timed as whole CLI processes "
    "(Python start and imports included), their output going to a file. Idle CPU is the daemon's user + system time (all "
    "threads, /proc/PID/stat) over a quiet window once every job is queued and marked waiting; the same window with an empty "
    "queue is the baseline.",
    "- **Threads.** Every process the benchmark starts runs with OMP_NUM_THREADS=1 (as bench/ladder.py does); the machine has "
    "2 cores, shared with other work: the load averages in the header say how busy it was.",
]


# ----------------------------------------------------------------------------- main


def _commit() -> str | None:
    """The commit of the code measured (with "+changes" when tracked files differ from it)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (head + ("+changes" if dirty else "")) or None


def main() -> int:
    # Over 60 lines: the options, then the benchmark's sequence, read top to bottom.
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (1 repetition, 100 queued jobs): under a minute, for the test")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of each recovery measurement (default 5; 1 with --quick)")
    parser.add_argument("--pairs", type=int, default=None, help="turns of each arm in the overhead measurement (default 40; 2 with --quick)")
    parser.add_argument("--window", type=float, default=None, help="seconds of one turn of an arm in the overhead measurement (default 1)")
    parser.add_argument("--queue-jobs", type=int, default=None, help="jobs in the queue test (default 10000; 100 with --quick)")
    parser.add_argument("--idle-seconds", type=float, default=None, help="window of the idle CPU measurement (default 15; 1 with --quick)")
    parser.add_argument("--only", choices=["in-process", "restart", "overhead", "queue", "idle"], action="append", help="run only these parts (repeatable)")
    parser.add_argument("--budget", type=float, default=None, help="seconds the whole run should take; the overhead measurement, run last, "
                        "takes fewer turns when the machine is slow (default 450; 50 with --quick)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run or CLI command may take (default 300)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where speed.md and speed.json go (default: bench/results)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (printed)")
    parser.add_argument("--update-readme", action="store_true", help="also rewrite the summary in README.md's Benchmarks section")
    args = parser.parse_args()
    quick = args.quick
    reps = args.reps or (1 if quick else 5)
    pairs = args.pairs or (2 if quick else 40)
    window = args.window or 1.0
    queue_jobs = args.queue_jobs or (100 if quick else 10000)
    idle_seconds = args.idle_seconds or (1.0 if quick else 15.0)
    cli_sample = 2 if quick else 8
    batch = 20 if quick else 1000
    repeats = 1 if quick else 2
    status_repeats = 1 if quick else 2
    parts = args.only or ["in-process", "restart", "overhead", "queue", "idle"]
    budget = args.budget or (50.0 if quick else 450.0)

    command = " ".join([".venv/bin/python", "bench/speed.py", *map(shlex.quote, sys.argv[1:])])
    machine = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "diffusers": importlib.metadata.version("diffusers"),
        "commit": _commit(),
        "load_average_at_start": os.getloadavg()[0],
    }
    settings = {"budget_s": budget, "quick": quick, "reps": reps, "pairs": pairs, "window": window, "queue_jobs": queue_jobs, "idle_seconds": idle_seconds,
                "cli_sample": cli_sample, "batch": batch, "repeats": repeats, "status_repeats": status_repeats, "parts": parts, "threads": THREAD_ENV}
    log(f"speed benchmark: {', '.join(parts)}; {reps} repetitions, {pairs} A/B pairs of {window:g} s, {queue_jobs} queued jobs; "
        f"load average {machine['load_average_at_start']:.1f}")

    # SIGTERM ends the benchmark like Ctrl-C does: through the finally below.
    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupted)
    scratch = Path(tempfile.mkdtemp(prefix="oomguard-speed-"))
    processes = Processes(scratch)
    tailer = Tailer()
    results: dict[str, Any] = {"command": command, "machine": machine, "settings": settings, "scratch": str(scratch)}
    pool: ThreadPoolExecutor | None = None
    timing: dict[str, dict[str, float]] = {}
    results["timing"] = timing
    try:
        steps: dict[str, Callable[[], Any]] = {
            "in-process": lambda: in_process_recovery(processes, tailer, scratch, reps, args.timeout),
            "restart": lambda: restart_recovery(processes, scratch, reps, args.timeout),
            "queue": lambda: queue_scale(processes, scratch, queue_jobs, batch, cli_sample, repeats, status_repeats, idle_seconds, args.timeout),
            "idle": lambda: idle_daemon(processes, scratch, idle_seconds, args.timeout),
            # Last: its number of turns adapts to what is left of the time budget.
            "overhead": lambda: supervisor_overhead(processes, tailer, scratch, pairs, window, args.timeout, deadline=STARTED + budget,
                                                    min_pairs=2 if quick else 10, overlap_start=quick),
        }
        titles = {"in-process": "1a. recovery in the process", "restart": "1b. recovery with a restart",
                  "queue": f"3. queue scale: {queue_jobs} jobs", "overhead": "2. supervisor overhead",
                  "idle": f"4. the daemon idle with {IDLE_QUEUED} queued and {IDLE_RUNNING} running jobs"}

        def run(names: list[str]) -> None:
            for name in names:
                if name in parts:
                    log(titles[name])
                    began, load = time.monotonic(), os.getloadavg()[0]
                    results[name.replace("-", "_")] = steps[name]()
                    timing[name] = {"seconds": time.monotonic() - began, "load_average_at_start": load, "load_average_at_end": os.getloadavg()[0]}

        if quick:
            # Tiny sizes, figures that mean nothing: two parts at a time, to finish sooner.
            pool = ThreadPoolExecutor(max_workers=2)
            futures = [pool.submit(run, ["in-process", "overhead"]), pool.submit(run, ["restart", "queue", "idle"])]
            for future in futures:
                future.result()
        else:
            run(["in-process", "restart", "queue", "idle", "overhead"])
    finally:
        tailer.close()
        strays = processes.cleanup()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
            strays += processes.sweep()
        if strays:
            log(f"killed {strays} stray process(es) left in {scratch}")
        if args.keep:
            log(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    machine["load_average_at_end"] = os.getloadavg()[0]
    results["total_seconds"] = time.monotonic() - STARTED
    results["stray_processes_killed"] = strays
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speed.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "speed.md").write_text(markdown(results) + "\n")
    log(f"wrote {args.out / 'speed.md'} and {args.out / 'speed.json'} in {results['total_seconds'] / 60:.1f} min")
    print(summary_table(results), flush=True)
    if args.update_readme:
        from readme_block import replace_block

        note = f"Measured {machine['date']} on {machine['cpus']} CPUs, torch {machine['torch']}, commit {machine['commit']}."
        if not replace_block("bench/speed.py", [note, "", summary_table(results)]):
            log("README.md has no summary markers for bench/speed.py: not updated")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; every process started was ended", file=sys.stderr)
        sys.exit(130)
    except BenchError as error:
        print(f"speed benchmark failed: {error}", file=sys.stderr)
        sys.exit(1)
