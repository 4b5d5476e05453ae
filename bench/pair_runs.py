"""What the pair benchmarks share (bench/multi_gpu_pairs.py, bench/graded_pairs.py): sweep a
job's candidate plans with the real runner under an emulated device that counts but never
refuses, and run ``oomguard run`` on the job under a cap."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
# Steps per swept plan, timed as the median of those after the first: with 4, one noisy step
# ranked every second block checkpointed slower than every block (2026-12-07 01:02).
SWEEP_STEPS = 10
UNLIMITED = "64GiB"


def environment() -> dict[str, str]:
    """This environment without oomguard's settings, one thread per process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOMGUARD_")}
    env.update(THREADS)
    return env


def sweep(name: str, spec: Any, plans: Iterable[Any], scratch: Path, log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Rank 0's peak and samples/s (median of the steps after the first, wall clock) of each
    plan, by its one-line name: SWEEP_STEPS steps of the real runner each, in its own process."""
    from oomguard.jobs.attempt import AttemptConfig
    from oomguard.jobs.device import DeviceSpec

    spec = spec.replace(train=spec.train.__class__(**{**spec.train.__dict__, "max_steps": SWEEP_STEPS, "checkpoint_every_steps": 1000}))
    measured: dict[str, dict[str, Any]] = {}
    for n, plan in enumerate(plans):
        attempt = scratch / f"sweep-{name}-{n}"
        attempt.mkdir(parents=True)
        AttemptConfig(job=spec, plan=plan, number=1, workdir=attempt / "work", device=DeviceSpec.from_option(UNLIMITED), recover_in_process=False).write(attempt)
        done = subprocess.run([sys.executable, "-m", "oomguard.jobs.run", str(attempt)], capture_output=True, text=True, env=environment(), timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"sweep of {name} [{plan.short()}] failed:\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
        steps = [json.loads(line) for line in (attempt / "metrics.jsonl").read_text().splitlines()]
        measured[plan.short()] = {
            "plan": plan.to_dict(),
            "peak_bytes": max(s["peak_bytes"] for s in steps),
            "samples_per_s": statistics.median(s["samples_per_s"] for s in steps[1:]),
        }
        log(f"{name} [{plan.short()}]: peak {measured[plan.short()]['peak_bytes'] / 2**20:.2f} MiB, "
            f"{measured[plan.short()]['samples_per_s']:.0f} samples/s")
    return measured


def run_oomguard(text: str, cap: int, scratch: Path, name: str) -> dict[str, Any]:
    """``oomguard run`` of the job file ``text`` under an emulated device of ``cap`` bytes: its
    record (``--json``) and the seconds it took."""
    path = scratch / f"{name}.toml"
    path.write_text(text)
    started = time.monotonic()
    done = subprocess.run(
        [str(BIN / "oomguard"), "run", str(path), "--workdir", str(scratch / name), "--emulate-device-memory", f"{cap}B", "--json"],
        capture_output=True, text=True, env=environment(), timeout=1800,
    )
    if done.returncode not in (0, 1):
        raise RuntimeError(f"oomguard run of {name} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return {"record": json.loads(done.stdout), "seconds": time.monotonic() - started}


def landed(record: dict[str, Any]) -> tuple[str | None, int]:
    """The one-line name of the plan a run ended on, and its OOMs: every measurement that did
    not fit, in the probe or ending an attempt."""
    from oomguard.strategies.plan import Plan

    attempts = record["attempts"]
    plan = Plan.from_dict(attempts[-1]["outcome"]["plan"]).short() if attempts and attempts[-1].get("outcome") else None
    ooms = sum(1 for a in attempts for m in (a.get("outcome") or {}).get("measurements", []) if not m["fits"])
    return plan, ooms


def pair_medians(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """Over pairs that each record "ooms", "fraction_of_oracle" (None: unknown) and "state": the
    median OOMs, the median fraction of the oracle, how many finished, how many pairs."""
    fractions = [p["fraction_of_oracle"] for p in pairs if p["fraction_of_oracle"] is not None]
    return {
        "ooms": statistics.median(p["ooms"] for p in pairs),
        "fraction_of_oracle": statistics.median(fractions) if fractions else None,
        "finished": sum(p["state"] == "finished" for p in pairs),
        "pairs": len(pairs),
    }


def sweep_summary(plans: dict[str, dict[str, Any]]) -> str:
    """A sweep in one line, lowest peak first: each plan's peak and samples/s."""
    return "; ".join(
        f"[{label}] {m['peak_bytes'] / 2**20:.2f} MiB, {m['samples_per_s']:.1f}/s" for label, m in sorted(plans.items(), key=lambda kv: kv[1]["peak_bytes"])
    )


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)
