#!/usr/bin/env python
"""Multi-GPU pairs of the ladder benchmark: built-in jobs on 2 or 4 emulated devices (one rank
each, gloo on the CPU), where the model's state or its activations do not fit one rank, and
what oomguard lands on against the fastest plan that fits.

1. Sweep. Every plan the job's ``ladder.allow`` reaches (``planner.candidate_plans``: the
   micro-batch, checkpointing, host offload and the three sharding levels) is run by the real
   ranks' runner for a few steps under an emulated device that counts bytes but never
   refuses: rank 0's peak (the first step, where the optimizer state appears, included) and
   its samples/s (median of the steps after the first; wall clock, one thread per rank).
2. A pair is the job and a cap: a share of the peak of the plain data-parallel plan. The
   oracle is the fastest swept plan whose peak fits the cap.
3. oomguard: ``oomguard run JOB --emulate-device-memory CAP --json`` with the product's
   defaults (the ranks probe together). From its record: every OOM (probe measurements that
   did not fit, and attempts that ended on one), the plan it ended on, and its swept speed
   against the oracle's.

4. Widen against stepping down: the state-2 job with ``resources.gpus = "1-2"`` under a real
   daemon with two emulated GPUs of a cap its state does not fit on one, against the same job
   with ``gpus = 1``; both without the probe, so that each first attempt runs out of memory on
   one GPU and the doctor chooses (widen onto the free GPU, or step down on one). Speeds are
   the final attempts' median samples/s (metrics.jsonl), run one after the other.

Run alone with ``.venv/bin/python bench/multi_gpu_pairs.py``; ``make bench`` runs it inside
bench/ladder.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pair_runs import BIN, environment, fmt, landed, pair_medians, run_oomguard, sweep, sweep_summary

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ALLOW = ("micro_batch", "checkpointing", "offload", "shard_optimizer", "shard_params", "shard_offload")


@dataclass(frozen=True)
class Job:
    name: str
    what: str
    gpus: int
    channels: tuple[int, int]
    resolution: int
    batch_size: int
    max_steps: int = 10


@dataclass(frozen=True)
class Pair:
    job: str
    # The cap, as a share of the plain data-parallel plan's peak.
    share: float


JOBS = {
    j.name: j
    for j in (
        Job("state-2", "UNet 32/64 channels at 8 px: the model's state dominates", 2, (32, 64), 8, 8),
        Job("state-4", "the same on 4 ranks", 4, (32, 64), 8, 8),
        Job("activations-2", "UNet 16/32 channels at 32 px: activations dominate", 2, (16, 32), 32, 8),
    )
}
# The widening case's GPUs, as a share of the state-2 job's data-parallel peak (below).
WIDEN_SHARE = 0.97
PAIRS = (
    Pair("state-2", 0.8),
    Pair("state-2", 0.6),
    Pair("state-2", 0.47),
    Pair("state-4", 0.6),
    Pair("state-4", 0.4),
    Pair("activations-2", 0.6),
)


def log(text: str) -> None:
    print(f"[multi-gpu pairs] {text}", file=sys.stderr, flush=True)


def job_text(job: Job, gpus: str | None = None, probe: bool = True) -> str:
    low, high = job.channels
    return (
        f'name = "{job.name}"\ntrainer = "unconditional"\n[data]\nsource = "synthetic:16"\nresolution = {job.resolution}\n'
        f'[model]\nblock_out_channels = [{low}, {high}]\nlayers_per_block = 1\n'
        'down_block_types = ["DownBlock2D", "DownBlock2D"]\nup_block_types = ["UpBlock2D", "UpBlock2D"]\nnorm_num_groups = 8\n'
        f"[train]\nbatch_size = {job.batch_size}\nmax_steps = {job.max_steps}\nlearning_rate = 1e-3\nseed = 0\ncheckpoint_every_steps = 5\n"
        f"[ladder]\nallow = {json.dumps(list(ALLOW))}\nprobe = {str(probe).lower()}\n[resources]\ngpus = {gpus or job.gpus}\n"
    )


def measure(scratch: Path) -> dict[str, Any]:
    """Every pair: the sweep, the oracle and what oomguard did."""
    from oomguard.jobs.spec import parse_job_text
    from oomguard.strategies import planner
    from oomguard.strategies.plan import Plan

    scratch.mkdir(parents=True, exist_ok=True)
    sweeps = {}
    for name, job in JOBS.items():
        spec = parse_job_text(job_text(job), f"<{name}.toml>", base_dir=scratch)
        sweeps[name] = sweep(name, spec, planner.candidate_plans(spec.initial_plan(), ALLOW), scratch, log)
    rows = []
    for n, pair in enumerate(PAIRS, 1):
        job, measured = JOBS[pair.job], sweeps[pair.job]
        plain = measured[Plan.initial(job.batch_size, world_size=job.gpus).short()]  # the job's own plan
        cap = int(plain["peak_bytes"] * pair.share)
        fitting = {label: m for label, m in measured.items() if m["peak_bytes"] <= cap}
        oracle = max(fitting, key=lambda label: fitting[label]["samples_per_s"]) if fitting else None
        record = run_oomguard(job_text(job), cap, scratch, f"pair-{n}")["record"]
        attempts = record["attempts"]
        plan, ooms = landed(record)
        row = {
            "n": n, "job": job.name, "what": job.what, "gpus": job.gpus, "cap_bytes": cap, "share": pair.share,
            "oracle": oracle, "landed": plan, "state": record["state"], "ooms": ooms, "attempts": len(attempts),
            "fraction_of_oracle": (measured[plan]["samples_per_s"] / measured[oracle]["samples_per_s"]) if plan in measured and oracle else None,
        }
        log(f"pair {n} {job.name} cap {cap / 2**20:.2f} MiB: oracle [{oracle}], landed [{plan}], {ooms} OOM(s), {record['state']}")
        rows.append(row)
    # GPUs just under the data-parallel plan's peak: the job's state does not fit one, host
    # offload does, and sharding on two fits with the margins (at the loosest pair's 0.8 the
    # sharding terms, FSDP's buffers counted, no longer say so: the doctor stepped down both times).
    state_2 = JOBS["state-2"]
    plain = sweeps["state-2"][Plan.initial(state_2.batch_size, world_size=state_2.gpus).short()]["peak_bytes"]
    widen = widen_versus_step_down(scratch, int(plain * WIDEN_SHARE))
    return {"jobs": {name: {"what": j.what, "gpus": j.gpus, "sweep": sweeps[name]} for name, j in JOBS.items()}, "pairs": rows, "widen": widen}


def widen_versus_step_down(scratch: Path, cap: int) -> dict[str, Any]:
    """The state-2 job on a daemon with two emulated GPUs of ``cap``: allowed to widen, and not."""
    job = JOBS["state-2"]
    runs = {}
    for name, gpus in (("widen", '"1-2"'), ("step-down", "1")):
        state = scratch / f"daemon-{name}"
        state.mkdir(parents=True)
        path = state / "job.toml"
        path.write_text(job_text(Job(job.name, job.what, job.gpus, job.channels, job.resolution, job.batch_size, max_steps=30), gpus, probe=False))
        oomguard = [str(BIN / "oomguard"), "--state-dir", str(state)]
        daemon = subprocess.Popen([*oomguard, "daemon", "--poll-interval", "0.1", "--emulate-gpus", f"2x{cap}B"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env=environment())
        try:
            deadline = time.monotonic() + 30
            while subprocess.run([*oomguard, "submit", str(path)], capture_output=True, env=environment()).returncode != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the daemon for {name} did not take the job")
                time.sleep(0.5)
            record: dict[str, Any] = {}
            deadline = time.monotonic() + 900
            while record.get("state") not in ("finished", "failed", "cancelled"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: the job did not end in 900 s")
                time.sleep(1)
                shown = subprocess.run([*oomguard, "show", "1", "--json"], capture_output=True, text=True, env=environment())
                record = json.loads(shown.stdout) if shown.returncode == 0 else {}
        finally:
            daemon.terminate()
            daemon.wait(timeout=120)
        last = record["attempts"][-1]
        steps = [json.loads(line) for line in (Path(last["directory"]) / "metrics.jsonl").read_text().splitlines()][1:]
        from oomguard.strategies.plan import Plan

        runs[name] = {
            "state": record["state"], "gpus": last["gpus"], "plan": Plan.from_dict(last["outcome"]["plan"]).short(),
            "attempts": len(record["attempts"]), "samples_per_s": statistics.median(s["samples_per_s"] for s in steps) if steps else None,
            "rungs": [e["message"].split(":")[0] for e in record["events"] if e["kind"] == "escalated"],
        }
        log(f"{name}: {record['state']} on GPU(s) {last['gpus']} under [{runs[name]['plan']}], {runs[name]['samples_per_s']} samples/s")
    rates = [runs[name]["samples_per_s"] for name in ("widen", "step-down")]
    return {"cap_bytes": cap, "runs": runs, "ratio": rates[0] / rates[1] if all(rates) else None}


def medians(result: dict[str, Any]) -> dict[str, Any]:
    return pair_medians(result["pairs"])


def markdown_section(result: dict[str, Any]) -> list[str]:
    m = medians(result)
    out = [
        "## Several GPUs",
        "",
        "Built-in jobs on 2 or 4 emulated devices, one rank each (bench/multi_gpu_pairs.py). The cap is a share of the plain "
        "data-parallel plan's peak, the same on every rank. *OOMs* counts every measurement that did not fit (the ranks' probe "
        "included) and every attempt that ended on one; speed is the landed plan's samples/s in the sweep against the oracle's "
        "(the fastest swept plan that fits), rank 0, wall clock, one thread per rank.",
        "",
        f"Median OOMs to land: **{m['ooms']}**; median samples/s against the oracle: **{fmt(m['fraction_of_oracle'], '.3f')}**; "
        f"finished: **{m['finished']} of {m['pairs']}**.",
        "",
        "| # | job | GPUs | cap | oracle | landed | OOMs | attempts | samples/s vs oracle |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["pairs"]:
        out.append(
            f"| {p['n']} | {p['job']}: {p['what']} | {p['gpus']} | {p['cap_bytes'] / 2**20:.2f} MiB ({p['share']:.2f}) | {p['oracle']} | "
            f"{p['landed']} | {p['ooms']} | {p['attempts']} | {fmt(p['fraction_of_oracle'])} |"
        )
    widen = result.get("widen")
    if widen:
        out += [
            "",
            f"Widen against stepping down (the state-2 job, no probe, a daemon with two emulated GPUs of {widen['cap_bytes'] / 2**20:.2f} MiB): "
            f"the widened run trains at **{fmt(widen['ratio'])}x** the samples/s of the run that stepped down on one GPU.",
            "",
            "| job's gpus | state | ended on GPU(s) | landed plan | attempts | what the doctor did | samples/s |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, run in widen["runs"].items():
            gpus = '"1-2"' if name == "widen" else "1"
            out.append(f"| {gpus} | {run['state']} | {run['gpus']} | {run['plan']} | {run['attempts']} | "
                       f"{'; '.join(run['rungs'])} | {fmt(run['samples_per_s'])} |")
    out += ["", "Sweeps (rank 0's peak and samples/s of every plan):", ""]
    out += [f"- {name} ({job['gpus']} GPUs): {sweep_summary(job['sweep'])}" for name, job in result["jobs"].items()]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where multi_gpu_pairs.json and .md go")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="oomguard-multi-gpu-pairs-") as scratch:
        result = measure(Path(scratch))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "multi_gpu_pairs.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "multi_gpu_pairs.md").write_text(
        "\n".join(["# Multi-GPU pairs", "", f"Measured {time.strftime('%Y-%m-%d %H:%M')} with `.venv/bin/python bench/multi_gpu_pairs.py`.", "",
                   *markdown_section(result)[2:]]) + "\n"
    )
    log(f"wrote {args.out / 'multi_gpu_pairs.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
