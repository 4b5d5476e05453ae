#!/usr/bin/env python
"""Fragmentation pairs of the ladder benchmark: jobs whose bytes fit the cap but whose PyTorch
caching allocator, fragmented, would need more than the cap reserved; and the allocator rung's
(expandable segments') measured effect.

1. Peaks. tests/scripts/fragmenting_train.py (a script that knows nothing of oomguard: each
   step's activations are freed and, from the second step, ten buffers kept for good split the
   cached activation blocks, so the next activations find only pieces) run as a command job by
   ``oomguard run`` under a cap far above its needs, at each micro-batch of the pairs: its exact
   peak (``--emulate-allocator exact``), and its peak reserved memory under the caching
   allocator's emulation without and with expandable segments (``PYTORCH_ALLOC_CONF``, which the
   attempt's environment keeps), read from the attempts' measurements (``reserved_bytes``).
2. Pairs (script, batch, cap): each under the exact emulation (the bytes fit: no OOM expected),
   under the caching emulation with the job's default ladder (the allocator rung answers the
   fragmentation OOM, the batch kept?), and under the caching emulation with ``[ladder] allow``
   lacking ``allocator`` (what the job gives up instead: a smaller micro-batch, more OOMs).
   One control pair has a cap that the fragmented cache fits too.
3. The built-in bench jobs (bench/jobs/*.toml) under ``caching/1024``: for a few plans, the
   peak reserved memory without and with expandable segments (bench/ladder.py's sweep task,
   the plan's allocator setting switching them), beside the exact peak.

The scripts' caching emulation is ``caching,overhead=32MiB`` (tests/e2e/test_fragmentation.py:
their activations are MiB-sized, as a real model's, so the allocator's sizes are not divided);
the built-in jobs' is ``caching/1024`` as in the ladder benchmark.

Run alone with ``.venv/bin/python bench/allocator_pairs.py`` (about 2 minutes on 2 cores); writes
bench/results/allocator_pairs.md and .json. ``make bench`` runs it inside bench/ladder.py, which
writes the same files and puts the tables in ladder.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from pair_runs import BIN, environment, fmt  # noqa: E402

RESULTS_DIR = ROOT / "bench" / "results"
SCRIPT = ROOT / "tests" / "scripts" / "fragmenting_train.py"
MiB = 2**20
STEPS = 3
SCRIPT_ALLOCATOR = "caching,overhead=32MiB"
JOBS_ALLOCATOR = "caching/1024"
EXPANDABLE = "expandable_segments:True"
# A cap far above what any of the scripts' runs needs: their peaks.
BIG_CAP = 4096 * MiB
# "accumulating": the same script with --gradient_accumulation_steps={grad_accum} (that many
# micro-batches' activations, one after another, per optimizer step), which the micro-batch rung
# needs; without it the command job's ladder is the allocator rung alone.
# (script, batch, cap in MiB, why). "plain": tests/scripts/fragmenting_train.py; "accumulating":
# the same with gradient accumulation. The activations are 1.5 MiB per sample, ten of them; the
# buffers ten of 7 MiB. At batch 8: 190 MiB live at most, 242 MiB reserved once fragmented,
# 202 MiB with expandable segments. At batch 12: 250 MiB live, 272 MiB reserved, 262 MiB with
# expandable segments (measured: the table's peaks).
PAIRS = (
    ("plain", 8, 210, "the script's own case (tests/e2e/test_fragmentation.py)"),
    ("plain", 8, 230, "looser: still under the fragmented cache's need"),
    ("accumulating", 8, 210, "the same with gradient accumulation: the micro-batch rung allowed too"),
    ("accumulating", 12, 266, "a larger batch: other block sizes, the same pattern"),
    ("plain", 8, 250, "control: the fragmented cache fits too"),
)
# Built-in jobs and plans for the rung's effect: each job's own plan, half its micro-batch, and
# its own plan with checkpointing (fewer, larger activations freed in another order).
BUILTIN = ("conv32", "attn32", "wide16")


def log(text: str) -> None:
    print(f"[allocator pairs {time.strftime('%H:%M:%S')}] {text}", flush=True)


def job_text(script: str, batch: int, scratch: Path, allow: tuple[str, ...] | None = None) -> str:
    """The command job of ``script`` ("plain" or "accumulating") at ``batch``."""
    argv = [sys.executable, str(SCRIPT), "--train_batch_size={micro_batch}", f"--max_train_steps={STEPS}"]
    if script == "accumulating":
        argv.insert(3, "--gradient_accumulation_steps={grad_accum}")
    text = (f'name = "fragmenting-{script}-{batch}"\ntrainer = "command"\n[command]\nargv = {json.dumps(argv)}\n'
            f"[train]\nbatch_size = {batch}\nmax_steps = {STEPS}\n")
    if allow is not None:
        text += f"[ladder]\nallow = {json.dumps(list(allow))}\n"
    return text


def default_allow(script: str, batch: int, scratch: Path) -> tuple[str, ...]:
    """The rungs the command job's policy allows by default (what the doctor reads: the
    micro-batch rung only where the argv has {grad_accum})."""
    from oomguard.jobs.spec import load_job_file

    path = scratch / f"allow-{script}-{batch}.toml"
    path.write_text(job_text(script, batch, scratch))
    return tuple(load_job_file(path).policy().allow)


def run(text: str, cap: int, allocator: str, scratch: Path, name: str, expandable: bool = False) -> dict[str, Any]:
    """``oomguard run`` of the job ``text`` under ``cap`` and ``--emulate-allocator allocator``
    (with PYTORCH_ALLOC_CONF=expandable_segments:True in its environment if ``expandable``):
    what it took and where it landed."""
    from oomguard.strategies.plan import Plan

    path = scratch / f"{name}.toml"
    path.write_text(text)
    env = {k: v for k, v in environment().items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    if expandable:
        env["PYTORCH_ALLOC_CONF"] = EXPANDABLE
    command = [str(BIN / "oomguard"), "run", str(path), "--workdir", str(scratch / name),
               "--emulate-device-memory", f"{cap}B", "--emulate-allocator", allocator, "--json"]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"oomguard run of {name} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    record = json.loads(done.stdout)
    attempts = record["attempts"]
    fitting = [m for a in attempts for m in (a.get("outcome") or {}).get("measurements") or [] if m.get("fits")]
    ooms = [m for a in attempts for m in (a.get("outcome") or {}).get("measurements") or [] if not m.get("fits")]
    last = attempts[-1] if attempts else None
    plan_dict = ((last.get("outcome") or {}).get("plan") or last.get("plan")) if last else None
    plan = Plan.from_dict(plan_dict) if plan_dict else None
    return {
        "name": name,
        "cap_mib": round(cap / MiB, 1),
        "allocator": allocator + (f" + PYTORCH_ALLOC_CONF={EXPANDABLE}" if expandable else ""),
        "state": record["state"],
        "seconds": round(time.monotonic() - started, 1),
        "attempts": len(attempts),
        "ooms": len(ooms),
        "landed_plan": plan.short() if plan else None,
        "landed_micro_batch": plan.micro_batch if plan else None,
        "landed_grad_accum": plan.grad_accum if plan else None,
        "allocator_rung": bool(plan and plan.allocator),
        # The rung each later attempt took, and why (the doctor's reason).
        "rungs": [f"{a.get('rung')}: {a.get('reason')}" for a in attempts[1:]],
        "oom_messages": [str((a.get("outcome") or {}).get("message") or "")[:300] for a in attempts if (a.get("outcome") or {}).get("kind") == "oom"],
        "peak_mib": round(max(m["peak_bytes"] for m in fitting) / MiB, 2) if fitting else None,
        "reserved_mib": round(max(m["reserved_bytes"] for m in fitting if m.get("reserved_bytes")) / MiB, 2)
        if any(m.get("reserved_bytes") for m in fitting) else None,
        "command": " ".join(command),
    }


def builtin_effect(jobs: tuple[str, ...] = BUILTIN, quick: bool = False) -> list[dict[str, Any]]:
    """For a few (job, plan) pairs of the ladder benchmark, under ``caching/1024``: the exact
    peak, and the reserved peak without and with expandable segments (the plan's allocator
    setting, as the allocator rung sets it)."""
    import ladder  # bench/ladder.py: its sweep task (one thread, in this process)
    import torch

    from oomguard.jobs.spec import load_job_file

    torch.set_num_threads(1)

    rows = []
    for name in jobs:
        path = ROOT / "bench" / "jobs" / f"{name}.toml"
        start = load_job_file(path).initial_plan()
        half = start.replace(micro_batch=max(1, start.micro_batch // 2))
        for plan in (start,) if quick else (start, half, start.replace(gradient_checkpointing=True)):
            plain = ladder.sweep_task(str(path), plan, 1, JOBS_ALLOCATOR)
            expandable = ladder.sweep_task(str(path), plan.replace(allocator=EXPANDABLE), 1, JOBS_ALLOCATOR)
            row = {
                "job": name,
                "plan": plan.short(),
                "exact_peak_mib": round(plain["peak_bytes"] / MiB, 2),
                "reserved_mib": round(plain["reserved_peak_bytes"] / MiB, 2),
                "reserved_expandable_mib": round(expandable["reserved_peak_bytes"] / MiB, 2),
                "exact_peak_expandable_mib": round(expandable["peak_bytes"] / MiB, 2),
            }
            row["saved_mib"] = round(row["reserved_mib"] - row["reserved_expandable_mib"], 2)
            rows.append(row)
            log(f"{name} [{plan.short()}]: exact {row['exact_peak_mib']} MiB, reserved {row['reserved_mib']} MiB, "
                f"with expandable segments {row['reserved_expandable_mib']} MiB")
    return rows


def measure(scratch: Path, quick: bool = False) -> dict[str, Any]:
    """Every measurement of this benchmark (one process at a time). ``quick``: the first pair
    and the control only, one plan of one built-in job (a smoke run)."""
    scratch.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    chosen = (PAIRS[0], PAIRS[-1]) if quick else PAIRS
    peaks = {}
    # The peaks of each script at each micro-batch a pair may land on (its batch, and half of it
    # for the accumulating one: what the micro-batch rung gives first).
    shapes = sorted({(s, b) for s, b, _, _ in chosen} | {(s, b // 2) for s, b, _, _ in chosen if s == "accumulating"})
    for script, batch in shapes:
        text = job_text(script, batch, scratch)
        exact = run(text, BIG_CAP, "exact", scratch, f"peak-{script}-{batch}-exact")
        plain = run(text, BIG_CAP, SCRIPT_ALLOCATOR, scratch, f"peak-{script}-{batch}-caching")
        expandable = run(text, BIG_CAP, SCRIPT_ALLOCATOR, scratch, f"peak-{script}-{batch}-expandable", expandable=True)
        peaks[f"{script} {batch}"] = {"script": script, "batch": batch, "exact_peak_mib": exact["peak_mib"], "reserved_mib": plain["reserved_mib"],
                                      "allocated_mib": plain["peak_mib"], "reserved_expandable_mib": expandable["reserved_mib"],
                                      "runs": [exact, plain, expandable]}
        log(f"{script} batch {batch}: exact peak {exact['peak_mib']} MiB; reserved {plain['reserved_mib']} MiB, "
            f"with expandable segments {expandable['reserved_mib']} MiB")
    pairs = []
    for n, (script, batch, cap_mib, why) in enumerate(chosen, 1):
        cap = cap_mib * MiB
        allow = default_allow(script, batch, scratch)
        without = tuple(r for r in allow if r != "allocator")
        exact = run(job_text(script, batch, scratch), cap, "exact", scratch, f"pair-{n}-exact")
        caching = run(job_text(script, batch, scratch), cap, SCRIPT_ALLOCATOR, scratch, f"pair-{n}-caching")
        no_rung = run(job_text(script, batch, scratch, without), cap, SCRIPT_ALLOCATOR, scratch, f"pair-{n}-caching-no-allocator-rung")
        peak = peaks[f"{script} {batch}"]
        pairs.append({"pair": n, "script": script, "batch": batch, "cap_mib": cap_mib, "why": why, "default_allow": list(allow),
                      "exact_peak_mib": peak["exact_peak_mib"], "reserved_mib": peak["reserved_mib"],
                      "reserved_expandable_mib": peak["reserved_expandable_mib"],
                      "exact": exact, "caching": caching, "caching_without_allocator_rung": no_rung})
        log(f"pair {n} {script} batch {batch} @ {cap_mib} MiB: exact {exact['state']} ({exact['ooms']} OOMs); caching "
            f"{caching['state']} on [{caching['landed_plan']}] ({caching['ooms']} OOMs); without the allocator rung "
            f"{no_rung['state']} on [{no_rung['landed_plan']}] ({no_rung['ooms']} OOMs)")
    builtin = builtin_effect(BUILTIN[:1], quick=True) if quick else builtin_effect()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": _torch_version()},
        "command": ".venv/bin/python bench/allocator_pairs.py" + (" --quick" if quick else "   # or make bench, inside bench/ladder.py"),
        "quick": quick,
        "script": str(SCRIPT.relative_to(ROOT)),
        "script_allocator": SCRIPT_ALLOCATOR,
        "jobs_allocator": JOBS_ALLOCATOR,
        "minutes": round((time.monotonic() - started) / 60, 1),
        "peaks": {name: {k: v for k, v in p.items() if k != "runs"} for name, p in peaks.items()},
        "peak_runs": {name: p["runs"] for name, p in peaks.items()},
        "pairs": pairs,
        "builtin": builtin,
    }


def _torch_version() -> str:
    import torch

    return torch.__version__


def fragmentation_pairs(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The pairs whose cap the fragmented cache does not fit (the control left out)."""
    return [p for p in result["pairs"] if p["reserved_mib"] is None or p["reserved_mib"] > p["cap_mib"]]


def medians(result: dict[str, Any]) -> dict[str, Any]:
    pairs = fragmentation_pairs(result)
    return {
        "pairs": len(pairs),
        "exact_ooms": statistics.median(p["exact"]["ooms"] for p in pairs) if pairs else None,
        "ooms": statistics.median(p["caching"]["ooms"] for p in pairs) if pairs else None,
        "allocator_rung": sum(p["caching"]["allocator_rung"] for p in pairs),
        "landed_at_batch": sum(p["caching"]["state"] == "finished" and p["caching"]["landed_micro_batch"] == p["batch"] for p in pairs),
        "without_ooms": statistics.median(p["caching_without_allocator_rung"]["ooms"] for p in pairs) if pairs else None,
        "without_failed": sum(p["caching_without_allocator_rung"]["state"] != "finished" for p in pairs),
        "without_kept_batch": sum(p["caching_without_allocator_rung"]["state"] == "finished"
                                  and p["caching_without_allocator_rung"]["landed_micro_batch"] == p["batch"] for p in pairs),
        "builtin_saved_max_mib": max((r["saved_mib"] for r in result["builtin"]), default=None),
    }


def _landed(run: dict[str, Any]) -> str:
    if run["state"] != "finished":
        return f"{run['state']} (`{run['landed_plan']}`)"
    return f"`{run['landed_plan']}`"


def markdown_section(result: dict[str, Any]) -> list[str]:
    c = medians(result)
    out = [
        "## Fragmentation pairs (bench/allocator_pairs.py)",
        "",
        f"`{result['script']}` (*plain*) run unchanged as a command job (`oomguard run JOB --emulate-device-memory CAP "
        f"--emulate-allocator ... --json`), {STEPS} steps: its activations (1.5 MiB per sample, ten) are freed each step and "
        "from the second step ten 7 MiB buffers kept for good split the cached activation blocks, so the next activations "
        "find only pieces. Its argv has no `{grad_accum}`, so its default ladder is the allocator rung alone. *accumulating*: "
        "the same script with `--gradient_accumulation_steps={grad_accum}` in its argv (the "
        "micro-batch rung allowed too). Under the exact emulation its bytes fit every cap below; under the caching allocator's "
        f"(`{result['script_allocator']}`) the fragmented cache needs more than the cap reserved. Each pair runs three ways: "
        "exact; caching with the job's default ladder; caching with `[ladder] allow` lacking `allocator`. Peaks: the same job "
        f"under a {BIG_CAP // MiB} MiB cap, from the attempts' measurements (`peak_bytes`, `reserved_bytes`); expandable "
        "segments by `PYTORCH_ALLOC_CONF=expandable_segments:True` in `oomguard run`'s environment, which the attempt keeps.",
        "",
        f"Over the {c['pairs']} pairs the fragmented cache does not fit (the control left out): exact emulation median "
        f"{fmt(c['exact_ooms'], 'g')} OOMs; caching with the default ladder: the allocator rung taken in {c['allocator_rung']}, "
        f"the micro-batch kept in {c['landed_at_batch']} of {c['pairs']}, median {fmt(c['ooms'], 'g')} OOM to land; without the "
        f"allocator rung: the micro-batch kept in {c['without_kept_batch']} of {c['pairs']}, {c['without_failed']} failed (no rung left "
        f"to try), median {fmt(c['without_ooms'], 'g')} OOMs.",
        "",
        "| script | micro-batch (no accumulation) | exact peak MiB | reserved MiB | reserved with expandable segments MiB |",
        "|---|---|---|---|---|",
    ]
    out += [f"| {p['script']} | {p['batch']} | {fmt(p['exact_peak_mib'])} | {fmt(p['reserved_mib'])} | {fmt(p['reserved_expandable_mib'])} |"
            for p in result["peaks"].values()]
    out += [
        "",
        "| # | script | batch | cap MiB | pair | exact: state, OOMs | caching, default ladder: landed | OOMs | attempts | allocator rung | reserved MiB | caching without `allocator`: landed | OOMs | attempts |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["pairs"]:
        e, c_, n = p["exact"], p["caching"], p["caching_without_allocator_rung"]
        out.append(f"| {p['pair']} | {p['script']} | {p['batch']} | {p['cap_mib']:g} | {p['why']} | {e['state']}, {e['ooms']} | {_landed(c_)} | {c_['ooms']} | "
                   f"{c_['attempts']} | {'yes' if c_['allocator_rung'] else 'no'} | {fmt(c_['reserved_mib'])} | {_landed(n)} | {n['ooms']} | {n['attempts']} |")
    out += ["", "What the doctor said, per pair and run (each later attempt's rung and reason):", ""]
    for p in result["pairs"]:
        for label, run in (("caching", p["caching"]), ("caching without `allocator`", p["caching_without_allocator_rung"])):
            for rung in run["rungs"]:
                out.append(f"- pair {p['pair']}, {label}: {rung}")
    out += [
        "",
        f"The allocator rung on the built-in bench jobs (`{result['jobs_allocator']}`, bench/ladder.py's sweep task: a warm "
        "step and one more, no cap): peak reserved memory without and with expandable segments for the same plan, beside "
        "the exact peak (the live bytes).",
        "",
        "| job | plan | exact peak MiB | reserved MiB | reserved with expandable segments MiB | saved MiB |",
        "|---|---|---|---|---|---|",
    ]
    out += [f"| {r['job']} | `{r['plan']}` | {fmt(r['exact_peak_mib'])} | {fmt(r['reserved_mib'])} | {fmt(r['reserved_expandable_mib'])} | {fmt(r['saved_mib'])} |"
            for r in result["builtin"]]
    return out


def write(result: dict[str, Any], out: Path = RESULTS_DIR) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "allocator_pairs.json").write_text(json.dumps(result, indent=2) + "\n")
    m = result["machine"]
    head = ["# Fragmentation pairs and the allocator rung", "",
            f"Measured {result['date']} on {m['cpus']} CPUs ({m['platform']}), Python {m['python']}, torch {m['torch']}, "
            f"in {result['minutes']} min. Rerun with `{result['command']}`.", ""]
    (out / "allocator_pairs.md").write_text("\n".join([*head, *markdown_section(result)[2:]]) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the results go (default: bench/results)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: the first pair and the control, one built-in plan")
    args = parser.parse_args()
    os.environ.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    with tempfile.TemporaryDirectory(prefix="oomguard-allocator-pairs-") as scratch:
        result = measure(Path(scratch), quick=args.quick)
    write(result, args.out)
    log(f"wrote {args.out / 'allocator_pairs.md'} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
