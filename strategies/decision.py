"""What the doctor answers with: the typed decisions (take a rung, retry, wait, give up) and the
past attempts it decides from. The daemon's lifecycle applies them; the doctor
(strategies/doctor.py) makes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from oomguard.strategies.outcome import Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.policy import Policy


@dataclass(frozen=True)
class PastAttempt:
    plan: Plan
    outcome: Outcome
    # Launched under a faster plan than the attempt before it ended with (a command job's step
    # up at a relaunch: strategies/step_up_history.py).
    stepped_up: bool = False


def own_plan(policy: Policy, history: Sequence[PastAttempt], plan: Plan) -> Plan:
    """The job's own plan: its file's, else its first attempt's, else ``plan``."""
    return policy.initial or (history[0].plan if history else plan)


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
class WaitForDisk:
    """The disk was full: wait until ``needed`` bytes are free at ``path`` (None: the attempt
    could not say how many), then run the same plan from the last verified checkpoint. It costs
    the job no try, and never fails it: room is a person's to make, and they are told."""

    reason: str
    path: str
    needed: int | None
    free: int | None
    # Not before this many seconds either (disk-full attempts in a row: strategies/doctor_disk.py).
    after_seconds: float = 0.0
    # The job's disk budget, when the room is missing in it rather than on the disk.
    budget: int | None = None


@dataclass(frozen=True)
class GiveUp:
    """Stop: a person has to act. ``report`` says what was tried and what could be done;
    ``next_step`` what the job's owner does now."""

    reason: str
    report: str
    next_step: str


Decision = NextPlan | Retry | Wait | WaitForDisk | GiveUp
