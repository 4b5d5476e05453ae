"""How many processes a built-in job's next plan may have: the plans on more processes the
doctor weighs after an OOM when GPUs are free (widen), and how a change of plan is named in
events. Apart from doctor.py because it is one idea: the width of a plan, which no rung turns
(the job's resources.gpus range allows it; daemon/narrowing.py gives GPUs back).
"""

from __future__ import annotations

from oomguard.strategies import rungs
from oomguard.strategies.plan import Plan
from oomguard.strategies.planner import candidate_plans, rungs_between
from oomguard.strategies.policy import Policy

# What a change of plan onto more processes is called in events, and back onto fewer.
WIDEN = "widen"
NARROW = "narrow"


def at_width(origin: Plan, width: int) -> Plan:
    """``origin`` on ``width`` processes, its micro-batch within each one's share."""
    return origin.replace(world_size=width, micro_batch=min(origin.micro_batch, origin.batch_size // width))


def widened_candidates(origin: Plan, plan: Plan, policy: Policy) -> list[Plan]:
    """Every plan the allowed rungs reach on the plan's number of processes and, where the
    policy lets the job widen (Policy.widest), on each larger number that splits the batch."""
    widths = [plan.world_size] + [
        width for width in range(plan.world_size + 1, (policy.widest or 0) + 1) if origin.batch_size % width == 0
    ]
    return [candidate for width in widths for candidate in candidate_plans(at_width(origin, width), policy.allow)]


def rungs_taken(old: Plan, new: Plan) -> str:
    """The rungs a change of plan took, as events name them: "widen" first when it adds
    processes; the batch rung for a plan that differs only in how its batch is run (the
    planner's answer may equal the plan the process ran, at another micro-batch)."""
    names = rungs_between(old, new)
    if not names and new.world_size == old.world_size:
        names = tuple(r.name for r in rungs.ladder() if r.role == "batch")
    return "+".join(((WIDEN,) if new.world_size > old.world_size else ()) + names)
