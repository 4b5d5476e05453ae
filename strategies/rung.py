"""The shape every rung module fills in: a name, whether it is exact, a pure Plan -> Plan step,
and the code that applies the rung's knob to a process environment or a model."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from oomguard.strategies.plan import Plan


def _no_environment(plan: Plan, env: Mapping[str, str]) -> dict[str, str]:
    return dict(env)


def _no_model_change(plan: Plan, model: Any) -> None:
    return None


@dataclass(frozen=True)
class Rung:
    """One memory saving of the ladder.

    ``step`` returns the plan with this rung taken one notch further, or None when this rung
    has nothing more to give (e.g. micro-batch already 1). ``describe`` says in words what a
    step changed, for events and notifications.
    """

    name: str
    exact: bool
    # True when the change only takes effect in a new process (allocator settings are read
    # once, when CUDA initialises).
    needs_restart: bool
    step: Callable[[Plan], Plan | None]
    describe: Callable[[Plan, Plan], str]
    environment: Callable[[Plan, Mapping[str, str]], dict[str, str]] = _no_environment
    configure_model: Callable[[Plan, Any], None] = _no_model_change
