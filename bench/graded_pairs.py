#!/usr/bin/env python
"""Graded pairs of the ladder benchmark: jobs a little over their cap, where a finer rung can
land at the cap instead of paying for whole-block checkpointing or smaller micro-batches: a
checkpointing grade (feed-forward layers only, every second block), the optimizer step
inside backward (no full set of gradients) when the model's state dominates, or a fraction of
the blocks kept in host memory (layer offload) against the optimizer offload.

1. Sweep. Every plan the job's allowed rungs reach (``planner.candidate_plans`` over the
   micro-batch, the three checkpointing grades and, for the state-bound job, the step in
   backward) runs a few steps of the
   real runner under an emulated device that counts bytes but never refuses: its peak and its
   samples/s (median of the steps after the first; wall clock, one thread).
2. A pair is a job and a cap: a share of the peak of the job's own plan. The oracle is the
   fastest swept plan that fits the cap (the new rungs included); the best on/off plan is the
   fastest that fits without them (what the ladder had before: no partial grade, no step in
   backward).
3. oomguard: ``oomguard run JOB --emulate-device-memory CAP --json`` with the product's
   defaults (the probe on). From its record: every OOM, the plan it ended on, and that plan's
   swept speed against the oracle's and the best on/off plan's.

Run alone with ``.venv/bin/python bench/graded_pairs.py`` (about 17 minutes on 2 cores);
``make bench`` runs it inside bench/ladder.py. ``--jobs NAME ...`` runs only those jobs' pairs
and writes graded_pairs-NAME.json and .md beside the full results.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from pair_runs import fmt, landed, pair_medians, run_oomguard, sweep, sweep_summary  # noqa: E402

# activation_offload and offload are left out: on a GPU each byte they move crosses PCIe, on this
# CPU it is a copy within host memory, nearly free, so a CPU sweep ranks them far above what
# they cost there (bench/gpu_check.py measures on a GPU).
GRADES = ("micro_batch", "checkpoint_ff", "checkpoint_alternate", "checkpointing")
STATE = ("micro_batch", "checkpoint_alternate", "checkpointing", "fused_backward")
# Layer offload against its on/off neighbour, the optimizer offload (both exact, both move state
# to the host). On this CPU the host is the device: neither pays for its copies, which on a GPU
# cross PCIe; layer offload still pays FSDP's per-block work.
LAYERS = ("micro_batch", "checkpointing", "offload", "layer_offload")


@dataclass(frozen=True)
class Job:
    name: str
    what: str
    text: str  # the job file, without [ladder]
    allow: tuple[str, ...] = GRADES


@dataclass(frozen=True)
class Pair:
    job: str
    # The cap, as a share of the peak of the job's own plan.
    share: float


def unconditional_job() -> Job:
    return Job(
        "attn-unet",
        "UNet2DModel 16/32 channels with attention at 32 px, batch 8",
        'name = "attn-unet"\ntrainer = "unconditional"\n[data]\nsource = "synthetic:16"\nresolution = 32\n'
        '[model]\nblock_out_channels = [16, 32]\nlayers_per_block = 1\n'
        'down_block_types = ["DownBlock2D", "AttnDownBlock2D"]\nup_block_types = ["AttnUpBlock2D", "UpBlock2D"]\nnorm_num_groups = 8\n'
        "[train]\nbatch_size = 8\nmax_steps = 8\nlearning_rate = 1e-3\nseed = 0\ncheckpoint_every_steps = 4\n",
    )


def text_to_image_job() -> Job:
    import t2i_jobs

    folders = t2i_jobs._cached()
    return Job(
        "t2i-sd",
        "text-to-image, every UNet weight trained, tiny SD 1.x pipeline at 64 px, batch 8",
        f'name = "t2i-sd"\ntrainer = "text_to_image"\n[data]\nsource = "{folders["images"]}"\nresolution = 64\n'
        f'[model]\npath = "{folders["sd"]}"\nmethod = "full"\n'
        "[train]\nbatch_size = 8\nmax_steps = 8\nlearning_rate = 1e-4\nseed = 0\ncheckpoint_every_steps = 4\n",
    )


def state_job() -> Job:
    return Job(
        "state-unet",
        "UNet2DModel 32/64 channels at 8 px, batch 4: weights, gradients and AdamW state dominate",
        'name = "state-unet"\ntrainer = "unconditional"\n[data]\nsource = "synthetic:16"\nresolution = 8\n'
        '[model]\nblock_out_channels = [32, 64]\nlayers_per_block = 1\n'
        'down_block_types = ["DownBlock2D", "DownBlock2D"]\nup_block_types = ["UpBlock2D", "UpBlock2D"]\nnorm_num_groups = 8\n'
        "[train]\nbatch_size = 4\nmax_steps = 8\nlearning_rate = 1e-3\nseed = 0\ncheckpoint_every_steps = 4\n",
        allow=STATE,
    )


def layers_job() -> Job:
    return Job(
        "layers-unet",
        "UNet2DModel 32/64 channels at 16 px, batch 4 (weights, gradients and AdamW state are 10 MiB of its 14); micro-batch, checkpointing, optimizer offload, layer offload",
        'name = "layers-unet"\ntrainer = "unconditional"\n[data]\nsource = "synthetic:16"\nresolution = 16\n'
        '[model]\nblock_out_channels = [32, 64]\nlayers_per_block = 1\n'
        'down_block_types = ["DownBlock2D", "DownBlock2D"]\nup_block_types = ["UpBlock2D", "UpBlock2D"]\nnorm_num_groups = 8\n'
        "[train]\nbatch_size = 4\nmax_steps = 8\nlearning_rate = 1e-3\nseed = 0\ncheckpoint_every_steps = 4\n",
        allow=LAYERS,
    )


PAIRS = (
    Pair("attn-unet", 0.92), Pair("attn-unet", 0.85), Pair("t2i-sd", 0.92), Pair("t2i-sd", 0.85), Pair("state-unet", 0.96), Pair("state-unet", 0.93),
    Pair("layers-unet", 0.70), Pair("layers-unet", 0.46), Pair("layers-unet", 0.43), Pair("layers-unet", 0.42), Pair("layers-unet", 0.40),
)


def log(text: str) -> None:
    print(f"[graded pairs] {text}", file=sys.stderr, flush=True)


def with_ladder(job: Job) -> str:
    return job.text + f"[ladder]\nallow = {json.dumps(list(job.allow))}\n"


def graded(plan: dict[str, Any]) -> bool:
    """Whether a plan (as a dict) takes one of the finer rungs (a partial checkpointing grade,
    the step in backward, a fraction of the blocks on the host): every other plan is on/off."""
    from oomguard.strategies.plan import Plan
    from oomguard.strategies.rungs import fused_backward, layer_offload
    from oomguard.strategies.rungs.checkpoint_grades import grade

    plan = Plan.from_dict(plan)
    return grade(plan) in ("ff", "alternate") or fused_backward.on(plan) or layer_offload.on(plan)


def fastest(measured: dict[str, dict[str, Any]], cap: int, *, grades: bool) -> str | None:
    fitting = {label: m for label, m in measured.items() if m["peak_bytes"] <= cap and (grades or not graded(m["plan"]))}
    return max(fitting, key=lambda label: fitting[label]["samples_per_s"]) if fitting else None


JOBS = {"attn-unet": unconditional_job, "t2i-sd": text_to_image_job, "state-unet": state_job, "layers-unet": layers_job}


def measure(scratch: Path, names: tuple[str, ...] = tuple(JOBS)) -> dict[str, Any]:
    """Every pair of the jobs ``names``: the sweep, the oracle, the best on/off plan and what
    oomguard did."""
    from oomguard.jobs.spec import parse_job_text
    from oomguard.strategies import planner

    scratch.mkdir(parents=True, exist_ok=True)
    jobs = {name: JOBS[name]() for name in names}
    sweeps = {}
    for name, job in jobs.items():
        spec = parse_job_text(with_ladder(job), f"<{name}.toml>", base_dir=scratch)
        allow = spec.policy().allow
        sweeps[name] = {"own": spec.initial_plan().short(), "plans": sweep(name, spec, planner.candidate_plans(spec.initial_plan(), allow), scratch, log)}
    rows = []
    for n, pair in enumerate(PAIRS, 1):
        if pair.job not in jobs:
            continue
        job, measured = jobs[pair.job], sweeps[pair.job]["plans"]
        cap = int(measured[sweeps[pair.job]["own"]]["peak_bytes"] * pair.share)
        oracle, on_off = fastest(measured, cap, grades=True), fastest(measured, cap, grades=False)
        record = run_oomguard(with_ladder(job), cap, scratch, f"pair-{n}")["record"]
        plan, ooms = landed(record)

        def speed(label: str | None) -> float | None:
            return measured[label]["samples_per_s"] if label in measured else None

        rows.append({
            "n": n, "job": job.name, "what": job.what, "cap_bytes": cap, "share": pair.share, "oracle": oracle, "on_off": on_off,
            "landed": plan, "state": record["state"], "ooms": ooms, "attempts": len(record["attempts"]),
            "oracle_samples_per_s": speed(oracle), "on_off_samples_per_s": speed(on_off), "landed_samples_per_s": speed(plan),
            "fraction_of_oracle": speed(plan) / speed(oracle) if speed(plan) and speed(oracle) else None,
            "graded_over_on_off": speed(oracle) / speed(on_off) if oracle and graded(measured[oracle]["plan"]) and speed(on_off) else None,
        })
        log(f"pair {n} {job.name} cap {cap / 2**20:.2f} MiB: oracle [{oracle}], on/off [{on_off}], landed [{plan}], {ooms} OOM(s), {record['state']}")
    return {"jobs": {name: {"what": job.what, **sweeps[name]} for name, job in jobs.items()}, "pairs": rows}


def medians(result: dict[str, Any]) -> dict[str, Any]:
    pairs = result["pairs"]
    return {**pair_medians(pairs), "graded_wins": sum(p["graded_over_on_off"] is not None and p["graded_over_on_off"] > 1 for p in pairs)}


def markdown_section(result: dict[str, Any]) -> list[str]:
    m = medians(result)
    out = [
        "## Finer rungs: checkpointing grades, the step in backward, layer offload",
        "",
        "Built-in jobs a little over their cap (bench/graded_pairs.py): the micro-batch, checkpointing of the feed-forward "
        "layers (`ckpt=ff`), of every second block (`ckpt=1/2`) and of every block (`ckpt`), and for the jobs whose model state "
        "dominates the optimizer step inside backward (`fused-bwd`) or a fraction of the blocks in host memory (`layers@host=F`, "
        "against the optimizer offload `offload=optimizer`). Activation offload is left out, and the offloads are compared only "
        "with each other: on this CPU their copies stay in host memory, nearly free, where a GPU pays PCIe. The cap is a share of the job's own plan's peak. *Oracle*: the "
        "fastest swept plan that fits; *on/off*: the fastest that fits without the finer rungs (the ladder before them). Samples/s are the sweep's (wall clock, one thread).",
        "",
        f"Median OOMs to land: **{m['ooms']}**; median samples/s against the oracle: **{fmt(m['fraction_of_oracle'], '.3f')}**; "
        f"finished: **{m['finished']} of {m['pairs']}**; pairs where a finer rung's plan is the oracle and beats the best on/off plan: "
        f"**{m['graded_wins']}**.",
        "",
        "| # | job | cap | oracle | best on/off | oracle / on/off | landed | OOMs | samples/s vs oracle |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["pairs"]:
        out.append(
            f"| {p['n']} | {p['job']}: {p['what']} | {p['cap_bytes'] / 2**20:.2f} MiB ({p['share']:.2f}) | {p['oracle']} | {p['on_off']} | "
            f"{fmt(p['graded_over_on_off'])} | {p['landed']} | {p['ooms']} | {fmt(p['fraction_of_oracle'])} |"
        )
    out += ["", "Sweeps (peak and samples/s of every plan):", ""]
    out += [f"- {name}: {sweep_summary(job['plans'])}" for name, job in result["jobs"].items()]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where graded_pairs.json and .md go")
    parser.add_argument("--jobs", nargs="+", choices=tuple(JOBS), help="only these jobs' pairs (written to graded_pairs-NAME.json and .md)")
    args = parser.parse_args()
    names = tuple(args.jobs) if args.jobs else tuple(JOBS)
    stem = "graded_pairs" + ("-" + "-".join(names) if args.jobs else "")
    command = ".venv/bin/python bench/graded_pairs.py" + (" --jobs " + " ".join(names) if args.jobs else "")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="oomguard-graded-pairs-") as scratch:
        result = measure(Path(scratch), names)
    minutes = (time.monotonic() - started) / 60
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(
        "\n".join(["# Graded pairs", "", f"Measured {time.strftime('%Y-%m-%d %H:%M')} with `{command}` "
                   f"(about {minutes:.0f} minutes on 2 cores).", "", *markdown_section(result)[2:]]) + "\n"
    )
    log(f"wrote {args.out / f'{stem}.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
