"""Job files: TOML in, a validated frozen :class:`JobSpec` out.

A job file names a trainer, its data, the UNet2DModel keyword arguments, the training
settings and the rungs of the memory ladder the job may use::

    name = "quickstart"
    trainer = "unconditional"
    [data]
    source = "synthetic:64"
    resolution = 32
    [model]
    block_out_channels = [32, 64]
    ...
    [train]
    batch_size = 16
    max_steps = 40
    learning_rate = 1e-4
    [ladder]
    allow = ["allocator", "micro_batch", "checkpointing"]

Every problem is reported as a :class:`JobFileError` whose ``str()`` is one line,
``{path}: {key}: {problem}``, naming the dotted key (``train.batch_size``) and what was
expected and found. Checks run in a fixed order and the first problem found is reported.

This module must stay cheap to import (the daemon and CLI import it): no torch, no diffusers.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import errno
import json
import math
import os
import re
import shutil
import stat
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from oomguard.jobs.trainers import TRAINER_NAMES
from oomguard.strategies import rungs
from oomguard.strategies.doctor import Policy
from oomguard.jobs.command import CommandError, CommandSpec, batch_argument, check, exposed_rungs, script_argument, when_keys
from oomguard.jobs.sizes import parse_size
from oomguard.strategies.plan import MixedPrecision, Plan

__all__ = [
    "ACT_FNS",
    "DOWN_BLOCK_TYPES",
    "IMAGE_EXTENSIONS",
    "MIXED_PRECISIONS",
    "MODEL_KEYS",
    "NAME_PATTERN",
    "SYNTHETIC_PREFIX",
    "TIME_EMBEDDING_TYPES",
    "UP_BLOCK_TYPES",
    "DataSpec",
    "JobFileError",
    "JobSpec",
    "LadderSpec",
    "ModelSpec",
    "TrainSpec",
    "load_job_file",
    "parse_job_text",
]

IMAGE_EXTENSIONS: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
SYNTHETIC_PREFIX = "synthetic:"
MIXED_PRECISIONS: tuple[str, ...] = ("no", "bf16", "fp16")
DOWN_BLOCK_TYPES: tuple[str, ...] = (
    "DownBlock2D",
    "AttnDownBlock2D",
    "ResnetDownsampleBlock2D",
    "SkipDownBlock2D",
    "AttnSkipDownBlock2D",
)
UP_BLOCK_TYPES: tuple[str, ...] = (
    "UpBlock2D",
    "AttnUpBlock2D",
    "ResnetUpsampleBlock2D",
    "SkipUpBlock2D",
    "AttnSkipUpBlock2D",
)
ACT_FNS: tuple[str, ...] = ("silu", "swish", "mish", "gelu", "relu")
TIME_EMBEDDING_TYPES: tuple[str, ...] = ("positional", "fourier")
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# UNet2DModel's own default; used only to check that it divides every block width.
DEFAULT_NORM_NUM_GROUPS = 32

# The accepted UNet2DModel keyword arguments, in the order they are checked and stored.
MODEL_KEYS: tuple[str, ...] = (
    "in_channels",
    "out_channels",
    "block_out_channels",
    "layers_per_block",
    "down_block_types",
    "up_block_types",
    "norm_num_groups",
    "attention_head_dim",
    "dropout",
    "act_fn",
    "time_embedding_type",
    "center_input_sample",
    "flip_sin_to_cos",
    "freq_shift",
    "downsample_padding",
    "mid_block_scale_factor",
    "norm_eps",
)
_MODEL_DEFAULTS: dict[str, Any] = {"in_channels": 3, "out_channels": 3}
_MODEL_REQUIRED = ("block_out_channels", "down_block_types", "up_block_types")

_TOP_KEYS = ("name", "trainer", "priority", "workdir", "data", "model", "train", "ladder", "resources", "notify", "command")
_TOP_TABLES = ("data", "model", "train", "ladder", "resources", "notify", "command")
# The trainer of jobs that run a command of their own (jobs/command.py).
COMMAND_TRAINER = "command"
_DATA_KEYS = ("source", "resolution", "random_flip")
_TRAIN_KEYS = (
    "batch_size",
    "max_steps",
    "learning_rate",
    "seed",
    "mixed_precision",
    "checkpoint_every_steps",
    "checkpoint_every_seconds",
    "keep_checkpoints",
    "lr_warmup_steps",
    "num_train_timesteps",
    "weight_decay",
    "micro_batch",
)
_LADDER_KEYS = ("allow", "max_attempts", "crash_retries", "probe")
_RESOURCES_KEYS = ("gpus", "share", "memory")
_COMMAND_KEYS = ("argv", "cwd", "env", "when", "processes")
_NOTIFY_KEYS = ("urls", "tags", "events")
# What a job can be notified of (daemon/notifier.py); `escalated` is opt-in.
NOTIFY_EVENTS: tuple[str, ...] = ("failed", "finished", "escalated", "stalled")
DEFAULT_NOTIFY_EVENTS: tuple[str, ...] = ("failed", "finished", "stalled")
_SECTION_KEYS: dict[str | None, tuple[str, ...]] = {
    None: _TOP_KEYS,
    "data": _DATA_KEYS,
    "model": MODEL_KEYS,
    "train": _TRAIN_KEYS,
    "ladder": _LADDER_KEYS,
    "resources": _RESOURCES_KEYS,
    "notify": _NOTIFY_KEYS,
    "command": _COMMAND_KEYS,
    "command.when": tuple(when_keys()),
    # [command.env] takes any variable name: checked one by one.
}
# A job file is a few hundred bytes; the spool reads at most this much of one (plus the header
# line `submit` adds: daemon/spool.py READ_LIMIT), so `oomguard submit` refuses a bigger file
# instead of placing one the daemon would reject, and never reads /dev/zero until memory runs out.
MAX_JOB_FILE_BYTES = 1 << 20
# The ladder's planner weighs every micro-batch size worth trying (about 2 * sqrt(batch), Plan.
# micro_batch_choices) for every shape of plan the allowed rungs reach, in the daemon's loop:
# with every rung allowed a decision took 0.4 s at a batch of 1024, 1.2 s at 4096 and 3.5 s
# at 16384 on 2 cores, and a batch of 10**12 would never end. Larger batches are refused at
# submit time rather than stalling the daemon.
MAX_BATCH_SIZE = 4096
# Integers that end up in SQLite columns (priority) must fit its 64-bit integers; a seed must
# fit torch.manual_seed (0 .. 2**64 - 1).
_INT64 = (-(2**63), 2**63 - 1)
_MAX_SEED = 2**64 - 1

# Keys people reach for that have a better home.
_SPECIAL_HINTS: dict[str, str] = {
    "sample_size": "the trainer sets it from data.resolution",
}


# ----------------------------------------------------------------------------- errors


_CONTROL_ESCAPES = {c: ascii(chr(c))[1:-1] for c in (*range(32), 127)}


class JobFileError(ValueError):
    """A job file that cannot be used; ``str()`` is one line: ``{path}: {key}: {problem}``.

    ``key`` is the dotted key of the offending value (``"train.batch_size"``), or None when
    the problem concerns the whole file (unreadable, empty, not TOML).
    """

    def __init__(self, path: str | os.PathLike[str], key: str | None, problem: str) -> None:
        # One line, always: a key, path or placeholder with a newline in it (all legal in TOML)
        # made a message of two lines, whose second could pass for a line of the daemon's log.
        path = os.fspath(path).translate(_CONTROL_ESCAPES)
        key = key.translate(_CONTROL_ESCAPES) if key is not None else None
        problem = problem.translate(_CONTROL_ESCAPES)
        super().__init__(path, key, problem)
        self.path = path
        self.key = key
        self.problem = problem

    def __str__(self) -> str:
        if self.key:
            return f"{self.path}: {self.key}: {self.problem}"
        return f"{self.path}: {self.problem}"


# ----------------------------------------------------------------------------- spec types


@dataclass(frozen=True)
class DataSpec:
    """Where the images come from: ``synthetic:N`` or an absolute path to an image folder."""

    source: str
    resolution: int
    random_flip: bool = False

    @property
    def is_synthetic(self) -> bool:
        return self.source.startswith(SYNTHETIC_PREFIX)

    @property
    def synthetic_count(self) -> int | None:
        """N of ``synthetic:N``; None for an image folder."""
        return int(self.source[len(SYNTHETIC_PREFIX):]) if self.is_synthetic else None

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "resolution": self.resolution, "random_flip": self.random_flip}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DataSpec:
        """Validates like a job file's ``[data]``, without looking at the file system."""
        ctx = _Ctx("<dict>", Path.cwd(), check_files=False)
        return _parse_data(ctx, _Section(ctx, "data", _strip_none(data)))


@dataclass(frozen=True)
class ModelSpec:
    """UNet2DModel keyword arguments, read-only: ``items`` is a tuple of (key, value) pairs
    in :data:`MODEL_KEYS` order with lists stored as tuples; :meth:`kwargs` gives a fresh
    dict with lists. ``in_channels``/``out_channels`` default to 3.

    ``ModelSpec({"block_out_channels": [32, 64], ...})`` also works: a mapping is converted
    (but not validated; :meth:`from_dict` validates).
    """

    items: tuple[tuple[str, Any], ...]

    def __post_init__(self) -> None:
        pairs = dict(self.items.items() if isinstance(self.items, Mapping) else self.items)
        for k, v in _MODEL_DEFAULTS.items():
            pairs.setdefault(k, v)
        # Canonical order (MODEL_KEYS, then anything else as given) so equal kwargs compare equal.
        order = {k: i for i, k in enumerate(MODEL_KEYS)}
        keys = sorted(pairs, key=lambda k: order.get(k, len(order)))
        frozen = tuple((str(k), tuple(pairs[k]) if isinstance(pairs[k], list) else pairs[k]) for k in keys)
        object.__setattr__(self, "items", frozen)

    def kwargs(self) -> dict[str, Any]:
        """A fresh ``UNet2DModel(**kwargs)`` dict (tuples turned back into lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.items}

    def get(self, key: str, default: Any = None) -> Any:
        for k, v in self.items:
            if k == key:
                return v
        return default

    def __getitem__(self, key: str) -> Any:
        for k, v in self.items:
            if k == key:
                return v
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return any(k == key for k, _ in self.items)

    @property
    def block_out_channels(self) -> tuple[int, ...]:
        return tuple(self.get("block_out_channels", ()))

    @property
    def down_block_types(self) -> tuple[str, ...]:
        return tuple(self.get("down_block_types", ()))

    @property
    def up_block_types(self) -> tuple[str, ...]:
        return tuple(self.get("up_block_types", ()))

    @property
    def downsample_factor(self) -> int:
        """How much the UNet shrinks its input: 2 ** (number of blocks - 1)."""
        return 2 ** max(len(self.block_out_channels) - 1, 0)

    def to_dict(self) -> dict[str, Any]:
        return self.kwargs()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        """Validates like a job file's ``[model]`` (without the check against data.resolution)."""
        ctx = _Ctx("<dict>", Path.cwd(), check_files=False)
        return _parse_model(ctx, _Section(ctx, "model", _strip_none(data)), resolution=None)


@dataclass(frozen=True)
class TrainSpec:
    """Training settings. ``batch_size`` is the effective batch the ladder must keep."""

    batch_size: int
    max_steps: int
    learning_rate: float | None  # None only for a command job (its script has its own)
    seed: int = 0
    mixed_precision: MixedPrecision = "no"
    # None means the default, max(1, max_steps // 10), filled in on construction.
    checkpoint_every_steps: int = None  # type: ignore[assignment]
    checkpoint_every_seconds: float | None = None
    keep_checkpoints: int = 2
    lr_warmup_steps: int = 0
    num_train_timesteps: int = 1000
    weight_decay: float = 0.0
    micro_batch: int | None = None

    def __post_init__(self) -> None:
        if self.checkpoint_every_steps is None:
            object.__setattr__(self, "checkpoint_every_steps", max(1, self.max_steps // 10))
        if self.learning_rate is not None:
            object.__setattr__(self, "learning_rate", float(self.learning_rate))
        object.__setattr__(self, "weight_decay", float(self.weight_decay))
        if self.checkpoint_every_seconds is not None:
            object.__setattr__(self, "checkpoint_every_seconds", float(self.checkpoint_every_seconds))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainSpec:
        ctx = _Ctx("<dict>", Path.cwd(), check_files=False)
        return _parse_train(ctx, _Section(ctx, "train", _strip_none(data)))


@dataclass(frozen=True)
class LadderSpec:
    """Which rungs a job may climb, and how many attempts it gets."""

    allow: tuple[str, ...] = field(default_factory=rungs.exact_names)
    max_attempts: int = 12
    crash_retries: int = 2
    # Measure a few steps at two micro-batch sizes before the first attempt and start at a
    # plan that fits.
    probe: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "allow", tuple(self.allow))

    def to_dict(self) -> dict[str, Any]:
        return {"allow": list(self.allow), "max_attempts": self.max_attempts, "crash_retries": self.crash_retries, "probe": self.probe}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LadderSpec:
        ctx = _Ctx("<dict>", Path.cwd(), check_files=False)
        return _parse_ladder(ctx, _Section(ctx, "ladder", _strip_none(data)))


@dataclass(frozen=True)
class ResourcesSpec:
    """What the job needs of the box: how many GPUs, and whether it may share them."""

    gpus: int = 1
    # Share GPUs with other jobs by memory (default: a GPU to itself).
    share: bool = False
    # Device memory per GPU the job expects to need, in bytes (None: learn it by running).
    memory: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "share": self.share, "memory": self.memory}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ResourcesSpec:
        return cls(gpus=int(data.get("gpus", 1)), share=bool(data.get("share", False)), memory=data.get("memory"))


@dataclass(frozen=True)
class NotifySpec:
    """Whom to tell, and about what: apprise URLs of the job's own, tags that pick servers of
    the daemon's apprise configuration, and the events (see NOTIFY_EVENTS)."""

    urls: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    events: tuple[str, ...] = DEFAULT_NOTIFY_EVENTS

    def to_dict(self) -> dict[str, Any]:
        return {"urls": list(self.urls), "tags": list(self.tags), "events": list(self.events)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NotifySpec:
        return cls(
            urls=tuple(data.get("urls") or ()), tags=tuple(data.get("tags") or ()), events=tuple(data.get("events") or DEFAULT_NOTIFY_EVENTS)
        )


@dataclass(frozen=True)
class JobSpec:
    """One validated job file. ``source_path`` is where it was read from (not a TOML key)."""

    name: str
    trainer: str
    # None for a command job: its script reads its own data and builds its own model.
    data: DataSpec | None
    model: ModelSpec | None
    train: TrainSpec
    ladder: LadderSpec = field(default_factory=LadderSpec)
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    notify: NotifySpec = field(default_factory=NotifySpec)
    command: CommandSpec | None = None
    priority: int = 0
    workdir: str | None = None
    source_path: str | None = None

    def initial_plan(self) -> Plan:
        """The plan the first attempt runs with: the whole batch at once unless
        ``train.micro_batch`` says otherwise."""
        if self.command is None:
            return Plan.initial(self.train.batch_size, self.train.mixed_precision, self.train.micro_batch)
        # A script runs micro_batch x grad_accum samples on each of its processes.
        return Plan.initial(
            self.train.batch_size, self.train.mixed_precision, self.train.micro_batch, world_size=self.command.processes, even_slices=True,
        )

    def policy(self) -> Policy:
        """What the doctor may do for this job."""
        allow = self.ladder.allow
        if self.command is not None:
            # A knob the script does not expose is not a rung for it.
            exposed = exposed_rungs(self.command)
            allow = tuple(rung for rung in allow if rung in exposed)
        return Policy(
            allow=allow,
            max_attempts=self.ladder.max_attempts,
            crash_retries=self.ladder.crash_retries,
            initial=self.initial_plan(),
            micro_batch_argument=batch_argument(self.command) if self.command is not None else None,
        )

    def replace(self, **changes: Any) -> JobSpec:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict shaped like the job file (plus ``source_path``)."""
        return {
            "name": self.name,
            "trainer": self.trainer,
            "priority": self.priority,
            "workdir": self.workdir,
            "data": self.data.to_dict() if self.data is not None else None,
            "model": self.model.to_dict() if self.model is not None else None,
            "train": self._train_dict(),
            "ladder": self.ladder.to_dict(),
            "resources": self.resources.to_dict(),
            "notify": self.notify.to_dict(),
            "command": self.command.to_dict() if self.command is not None else None,
            "source_path": self.source_path,
        }

    def _train_dict(self) -> dict[str, Any]:
        train = self.train.to_dict()
        if self.command is not None:  # the keys a job file of a command job may hold
            train = {key: value for key, value in train.items() if key not in _SCRIPT_OWNED_TRAIN_KEYS}
        return train

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSpec:
        """Inverse of :meth:`to_dict` (``from_dict(s.to_dict()) == s``, also through JSON).

        Validates like a job file but does not look at the file system, so a job whose image
        folder has since gone still loads. Raises :class:`JobFileError` on bad input.
        """
        if not isinstance(data, Mapping):
            raise JobFileError("<dict>", None, f"expected a mapping, found {_describe(data)}")
        raw = dict(data)
        source_path = raw.pop("source_path", None)
        if source_path is not None and not isinstance(source_path, str):
            raise JobFileError("<dict>", "source_path", f"expected a string, found {_describe(source_path)}")
        base_dir = Path(source_path).parent if source_path else Path.cwd()
        ctx = _Ctx(source_path or "<dict>", base_dir, check_files=False)
        return _parse_job(ctx, _strip_none(raw), source_path)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        return cls.from_dict(json.loads(text))


# ----------------------------------------------------------------------------- entry points


def load_job_file(path: str | os.PathLike[str], submit_dir: Path | None = None) -> JobSpec:
    """Read and validate a job file. Relative paths inside it are resolved against its folder;
    a command job without [command] cwd runs in ``submit_dir``, the folder it is submitted
    from (by default the current one), as sbatch and pueue run theirs.

    Raises :class:`JobFileError` for every problem, including unreadable files.
    """
    display = os.fspath(path)
    p = Path(path)
    if p.is_dir():
        raise JobFileError(display, None, "is a directory, not a job file")
    try:
        # A FIFO would block the read until someone writes, and /dev/zero never ends: only a
        # regular file is read, and at most MAX_JOB_FILE_BYTES of it.
        st = os.stat(p)
        if not stat.S_ISREG(st.st_mode):
            raise JobFileError(display, None, "is not a regular file (a FIFO, device or socket); give the path of a job file (TOML)")
        if st.st_size > MAX_JOB_FILE_BYTES:
            raise JobFileError(display, None, _too_big(st.st_size))
        with open(p, "rb") as handle:
            raw = handle.read(MAX_JOB_FILE_BYTES + 1)
        if len(raw) > MAX_JOB_FILE_BYTES:
            raise JobFileError(display, None, _too_big(len(raw)))
    except JobFileError:
        raise
    except FileNotFoundError:
        raise JobFileError(display, None, "job file not found") from None
    except PermissionError:
        raise JobFileError(display, None, "cannot read job file: permission denied") from None
    except OSError as e:
        raise JobFileError(display, None, f"cannot read job file: {e.strerror or e}") from None
    except ValueError:  # a NUL in the path
        raise JobFileError(display, None, "job file not found (the path contains a NUL character)") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        problem = f"not valid UTF-8 text (byte 0x{raw[e.start]:02x} on line {line}); save the job file as UTF-8"
        raise JobFileError(display, None, problem) from None
    absolute = p.expanduser().resolve()
    ctx = _Ctx(display, absolute.parent, check_files=True, submit_dir=submit_dir or _current_folder())
    return _parse_text(ctx, text, str(absolute))


def _current_folder() -> Path | None:
    """The folder this process is in; None when it was removed under it."""
    try:
        return Path.cwd()
    except OSError:
        return None


def _too_big(size: int) -> str:
    return (
        f"is {size} bytes; a job file may have at most {MAX_JOB_FILE_BYTES} (1 MiB): "
        "keep data, models and long lists in the files and folders it names"
    )


def parse_job_text(
    text: str,
    path: str | os.PathLike[str],
    base_dir: str | os.PathLike[str] | None = None,
    *,
    check_files: bool = True,
    submit_dir: Path | None = None,
    home: str | None = None,
) -> JobSpec:
    """Validate job-file text. ``path`` names the file in messages (and becomes
    ``source_path``); relative paths are resolved against ``base_dir``, by default the
    folder of ``path``. ``check_files``: also look at the files and folders it names (the
    data folder, the command's folder, program and script). ``submit_dir``: where a command
    job without [command] cwd runs (the folder it was submitted from); None: its workdir.
    ``home``: what ``~`` stands for, the home of the job's owner (None: whoever parses)."""
    display = os.fspath(path)
    base = Path(base_dir) if base_dir is not None else Path(display).parent
    ctx = _Ctx(display, base.expanduser().absolute(), check_files=check_files, submit_dir=submit_dir, home=home)
    return _parse_text(ctx, text, display)


# ----------------------------------------------------------------------------- internals


class _Ctx:
    def __init__(self, path: str, base_dir: Path, check_files: bool, submit_dir: Path | None = None, home: str | None = None) -> None:
        self.path = path
        self.base_dir = base_dir
        self.check_files = check_files
        self.submit_dir = submit_dir
        self.home = home
        # Set from trainer = "command" before any table is read: such a job may use fewer keys.
        self.command_job = False

    def fail(self, key: str | None, problem: str) -> JobFileError:
        return JobFileError(self.path, key, problem)


_MISSING: Any = object()


def _strip_none(data: Any) -> Any:
    """Drop None values (to_dict's 'absent') from a mapping and its sub-mappings."""
    if not isinstance(data, Mapping):
        return data
    return {k: _strip_none(v) for k, v in data.items() if v is not None}


def _render(value: Any, limit: int = 60) -> str:
    """A value as it would be written in TOML, shortened."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = "nan" if math.isnan(value) else ("inf" if value == math.inf else "-inf" if value == -math.inf else repr(value))
    elif isinstance(value, int):
        text = str(value)
    elif isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(_render(v, limit) for v in value) + "]"
    elif isinstance(value, Mapping):
        text = "a table"
    elif hasattr(value, "isoformat"):
        text = value.isoformat()
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(value: Any) -> str:
    """A value of the wrong type: its TOML type, then the value."""
    if isinstance(value, bool):
        return f"a boolean ({_render(value)})"
    if isinstance(value, int):
        return f"an integer ({_render(value)})"
    if isinstance(value, float):
        return f"a float ({_render(value)})"
    if isinstance(value, str):
        return f"a string ({_render(value)})"
    if isinstance(value, (list, tuple)):
        return f"a list ({_render(value)})"
    if isinstance(value, Mapping):
        return "a table"
    if hasattr(value, "isoformat"):
        return f"a date/time ({_render(value)})"
    return f"a {type(value).__name__} ({_render(value)})"


def _one_of(choices: Sequence[str]) -> str:
    return ", ".join(f'"{c}"' for c in choices)


def _did_you_mean(word: str, choices: Sequence[str]) -> str:
    lowered = {c.lower(): c for c in choices}
    if word.lower() in lowered:
        return f"; did you mean '{lowered[word.lower()]}'?"
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Section:
    """One table of the job file, read key by key with typed getters."""

    def __init__(self, ctx: _Ctx, name: str | None, raw: Any) -> None:
        self.ctx = ctx
        self.name = name
        if not isinstance(raw, Mapping):
            raise ctx.fail(name, f"expected a table ([{name}]), found {_describe(raw)}")
        self.raw = raw
        if name in _SECTION_KEYS:
            self._check_unknown(_SECTION_KEYS[name])

    def _check_unknown(self, allowed: tuple[str, ...]) -> None:
        # A command job's keys the built-in trainer alone has are refused one by one, with a
        # reason, once the table is read; they are never offered as what a key should be.
        explained = _NOT_FOR_COMMAND_JOBS.get(self.name, ()) if self.ctx.command_job else ()
        allowed = tuple(key for key in allowed if key not in explained)
        for key in self.raw:
            if key in allowed or key in explained:
                continue
            hint = self._hint(str(key), allowed)
            listed = ", ".join(sorted(allowed))
            raise self.ctx.fail(self.key(str(key)), f"unknown key (expected one of: {listed}){hint}")

    def _hint(self, key: str, allowed: tuple[str, ...]) -> str:
        if key in _SPECIAL_HINTS and self.name == "model":
            return f"; {_SPECIAL_HINTS[key]}"
        close = _did_you_mean(key, allowed)
        if close:
            return close
        for other, keys in _SECTION_KEYS.items():
            if other != self.name and key in keys:
                if other is None:
                    return f"; '{key}' is a top-level key: put it above the first [table] header"
                return f"; '{key}' belongs in [{other}]"
        return ""

    def key(self, k: str) -> str:
        return f"{self.name}.{k}" if self.name else k

    def fail(self, k: str, problem: str) -> JobFileError:
        return self.ctx.fail(self.key(k), problem)

    def get(self, k: str, default: Any) -> Any:
        if k in self.raw:
            return self.raw[k]
        if default is _MISSING:
            raise self.fail(k, "required key is missing")
        return default

    def has(self, k: str) -> bool:
        return k in self.raw

    def int(self, k: str, *, minimum: int | None = None, maximum: int | None = None, default: Any = _MISSING) -> Any:
        value = self.get(k, default)
        if value is default and not self.has(k):
            return value
        if minimum is not None and maximum is not None:
            want = f"an integer in {minimum}..{maximum}"
        elif minimum is not None:
            want = f"an integer >= {minimum}"
        else:
            want = "an integer"
        if not _is_int(value):
            raise self.fail(k, f"expected {want}, found {_describe(value)}")
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise self.fail(k, f"expected {want}, found {_render(value)}")
        return value

    def number(
        self,
        k: str,
        *,
        gt: float | None = None,
        ge: float | None = None,
        lt: float | None = None,
        default: Any = _MISSING,
    ) -> Any:
        value = self.get(k, default)
        if value is default and not self.has(k):
            return value
        if ge is not None and lt is not None:
            want = f"a number in [{ge:g}, {lt:g})"
        elif gt is not None:
            want = f"a number > {gt:g}"
        elif ge is not None:
            want = f"a number >= {ge:g}"
        else:
            want = "a number"
        if not _is_number(value):
            raise self.fail(k, f"expected {want}, found {_describe(value)}")
        ok = math.isfinite(value)
        ok = ok and (gt is None or value > gt) and (ge is None or value >= ge) and (lt is None or value < lt)
        if not ok:
            raise self.fail(k, f"expected {want}, found {_render(value)}")
        return float(value)

    def bool(self, k: str, default: Any = _MISSING) -> Any:
        value = self.get(k, default)
        if value is default and not self.has(k):
            return value
        if not isinstance(value, bool):
            raise self.fail(k, f"expected true or false, found {_describe(value)}")
        return value

    def str(self, k: str, default: Any = _MISSING) -> Any:
        value = self.get(k, default)
        if value is default and not self.has(k):
            return value
        if not isinstance(value, str):
            raise self.fail(k, f"expected a string, found {_describe(value)}")
        if not value:
            raise self.fail(k, 'expected a non-empty string, found ""')
        return value

    def choice(self, k: str, choices: Sequence[str], default: Any = _MISSING) -> Any:
        value = self.get(k, default)
        if value is default and not self.has(k):
            return value
        if not isinstance(value, str):
            raise self.fail(k, f"expected one of {_one_of(choices)}, found {_describe(value)}")
        if value not in choices:
            hint = _did_you_mean(value, choices)
            raise self.fail(k, f"expected one of {_one_of(choices)}, found {_render(value)}{hint}")
        return value

    def names(self, k: str, choices: Sequence[str], what: str, default: Any = _MISSING) -> Any:
        """A list of unique names from ``choices``, e.g. ladder.allow."""
        value = self.get(k, default)
        if value is default and not self.has(k):
            return value
        want = f"a list of {what} names"
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(k, f"expected {want}, found {_describe(value)}")
        seen: set[str] = set()
        for v in value:
            if v not in choices:
                hint = _did_you_mean(v, choices)
                raise self.fail(k, f"unknown {what} '{v}' (expected one of: {', '.join(choices)}){hint}")
            if v in seen:
                raise self.fail(k, f"{what} '{v}' is listed twice")
            seen.add(v)
        return tuple(value)

    def table(self, k: str, *, required: bool) -> _Section | None:
        if k not in self.raw:
            if required:
                raise self.fail(k, f"required table [{self.key(k)}] is missing")
            return None
        return _Section(self.ctx, self.key(k), self.raw[k])


def _parse_text(ctx: _Ctx, text: str, source_path: str | None) -> JobSpec:
    if not isinstance(text, str):
        raise ctx.fail(None, f"expected job file text, found {type(text).__name__}")
    if text.startswith("\ufeff"):
        text = text[1:]
    if not text.strip():
        raise ctx.fail(None, "empty job file (expected at least name, trainer, [data], [model] and [train])")
    if "\x00" in text:
        # tomllib names it only as "Illegal character '\x00'"; a NUL is the sign of a binary
        # or UTF-16 file.
        line = text[: text.index("\x00")].count("\n") + 1
        raise ctx.fail(None, f"not a text file: NUL byte on line {line} (binary, or UTF-16; save the job file as UTF-8 text)")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ctx.fail(None, f"not valid TOML: {e}") from None
    except RecursionError:
        # tomllib parses nested arrays and inline tables recursively: [[[[...]]]] a few
        # thousand deep raised RecursionError, which is no JobFileError.
        raise ctx.fail(None, "not valid TOML for a job: arrays or inline tables nested too deeply") from None
    except ValueError as e:
        # int() of an integer of more than 4300 digits (sys.get_int_max_str_digits) raised
        # a plain ValueError inside tomllib.
        if "digits" in str(e):
            raise ctx.fail(None, "not valid TOML for a job: an integer with thousands of digits") from None
        raise ctx.fail(None, f"not valid TOML: {e}") from None
    if not raw:
        raise ctx.fail(None, "empty job file (expected at least name, trainer, [data], [model] and [train])")
    return _parse_job(ctx, raw, source_path)


def _parse_job(ctx: _Ctx, raw: Mapping[str, Any], source_path: str | None) -> JobSpec:
    ctx.command_job = isinstance(raw, Mapping) and raw.get("trainer") == COMMAND_TRAINER
    top = _Section(ctx, None, raw)
    name = top.str("name")
    if not NAME_PATTERN.fullmatch(name):
        raise top.fail(
            "name",
            f"expected 1-64 characters of [A-Za-z0-9._-] starting with a letter or digit, found {_render(name)}",
        )
    trainer = top.str("trainer")
    trainers = (*TRAINER_NAMES, COMMAND_TRAINER)
    if trainer not in trainers:
        hint = _did_you_mean(trainer, trainers)
        raise top.fail("trainer", f"unknown trainer '{trainer}' (expected one of: {', '.join(trainers)}){hint}")
    priority = top.int("priority", default=0)
    if not _INT64[0] <= priority <= _INT64[1]:  # it is an SQLite column: OverflowError in the daemon
        raise top.fail("priority", f"expected an integer in {_INT64[0]}..{_INT64[1]}, found {priority}")
    workdir = top.str("workdir", default=None)
    if workdir is not None:
        workdir = str(_resolve(ctx, workdir, "workdir"))
    is_command = trainer == COMMAND_TRAINER
    command = None
    if is_command:
        command_section = top.table("command", required=True)
        assert command_section is not None
        command = _parse_command(ctx, command_section, workdir)
        for unused in _NOT_FOR_COMMAND_JOBS[None]:
            if unused in raw:
                raise top.fail(unused, f"a command job reads its own data and builds its own model: remove [{unused}] (pass what the script needs in [command] argv)")
        data, model = None, None
    else:
        if "command" in raw:
            raise top.fail("command", f'[command] is for trainer = "{COMMAND_TRAINER}"; trainer "{trainer}" is built in')
        data_section = top.table("data", required=True)
        assert data_section is not None
        data = _parse_data(ctx, data_section)
        model_section = top.table("model", required=True)
        assert model_section is not None
        model = _parse_model(ctx, model_section, resolution=data.resolution)
    train_section = top.table("train", required=True)
    assert train_section is not None
    if command is not None:
        for owned in _NOT_FOR_COMMAND_JOBS["train"]:
            if train_section.has(owned):
                raise train_section.fail(owned, "a command job's script has its own; remove it here (pass it in [command] argv)")
    train = _parse_train(ctx, train_section)
    if command is not None:
        _check_command_batch(train_section, train, command.processes)
    elif train.learning_rate is None:
        raise train_section.fail("learning_rate", "required key is missing (e.g. learning_rate = 1e-4)")
    ladder_section = top.table("ladder", required=False)
    ladder = _parse_ladder(ctx, ladder_section) if ladder_section is not None else LadderSpec()
    resources_section = top.table("resources", required=False)
    resources = _parse_resources(resources_section) if resources_section is not None else ResourcesSpec()
    notify_section = top.table("notify", required=False)
    notify = _parse_notify(notify_section) if notify_section is not None else NotifySpec()
    return JobSpec(
        name=name,
        trainer=trainer,
        data=data,
        model=model,
        train=train,
        ladder=ladder,
        resources=resources,
        notify=notify,
        command=command,
        priority=priority,
        workdir=workdir,
        source_path=source_path,
    )


def _resolve(ctx: _Ctx, text: str, key: str) -> Path:
    # A NUL (ValueError), "~nosuchuser" (RuntimeError) and a name longer than the file system
    # allows (OSError) used to escape as exceptions other than JobFileError.
    if "\x00" in text:
        raise ctx.fail(key, "contains a NUL character (\\u0000), which no path can hold; remove it")
    try:
        # "~" is the home of the job's owner (ctx.home; the daemon, root, parses others' files),
        # never that of whoever parses.
        p = Path(ctx.home + text[1:]) if ctx.home and (text == "~" or text.startswith("~/")) else Path(text).expanduser()
    except RuntimeError:
        raise ctx.fail(key, f"cannot expand {_render(text)}: no such user's home directory; give the full path") from None
    if not p.is_absolute():
        p = ctx.base_dir / p
    if not ctx.check_files:
        # Not looked at: not on the file system as whoever parses (the daemon, root, parsing
        # another user's file, must not follow that user's links, nor store where a link in a
        # folder only root may read points). The job's own processes resolve it, as its owner.
        return p
    try:
        return p.resolve()
    except (OSError, ValueError) as e:  # ValueError: a NUL in the base folder
        raise ctx.fail(key, f"cannot use path {_render(text)}: {getattr(e, 'strerror', None) or e}") from None


# Looking through a data folder for an image is bounded, whoever looks (`oomguard submit` as
# the user, or the daemon for its own user's job files: daemon/spool.py): at most
# DATA_SCAN_ENTRIES entries and DATA_SCAN_SECONDS per folder, and in a long-running process at
# most a share of its time (a burst of job files naming a folder of 300,000 files must not hold
# the daemon's loop past systemd's watchdog, nor the next user's submit). A look that reaches a
# bound decides nothing: the job is accepted, and its runner, which lists the folder as the
# job's owner when the attempt starts, says so if it holds no images.
DATA_SCAN_ENTRIES = 20_000
DATA_SCAN_SECONDS = 1.0
_SCAN_BURST_SECONDS = 2.0  # what looks may spend at once ...
_SCAN_SHARE = 0.1  # ... and per second of wall-clock time after that


class _ScanBudget:
    def __init__(self) -> None:
        self.left = _SCAN_BURST_SECONDS
        self.at = time.monotonic()

    def grant(self) -> float:
        now = time.monotonic()
        self.left = min(_SCAN_BURST_SECONDS, self.left + (now - self.at) * _SCAN_SHARE)
        self.at = now
        return min(self.left, DATA_SCAN_SECONDS)

    def spend(self, seconds: float) -> None:
        self.left -= seconds


_SCAN_BUDGET = _ScanBudget()


def _has_image(folder: Path) -> bool | None:
    """Whether ``folder`` holds an image file, in it or in a folder below (breadth first:
    images are usually near the top; links to folders are not followed, subfolders that cannot
    be read are skipped): True, False, or None when a bound was reached first. OSError when
    ``folder`` itself cannot be read."""
    allowed = _SCAN_BUDGET.grant()
    if allowed <= 0:
        return None
    started = time.monotonic()
    deadline, seen = started + allowed, 0
    todo = collections.deque([str(folder)])
    try:
        while todo:
            current = todo.popleft()
            try:
                with os.scandir(current) as entries:
                    for entry in entries:
                        seen += 1
                        if seen >= DATA_SCAN_ENTRIES or (seen % 512 == 0 and time.monotonic() > deadline):
                            return None
                        try:
                            is_dir = entry.is_dir()
                        except OSError:
                            is_dir = False
                        if not is_dir:
                            if os.path.splitext(entry.name)[1].lower() in IMAGE_EXTENSIONS:
                                return True
                        elif not entry.is_symlink():
                            todo.append(entry.path)
            except OSError:
                if current == str(folder):
                    raise
    finally:
        _SCAN_BUDGET.spend(time.monotonic() - started)
    return False


def _parse_data(ctx: _Ctx, s: _Section) -> DataSpec:
    source = s.str("source")
    if source.startswith(SYNTHETIC_PREFIX):
        count = source[len(SYNTHETIC_PREFIX):]
        if not (count.isascii() and count.isdigit()) or int(count) < 1:
            raise s.fail("source", f"synthetic:N needs an integer N >= 1, found {_render(source)}")
        source = f"{SYNTHETIC_PREFIX}{int(count)}"
    else:
        folder = _resolve(ctx, source, s.key("source"))
        if ctx.check_files:
            where = "(expected an image folder or synthetic:N)"
            # As whoever submits, and only what they may see: a folder they may not search
            # reads the same whether it exists or not (the kernel says EACCES either way).
            unreadable = "; give a folder you can read, or ask its owner to let you read it (the job runs as you)"
            try:
                exists, is_dir = folder.exists(), folder.is_dir()
            except OSError as e:  # e.g. a name too long, or a folder the user may not search
                fix = unreadable if e.errno == errno.EACCES else ""
                raise s.fail("source", f"cannot look at folder {_render(str(folder))}: {e.strerror or e} {where}{fix}") from None
            if not exists:
                raise s.fail("source", f"folder {folder} does not exist {where}")
            if not is_dir:
                raise s.fail("source", f"{folder} is not a folder {where}")
            try:
                has_image = _has_image(folder)
            except OSError as e:
                raise s.fail("source", f"cannot read folder {_render(str(folder))}: {e.strerror or e}{unreadable}") from None
            if has_image is False:
                exts = ", ".join(IMAGE_EXTENSIONS)
                raise s.fail("source", f"no image files ({exts}) in folder {folder}")
        source = str(folder)
    resolution = s.int("resolution", minimum=8)
    random_flip = s.bool("random_flip", default=False)
    return DataSpec(source=source, resolution=resolution, random_flip=random_flip)


def _int_list(s: _Section, k: str) -> tuple[int, ...]:
    value = s.get(k, _MISSING)
    want = "a non-empty list of integers >= 1"
    if not isinstance(value, list):
        raise s.fail(k, f"expected {want}, found {_describe(value)}")
    if not value or not all(_is_int(v) and v >= 1 for v in value):
        raise s.fail(k, f"expected {want}, found {_render(value)}")
    return tuple(value)


def _block_types(s: _Section, k: str, choices: tuple[str, ...], what: str) -> tuple[str, ...]:
    value = s.get(k, _MISSING)
    want = f"a list of {what} block type names"
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        shown = _describe(value) if not isinstance(value, list) else _render(value)
        raise s.fail(k, f"expected {want}, found {shown}")
    for v in value:
        if v not in choices:
            hint = _did_you_mean(v, choices)
            raise s.fail(k, f"unknown {what} block type '{v}' (expected one of: {', '.join(choices)}){hint}")
    return tuple(value)


def _parse_model(ctx: _Ctx, s: _Section, resolution: int | None) -> ModelSpec:
    kw: dict[str, Any] = {}
    for k in MODEL_KEYS:
        if not s.has(k):
            if k in _MODEL_REQUIRED:
                raise s.fail(k, "required key is missing")
            if k in _MODEL_DEFAULTS:
                kw[k] = _MODEL_DEFAULTS[k]
            continue
        if k in ("in_channels", "out_channels", "layers_per_block", "norm_num_groups", "attention_head_dim"):
            kw[k] = s.int(k, minimum=1)
        elif k == "block_out_channels":
            kw[k] = _int_list(s, k)
        elif k == "down_block_types":
            kw[k] = _block_types(s, k, DOWN_BLOCK_TYPES, "down")
        elif k == "up_block_types":
            kw[k] = _block_types(s, k, UP_BLOCK_TYPES, "up")
        elif k == "dropout":
            kw[k] = s.number(k, ge=0.0, lt=1.0)
        elif k == "act_fn":
            kw[k] = s.choice(k, ACT_FNS)
        elif k == "time_embedding_type":
            kw[k] = s.choice(k, TIME_EMBEDDING_TYPES)
        elif k in ("center_input_sample", "flip_sin_to_cos"):
            kw[k] = s.bool(k)
        elif k == "freq_shift":
            kw[k] = s.int(k)
        elif k == "downsample_padding":
            kw[k] = s.int(k, minimum=0)
        elif k in ("mid_block_scale_factor", "norm_eps"):
            kw[k] = s.number(k, gt=0.0)
        else:  # pragma: no cover - MODEL_KEYS and this chain must agree
            raise AssertionError(k)

    channels: tuple[int, ...] = kw["block_out_channels"]
    for k in ("down_block_types", "up_block_types"):
        if len(kw[k]) != len(channels):
            raise s.fail(
                k,
                f"has {len(kw[k])} entries but block_out_channels has {len(channels)}"
                " (one block type per block_out_channels entry)",
            )
    groups = kw.get("norm_num_groups", DEFAULT_NORM_NUM_GROUPS)
    for c in channels:
        if c % groups:
            if "norm_num_groups" in kw:
                raise s.fail(
                    "norm_num_groups",
                    f"{groups} does not divide block_out_channels entry {c}"
                    " (GroupNorm needs every entry divisible by norm_num_groups)",
                )
            raise s.fail(
                "block_out_channels",
                f"entry {c} is not divisible by norm_num_groups {groups} (the default);"
                " set norm_num_groups to a divisor of every entry",
            )
    if resolution is not None:
        factor = 2 ** (len(channels) - 1)
        if resolution % factor:
            raise ctx.fail(
                "data.resolution",
                f"{resolution} is not divisible by {factor}"
                f" (the model halves it {len(channels) - 1} time(s): 2**(len(block_out_channels) - 1) = {factor})",
            )
    return ModelSpec(tuple(kw.items()))


def _parse_train(ctx: _Ctx, s: _Section) -> TrainSpec:
    batch_size = s.int("batch_size", minimum=1)
    if batch_size > MAX_BATCH_SIZE:
        raise s.fail(
            "batch_size",
            f"expected an integer in 1..{MAX_BATCH_SIZE}, found {batch_size} (the ladder weighs the micro-batch sizes of "
            f"the batch in the daemon's loop; larger batches are not supported: lower it and raise max_steps)",
        )
    max_steps = s.int("max_steps", minimum=1)
    learning_rate = s.number("learning_rate", gt=0.0, default=None)
    seed = s.int("seed", minimum=0, default=0)
    if seed > _MAX_SEED:  # torch.manual_seed refuses it: every attempt would crash
        raise s.fail("seed", f"expected an integer in 0..{_MAX_SEED} (2**64 - 1), found {seed}")
    mixed_precision = s.choice("mixed_precision", MIXED_PRECISIONS, default="no")
    checkpoint_every_steps = s.int("checkpoint_every_steps", minimum=1, default=max(1, max_steps // 10))
    checkpoint_every_seconds = s.number("checkpoint_every_seconds", gt=0.0, default=None)
    keep_checkpoints = s.int("keep_checkpoints", minimum=1, default=2)
    lr_warmup_steps = s.int("lr_warmup_steps", minimum=0, default=0)
    if lr_warmup_steps >= max_steps:
        raise s.fail(
            "lr_warmup_steps", f"must be less than train.max_steps ({max_steps}), found {lr_warmup_steps}"
        )
    num_train_timesteps = s.int("num_train_timesteps", minimum=1, default=1000)
    weight_decay = s.number("weight_decay", ge=0.0, default=0.0)
    micro_batch = s.int("micro_batch", minimum=1, default=None)
    if micro_batch is not None and micro_batch > batch_size:
        raise s.fail(
            "micro_batch", f"expected an integer in 1..{batch_size} (at most train.batch_size), found {micro_batch}"
        )
    return TrainSpec(
        batch_size=batch_size,
        max_steps=max_steps,
        learning_rate=learning_rate,
        seed=seed,
        mixed_precision=mixed_precision,
        checkpoint_every_steps=checkpoint_every_steps,
        checkpoint_every_seconds=checkpoint_every_seconds,
        keep_checkpoints=keep_checkpoints,
        lr_warmup_steps=lr_warmup_steps,
        num_train_timesteps=num_train_timesteps,
        weight_decay=weight_decay,
        micro_batch=micro_batch,
    )


def _parse_ladder(ctx: _Ctx, s: _Section) -> LadderSpec:
    allow = s.names("allow", rungs.names(), "rung", default=rungs.exact_names())
    max_attempts = s.int("max_attempts", minimum=1, default=12)
    crash_retries = s.int("crash_retries", minimum=0, default=2)
    probe = s.bool("probe", default=True)
    return LadderSpec(allow=tuple(allow), max_attempts=max_attempts, crash_retries=crash_retries, probe=probe)


def _parse_resources(s: _Section) -> ResourcesSpec:
    gpus = s.int("gpus", minimum=1, maximum=64, default=1)
    share = s.bool("share", default=False)
    memory = s.get("memory", None)
    if memory is not None:
        if _is_int(memory) and memory > 0:
            memory = int(memory)
        elif isinstance(memory, str):
            try:
                memory = parse_size(memory)
            except ValueError as error:
                raise s.fail("memory", str(error)) from None
        else:
            raise s.fail("memory", f"expected a size such as \"20GiB\", found {_describe(memory)}")
    return ResourcesSpec(gpus=gpus, share=share, memory=memory)


def _string_list(s: _Section, k: str, secret: bool = False) -> tuple[str, ...]:
    """A list of non-empty strings; a ``secret`` one (URLs with tokens) is never echoed."""
    value = s.get(k, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        found = f"a {type(value).__name__}" if secret else _describe(value)
        raise s.fail(k, f"expected a list of non-empty strings, found {found}")
    return tuple(value)


def _parse_notify(s: _Section) -> NotifySpec:
    urls = _string_list(s, "urls", secret=True)
    for url in urls:
        scheme, separator, _ = url.partition("://")
        if not separator or not scheme.replace("+", "").isalnum():
            # Never echo the URL: it may hold a token.
            raise s.fail("urls", f"entry {urls.index(url) + 1} is not an apprise URL (expected SCHEME://..., e.g. json://host/path or mailto://...)")
    tags = _string_list(s, "tags")
    events = s.names("events", NOTIFY_EVENTS, "notification event", default=DEFAULT_NOTIFY_EVENTS)
    return NotifySpec(urls=urls, tags=tags, events=tuple(events))


def _parse_command(ctx: _Ctx, s: _Section, workdir: str | None) -> CommandSpec:
    argv = s.get("argv", None)
    if argv is None:
        raise s.fail("argv", 'required key is missing (the command as a list of arguments, e.g. ["python", "train.py", "--train_batch_size={micro_batch}"])')
    if isinstance(argv, str):
        raise s.fail(
            "argv",
            f"expected a list of arguments, found a string: oomguard never runs a shell; write it as a list, e.g. {json.dumps(argv.split()[:3])}",
        )
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and a for a in argv):
        raise s.fail("argv", f"expected a non-empty list of non-empty strings, found {_describe(argv)}")
    # execve() cannot pass a NUL: such an argument used to be accepted here and fail at every
    # attempt's start (ValueError: embedded null byte) instead of at submit time.
    for number, argument in enumerate(argv, 1):
        if "\x00" in argument:
            raise s.fail("argv", f"argument {number} ({_render(argument)}) contains a NUL character (\\u0000), which no program can receive; remove it")
    cwd = s.str("cwd", default=None)
    if cwd is not None:
        cwd = str(_resolve(ctx, cwd, s.key("cwd")))
    elif ctx.submit_dir is not None:
        cwd = str(ctx.submit_dir)
    env_section = s.table("env", required=False)
    env: dict[str, str] = {}
    if env_section is not None:
        for name, value in env_section.raw.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(name)):
                raise env_section.fail(str(name), "not an environment variable name (letters, digits and _, not starting with a digit)")
            if not isinstance(value, str):
                # Its type only, never the value: it may be a secret, and errors reach the daemon's log.
                raise env_section.fail(str(name), f"expected a string, found {_describe(value).partition(' (')[0]}")
            if "\x00" in value:
                raise env_section.fail(str(name), "contains a NUL character (\\u0000), which no environment variable can hold; remove it")
            env[str(name)] = value
    when_section = s.table("when", required=False)
    when: dict[str, tuple[str, ...]] = {}
    if when_section is not None:
        for knob in when_section.raw:
            arguments = when_section.raw[knob]
            if isinstance(arguments, str):
                arguments = [arguments]
            if not isinstance(arguments, list) or not all(isinstance(a, str) and a for a in arguments):
                raise when_section.fail(knob, f"expected a list of arguments, found {_describe(arguments)}")
            if any("\x00" in a for a in arguments):
                raise when_section.fail(knob, "an argument contains a NUL character (\\u0000), which no program can receive; remove it")
            when[knob] = tuple(arguments)
    processes = s.int("processes", minimum=1, maximum=1024, default=1)
    command = CommandSpec(argv=tuple(argv), cwd=cwd, env=tuple(sorted(env.items())), when=tuple(sorted(when.items())), processes=processes)
    try:
        check(command)
    except CommandError as error:
        raise s.fail(error.where, str(error)) from None
    if ctx.check_files:
        _check_command_paths(ctx, s, command, workdir)
    return command


# [train] keys of the built-in trainer only: a command's script decides these itself.
_SCRIPT_OWNED_TRAIN_KEYS = (
    "learning_rate", "seed", "checkpoint_every_steps", "checkpoint_every_seconds", "keep_checkpoints", "lr_warmup_steps",
    "num_train_timesteps", "weight_decay",
)


# What a command job may not have, by table: each is refused with its own reason (above).
_NOT_FOR_COMMAND_JOBS: dict[str | None, tuple[str, ...]] = {None: ("data", "model"), "train": _SCRIPT_OWNED_TRAIN_KEYS}


def _check_command_batch(s: _Section, train: TrainSpec, processes: int) -> None:
    """A command's script runs micro_batch x grad_accum samples on each of its processes per
    optimizer step: train.batch_size splits evenly over the processes, and a first
    micro-batch divides each process's share."""
    if train.batch_size % processes:
        raise s.fail(
            "batch_size",
            f"{train.batch_size} cannot be split evenly over [command] processes = {processes}; "
            f"make it a multiple of {processes} (the batch of all processes together)",
        )
    per_process = train.batch_size // processes
    if train.micro_batch is not None and (train.micro_batch > per_process or per_process % train.micro_batch):
        divisors = [size for size in range(1, per_process + 1) if per_process % size == 0]
        raise s.fail(
            "micro_batch",
            f"expected a divisor of {per_process} (train.batch_size / [command] processes: the script runs micro_batch x "
            f"grad_accum samples), one of {', '.join(map(str, divisors[:12]))}{' ...' if len(divisors) > 12 else ''}; found {train.micro_batch}",
        )



def _check_command_paths(ctx: _Ctx, s: _Section, command: CommandSpec, workdir: str | None) -> None:
    """The command can start: its folder ([command] cwd) is one, and the program and the script
    it names are there. Relative paths are taken from the folder the command runs in: [command]
    cwd, else the job's workdir. Who checks, and as whom: daemon/spool.py _may_look_at_paths_for."""
    if command.cwd is not None:
        problem = _guarded(lambda: _folder_problem(Path(command.cwd)), "folder", command.cwd)  # type: ignore[arg-type]
        if problem:
            raise s.fail("cwd", problem)
    runs_in = _RunsIn(ctx.base_dir, command.cwd, workdir)
    program, script = command.argv[0], script_argument(command.argv)
    problem = _guarded(lambda: _program_problem(program, runs_in), "program", program)
    if problem is None and script is not None and "{" not in script:  # a placeholder is known only when an attempt starts
        problem = _guarded(lambda: _script_problem(script, runs_in), "script", script)
    if problem:
        raise s.fail("argv", problem)


def _guarded(look: Callable[[], str | None], what: str, path: str) -> str | None:
    """``look()``, with a path the file system refuses to look at (too long, a folder the
    user may not search) as the problem itself."""
    try:
        return look()
    except OSError as e:
        fix = "; the job runs as you: give a path you can reach, or ask its owner to let you in" if e.errno == errno.EACCES else ""
        return f"cannot look at {what} {_render(path)}: {e.strerror or e}{fix}"


def _folder_problem(folder: Path) -> str | None:
    fix = "set cwd to the folder your script runs in (its relative paths start there), or create it"
    if not folder.exists():
        return f"folder {folder} does not exist; {fix}"
    if not folder.is_dir():
        return f"{folder} is not a folder; {fix}"
    return None


@dataclass(frozen=True)
class _RunsIn:
    """The folder a command runs in, where the relative paths in its argv start: [command] cwd,
    else the job's workdir; with neither, a workdir the daemon makes, empty, when it queues the job."""

    job_file_folder: Path
    cwd: str | None
    workdir: str | None

    @property
    def folder(self) -> Path | None:
        return Path(self.cwd or self.workdir) if (self.cwd or self.workdir) else None

    @property
    def named(self) -> str:
        return f"[command] cwd, {self.cwd}" if self.cwd else f"the job's workdir, {self.workdir}"

    def path(self, written: str) -> Path | None:
        """Where ``written`` points; None for a relative path with no folder to start from."""
        if Path(written).is_absolute():
            return Path(written)
        return self.folder / written if self.folder is not None else None

    def unplaced(self, what: str, written: str) -> str:
        """Why a relative ``written`` cannot be found, and the cwd that would place it."""
        fix = (f'set [command] cwd = "{self.job_file_folder}" (where {written} is)' if (self.job_file_folder / written).exists()
               else "set [command] cwd to the folder that holds it")
        return f"{what} {written} is a relative path, but without [command] cwd the command runs in the job's workdir, an empty folder: {fix}, or give its full path"


def _program_problem(program: str, runs_in: _RunsIn) -> str | None:
    """Why ``program`` cannot be started (checked when the job file is submitted), or None."""
    if "{" in program:
        return f"the program itself ({program!r}) cannot be a placeholder"
    if "/" in program:
        path = runs_in.path(program)
        if path is None:
            return runs_in.unplaced("program", program)
        if not path.is_file():
            return f"program {program} not found ({path} does not exist)"
        if not os.access(path, os.X_OK):
            return f"program {path} is not executable (chmod +x it, or start it with its interpreter, e.g. [\"python\", \"{program}\"])"
        return None
    if shutil.which(program) is None:
        return f"program {program!r} not found on PATH; give its full path, or install it"
    return None


def _script_problem(script: str, runs_in: _RunsIn) -> str | None:
    """Why the script the command runs (jobs/command.py script_argument) is not there, or None."""
    path = runs_in.path(script)
    if path is None:
        return runs_in.unplaced("script", script)
    if path.is_dir():
        return f"script {script} is a folder, not a script file ({path}); name the script in argv"
    if path.exists():
        return None
    relative = "" if Path(script).is_absolute() else f" (relative to {runs_in.named})"
    return f"script {script} not found: {path} does not exist{relative}{_did_you_mean(path.name, _python_files(path.parent))}; fix its path in argv"


def _python_files(folder: Path) -> list[str]:
    """The names of the scripts in ``folder``, for a did-you-mean; none when it cannot be listed.
    Bounded like a data folder's look (DATA_SCAN_ENTRIES): a huge folder gets no suggestion."""
    names: list[str] = []
    try:
        with os.scandir(folder) as entries:
            for seen, entry in enumerate(entries):
                if seen >= DATA_SCAN_ENTRIES:
                    return []
                if entry.name.endswith(".py") and not entry.name.startswith("."):
                    names.append(entry.name)
    except OSError:
        return []
    return names
