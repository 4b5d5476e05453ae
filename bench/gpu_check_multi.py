#!/usr/bin/env python
"""GPU check with several GPUs (``bench/gpu_check_multi.py``, for a machine with 2 or more
CUDA devices): a built-in job whose model state does not fit one card, run by `oomguard run`
on one card and on two, each card capped at the same size (a per-process memory fraction of the
real GPU, jobs/memory_cap.py): which plan each lands on, how many OOMs that takes, and the
samples/s of the landed plan. On two cards the sharding rungs are the exact answer; on one the
job must offload (or take an approximate rung if it allows one).

The job: the built-in ``unconditional`` trainer on a UNet2DModel of about 0.4 B parameters
(``MODEL`` below; random weights, nothing downloaded) at 64 px, batch 8, AdamW in fp32: about
6.5 GB of weights, gradients and optimizer state, on cards of ``CARD`` (4 GiB). Every rung that
is exact is allowed (``ladder.allow`` left at its default).

Recorded per case, from the job record `oomguard run --json` prints: the final state, the
landed plan, every OOM (measurements with ``fits: false``, the probe's included), the attempts,
the wall time, and from the last attempt's metrics.jsonl the median samples/s and rank 0's peak
allocated bytes after the first step. Results: bench/results/gpu-multi.md and .json.

Without two CUDA devices it exits with status 2 and says why, unless ``--dry-run``: the same
code on the CPU with two emulated devices of 9 MiB and a small UNet (32/64 channels at 8 px,
about 10 MiB of state), in about 30 s on two cores; results gpu-dry-run-multi.md/json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CARD = "4GiB"
MODEL = {"channels": [256, 512, 768, 768], "resolution": 64, "norm_groups": 32}
DRY_RUN_CARD = "9MiB"
DRY_RUN_MODEL = {"channels": [32, 64], "resolution": 8, "norm_groups": 8}
STEPS = 6


def log(text: str) -> None:
    print(f"[gpu check, several GPUs] {text}", file=sys.stderr, flush=True)


def job_text(name: str, gpus: int, model: dict[str, Any]) -> str:
    blocks = len(model["channels"])
    return (
        f'name = "{name}"\ntrainer = "unconditional"\n[data]\nsource = "synthetic:16"\nresolution = {model["resolution"]}\n'
        f"[model]\nblock_out_channels = {json.dumps(model['channels'])}\nlayers_per_block = 2\n"
        f"down_block_types = {json.dumps(['DownBlock2D'] * blocks)}\nup_block_types = {json.dumps(['UpBlock2D'] * blocks)}\n"
        f"norm_num_groups = {model['norm_groups']}\n"
        f"[train]\nbatch_size = 8\nmax_steps = {STEPS}\nlearning_rate = 1e-4\nseed = 0\ncheckpoint_every_steps = 1000\n"
        f"[resources]\ngpus = {gpus}\n"
    )


def run_case(name: str, gpus: int, card: str, model: dict[str, Any], scratch: Path) -> dict[str, Any]:
    job = scratch / f"{name}.toml"
    job.write_text(job_text(name, gpus, model))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOMGUARD_")}
    started = time.monotonic()
    done = subprocess.run(
        [str(BIN / "oomguard"), "run", str(job), "--workdir", str(scratch / name), "--emulate-device-memory", card, "--json"],
        capture_output=True, text=True, env=env, timeout=1800,
    )
    seconds = time.monotonic() - started
    if done.returncode not in (0, 1):
        return {"case": name, "gpus": gpus, "state": f"oomguard run exited {done.returncode}", "error": done.stderr[-2000:], "seconds": seconds}
    record = json.loads(done.stdout)
    attempts = record["attempts"]
    last = attempts[-1] if attempts else None
    steps = []
    if last is not None:
        metrics = Path(last["directory"]) / "metrics.jsonl"
        steps = [json.loads(line) for line in metrics.read_text().splitlines()][1:] if metrics.exists() else []
    return {
        "case": name, "gpus": gpus, "card": card, "state": record["state"], "seconds": seconds,
        "landed": (last or {}).get("outcome", {}).get("plan"),
        "landed_short": _short((last or {}).get("outcome", {}).get("plan")),
        "ooms": sum(1 for a in attempts for m in (a.get("outcome") or {}).get("measurements", []) if not m["fits"]),
        "attempts": len(attempts),
        "samples_per_s": statistics.median(s["samples_per_s"] for s in steps) if steps else None,
        "peak_bytes": max((s["peak_bytes"] or 0 for s in steps), default=None),
        "events": [f"{e['kind']}: {e['message']}" for e in record.get("events", []) if e["kind"] in ("escalated", "attempt-ended")],
    }


def _short(plan: dict[str, Any] | None) -> str | None:
    if plan is None:
        return None
    from oomguard.strategies.plan import Plan

    return Plan.from_dict(plan).short()


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# GPU check, several GPUs" + (" (dry run on the CPU)" if result["dry_run"] else ""),
        "",
        f"Measured {result['when']} on {result['machine']} with `{result['command']}`. Each card capped at {result['card']}.",
        "",
        "| case | GPUs | state | landed plan | OOMs | attempts | samples/s | rank 0 peak | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["cases"]:
        rate = f"{c['samples_per_s']:.1f}" if c.get("samples_per_s") else "-"
        peak = f"{c['peak_bytes'] / 2**30:.2f} GiB" if c.get("peak_bytes") and not result["dry_run"] else (
            f"{c['peak_bytes'] / 2**20:.2f} MiB" if c.get("peak_bytes") else "-")
        lines.append(f"| {c['case']} | {c['gpus']} | {c['state']} | {c.get('landed_short') or '-'} | {c.get('ooms', '-')} | "
                     f"{c.get('attempts', '-')} | {rate} | {peak} | {c['seconds']:.0f} |")
    lines += ["", "What the doctor and the runner did:", ""]
    for c in result["cases"]:
        lines += [f"- {c['case']}:"] + [f"  - {e[:300]}" for e in c.get("events", [])] + ([f"  - error: {c['error'][-500:]}"] if c.get("error") else [])
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, with emulated devices and a small model")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not args.dry_run and found < 2:
        print(f"bench/gpu_check_multi.py needs 2 or more CUDA devices; this machine has {found}. "
              "Run it where two GPUs are free, or with --dry-run to check the code on the CPU.", file=sys.stderr)
        return 2
    card, model = (DRY_RUN_CARD, DRY_RUN_MODEL) if args.dry_run else (CARD, MODEL)
    machine = "CPU, 2 emulated devices" if args.dry_run else f"{found} x {torch.cuda.get_device_name(0)}"
    with tempfile.TemporaryDirectory(prefix="oomguard-gpu-multi-") as scratch:
        cases = []
        for name, gpus in (("one-card", 1), ("two-cards", 2)):
            log(f"{name}: {gpus} GPU(s), each capped at {card}")
            cases.append(run_case(name, gpus, card, model, Path(scratch)))
            log(f"{name}: {cases[-1]['state']}, landed [{cases[-1].get('landed_short')}], {cases[-1].get('ooms')} OOM(s)")
    stem = "gpu-dry-run-multi" if args.dry_run else "gpu-multi"
    result = {
        "dry_run": args.dry_run, "card": card, "model": model, "machine": machine, "when": time.strftime("%Y-%m-%d %H:%M"),
        "command": ".venv/bin/python bench/gpu_check_multi.py" + (" --dry-run" if args.dry_run else ""), "cases": cases,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(result))
    log(f"wrote {args.out / f'{stem}.md'}")
    return 0 if all(c["state"] == "finished" for c in cases if c["gpus"] > 1) else 1


if __name__ == "__main__":
    sys.exit(main())
