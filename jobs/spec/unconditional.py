"""The built-in trainer's job kind (``trainer = "unconditional"``): [data], where the images
come from, and [model], the UNet2DModel keyword arguments, each a frozen dataclass with the
parser of its table; and the bounded look through an image folder that intake makes.
"""

from __future__ import annotations

import collections
import errno
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomguard.jobs.spec.keys import MODEL_KEYS
from oomguard.jobs.spec.reader import MISSING, ReadContext, Section, describe_value, did_you_mean, is_int, render_value, resolve_path, strip_none

IMAGE_EXTENSIONS: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
SYNTHETIC_PREFIX = "synthetic:"
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
# UNet2DModel's own default; used only to check that it divides every block width.
DEFAULT_NORM_NUM_GROUPS = 32
_MODEL_DEFAULTS: dict[str, Any] = {"in_channels": 3, "out_channels": 3}
_MODEL_REQUIRED = ("block_out_channels", "down_block_types", "up_block_types")


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
        ctx = ReadContext("<dict>", Path.cwd(), check_files=False)
        return parse_data(ctx, Section(ctx, "data", strip_none(data)))


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
        ctx = ReadContext("<dict>", Path.cwd(), check_files=False)
        return parse_model(ctx, Section(ctx, "model", strip_none(data)), resolution=None)


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


def parse_data(ctx: ReadContext, s: Section) -> DataSpec:
    source = s.str("source")
    if source.startswith(SYNTHETIC_PREFIX):
        count = source[len(SYNTHETIC_PREFIX):]
        if not (count.isascii() and count.isdigit()) or int(count) < 1:
            raise s.fail("source", f"synthetic:N needs an integer N >= 1, found {render_value(source)}")
        source = f"{SYNTHETIC_PREFIX}{int(count)}"
    else:
        folder = resolve_path(ctx, source, s.key("source"))
        if ctx.check_files:
            where = "(expected an image folder or synthetic:N)"
            # As whoever submits, and only what they may see: a folder they may not search
            # reads the same whether it exists or not (the kernel says EACCES either way).
            unreadable = "; give a folder you can read, or ask its owner to let you read it (the job runs as you)"
            try:
                exists, is_dir = folder.exists(), folder.is_dir()
            except OSError as e:  # e.g. a name too long, or a folder the user may not search
                fix = unreadable if e.errno == errno.EACCES else ""
                raise s.fail("source", f"cannot look at folder {render_value(str(folder))}: {e.strerror or e} {where}{fix}") from None
            if not exists:
                raise s.fail("source", f"folder {folder} does not exist {where}")
            if not is_dir:
                raise s.fail("source", f"{folder} is not a folder {where}")
            try:
                has_image = _has_image(folder)
            except OSError as e:
                raise s.fail("source", f"cannot read folder {render_value(str(folder))}: {e.strerror or e}{unreadable}") from None
            if has_image is False:
                exts = ", ".join(IMAGE_EXTENSIONS)
                raise s.fail("source", f"no image files ({exts}) in folder {folder}")
        source = str(folder)
    resolution = s.int("resolution", minimum=8)
    random_flip = s.bool("random_flip", default=False)
    return DataSpec(source=source, resolution=resolution, random_flip=random_flip)


def _int_list(s: Section, k: str) -> tuple[int, ...]:
    value = s.get(k, MISSING)
    want = "a non-empty list of integers >= 1"
    if not isinstance(value, list):
        raise s.fail(k, f"expected {want}, found {describe_value(value)}")
    if not value or not all(is_int(v) and v >= 1 for v in value):
        raise s.fail(k, f"expected {want}, found {render_value(value)}")
    return tuple(value)


def _block_types(s: Section, k: str, choices: tuple[str, ...], what: str) -> tuple[str, ...]:
    value = s.get(k, MISSING)
    want = f"a list of {what} block type names"
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        shown = describe_value(value) if not isinstance(value, list) else render_value(value)
        raise s.fail(k, f"expected {want}, found {shown}")
    for v in value:
        if v not in choices:
            hint = did_you_mean(v, choices)
            raise s.fail(k, f"unknown {what} block type '{v}' (expected one of: {', '.join(choices)}){hint}")
    return tuple(value)


def parse_model(ctx: ReadContext, s: Section, resolution: int | None) -> ModelSpec:
    """[model]: each key on its own, then the keys against each other, then the model
    against ``data.resolution`` (None: not checked, as for ModelSpec.from_dict)."""
    kw = _model_kwargs(s)
    channels: tuple[int, ...] = kw["block_out_channels"]
    _check_one_block_type_per_block(s, kw, channels)
    _check_norm_groups(s, kw, channels)
    if resolution is not None:
        _check_resolution(ctx, resolution, channels)
    return ModelSpec(tuple(kw.items()))


def _model_kwargs(s: Section) -> dict[str, Any]:
    """The keys of [model] that are there (and the defaults), each checked on its own, in
    MODEL_KEYS order."""
    kw: dict[str, Any] = {}
    for k in MODEL_KEYS:
        if not s.has(k):
            if k in _MODEL_REQUIRED:
                raise s.fail(k, "required key is missing")
            if k in _MODEL_DEFAULTS:
                kw[k] = _MODEL_DEFAULTS[k]
            continue
        kw[k] = _model_value(s, k)
    return kw


def _model_value(s: Section, k: str) -> Any:
    if k in ("in_channels", "out_channels", "layers_per_block", "norm_num_groups", "attention_head_dim"):
        return s.int(k, minimum=1)
    if k == "block_out_channels":
        return _int_list(s, k)
    if k == "down_block_types":
        return _block_types(s, k, DOWN_BLOCK_TYPES, "down")
    if k == "up_block_types":
        return _block_types(s, k, UP_BLOCK_TYPES, "up")
    if k == "dropout":
        return s.number(k, ge=0.0, lt=1.0)
    if k == "act_fn":
        return s.choice(k, ACT_FNS)
    if k == "time_embedding_type":
        return s.choice(k, TIME_EMBEDDING_TYPES)
    if k in ("center_input_sample", "flip_sin_to_cos"):
        return s.bool(k)
    if k == "freq_shift":
        return s.int(k)
    if k == "downsample_padding":
        return s.int(k, minimum=0)
    if k in ("mid_block_scale_factor", "norm_eps"):
        return s.number(k, gt=0.0)
    raise AssertionError(k)  # pragma: no cover - MODEL_KEYS and this chain must agree


def _check_one_block_type_per_block(s: Section, kw: Mapping[str, Any], channels: tuple[int, ...]) -> None:
    for k in ("down_block_types", "up_block_types"):
        if len(kw[k]) != len(channels):
            raise s.fail(
                k,
                f"has {len(kw[k])} entries but block_out_channels has {len(channels)}"
                " (one block type per block_out_channels entry)",
            )


def _check_norm_groups(s: Section, kw: Mapping[str, Any], channels: tuple[int, ...]) -> None:
    """GroupNorm needs every block width divisible by norm_num_groups, given or the default."""
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


def _check_resolution(ctx: ReadContext, resolution: int, channels: tuple[int, ...]) -> None:
    """The model halves the image once per block after the first: the resolution must survive it."""
    factor = 2 ** (len(channels) - 1)
    if resolution % factor:
        raise ctx.fail(
            "data.resolution",
            f"{resolution} is not divisible by {factor}"
            f" (the model halves it {len(channels) - 1} time(s): 2**(len(block_out_channels) - 1) = {factor})",
        )
