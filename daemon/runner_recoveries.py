"""The records of the rungs a runner took itself (jobs/loop.py's ``recoveries``: the probe's
start, an in-process rung, a step up and its way back, an aspect-ratio bucket's smaller
micro-batch), as the daemon reads them from outcome.json and the heartbeat: files the job's
owner writes, so a record is checked before it is read."""

from __future__ import annotations

from typing import Any

from oomguard.strategies.plan import Plan
from oomguard.strategies.planner import describe_change


def recorded_plans(change: dict[str, Any]) -> tuple[Plan, Plan] | None:
    """A runner's recoveries record's two plans (from, to), or None when the record is not one
    a runner writes (a step, a reason and two plans)."""
    if not isinstance(change.get("step"), int) or not isinstance(change.get("reason"), str):
        return None
    try:
        return Plan.from_dict(change["from"]), Plan.from_dict(change["to"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def recovery_text(change: dict[str, Any], old: Plan, new: Plan) -> str:
    """The event's words for a record ``recorded_plans`` read (``old``, ``new``: its plans)."""
    step, reason = change["step"], change["reason"]
    oom = change.get("oom") if isinstance(change.get("oom"), str) else None
    if "bucket" in change and oom is not None:
        # One aspect-ratio bucket's spike: the plan stays, that bucket's slices shrink.
        return f"at step {step}, in the runner: {oom} -> {reason}; resumed at step {step} in the same process"
    what = f"at step {step}, in the runner: [{old.short()}] -> [{new.short()}]: "
    if oom is None:
        return what + reason
    # An OOM the runner recovered from itself: what ran out, what changed, and that training
    # went on, in words (the daemon's log is what people read).
    if change.get("restart"):
        return what + f"{oom} -> {describe_change(old, new)}; {reason}; a new process goes on from the checkpoint at step {step}"
    return what + f"{oom} -> {describe_change(old, new)}; {reason}; resumed at step {step} in the same process"
