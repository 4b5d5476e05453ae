"""Rung `allocator`: PyTorch's expandable segments, the cure for a fragmented caching allocator.

Exact (the arithmetic is unchanged). The setting is read when CUDA initialises, so it needs a
new process: the daemon puts it in the attempt's environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import metadata

from oomguard.strategies.plan import EXPANDABLE_SEGMENTS, Plan
from oomguard.strategies.rungs.base import CommandSide, Rung

NEW_VARIABLE = "PYTORCH_ALLOC_CONF"
OLD_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
# PyTorch 2.9 renamed PYTORCH_CUDA_ALLOC_CONF to PYTORCH_ALLOC_CONF (the old name still works
# with a deprecation warning). Setting both is ambiguous, so exactly one is set.
FIRST_VERSION_WITH_NEW_VARIABLE = (2, 9)


def installed_torch_version() -> tuple[int, int] | None:
    """torch's (major, minor) from the installed distribution, without importing torch."""
    try:
        text = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
    numbers = text.split("+")[0].split(".")
    try:
        return int(numbers[0]), int(numbers[1])
    except (IndexError, ValueError):
        return None


def variable_for(version: tuple[int, int] | None) -> str:
    if version is None or version >= FIRST_VERSION_WITH_NEW_VARIABLE:
        return NEW_VARIABLE
    return OLD_VARIABLE


def step(plan: Plan) -> Plan | None:
    if plan.allocator == EXPANDABLE_SEGMENTS:
        return None
    return plan.replace(allocator=EXPANDABLE_SEGMENTS)


def describe(old: Plan, new: Plan) -> str:
    return "use expandable segments in the CUDA caching allocator (reclaims fragmented memory; new process)"


def environment(plan: Plan, env: Mapping[str, str], version: tuple[int, int] | None = None) -> dict[str, str]:
    """The attempt's environment: the user's allocator options merged into one variable.

    Options the user already set (in either variable) are kept; ours is added when the plan
    asks for it; the variable this torch does not read first is removed.
    """
    result = dict(env)
    chosen = variable_for(version if version is not None else installed_torch_version())
    options: list[str] = []
    for name in (OLD_VARIABLE, NEW_VARIABLE):
        for option in result.pop(name, "").split(","):
            if option.strip() and option.strip() not in options:
                options.append(option.strip())
    if plan.allocator:
        options = [o for o in options if not o.startswith("expandable_segments:")]
        options.append(plan.allocator)
    if options:
        result[chosen] = ",".join(options)
    return result


def label(plan: Plan) -> str | None:
    return "expandable" if plan.allocator else None


RUNG = Rung(
    name="allocator",
    exact=True,
    needs_restart=True,
    step=step,
    describe=describe,
    knob="allocator",
    default="",
    role="process",
    cures_fragmentation=True,
    label=label,
    environment=environment,
    # The daemon's own: an environment variable every script's torch reads.
    command=CommandSide(),
)
