"""What each frozen-part rung saved, for bench/ladder.py: for every rung whose ``needs`` holds
"frozen_parts" or "ema" (the rungs only a text-to-image job's frozen encoders, or a job's
average of its weights, make possible; found in the registry, ``strategies.rungs.ladder()``:
no rung is named here) and every job that has frozen parts (a text-to-image job's VAE encoder
and text encoders), the bytes it saved, measured in the sweep: the peak of a plan without the rung minus the peak
of the plan that differs from it only in that rung's knob.

Two figures per (rung, job): the pair at the job's own plan (the whole batch at once, nothing
saved, against the rung's step from it), measured for this table even where the job's
``ladder.allow`` leaves the rung out; and the median over every such pair the sweep measured
(each micro-batch and shape of the job's ladder with the rung on).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

FEATURE = "frozen_parts"
# The needs of the rungs this table shows: frozen parts, and the EMA of a job with train.ema.
SAVING_FEATURES = frozenset({FEATURE, "ema"})
MiB = 2**20


def frozen_part_rungs() -> list[Any]:
    """The registry's rungs that need frozen parts or the EMA, in ladder order."""
    from oomguard.strategies import rungs

    return [r for r in rungs.ladder() if r.needs & SAVING_FEATURES]


def _consumer(rung: Any) -> str:
    """The static consumer the rung takes off the device ("frozen" or "ema"), shown beside its saving."""
    return "ema" if "ema" in rung.shrinks else "frozen"


def extra_plans(spec: Any, start: Any) -> list[Any]:
    """The plans to sweep for the own-plan pairs: each frozen-part rung's step from the job's
    own plan, for every such rung the job offers the needs of."""
    features = spec.features()
    if FEATURE not in features:
        return []
    steps = [r.step(start) for r in frozen_part_rungs() if r.needs <= features]
    return [plan for plan in steps if plan is not None]


def job_savings(name: str, spec: Any, start: Any, results: dict[Any, dict[str, Any]], key: Callable[[Any], Any]) -> list[dict[str, Any]]:
    """One row per frozen-part rung for the job; ``results``: the sweep's, by ``key(plan)``."""
    features = spec.features()
    allowed = set(spec.policy().allow)
    rows = []
    for rung in frozen_part_rungs():
        row: dict[str, Any] = {"rung": rung.name, "exact": rung.exact, "job": name, "in_ladder": rung.name in allowed, "consumer": _consumer(rung)}
        missing = sorted(rung.needs - features)
        if missing:
            rows.append({**row, "note": f"the job does not offer {', '.join(missing)}"})
            continue
        pairs = []
        for plan, result in results.items():
            off = key(rung.set(plan, rung.default))
            if rung.is_on(plan) and off != plan and off in results:
                pairs.append({"without": off, "with": plan, "saved_bytes": results[off]["peak_bytes"] - result["peak_bytes"],
                              "frozen_bytes": (_static(results[off], _consumer(rung)), _static(result, _consumer(rung)))})
        on = rung.step(start)
        own = next((p for p in pairs if on is not None and p["without"] == key(start) and p["with"] == key(on)), None)
        saved = [p["saved_bytes"] for p in pairs]
        rows.append({
            **row,
            "own_plan": {"without": own["without"].short(), "with": own["with"].short(), "saved_bytes": own["saved_bytes"],
                         "frozen_bytes_without": own["frozen_bytes"][0], "frozen_bytes_with": own["frozen_bytes"][1]} if own else None,
            "pairs": len(pairs),
            "median_saved_bytes": statistics.median(saved) if saved else None,
            "min_saved_bytes": min(saved, default=None),
            "max_saved_bytes": max(saved, default=None),
            "note": None if pairs else "no pair measured (its step does not apply to the job's plans)",
        })
    return rows


def _static(result: dict[str, Any], consumer: str) -> int | None:
    return (result.get("static_bytes") or {}).get(consumer)


def _mib(value: float | None) -> str:
    return "—" if value is None else f"{value / MiB:.3f}"


def markdown_section(rows: list[dict[str, Any]], frozen: dict[str, dict[str, Any]]) -> list[str]:
    """The report's section: the frozen parts per job, then the savings per (rung, job).
    ``frozen``: per job with frozen parts, its own plan's frozen bytes and peak."""
    out = ["## Frozen-part rung savings", ""]
    if not frozen:
        return [*out, "No job of this run has frozen parts.", ""]
    out += ["Frozen parts on the device (the VAE's encoder and the text encoders; `Training.static_bytes()['frozen']` "
            "after the sweep's steps of the job's own plan):", "",
            "| job | frozen MiB | own plan's peak MiB | share |", "|---|---|---|---|"]
    out += [f"| {job} | {_mib(f['frozen_bytes'])} | {_mib(f['peak_bytes'])} | "
            + (f"{f['frozen_bytes'] / f['peak_bytes']:.0%}" if f["frozen_bytes"] is not None and f["peak_bytes"] else "—") + " |"
            for job, f in frozen.items()]
    out.append("")
    if not frozen_part_rungs():
        return [*out, f"No rung on the ladder (`strategies.rungs.ladder()`) has `{FEATURE}` in its `needs` yet: no saving to show.", ""]
    out += [
        "Saved: the peak of a swept plan without the rung minus the peak of the plan that differs from it only in the "
        "rung's knob (negative: it cost memory). *At the job's own plan*: that pair at the job's initial plan (the whole "
        "batch at once, nothing else saved) against the rung's step from it, measured for this table even where the "
        "job's `ladder.allow` leaves the rung out; on the device: the bytes of what the rung moves (the frozen parts, "
        "or the EMA for `ema_offload`) without -> with. "
        "*Median*: over every such pair of the job's sweep (its micro-batches and shapes with the rung on).",
        "",
        "| rung | exact | job | in the job's ladder | saved at the own plan MiB | on the device MiB without -> with | median saved MiB (pairs) | range MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "pairs" not in r:
            out.append(f"| {r['rung']} | {'yes' if r['exact'] else 'no'} | {r['job']} | — | {r['note']} | | | |")
            continue
        own = r["own_plan"] or {}
        frozen_change = f"{r.get('consumer', 'frozen')}: {_mib(own.get('frozen_bytes_without'))} -> {_mib(own.get('frozen_bytes_with'))}" if own else "—"
        spread = f"{_mib(r['min_saved_bytes'])} .. {_mib(r['max_saved_bytes'])}" if r["pairs"] else (r["note"] or "—")
        out.append(f"| {r['rung']} | {'yes' if r['exact'] else 'no'} | {r['job']} | {'yes' if r['in_ladder'] else 'no'} | "
                   f"{_mib(own.get('saved_bytes'))} | {frozen_change} | {_mib(r['median_saved_bytes'])} ({r['pairs']}) | {spread} |")
    out.append("")
    return out
