"""What a job file may say: the keys of each table, and the placeholders and [command.when]
knobs a command job may use, with the help text messages and the README show for them.

The tables of keys are what an unknown key is checked against (reader.py Section) and what
a did-you-mean is drawn from; the values each key takes are checked by the module of its
table (common.py, unconditional.py, command.py).
"""

from __future__ import annotations

from oomguard.strategies import rungs
from oomguard.strategies.rungs.base import Placeholder

# The trainer of jobs that run a command of their own (jobs/spec/command.py).
COMMAND_TRAINER = "command"
# The built-in trainer that fine-tunes a Stable Diffusion pipeline on captioned images
# (jobs/spec/text_to_image.py); its [data], [model] and [train] hold other keys.
TEXT_TO_IMAGE_TRAINER = "text_to_image"

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

# What a job can be notified of (daemon/notifier.py); `escalated` is opt-in. `waiting_for_disk`:
# the disk was full, and the job waits for someone to make room (once per wait).
NOTIFY_EVENTS: tuple[str, ...] = ("failed", "finished", "escalated", "stalled", "waiting_for_disk", "creep")
DEFAULT_NOTIFY_EVENTS: tuple[str, ...] = ("failed", "finished", "stalled", "waiting_for_disk", "creep")

_TOP_KEYS = ("name", "trainer", "priority", "workdir", "data", "model", "train", "ladder", "resources", "notify", "command")
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
    "keep_every_steps",
    "lr_warmup_steps",
    "num_train_timesteps",
    "weight_decay",
    "micro_batch",
    "lr_scheduler",
    "ema",
    "ema_decay",
    "log_with",
)
_LADDER_KEYS = ("allow", "max_attempts", "crash_retries", "probe", "in_process")
_RESOURCES_KEYS = ("gpus", "share", "memory", "host_memory", "cpus", "time_limit", "gpu_type", "disk")
_COMMAND_KEYS = ("argv", "cwd", "env", "when", "processes")
_NOTIFY_KEYS = ("urls", "tags", "events")

# The placeholders of the job itself; the rungs' own come from their modules (CommandSide).
_JOB_PLACEHOLDERS = (
    Placeholder("batch_size", "the effective batch (micro_batch x grad_accum x processes)", listed=2),
    Placeholder("processes", "the training processes the command starts ([command] processes)", listed=3),
    Placeholder("gpus", "the GPUs the attempt was placed on (accelerate launch --num_processes {gpus}, torchrun --nproc_per_node {gpus})", listed=3),
    Placeholder("workdir", "the job's work directory", listed=7),
    Placeholder("attempt", "the attempt number, from 1", listed=8),
)


def placeholders() -> dict[str, str]:
    """What a placeholder may name, with what it becomes for a plan, in the order messages
    and the README list them."""
    every = [*_JOB_PLACEHOLDERS, *(p for r in rungs.ladder() if r.command is not None for p in r.command.placeholders)]
    return {p.name: p.help for p in sorted(every, key=lambda p: p.listed)}


def when_keys() -> dict[str, str]:
    """The [command.when] keys (the knob that adds the arguments) with when they are on, in
    the order messages and the README list them."""
    every = [r.command.when for r in rungs.ladder() if r.command is not None and r.command.when is not None]
    return {w.key: w.help for w in sorted(every, key=lambda w: w.listed)}


def __getattr__(name: str) -> dict[str, str]:
    # PLACEHOLDERS and WHEN_KNOBS, the names these tables were imported by, computed from the
    # ladder as it is now (a test may register a rung).
    if name == "PLACEHOLDERS":
        return placeholders()
    if name == "WHEN_KNOBS":
        return when_keys()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The keys each table may hold, by its dotted name (None: the top level).
SECTION_KEYS: dict[str | None, tuple[str, ...]] = {
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

# A text-to-image job's tables where they differ from the unconditional trainer's.
# [train] keys only the text-to-image trainer reads.
TEXT_TO_IMAGE_TRAIN_KEYS = ("noise_offset", "snr_gamma", "sample_every_steps", "sample_prompts", "sample_inference_steps")
_TEXT_TO_IMAGE_KEYS: dict[str | None, tuple[str, ...]] = {
    "data": ("source", "resolution", "center_crop", "random_flip", "caption_column", "buckets", "bucket_no_upscale"),
    "model": ("path", "method", "lora_rank", "lora_alpha", "target_modules"),
    "train": (*_TRAIN_KEYS, *TEXT_TO_IMAGE_TRAIN_KEYS),
}


def section_keys(name: str | None, trainer: str | None) -> tuple[str, ...] | None:
    """The keys table ``name`` may hold in a job of ``trainer`` (None: any key, checked one
    by one by its reader)."""
    if trainer == TEXT_TO_IMAGE_TRAINER and name in _TEXT_TO_IMAGE_KEYS:
        return _TEXT_TO_IMAGE_KEYS[name]
    return SECTION_KEYS.get(name)


# Keys people reach for that have a better home.
SPECIAL_HINTS: dict[str, str] = {
    "sample_size": "the trainer sets it from data.resolution",
}

# [train] keys of the built-in trainer only: a command's script decides these itself.
SCRIPT_OWNED_TRAIN_KEYS = (
    "learning_rate", "seed", "checkpoint_every_steps", "checkpoint_every_seconds", "keep_checkpoints", "keep_every_steps", "lr_warmup_steps",
    "num_train_timesteps", "weight_decay", "lr_scheduler", "ema", "ema_decay", "log_with",
)

# What a command job may not have, by table: each is refused with its own reason (job.py).
NOT_FOR_COMMAND_JOBS: dict[str | None, tuple[str, ...]] = {None: ("data", "model"), "train": SCRIPT_OWNED_TRAIN_KEYS}
