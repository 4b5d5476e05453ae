#!/usr/bin/env python
"""Command-job pairs of the ladder benchmark: scripts that behave like diffusers' examples,
run unchanged as command jobs by ``oomguard run`` under an emulated cap, and what oomguard
lands on against the best micro-batch there is.

Each *variant* is a script with its arguments (tests/scripts/: a schedule sized from the data
loader, accelerate ``save_state``/``load_state`` and ``checkpoint-N``, a pretrained UNet from
``from_pretrained``, LoRA adapters, EMA). For each:

1. Sweep. The script alone (no daemon) under the bootstrap with an emulated device that never
   refuses, at every micro-batch that divides the batch, for a few steps: the steady peak and
   samples/s its bootstrap reports (metrics.jsonl; the first step of a process is left out).
2. A pair is the variant and a cap *schedule*: the whole device until a step, then a cap
   between the peaks of two micro-batches (as when another process takes memory mid-run), or
   that cap from the start. The oracle is the fastest swept micro-batch whose peak fits it.
3. oomguard: ``oomguard run JOB --emulate-device-memory SCHEDULE --json``; from its record:
   the OOMs it took, the plan it ended on, and whether the job's end state passed its check
   (all optimizer steps, the first attempt's final learning rate).

Speeds are the sweep's (wall clock, one thread per process): the landed plan's against the
oracle's, both measured the same way. Run alone with ``.venv/bin/python bench/command_pairs.py``;
``make bench`` runs it inside bench/ladder.py.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
BIN = Path(sys.executable).parent
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
# Steps of a sweep run (the first is left out of its figures).
SWEEP_STEPS = 6
UNLIMITED = "64GiB"


@dataclass(frozen=True)
class Variant:
    name: str
    script: str
    arguments: tuple[str, ...]
    batch_size: int
    max_steps: int
    what: str
    # How the script is told how many steps a sweep run takes.
    sweep_arguments: tuple[str, ...]
    smallest_micro_batch: int = 8


@dataclass(frozen=True)
class Pair:
    variant: str
    # The cap lies halfway between the peaks of these micro-batches (the larger does not fit).
    between: tuple[int, int]
    # The optimizer step after which the cap applies (0: from the start).
    drop_after: int


UNCONDITIONAL = "unconditional_like_train.py"
VARIANTS = {
    v.name: v
    for v in (
        Variant("schedule-from-loader", UNCONDITIONAL, ("--checkpointing_steps=5",), 128, 18,
                "MLP; cosine schedule sized from the loader in micro-batches", ("--num_epochs=1", f"--dataset_size={128 * SWEEP_STEPS}")),
        Variant("pretrained-unet", UNCONDITIONAL, ("--pretrained_model_name_or_path={unet}", "--resolution=16", "--dataset_size=128",
                "--num_epochs=3", "--checkpointing_steps=3"), 32, 12,
                "UNet2DModel from_pretrained (safetensors)", ("--num_epochs=1", f"--dataset_size={32 * SWEEP_STEPS}"), 4),
        Variant("lora", UNCONDITIONAL, ("--pretrained_model_name_or_path={unet}", "--lora_rank=4", "--resolution=16", "--dataset_size=128",
                "--num_epochs=3", "--checkpointing_steps=3"), 32, 12,
                "LoRA (peft) on a pretrained UNet", ("--num_epochs=1", f"--dataset_size={32 * SWEEP_STEPS}"), 4),
        Variant("ema-max-steps", "diffusers_like_train.py", ("--max_train_steps=16", "--checkpointing_steps=5", "--use_ema"), 1024, 16,
                "MLP with EMA, --max_train_steps", (f"--max_train_steps={SWEEP_STEPS}",), 64),
    )
}
PAIRS = (
    Pair("schedule-from-loader", (64, 128), drop_after=7),
    Pair("schedule-from-loader", (16, 32), drop_after=7),
    Pair("pretrained-unet", (16, 32), drop_after=4),
    Pair("lora", (8, 16), drop_after=4),
    Pair("ema-max-steps", (256, 512), drop_after=7),
    Pair("schedule-from-loader", (64, 128), drop_after=0),
)


def log(text: str) -> None:
    print(f"[command pairs] {text}", file=sys.stderr, flush=True)


def _environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOMGUARD_")}
    env.update(THREADS, **extra)
    return env


def _argv(variant: Variant, unet: Path, micro_batch: str, grad_accum: str, output_dir: str) -> list[str]:
    return [
        sys.executable, str(SCRIPTS / variant.script), f"--train_batch_size={micro_batch}", f"--gradient_accumulation_steps={grad_accum}",
        f"--output_dir={output_dir}", "--resume_from_checkpoint=latest", *(a.replace("{unet}", str(unet)) for a in variant.arguments),
    ]


def sweep(variant: Variant, unet: Path, scratch: Path) -> dict[int, dict[str, float]]:
    """Peak and samples/s at every micro-batch that divides the batch (down to the smallest)."""
    from oomguard.jobs.command import ATTEMPT_ENV, BOOTSTRAP_DIR

    measured: dict[int, dict[str, float]] = {}
    size = variant.batch_size
    while size >= variant.smallest_micro_batch:
        folder = scratch / f"sweep-{variant.name}-{size}"
        folder.mkdir(parents=True)
        argv = _argv(variant, unet, str(size), str(variant.batch_size // size), str(folder / "out"))
        argv = [a for a in argv if not a.startswith(("--num_epochs", "--max_train_steps", "--dataset_size", "--resume"))] + list(variant.sweep_arguments)
        env = _environment(
            PYTHONPATH=str(BOOTSTRAP_DIR), OOMGUARD_ATTEMPT_DIR=str(folder), OOMGUARD_EMULATE_DEVICE_MEMORY=UNLIMITED,
            **{ATTEMPT_ENV: json.dumps({"plan": f"mb={size}", "max_steps": SWEEP_STEPS, "batch_size": variant.batch_size})},
        )
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"sweep of {variant.name} at micro-batch {size} failed:\n{done.stderr[-2000:]}")
        steps = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()][1:]
        measured[size] = {
            "peak_bytes": max(s["peak_bytes"] for s in steps),
            "samples_per_s": statistics.median(s["samples_per_s"] for s in steps if s["samples_per_s"]),
        }
        log(f"{variant.name} mb={size}: peak {measured[size]['peak_bytes'] / 2**10:.0f} KiB, {measured[size]['samples_per_s']:.0f} samples/s")
        size //= 2
    return measured


def run_oomguard(variant: Variant, unet: Path, schedule: str, scratch: Path, name: str) -> dict[str, Any]:
    job = scratch / f"{name}.toml"
    argv = _argv(variant, unet, "{micro_batch}", "{grad_accum}", "{workdir}/out")
    job.write_text(
        f'name = "{name}"\ntrainer = "command"\n[command]\nargv = {json.dumps(argv)}\n'
        f"[train]\nbatch_size = {variant.batch_size}\nmax_steps = {variant.max_steps}\n"
    )
    started = time.monotonic()
    done = subprocess.run(
        [str(BIN / "oomguard"), "run", str(job), "--workdir", str(scratch / name), "--emulate-device-memory", schedule, "--json"],
        capture_output=True, text=True, env=_environment(), timeout=1800,
    )
    if done.returncode not in (0, 1):
        raise RuntimeError(f"oomguard run of {name} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    record = json.loads(done.stdout)
    return {"record": record, "seconds": time.monotonic() - started}


def measure(scratch: Path) -> dict[str, Any]:
    """Every pair: the sweep, the oracle and what oomguard did."""
    scratch.mkdir(parents=True, exist_ok=True)
    unet = scratch / "unet"
    subprocess.run([sys.executable, str(SCRIPTS / "save_tiny_unet.py"), str(unet), "16"], check=True, env=_environment(), timeout=600)
    sweeps = {name: sweep(variant, unet, scratch) for name, variant in VARIANTS.items()}
    rows = []
    for n, pair in enumerate(PAIRS, 1):
        variant, measured = VARIANTS[pair.variant], sweeps[pair.variant]
        small, large = pair.between
        cap = int((measured[small]["peak_bytes"] + measured[large]["peak_bytes"]) / 2)
        fitting = {size: m for size, m in measured.items() if m["peak_bytes"] <= cap}
        oracle = max(fitting, key=lambda size: fitting[size]["samples_per_s"])
        schedule = f"{cap}B" if pair.drop_after == 0 else f"{UNLIMITED},{cap}B@{pair.drop_after}"
        run = run_oomguard(variant, unet, schedule, scratch, f"pair-{n}")
        record = run["record"]
        attempts = record["attempts"]
        landed = attempts[-1]["plan"]["micro_batch"] if attempts else None
        ooms = sum(1 for a in attempts if (a.get("outcome") or {}).get("kind") == "oom")
        row = {
            "n": n,
            "variant": variant.name,
            "what": variant.what,
            "cap_bytes": cap,
            "schedule": "from the start" if pair.drop_after == 0 else f"after step {pair.drop_after}",
            "oracle_micro_batch": oracle,
            "landed_micro_batch": landed,
            "state": record["state"],
            "ooms": ooms,
            "attempts": len(attempts),
            "end_state_passed": record["state"] == "finished" and "end state as planned" in (record["result"] or ""),
            "fraction_of_oracle": measured[landed]["samples_per_s"] / measured[oracle]["samples_per_s"] if landed in measured else None,
            "result": record["result"],
            "seconds": run["seconds"],
        }
        log(f"pair {n} {variant.name} cap {cap / 2**10:.0f} KiB {row['schedule']}: oracle mb={oracle}, landed mb={landed}, "
            f"{ooms} OOM(s), {record['state']}, end state {'passed' if row['end_state_passed'] else 'NOT passed'}")
        rows.append(row)
    return {"variants": {name: {"what": v.what, "batch_size": v.batch_size, "sweep": sweeps[name]} for name, v in VARIANTS.items()}, "pairs": rows}




def medians(result: dict[str, Any]) -> dict[str, Any]:
    pairs = result["pairs"]
    fractions = [p["fraction_of_oracle"] for p in pairs if p["fraction_of_oracle"] is not None]
    return {
        "ooms": statistics.median(p["ooms"] for p in pairs),
        "fraction_of_oracle": statistics.median(fractions) if fractions else None,
        "end_state_passed": sum(p["end_state_passed"] for p in pairs),
        "pairs": len(pairs),
    }


def markdown_section(result: dict[str, Any]) -> list[str]:
    m = medians(result)
    out = [
        "## Command jobs",
        "",
        "Scripts in tests/scripts/ that behave like diffusers' examples, run unchanged as command jobs by `oomguard run` "
        "(bench/command_pairs.py). The cap is halfway between the peaks of two micro-batches of the script's own sweep, "
        "from a step on (another process takes memory mid-run) or from the start. *OOMs* counts every attempt that ran out "
        "of memory (the first one is forced by the cap); *end state* is the daemon's own check of the finished job (all "
        "optimizer steps, the first attempt's final learning rate); speed is the landed micro-batch's samples/s in the sweep "
        "against the oracle's (the fastest micro-batch that fits), wall clock, one thread per process.",
        "",
        f"Median OOMs to land: **{m['ooms']}**; median samples/s against the oracle: **{_fmt(m['fraction_of_oracle'])}**; "
        f"end state passed: **{m['end_state_passed']} of {m['pairs']}**.",
        "",
        "| # | script | cap | cap applies | oracle mb | landed mb | OOMs | attempts | end state | samples/s vs oracle |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["pairs"]:
        out.append(
            f"| {p['n']} | {p['variant']}: {p['what']} | {p['cap_bytes'] / 2**10:.0f} KiB | {p['schedule']} | {p['oracle_micro_batch']} | "
            f"{p['landed_micro_batch']} | {p['ooms']} | {p['attempts']} | {'passed' if p['end_state_passed'] else p['state'] + ', not passed'} | "
            f"{_fmt(p['fraction_of_oracle'])} |"
        )
    return out


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where command_pairs.json and .md go")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="oomguard-command-pairs-") as scratch:
        result = measure(Path(scratch))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "command_pairs.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "command_pairs.md").write_text("\n".join(["# Command-job pairs", "", *markdown_section(result)[2:]]) + "\n")
    log(f"wrote {args.out / 'command_pairs.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
