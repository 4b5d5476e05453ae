"""The job contract: a job file in, a validated frozen :class:`JobSpec` out, and what the
daemon and the runner carry of it after that. Torch-free (the daemon and the CLI import it),
and free of the doctor, the planner and the memory model (tests/integration/test_imports.py).

These are the names the rest of oomguard imports; each lives in a module of one idea:

- job_file.py: reading a job file (bytes, text, TOML) — :func:`load_job_file`, :func:`parse_job_text`;
- job.py: :class:`JobSpec`, how its tables make one, and :meth:`JobSpec.load` for a stored one;
- common.py: the tables of every job ([train], [ladder], [resources], [notify]);
- unconditional.py: the built-in trainer's [data] and [model], and the image-folder look;
- command.py: a command job's [command]; command_paths.py: what it names on the file system;
- keys.py: the keys each table may hold, the placeholders and [command.when] knobs;
- reader.py: the typed reading of one table (its errors are strategies/errors.py's JobFileError).
"""

from __future__ import annotations

from oomguard.jobs.spec.command import CommandSpec
from oomguard.jobs.spec.common import MAX_BATCH_SIZE, MIXED_PRECISIONS, LadderSpec, NotifySpec, ResourcesSpec, TrainSpec
from oomguard.jobs.spec.job import NAME_PATTERN, JobSpec
from oomguard.jobs.spec.job_file import MAX_JOB_FILE_BYTES, load_job_file, parse_job_text
from oomguard.jobs.spec.keys import COMMAND_TRAINER, DEFAULT_NOTIFY_EVENTS, MODEL_KEYS, NOTIFY_EVENTS
from oomguard.jobs.spec.unconditional import (
    ACT_FNS,
    DOWN_BLOCK_TYPES,
    IMAGE_EXTENSIONS,
    SYNTHETIC_PREFIX,
    TIME_EMBEDDING_TYPES,
    UP_BLOCK_TYPES,
    DataSpec,
    ModelSpec,
)

__all__ = [
    "ACT_FNS",
    "COMMAND_TRAINER",
    "DEFAULT_NOTIFY_EVENTS",
    "DOWN_BLOCK_TYPES",
    "IMAGE_EXTENSIONS",
    "MAX_BATCH_SIZE",
    "MAX_JOB_FILE_BYTES",
    "MIXED_PRECISIONS",
    "MODEL_KEYS",
    "NAME_PATTERN",
    "NOTIFY_EVENTS",
    "SYNTHETIC_PREFIX",
    "TIME_EMBEDDING_TYPES",
    "UP_BLOCK_TYPES",
    "CommandSpec",
    "DataSpec",
    "JobSpec",
    "LadderSpec",
    "ModelSpec",
    "NotifySpec",
    "ResourcesSpec",
    "TrainSpec",
    "load_job_file",
    "parse_job_text",
]
