"""A job: the validated frozen :class:`JobSpec`, and how a job file's tables make one.

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

The file itself is read by job_file.py; each table by the module of its kind (common.py,
unconditional.py, command.py). A spec is validated once, at intake: a stored one (the store's
rows, attempt.json) comes back through :meth:`JobSpec.load`, which does not validate again.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from oomguard.jobs.spec.command import CommandSpec, batch_argument, check_command_batch, exposed_rungs, parse_command
from oomguard.jobs.spec.command_paths import check_command_paths
from oomguard.jobs.spec.common import (
    LadderSpec,
    NotifySpec,
    ResourcesSpec,
    TrainSpec,
    parse_ladder,
    parse_notify,
    parse_resources,
    parse_train,
)
from oomguard.jobs.spec.keys import COMMAND_TRAINER, NOT_FOR_COMMAND_JOBS, SCRIPT_OWNED_TRAIN_KEYS, TEXT_TO_IMAGE_TRAIN_KEYS, TEXT_TO_IMAGE_TRAINER
from oomguard.jobs.spec.reader import ReadContext, Section, describe_value, did_you_mean, render_value, resolve_path, strip_none
from oomguard.jobs.spec import text_to_image
from oomguard.jobs.spec.text_to_image import CaptionedDataSpec, PipelineSpec
from oomguard.jobs.spec.unconditional import DataSpec, ModelSpec, parse_data, parse_model
from oomguard.jobs.trainers import TRAINER_NAMES
from oomguard.strategies import rungs
from oomguard.strategies.plan import Plan
from oomguard.strategies.policy import WHOLE_MODEL, Policy
from oomguard.strategies.errors import JobFileError

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# Integers that end up in SQLite columns (priority) must fit its 64-bit integers.
_INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class JobSpec:
    """One validated job file. ``source_path`` is where it was read from (not a TOML key)."""

    name: str
    trainer: str
    # None for a command job: its script reads its own data and builds its own model. A
    # text-to-image job has captioned images and a pipeline folder.
    data: DataSpec | CaptionedDataSpec | None
    model: ModelSpec | PipelineSpec | None
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
            # The built-in runner starts one process per GPU (data parallel).
            return Plan.initial(self.train.batch_size, self.train.mixed_precision, self.train.micro_batch, world_size=self.resources.gpus)
        # A script runs micro_batch x grad_accum samples on each of its processes.
        return Plan.initial(
            self.train.batch_size, self.train.mixed_precision, self.train.micro_batch, world_size=self.command.processes, even_slices=True,
        )

    def policy(self) -> Policy:
        """What the doctor may do for this job."""
        features = self.features()
        allow = rungs.usable_by(features, self.ladder.allow)
        if self.command is not None:
            # A knob the script does not expose is not a rung for it.
            exposed = exposed_rungs(self.command)
            allow = tuple(rung for rung in allow if rung in exposed)
        return Policy(
            allow=allow,
            usable=rungs.usable_by(features),
            max_attempts=self.ladder.max_attempts,
            crash_retries=self.ladder.crash_retries,
            initial=self.initial_plan(),
            micro_batch_argument=batch_argument(self.command) if self.command is not None else None,
        )

    def features(self) -> frozenset[str]:
        """What the job offers rungs (Rung.needs): a job that trains LoRA adapters already has
        no whole model to turn into LoRA; only a text-to-image job has frozen encoders; only a
        job with train.ema keeps an average of its weights ("ema"); a text-to-image UNet's
        transformer blocks have feed-forward layers ("feed_forward"), a UNet2DModel none."""
        ema = ("ema",) if self.train.ema else ()
        # The sharding rungs shard a built-in trainer's whole model, but not an average of its
        # weights (train.ema); a command job's script shards its own (its [command.when] keys).
        shardable = ("shardable",) if self.command is not None or not self.train.ema else ()
        if isinstance(self.model, PipelineSpec):
            fixed_crops = isinstance(self.data, CaptionedDataSpec) and self.data.center_crop
            return frozenset({
                "frozen_parts", "feed_forward", *(() if self.model.trains_adapters else ("full_model",)), *(("fixed_crops",) if fixed_crops else ()), *ema,
                *shardable,
            })
        return WHOLE_MODEL | frozenset((*ema, *shardable))

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
        """[train] with the keys a job file of this kind may hold."""
        train = self.train.to_dict()
        if self.command is not None:
            train = {key: value for key, value in train.items() if key not in SCRIPT_OWNED_TRAIN_KEYS}
        if self.trainer != TEXT_TO_IMAGE_TRAINER:
            train = {key: value for key, value in train.items() if key not in TEXT_TO_IMAGE_TRAIN_KEYS}
        return train

    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> JobSpec:
        """A job given as a dict (a job file's tables, or :meth:`to_dict`'s output), validated
        like a job file but without looking at the file system (``parse(s.to_dict()) == s``,
        also through JSON). Raises :class:`JobFileError` on bad input. The way in for a dict
        that was never validated; a stored spec comes back through :meth:`load`."""
        if not isinstance(data, Mapping):
            raise JobFileError("<dict>", None, f"expected a mapping, found {describe_value(data)}")
        raw = dict(data)
        source_path = raw.pop("source_path", None)
        if source_path is not None and not isinstance(source_path, str):
            raise JobFileError("<dict>", "source_path", f"expected a string, found {describe_value(source_path)}")
        base_dir = Path(source_path).parent if source_path else Path.cwd()
        ctx = ReadContext(source_path or "<dict>", base_dir, check_files=False)
        return parse_job(ctx, strip_none(raw), source_path)

    @classmethod
    def load(cls, data: Mapping[str, Any]) -> JobSpec:
        """A spec stored by :meth:`to_dict` (the store's ``spec`` column, attempt.json), rebuilt
        as it was: no validation and no file-system access, since it was validated once, at
        intake. ``load(s.to_dict()) == s``, also through JSON; unknown keys are ignored, as
        Plan.from_dict ignores them. A dict that was never validated goes through
        :meth:`parse`."""
        train = _stored_fields(TrainSpec, data["train"])
        train.setdefault("learning_rate", None)  # a command job stores none: its script has its own
        return cls(
            name=data["name"],
            trainer=data["trainer"],
            data=_stored_data(data),
            model=_stored_model(data),
            train=TrainSpec(**train),
            ladder=LadderSpec(**_stored_fields(LadderSpec, data.get("ladder") or {})),
            resources=ResourcesSpec.from_dict(data.get("resources") or {}),
            notify=NotifySpec.from_dict(data.get("notify") or {}),
            command=CommandSpec.from_dict(data["command"]) if data.get("command") is not None else None,
            priority=data.get("priority", 0),
            workdir=data.get("workdir"),
            source_path=data.get("source_path"),
        )


def _stored_data(stored: Mapping[str, Any]) -> DataSpec | CaptionedDataSpec | None:
    if stored.get("data") is None:
        return None
    if stored["trainer"] == TEXT_TO_IMAGE_TRAINER:
        return text_to_image.load_data(stored["data"])
    return DataSpec(**_stored_fields(DataSpec, stored["data"]))


def _stored_model(stored: Mapping[str, Any]) -> ModelSpec | PipelineSpec | None:
    if stored.get("model") is None:
        return None
    if stored["trainer"] == TEXT_TO_IMAGE_TRAINER:
        return PipelineSpec.load(stored["model"])
    return ModelSpec(tuple(stored["model"].items()))


def _stored_fields(part: type, stored: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of a stored table that are fields of ``part``; None (to_dict's 'absent')
    leaves the field's default."""
    names = {f.name for f in dataclasses.fields(part)}
    return {key: value for key, value in stored.items() if key in names and value is not None}


def parse_job(ctx: ReadContext, raw: Mapping[str, Any], source_path: str | None) -> JobSpec:
    """The whole job, in a fixed order (the first problem found is reported): the top-level
    keys, the tables of the job's kind, then [train], [ladder], [resources] and [notify]."""
    trainer_given = raw.get("trainer") if isinstance(raw, Mapping) else None
    ctx.trainer = trainer_given if isinstance(trainer_given, str) else None
    top = Section(ctx, None, raw)
    name = _name(top)
    trainer = _trainer(top)
    priority = top.int("priority", default=0)
    if not _INT64[0] <= priority <= _INT64[1]:  # it is an SQLite column: OverflowError in the daemon
        raise top.fail("priority", f"expected an integer in {_INT64[0]}..{_INT64[1]}, found {priority}")
    workdir = top.str("workdir", default=None)
    if workdir is not None:
        workdir = str(resolve_path(ctx, workdir, "workdir"))
    command = _command_tables(top, workdir) if trainer == COMMAND_TRAINER else None
    data, model = _built_in_tables(top, trainer) if command is None else (None, None)
    train = _train_table(top, command)
    ladder = _optional_table(top, "ladder", parse_ladder, LadderSpec)
    resources = _optional_table(top, "resources", parse_resources, ResourcesSpec)
    if command is None and resources.gpus > 1:
        _check_built_in_ranks(top, train, resources.gpus)
    notify = _optional_table(top, "notify", parse_notify, NotifySpec)
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


def _name(top: Section) -> str:
    name = top.str("name")
    if not NAME_PATTERN.fullmatch(name):
        raise top.fail(
            "name",
            f"expected 1-64 characters of [A-Za-z0-9._-] starting with a letter or digit, found {render_value(name)}",
        )
    return name


def _trainer(top: Section) -> str:
    trainer = top.str("trainer")
    trainers = (*TRAINER_NAMES, COMMAND_TRAINER)
    if trainer not in trainers:
        hint = did_you_mean(trainer, trainers)
        raise top.fail("trainer", f"unknown trainer '{trainer}' (expected one of: {', '.join(trainers)}){hint}")
    return trainer


def _command_tables(top: Section, workdir: str | None) -> CommandSpec:
    """A command job's [command], its paths looked at when the context says so; such a job
    has no [data] nor [model]: its script reads its own data and builds its own model."""
    section = top.required_table("command")
    command = parse_command(top.ctx, section)
    if top.ctx.check_files:
        check_command_paths(top.ctx, section, command, workdir)
    for unused in NOT_FOR_COMMAND_JOBS[None]:
        if unused in top.raw:
            raise top.fail(unused, f"a command job reads its own data and builds its own model: remove [{unused}] (pass what the script needs in [command] argv)")
    return command


def _built_in_tables(top: Section, trainer: str) -> tuple[DataSpec | CaptionedDataSpec, ModelSpec | PipelineSpec]:
    """A built-in trainer's [data] and [model] (the model checked against data.resolution)."""
    if "command" in top.raw:
        raise top.fail("command", f'[command] is for trainer = "{COMMAND_TRAINER}"; trainer "{trainer}" is built in')
    if trainer == TEXT_TO_IMAGE_TRAINER:
        captioned = text_to_image.parse_data(top.ctx, top.required_table("data"))
        return captioned, text_to_image.parse_model(top.ctx, top.required_table("model"), captioned.resolution)
    data = parse_data(top.ctx, top.required_table("data"))
    model = parse_model(top.ctx, top.required_table("model"), resolution=data.resolution)
    return data, model


def _train_table(top: Section, command: CommandSpec | None) -> TrainSpec:
    """[train]: for a command job without the keys its script owns, and with a batch its
    processes can split; for a built-in trainer with a learning rate."""
    section = top.required_table("train")
    if command is not None:
        for owned in NOT_FOR_COMMAND_JOBS["train"]:
            if section.has(owned):
                raise section.fail(owned, "a command job's script has its own; remove it here (pass it in [command] argv)")
    train = parse_train(section)
    if command is not None:
        check_command_batch(section, train, command.processes)
    elif train.learning_rate is None:
        raise section.fail("learning_rate", "required key is missing (e.g. learning_rate = 1e-4)")
    return train


def _check_built_in_ranks(top: Section, train: TrainSpec, gpus: int) -> None:
    """A built-in job on several GPUs runs one process per GPU, each on an equal share of
    train.batch_size (data parallel): the batch must split evenly, and a micro_batch given
    must fit one share."""
    section = top.table("resources", required=False)
    assert section is not None  # gpus > 1 was read from it
    if train.batch_size % gpus:
        raise section.fail(
            "gpus", f"train.batch_size = {train.batch_size} cannot be split evenly over {gpus} GPUs (one process each); "
            f"make the batch a multiple of {gpus}, or ask for a number of GPUs that divides it",
        )
    if train.micro_batch is not None and train.micro_batch > train.batch_size // gpus:
        raise section.fail(
            "gpus", f"train.micro_batch = {train.micro_batch} is more than each of the {gpus} processes' share of the batch "
            f"({train.batch_size // gpus}); lower micro_batch to at most {train.batch_size // gpus}",
        )


_Table = TypeVar("_Table")


def _optional_table(top: Section, key: str, parse: Callable[[Section], _Table], absent: Callable[[], _Table]) -> _Table:
    """The table ``key`` parsed, or its defaults (``absent()``) when the job file has none."""
    section = top.table(key, required=False)
    return parse(section) if section is not None else absent()
