"""What the doctor answers with: the typed decisions (take a rung, retry, wait, give up) and the
past attempts it decides from. The daemon's lifecycle applies them; the doctor
(strategies/doctor.py) makes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan


@dataclass(frozen=True)
class PastAttempt:
    plan: Plan
    outcome: Outcome


@dataclass(frozen=True)
class NextPlan:
    """Take a rung: run the next attempt under ``plan``."""

    plan: Plan
    rung: str
    reason: str


@dataclass(frozen=True)
class Retry:
    """Run the same plan again (a crash that may be transient, or an interruption), not
    before ``after_seconds``: a crash that comes from the machine (a full disk, a lost mount)
    must not use up every retry in the seconds it lasts."""

    reason: str
    after_seconds: float = 0.0
    # What the next attempts ask of a cluster (None: as before): more host memory after an OOM
    # at its limit, checkpoints at least this often after a time limit passed without one.
    host_memory: int | None = None
    checkpoint_every_seconds: float | None = None


@dataclass(frozen=True)
class Wait:
    """Another process took the memory: wait until ``free_bytes`` are free on the job's GPUs
    again, then run the same plan."""

    reason: str
    free_bytes: int


@dataclass(frozen=True)
class GiveUp:
    """Stop: a person has to act. ``report`` says what was tried and what could be done;
    ``next_step`` what the job's owner does now."""

    reason: str
    report: str
    next_step: str


Decision = NextPlan | Retry | Wait | GiveUp
