"""Built-in trainers: the registry from a job file's ``trainer`` to the module that trains it.

Only names here and lazy imports: importing a trainer module imports torch, and the job-file
check (jobs/spec.py, daemon side) reads ``TRAINER_NAMES`` without it. Adding a trainer is one
module with a ``make_trainer(job, workdir)`` (jobs/trainers/base.py says what it returns) and one line
in ``_BUILT_IN``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oomguard.jobs.trainers.base import Trainer

TrainerFactory = Callable[..., "Trainer"]

# trainer name -> the module whose make_trainer(job, workdir) builds it.
_BUILT_IN: dict[str, str] = {
    "unconditional": "oomguard.jobs.trainers.unconditional",
    "text_to_image": "oomguard.jobs.trainers.text_to_image",
}

TRAINER_NAMES: tuple[str, ...] = tuple(_BUILT_IN)

# Trainers a test put in for the duration of a block (``register``).
_registered: dict[str, TrainerFactory] = {}


def make_trainer(job: Any, workdir: Path | None = None) -> Trainer:
    """The trainer for ``job`` (a JobSpec), by its ``trainer`` name. ``workdir``: the job's
    folder, where a trainer may keep what it computes once (caches); None: nowhere that
    outlives the process (a benchmark's or a test's trainer)."""
    if job.trainer in _registered:
        return _registered[job.trainer](job)
    if job.trainer not in _BUILT_IN:
        raise ValueError(f"unknown trainer {job.trainer!r} (built in: {', '.join(TRAINER_NAMES)})")
    return importlib.import_module(_BUILT_IN[job.trainer]).make_trainer(job, workdir)


@contextmanager
def register(name: str, factory: TrainerFactory) -> Iterator[None]:
    """Make ``factory`` the trainer of jobs whose ``trainer`` is ``name`` for the duration of
    the block: what a test does to add a trainer without editing this module."""
    if name in _BUILT_IN or name in _registered:
        raise ValueError(f"a trainer named {name!r} is registered already")
    _registered[name] = factory
    try:
        yield
    finally:
        del _registered[name]
