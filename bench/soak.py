#!/usr/bin/env python
"""The soak: an accelerated week of a lab box, to show that an unattended daemon loses nothing
and stays bounded.

One real daemon (``--emulate-gpus``, a short ``--forget-after`` and ``--log-limit`` so that its
housekeeping acts many times within the run) takes short built-in jobs for ``--minutes``, while:

- jobs arrive in batches through ``oomguard submit`` (batch sizes and lengths drawn at random,
  some too big for a GPU's whole batch: they step down the ladder; some run for minutes, so that
  a neighbour there when they started leaves while they train: they step back up);
- neighbours (``oomguard neighbour``) arrive on a random GPU, hold memory a while and leave:
  jobs wait, step down, and step back up;
- the daemon is killed with SIGKILL every ``--kill-every`` seconds and started again: it adopts
  the attempts that ran on;
- where this runs as root, the jobs' workdirs are on a small tmpfs that a ballast file fills
  every ``--fill-every`` seconds and frees a while later: jobs wait for disk and go on.

A watcher reads the store (read-only) every two seconds: every job's end and why, every event,
the daemon's RSS, the store's and the log folders' bytes. The report (bench/results/soak.md and
soak.json): jobs lost (submitted, never seen to end: must be 0), jobs ended without a reason (0),
the daemon's RSS at start and end, the store's and logs' bytes over time (bounded by the
policy), and the step-ups and whether each held.

Run it with ``make soak`` (30 minutes) or ``.venv/bin/python bench/soak.py --minutes 5``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tiny_job import TINY_JOB

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
OOMGUARD = str(Path(sys.executable).with_name("oomguard"))
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
MiB = 2**20
ENDED = ("finished", "failed", "cancelled")
# Emulated peaks of the tiny job (bench/tiny_job.py): micro-batch 8 about 4.1 MiB,
# 4 about 2.5 MiB; the GPUs have 6 MiB each, so batch 16 steps down and a neighbour of 2-3 MiB
# forces a wait or a step down.
GPUS = "2x6MiB"
# A share of the jobs run for minutes (1,000-2,000 steps of the tiny model), long enough for
# a neighbour that was there when they started to leave while they train: they step back up.
# They say what they need (resources.memory), so they start beside a neighbour (a job whose need
# is unknown waits for a GPU 90 % free), where the probe starts them at micro-batch 4.
LONG_SHARE = 0.15
LONG_STEPS = (1000, 2000)
LONG_CHECKPOINT_EVERY = 50
LONG_RESOURCES = '[resources]\nmemory = "3MiB"\n'


def log(text: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] soak: {text}", flush=True)


def log_bytes(path: Path) -> int:
    """The bytes of every attempt folder below ``path`` (logs, heartbeats, metrics), and of
    whatever else is below a ``spool`` folder: what the daemon's housekeeping keeps bounded."""
    total = 0
    for root, _, files in os.walk(path):
        if "/attempts/" not in root + "/" and "/spool" not in root:
            continue
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        return None
    return None


class Box:
    """The daemon and what the soak does to it."""

    def __init__(self, scratch: Path, args: argparse.Namespace) -> None:
        self.scratch, self.args = scratch, args
        self.state = scratch / "state"
        self.daemon: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()
        self.submitted: list[int] = []
        self.kills = 0
        self.fills = 0
        self.neighbours = 0
        self.disk = scratch / "disk" if os.geteuid() == 0 and not args.no_disk else None

    def _started(self) -> int:
        path = self.scratch / "daemon.out"
        return path.read_text(errors="replace").count(" watching ") if path.exists() else 0

    def start_daemon(self) -> None:
        before = self._started()
        output = (self.scratch / "daemon.out").open("ab")
        self.daemon = subprocess.Popen(
            [OOMGUARD, "--state-dir", str(self.state), "daemon", "--emulate-gpus", GPUS, "--forget-after", str(self.args.forget_after_days),
             "--log-limit", "256KiB", "--stall-after", "600"],
            stdout=output, stderr=subprocess.STDOUT, env={**os.environ, **THREADS}, start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while self._started() == before:
            if time.monotonic() > deadline or self.daemon.poll() is not None:
                raise RuntimeError("the daemon did not start:\n" + (self.scratch / "daemon.out").read_text()[-2000:])
            time.sleep(0.1)

    def mount_disk(self) -> None:
        if self.disk is None:
            return
        self.disk.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.args.disk_mib}m", "tmpfs", str(self.disk)], capture_output=True, text=True)
        if done.returncode != 0:
            log(f"no small disk (mount said: {done.stderr.strip()}): workdirs stay in the scratch folder")
            self.disk = None

    def unmount_disk(self) -> None:
        if self.disk is not None:
            subprocess.run(["umount", "-l", str(self.disk)], capture_output=True)

    def submit(self, count: int, rng: random.Random) -> None:
        folder = self.scratch / "job-files"
        folder.mkdir(exist_ok=True)
        files = []
        for _ in range(count):
            n = len(self.submitted) + len(files)
            name = f"soak-{n:04d}"
            workdir = f'workdir = "{self.disk / name}"' if self.disk is not None else ""
            path = folder / f"{name}.toml"
            long = rng.random() < LONG_SHARE
            steps, every = (rng.randint(*LONG_STEPS), LONG_CHECKPOINT_EVERY) if long else (rng.randint(12, 40), 4)
            text = TINY_JOB.format(name=name, workdir=workdir, batch_size=rng.choice([8, 8, 16]), max_steps=steps, seed=n, checkpoint_every=every)
            path.write_text(text + (LONG_RESOURCES if long else ""))
            files.append(str(path))
        done = subprocess.run([OOMGUARD, "--state-dir", str(self.state), "submit", *files, "--wait", "60"], capture_output=True, text=True, timeout=600)
        ids = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("job ") and line.endswith(" queued")]
        with self.lock:
            self.submitted += ids
        if len(ids) != count:
            log(f"submit of {count} files queued {len(ids)}: {done.stdout[-500:]} {done.stderr[-500:]}")

    def kill_daemon(self) -> None:
        assert self.daemon is not None
        os.kill(self.daemon.pid, signal.SIGKILL)
        self.daemon.wait()
        self.kills += 1
        time.sleep(2)
        self.start_daemon()

    def neighbour(self, rng: random.Random) -> None:
        take, seconds = rng.choice(["2MiB", "3MiB"]), rng.randint(20, 60)
        subprocess.Popen(
            [OOMGUARD, "--state-dir", str(self.state), "neighbour", "--gpu", str(rng.randint(0, 1)), "--take", take, "--seconds", str(seconds)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        self.neighbours += 1

    def fill_disk(self, hold_seconds: float) -> None:
        """A ballast file that leaves about 256 KiB free, for ``hold_seconds``."""
        if self.disk is None:
            return
        ballast = self.disk / "ballast"
        stat = os.statvfs(self.disk)
        free = stat.f_bavail * stat.f_frsize
        try:
            with ballast.open("wb") as f:
                f.truncate(0)
                remaining = max(0, free - 256 * 1024)
                while remaining > 0:
                    chunk = min(remaining, MiB)
                    f.write(b"\0" * chunk)
                    remaining -= chunk
        except OSError:
            pass
        self.fills += 1
        time.sleep(hold_seconds)
        ballast.unlink(missing_ok=True)


class Watcher:
    """What the store shows, every two seconds, read-only."""

    def __init__(self, box: Box) -> None:
        self.box = box
        self.ended: dict[int, tuple[str, str]] = {}
        self.events: Counter[str] = Counter()
        self.last_event = 0
        self.samples: list[dict[str, Any]] = []

    def look(self) -> None:
        database = self.box.state / "oomguard.db"
        if not database.exists():
            return
        connection = sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=10)
        try:
            for job_id, state, result, workdir in connection.execute(f"select id, state, result, workdir from jobs where state in {ENDED}"):
                if job_id not in self.ended:
                    self.ended[job_id] = (state, result or "")
                    # Its owner takes the final model away: checkpoints and models are theirs to
                    # keep, and a week of them would fill any small disk. Attempt logs stay.
                    for part in ("checkpoints", "final"):
                        shutil.rmtree(Path(workdir) / part, ignore_errors=True)
            for event_id, code in connection.execute("select id, code from events where id > ? order by id", [self.last_event]):
                self.events[code or ""] += 1
                self.last_event = event_id
            counts = dict(connection.execute("select state, count(*) from jobs group by state").fetchall())
            rows = {table: connection.execute(f"select count(*) from {table}").fetchone()[0] for table in ("jobs", "attempts", "events")}
        except sqlite3.OperationalError:
            return
        finally:
            connection.close()
        daemon = self.box.daemon
        self.samples.append({
            "at": time.time(), "counts": counts, "rows": rows,
            "daemon_rss": rss_bytes(daemon.pid) if daemon is not None else None,
            "store_bytes": sum(os.path.getsize(f"{database}{s}") for s in ("", "-wal") if os.path.exists(f"{database}{s}")),
            "logs_bytes": log_bytes(self.box.disk if self.box.disk is not None else self.box.state / "jobs") + log_bytes(self.box.state / "spool"),
        })


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    scratch = Path(tempfile.mkdtemp(prefix="oomguard-soak-"))
    box = Box(scratch, args)
    watcher = Watcher(box)
    box.mount_disk()
    box.start_daemon()
    started = time.monotonic()
    deadline = started + args.minutes * 60
    next_kill, next_neighbour, next_fill = started + args.kill_every, started + args.neighbour_every, started + args.fill_every
    filling: threading.Thread | None = None
    try:
        while time.monotonic() < deadline:
            queued = (watcher.samples[-1]["counts"].get("queued", 0) if watcher.samples else 0)
            if queued < 10 and len(box.submitted) < args.jobs:
                box.submit(min(20, args.jobs - len(box.submitted)), rng)
            now = time.monotonic()
            if now >= next_kill:
                box.kill_daemon()
                next_kill = now + args.kill_every
            if now >= next_neighbour:
                box.neighbour(rng)
                next_neighbour = now + rng.uniform(0.5, 1.5) * args.neighbour_every
            if now >= next_fill and (filling is None or not filling.is_alive()):
                filling = threading.Thread(target=box.fill_disk, args=(rng.uniform(20, 60),), daemon=True)
                filling.start()
                next_fill = now + args.fill_every
            watcher.look()
            if len(watcher.samples) % 30 == 1:
                s = watcher.samples[-1]
                log(f"{len(box.submitted)} submitted, {len(watcher.ended)} ended; {s['counts']}; daemon RSS "
                    f"{(s['daemon_rss'] or 0) / MiB:.0f} MiB, store {s['store_bytes'] / MiB:.1f} MiB, logs {s['logs_bytes'] / MiB:.1f} MiB; "
                    f"kills {box.kills}, neighbours {box.neighbours}, disk fills {box.fills}")
            time.sleep(2)
        log("no more jobs: waiting for the queue to drain")
        drain_until = time.monotonic() + args.drain_minutes * 60
        while time.monotonic() < drain_until and len(set(box.submitted) - set(watcher.ended)) > 0:
            watcher.look()
            time.sleep(2)
    finally:
        if filling is not None:
            filling.join(timeout=120)
        if box.daemon is not None and box.daemon.poll() is None:
            os.kill(box.daemon.pid, signal.SIGTERM)
            box.daemon.wait(timeout=120)
        subprocess.run(["pkill", "-f", str(scratch)], capture_output=True)
        box.unmount_disk()
    watcher.look()
    unended = sorted(set(box.submitted) - set(watcher.ended))
    without_reason = sorted(job_id for job_id, (_, result) in watcher.ended.items() if not result.strip())
    rss = [s["daemon_rss"] for s in watcher.samples if s["daemon_rss"]]
    first_rss = rss[len(rss) // 10] if rss else None  # after the first tenth: imports and caches settled
    return {
        "command": " ".join([".venv/bin/python", "bench/soak.py", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "minutes": args.minutes, "submitted": len(box.submitted), "ended": Counter(state for state, _ in watcher.ended.values()),
        "jobs_lost": unended, "ended_without_reason": without_reason, "kills": box.kills, "neighbours": box.neighbours,
        "disk_fills": box.fills, "small_disk": box.disk is not None,
        "daemon_rss_start": first_rss, "daemon_rss_end": rss[-1] if rss else None,
        "store_bytes_max": max((s["store_bytes"] for s in watcher.samples), default=0),
        "store_bytes_end": watcher.samples[-1]["store_bytes"] if watcher.samples else 0,
        "logs_bytes_max": max((s["logs_bytes"] for s in watcher.samples), default=0),
        "rows_max": max((s["rows"]["jobs"] for s in watcher.samples), default=0),
        "events": dict(watcher.events), "step_ups": watcher.events.get("step_up", 0), "step_ups_failed": watcher.events.get("step_up_failed", 0),
        "samples": watcher.samples[:: max(1, len(watcher.samples) // 60)],
    }


def markdown(r: dict[str, Any]) -> str:
    growth = (r["daemon_rss_end"] / r["daemon_rss_start"] - 1) if r["daemon_rss_start"] and r["daemon_rss_end"] else None
    held = r["step_ups"] - r["step_ups_failed"]
    return "\n".join([
        "# Soak", "",
        f"Written by `{r['command']}` on {r['date']}: {r['minutes']:g} minutes, {r['submitted']} jobs submitted "
        f"({', '.join(f'{n} {state}' for state, n in sorted(r['ended'].items()))}), the daemon killed with SIGKILL {r['kills']} times, "
        f"{r['neighbours']} neighbours, the disk filled {r['disk_fills']} times" + ("" if r["small_disk"] else " (no small disk: --no-disk, or not root)") + ".",
        "",
        "| measure | value | target |",
        "|---|---|---|",
        f"| jobs lost (submitted, never ended) | {len(r['jobs_lost'])} | 0 |",
        f"| jobs ended without a reason | {len(r['ended_without_reason'])} | 0 |",
        f"| daemon RSS, after the first tenth → end | {(r['daemon_rss_start'] or 0) / MiB:.0f} → {(r['daemon_rss_end'] or 0) / MiB:.0f} MiB"
        + (f" ({growth:+.1%})" if growth is not None else "") + " | growth ≤ 10 % |",
        f"| store (db + wal), most / at the end | {r['store_bytes_max'] / MiB:.2f} / {r['store_bytes_end'] / MiB:.2f} MiB | bounded |",
        f"| jobs in the store at most | {r['rows_max']} | bounded by --forget-after |",
        f"| attempt logs and spool, most | {r['logs_bytes_max'] / MiB:.1f} MiB | bounded |",
        f"| steps back up / of which held | {r['step_ups']} / {held} | |",
        "",
        "Events by code: " + ", ".join(f"{code} {n}" for code, n in sorted(r["events"].items())) + ".",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long jobs keep arriving (default 30)")
    parser.add_argument("--jobs", type=int, default=500, help="jobs submitted at most (default 500)")
    parser.add_argument("--kill-every", type=float, default=240.0, help="seconds between SIGKILLs of the daemon (default 240)")
    parser.add_argument("--neighbour-every", type=float, default=45.0, help="mean seconds between neighbours (default 45)")
    parser.add_argument("--fill-every", type=float, default=300.0, help="seconds between disk fills, as root (default 300)")
    parser.add_argument("--disk-mib", type=int, default=96, help="the small disk's size, MiB (default 96)")
    parser.add_argument("--no-disk", action="store_true", help="no small disk, even as root")
    parser.add_argument("--forget-after-days", type=float, default=0.003, help="the daemon's --forget-after (default 0.003: ~4 minutes)")
    parser.add_argument("--drain-minutes", type=float, default=25.0, help="how long to wait for the last jobs (default 25: the long ones take minutes each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS, help="where soak.md and soak.json go (default bench/results)")
    args = parser.parse_args()
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    text = markdown(result)
    (args.out / "soak.md").write_text(text + "\n")
    print(text)
    return 0 if not result["jobs_lost"] and not result["ended_without_reason"] else 1


if __name__ == "__main__":
    sys.exit(main())
