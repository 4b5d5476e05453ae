"""A job's policy: which rungs the doctor may take for it, and how many tries it gets.

Its own module so that the job contract (jobs/spec/, which builds one from a job file) does
not import the doctor and, through it, the planner and the memory model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oomguard.strategies import rungs
from oomguard.strategies.plan import Plan


# What a job that trains a whole model and has nothing frozen offers rungs (Rung.needs).
WHOLE_MODEL = frozenset({"full_model"})


@dataclass(frozen=True)
class Policy:
    """What the job allows: which rungs, and how many tries."""

    # By default the exact rungs of a job that trains a whole model and has nothing frozen
    # (what a job file's default gives the unconditional trainer; JobSpec.policy() gives each
    # job its own).
    allow: tuple[str, ...] = field(default_factory=lambda: rungs.usable_by(WHOLE_MODEL, rungs.exact_names()))
    # Every rung the job could take if its file allowed it (what reports suggest).
    usable: tuple[str, ...] = field(default_factory=lambda: rungs.usable_by(WHOLE_MODEL))
    max_attempts: int = 12
    crash_retries: int = 2
    # Attempts cut short by a neighbour's spike (contention) in a row, at most: a GPU that
    # other processes keep taking needs a person.
    max_waits: int = 20
    # The job's own first plan: the planner searches everything reachable from it.
    initial: Plan | None = None
    # Rungs under which the job's loss diverged (set by decide from the history): neither
    # taken nor suggested again.
    unsafe: tuple[str, ...] = ()
    # A command job's argument that carries the plan's micro-batch to its script (e.g.
    # "--train_batch_size={micro_batch}"): a script may ignore it, which the doctor watches
    # for. None for the built-in trainer, which always honours its plan.
    micro_batch_argument: str | None = None
    # The most processes (one per GPU) the job's next plan may have: a built-in job whose
    # resources.gpus is a range, when the daemon sees GPUs it could widen onto (set by the
    # daemon at the decision). None: the plan's own number.
    widest: int | None = None
