"""The tables every job has, whatever its kind: [train], [ladder], [resources] and
[notify], each a frozen dataclass with the parser of its table.

A command job uses only part of [train] (keys.py SCRIPT_OWNED_TRAIN_KEYS are its script's).
Just past 400 lines: each table's parser stands beside its dataclass (its defaults, checks and
round trip through to_dict), and [train]'s sub-parts already live apart (trackers.py, _ema,
_samples).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard.jobs.spec.keys import DEFAULT_NOTIFY_EVENTS, NOTIFY_EVENTS, TEXT_TO_IMAGE_TRAINER
from oomguard.jobs.spec.trackers import DEFAULT_LOG_WITH, parse_log_with
from oomguard.jobs.spec.reader import ReadContext, Section, describe_value, is_int, render_value, strip_none
from oomguard.strategies import rungs
from oomguard.strategies.plan import MixedPrecision
from oomguard.strategies.units import parse_size, parse_time_limit

MIXED_PRECISIONS: tuple[str, ...] = ("no", "bf16", "fp16")
# diffusers' get_scheduler names (diffusers.optimization.SchedulerType) that need nothing but
# warm-up steps and the run's length. The default keeps the rate constant after warm-up.
LR_SCHEDULERS: tuple[str, ...] = ("constant_with_warmup", "constant", "linear", "cosine", "cosine_with_restarts", "polynomial")
# The ladder's planner weighs every micro-batch size worth trying (about 2 * sqrt(batch), Plan.
# micro_batch_choices) for every shape of plan the allowed rungs reach, in the daemon's loop:
# with every rung allowed a decision took 0.4 s at a batch of 1024, 1.2 s at 4096 and 3.5 s
# at 16384 on 2 cores, and a batch of 10**12 would never end. Larger batches are refused at
# submit time rather than stalling the daemon.
MAX_BATCH_SIZE = 4096
# diffusers' EMAModel's default decay, which its training scripts keep.
DEFAULT_EMA_DECAY = 0.9999
# The smallest [resources] disk a job may give its checkpoints (a smaller one is a typo: bytes
# meant as MiB).
MIN_DISK_BUDGET = 1 << 20
# A seed must fit torch.manual_seed (0 .. 2**64 - 1).
_MAX_SEED = 2**64 - 1


DEFAULT_SAMPLE_INFERENCE_STEPS = 20
MAX_SAMPLE_PROMPTS = 16
MAX_PROMPT_CHARACTERS = 1000


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
    # Checkpoints whose step is a multiple of this are kept for good, beyond the last
    # keep_checkpoints (None: none is): jobs/checkpoints.py prune.
    keep_every_steps: int | None = None
    lr_warmup_steps: int = 0
    num_train_timesteps: int = 1000
    weight_decay: float = 0.0
    micro_batch: int | None = None
    lr_scheduler: str = "constant_with_warmup"
    # The text-to-image trainer's (keys.TEXT_TO_IMAGE_TRAIN_KEYS): offset noise (a share of
    # one random value per latent channel added to the noise) and Min-SNR loss weighting.
    noise_offset: float = 0.0
    snr_gamma: float | None = None
    # An exponential moving average of the trained weights, saved as the final model (what
    # diffusers' scripts do with --use_ema); ``ema_decay`` is its largest decay (jobs/ema.py).
    ema: bool = False
    ema_decay: float = DEFAULT_EMA_DECAY
    # Images rendered from ``sample_prompts`` every ``sample_every_steps`` steps (None: never)
    # with ``sample_inference_steps`` denoising steps, into WORKDIR/samples/ (the text-to-image
    # trainer's: jobs/sampling.py).
    sample_every_steps: int | None = None
    sample_prompts: tuple[str, ...] = ()
    sample_inference_steps: int = DEFAULT_SAMPLE_INFERENCE_STEPS
    # The experiment trackers a built-in job's metrics go to (jobs/spec/trackers.py; empty:
    # none beyond metrics.jsonl).
    log_with: tuple[str, ...] = DEFAULT_LOG_WITH

    def __post_init__(self) -> None:
        if self.checkpoint_every_steps is None:
            object.__setattr__(self, "checkpoint_every_steps", max(1, self.max_steps // 10))
        if self.learning_rate is not None:
            object.__setattr__(self, "learning_rate", float(self.learning_rate))
        object.__setattr__(self, "weight_decay", float(self.weight_decay))
        object.__setattr__(self, "noise_offset", float(self.noise_offset))
        object.__setattr__(self, "ema_decay", float(self.ema_decay))
        object.__setattr__(self, "sample_prompts", tuple(self.sample_prompts))
        object.__setattr__(self, "log_with", tuple(self.log_with))
        if self.checkpoint_every_seconds is not None:
            object.__setattr__(self, "checkpoint_every_seconds", float(self.checkpoint_every_seconds))

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if not self.ema:
            del data["ema_decay"]  # a job file may name it only with ema = true
        data["log_with"] = list(self.log_with)  # as a job file writes it (a list, not a tuple)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainSpec:
        ctx = ReadContext("<dict>", Path.cwd(), check_files=False)
        ctx.trainer = TEXT_TO_IMAGE_TRAINER  # the widest [train]: every key TrainSpec has
        return parse_train(Section(ctx, "train", strip_none(data)))


@dataclass(frozen=True)
class LadderSpec:
    """Which rungs a job may climb, and how many attempts it gets."""

    allow: tuple[str, ...] = field(default_factory=rungs.exact_names)
    max_attempts: int = 12
    crash_retries: int = 2
    # Measure a few steps at two micro-batch sizes before the first attempt and start at a
    # plan that fits.
    probe: bool = True
    # Take a rung inside the running process when an OOM allows it (false: every rung is a new
    # attempt, in a new process: on a cluster, a new batch job).
    in_process: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "allow", tuple(self.allow))

    def to_dict(self) -> dict[str, Any]:
        return {
            "allow": list(self.allow), "max_attempts": self.max_attempts, "crash_retries": self.crash_retries, "probe": self.probe,
            "in_process": self.in_process,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LadderSpec:
        ctx = ReadContext("<dict>", Path.cwd(), check_files=False)
        return parse_ladder(Section(ctx, "ladder", strip_none(data)))


@dataclass(frozen=True)
class ResourcesSpec:
    """What the job needs of the box: how many GPUs, and whether it may share them; on a
    Slurm cluster also what each attempt asks for (None: the daemon config's default)."""

    gpus: int = 1
    # A built-in job given a range (gpus = "1-4") starts on ``gpus`` and may widen onto free
    # GPUs up to this many (None: exactly ``gpus``).
    gpus_max: int | None = None
    # Share GPUs with other jobs by memory (default: a GPU to itself).
    share: bool = False
    # Device memory per GPU the job expects to need, in bytes (None: learn it by running).
    memory: int | None = None
    # On a cluster (daemon/launch/slurm.py): host memory (sbatch --mem, bytes), CPUs
    # (--cpus-per-task), the time limit of one attempt (--time, seconds) and the GPU type
    # (--gres=gpu:TYPE:N). A local daemon does not use them.
    host_memory: int | None = None
    cpus: int | None = None
    time_limit: int | None = None
    gpu_type: str | None = None
    # The most the job's checkpoints folder may hold, in bytes (None: no budget): a checkpoint
    # that would take it past this waits as on a full disk (jobs/checkpoint_budget.py).
    disk: int | None = None

    @property
    def widest(self) -> int:
        """The most GPUs the job may run on."""
        return self.gpus_max if self.gpus_max is not None else self.gpus

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpus": self.gpus, "share": self.share, "memory": self.memory, "host_memory": self.host_memory, "cpus": self.cpus,
            "time_limit": self.time_limit, "gpu_type": self.gpu_type, "disk": self.disk,
            # Left out unless given, so that stored specs read as they were.
            **({"gpus_max": self.gpus_max} if self.gpus_max is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ResourcesSpec:
        return cls(
            gpus=int(data.get("gpus", 1)), gpus_max=data.get("gpus_max"), share=bool(data.get("share", False)), memory=data.get("memory"),
            host_memory=data.get("host_memory"), cpus=data.get("cpus"), time_limit=data.get("time_limit"), gpu_type=data.get("gpu_type"),
            disk=data.get("disk"),
        )


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


def parse_train(s: Section) -> TrainSpec:
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
    keep_every_steps = _keep_every_steps(s, checkpoint_every_steps, max_steps)
    lr_warmup_steps = s.int("lr_warmup_steps", minimum=0, default=0)
    if lr_warmup_steps >= max_steps:
        raise s.fail(
            "lr_warmup_steps", f"must be less than train.max_steps ({max_steps}), found {lr_warmup_steps}"
        )
    num_train_timesteps = s.int("num_train_timesteps", minimum=1, default=1000)
    weight_decay = s.number("weight_decay", ge=0.0, default=0.0)
    micro_batch = s.int("micro_batch", minimum=1, default=None)
    lr_scheduler = s.choice("lr_scheduler", LR_SCHEDULERS, default="constant_with_warmup")
    # Only a text-to-image job's table may hold these (keys.py): elsewhere they are unknown keys.
    noise_offset = s.number("noise_offset", ge=0.0, lt=1.0, default=0.0)
    snr_gamma = s.number("snr_gamma", gt=0.0, default=None)
    ema, ema_decay = _ema(s)
    sample_every_steps, sample_prompts, sample_inference_steps = _samples(s)
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
        keep_every_steps=keep_every_steps,
        lr_warmup_steps=lr_warmup_steps,
        num_train_timesteps=num_train_timesteps,
        weight_decay=weight_decay,
        micro_batch=micro_batch,
        lr_scheduler=lr_scheduler,
        noise_offset=noise_offset,
        snr_gamma=snr_gamma,
        ema=ema,
        ema_decay=ema_decay,
        sample_every_steps=sample_every_steps,
        sample_prompts=sample_prompts,
        sample_inference_steps=sample_inference_steps,
        log_with=parse_log_with(s),
    )


def _ema(s: Section) -> tuple[bool, float]:
    """train.ema and its ema_decay (only with ema = true)."""
    ema = s.bool("ema", default=False)
    ema_decay = s.number("ema_decay", gt=0.0, lt=1.0, default=None)
    if ema_decay is not None and not ema:
        raise s.fail("ema_decay", "is set but train.ema is not: add `ema = true` to [train], or drop ema_decay")
    return ema, ema_decay if ema_decay is not None else DEFAULT_EMA_DECAY


def _samples(s: Section) -> tuple[int | None, tuple[str, ...], int]:
    """train.sample_every_steps, sample_prompts and sample_inference_steps: both of the first
    two or neither."""
    every = s.int("sample_every_steps", minimum=1, default=None)
    steps = s.int("sample_inference_steps", minimum=1, maximum=1000, default=DEFAULT_SAMPLE_INFERENCE_STEPS)
    prompts = s.get("sample_prompts", None)
    if prompts is None or prompts == []:
        if every is not None:
            raise s.fail("sample_every_steps", 'is set but train.sample_prompts is not: add e.g. sample_prompts = ["a photo of a cat"]')
        return None, (), steps
    if not isinstance(prompts, list) or not all(isinstance(p, str) and p.strip() for p in prompts):
        raise s.fail("sample_prompts", f"expected a list of non-empty prompts, found {describe_value(prompts)}")
    if len(prompts) > MAX_SAMPLE_PROMPTS or any(len(p) > MAX_PROMPT_CHARACTERS for p in prompts):
        raise s.fail("sample_prompts", f"expected at most {MAX_SAMPLE_PROMPTS} prompts of at most {MAX_PROMPT_CHARACTERS} characters each")
    if every is None:
        raise s.fail("sample_prompts", "is set but train.sample_every_steps is not: add e.g. sample_every_steps = 500")
    return every, tuple(prompts), steps


def _keep_every_steps(s: Section, checkpoint_every_steps: int, max_steps: int) -> int | None:
    """train.keep_every_steps: the checkpoints kept for good are those whose step is a multiple
    of it, so it must be one of the steps checkpoints are written at, before the run's end."""
    keep_every_steps = s.int("keep_every_steps", minimum=1, default=None)
    if keep_every_steps is not None and keep_every_steps % checkpoint_every_steps:
        raise s.fail(
            "keep_every_steps",
            f"expected a multiple of train.checkpoint_every_steps ({checkpoint_every_steps}), found {keep_every_steps}: a checkpoint "
            f"is kept for good when its step is a multiple of it, and checkpoints are written every {checkpoint_every_steps} steps",
        )
    if keep_every_steps is not None and keep_every_steps >= max_steps:
        raise s.fail(
            "keep_every_steps",
            f"expected less than train.max_steps ({max_steps}), found {keep_every_steps}: no checkpoint would be kept (the final "
            "model is kept anyway); lower it, or remove it",
        )
    return keep_every_steps


def parse_ladder(s: Section) -> LadderSpec:
    allow = s.names("allow", rungs.names(), "rung", default=rungs.exact_names())
    max_attempts = s.int("max_attempts", minimum=1, default=12)
    crash_retries = s.int("crash_retries", minimum=0, default=2)
    probe = s.bool("probe", default=True)
    in_process = s.bool("in_process", default=True)
    return LadderSpec(allow=tuple(allow), max_attempts=max_attempts, crash_retries=crash_retries, probe=probe, in_process=in_process)


def parse_resources(s: Section) -> ResourcesSpec:
    gpus, gpus_max = _gpus(s)
    share = s.bool("share", default=False)
    memory = _size(s, "memory", "20GiB")
    host_memory = _size(s, "host_memory", "64GiB")
    cpus = s.int("cpus", minimum=1, maximum=4096, default=None)
    time_limit = s.get("time_limit", None)
    if time_limit is not None:
        try:
            time_limit = parse_time_limit(time_limit)
        except ValueError as error:
            raise s.fail("time_limit", f"{error}; it is one attempt's limit on a Slurm cluster") from None
    gpu_type = s.str("gpu_type", default=None)
    if gpu_type is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", gpu_type):
        raise s.fail("gpu_type", f"expected a GPU type as the cluster's gres.conf names it (e.g. \"a100\"), found {render_value(gpu_type)}")
    disk = _size(s, "disk", "20GiB")
    if disk is not None and s.ctx.command_job:
        raise s.fail("disk", "a command job's script writes and prunes its own checkpoints, which oomguard cannot keep within a budget: remove it")
    if disk is not None and disk < MIN_DISK_BUDGET:
        raise s.fail("disk", f"expected at least 1MiB (room for a checkpoint), found {disk} bytes; write it as a size such as \"20GiB\"")
    return ResourcesSpec(
        gpus=gpus, gpus_max=gpus_max, share=share, memory=memory, host_memory=host_memory, cpus=cpus, time_limit=time_limit, gpu_type=gpu_type, disk=disk,
    )


GPU_RANGE = re.compile(r"\s*([0-9]{1,2})\s*-\s*([0-9]{1,2})\s*")


def _gpus(s: Section) -> tuple[int, int | None]:
    """resources.gpus: a number, or for a built-in job a range "A-B" (start on A GPUs, widen onto
    free ones up to B)."""
    value = s.get("gpus", 1)
    if not isinstance(value, str):
        return s.int("gpus", minimum=1, maximum=64, default=1), None
    match = GPU_RANGE.fullmatch(value)
    if match is None or not 1 <= int(match[1]) <= int(match[2]) <= 64:
        raise s.fail("gpus", f'expected a number of GPUs in 1..64, or a range such as "1-4" (at least 1, at most 64), found {render_value(value)}')
    if s.ctx.command_job:
        raise s.fail("gpus", "a command job runs on the GPUs it is given ([command] processes): write one number, not a range")
    low, high = int(match[1]), int(match[2])
    return low, (high if high > low else None)


def _size(s: Section, k: str, example: str) -> int | None:
    """An optional memory size: bytes, or a size such as "20GiB"."""
    value = s.get(k, None)
    if value is None:
        return None
    if is_int(value) and value > 0:
        return int(value)
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError as error:
            raise s.fail(k, str(error)) from None
    raise s.fail(k, f"expected a size such as \"{example}\", found {describe_value(value)}")


def _string_list(s: Section, k: str, secret: bool = False) -> tuple[str, ...]:
    """A list of non-empty strings; a ``secret`` one (URLs with tokens) is never echoed."""
    value = s.get(k, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        found = f"a {type(value).__name__}" if secret else describe_value(value)
        raise s.fail(k, f"expected a list of non-empty strings, found {found}")
    return tuple(value)


def parse_notify(s: Section) -> NotifySpec:
    urls = _string_list(s, "urls", secret=True)
    for url in urls:
        scheme, separator, _ = url.partition("://")
        if not separator or not scheme.replace("+", "").isalnum():
            # Never echo the URL: it may hold a token.
            raise s.fail("urls", f"entry {urls.index(url) + 1} is not an apprise URL (expected SCHEME://..., e.g. json://host/path or mailto://...)")
    tags = _string_list(s, "tags")
    events = s.names("events", NOTIFY_EVENTS, "notification event", default=DEFAULT_NOTIFY_EVENTS)
    return NotifySpec(urls=urls, tags=tags, events=tuple(events))

