"""Job-file parsing and validation (oomguard.jobs.spec). Fast: no torch, no GPU."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import pickle
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest

from oomguard.jobs import spec as spec_module
from oomguard.jobs.spec import DataSpec, JobSpec, LadderSpec, ModelSpec, TrainSpec, load_job_file, parse_job_text
from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs import exact_names, names
from oomguard.strategies.errors import JobFileError

RUNG_NAMES, EXACT_RUNG_NAMES = names(), exact_names()

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "jobs" / "examples" / "quickstart.toml"
BAD_JOBS = Path(__file__).resolve().parents[1] / "bad_jobs"
BAD_FILES = sorted(BAD_JOBS.glob("*.toml"))
EXPECT_PREFIX = "# expect: "


# ----------------------------------------------------------------------------- helpers


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(value)


def to_toml(doc: dict[str, Any]) -> str:
    """A minimal TOML writer: top-level scalars, then one [table] per dict value."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for k, v in doc.items():
        if isinstance(v, dict):
            lines.append(f"\n[{k}]")
            lines.extend(f"{kk} = {_toml_value(vv)}" for kk, vv in v.items())
    return "\n".join(lines) + "\n"


def base_doc() -> dict[str, Any]:
    """A valid job, like quickstart but with 8 synthetic images."""
    return {
        "name": "unit",
        "trainer": "unconditional",
        "data": {"source": "synthetic:8", "resolution": 32},
        "model": {
            "block_out_channels": [32, 64],
            "layers_per_block": 1,
            "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
            "up_block_types": ["AttnUpBlock2D", "UpBlock2D"],
            "norm_num_groups": 8,
        },
        "train": {"batch_size": 16, "max_steps": 40, "learning_rate": 1e-4},
    }


_DELETE = object()


def with_changes(changes: dict[str, Any]) -> dict[str, Any]:
    """base_doc() with dotted keys set (or deleted with _DELETE)."""
    doc = copy.deepcopy(base_doc())
    for dotted, value in changes.items():
        *tables, key = dotted.split(".")
        target = doc
        for t in tables:
            target = target.setdefault(t, {})
        if value is _DELETE:
            del target[key]
        else:
            target[key] = value
    return doc


def parse(doc: dict[str, Any], path: str = "job.toml", base_dir: Path | None = None) -> JobSpec:
    return parse_job_text(to_toml(doc), path, base_dir=base_dir)


def png_bytes(width: int = 2, height: int = 2) -> bytes:
    """A valid RGB PNG, written by hand."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + bytes([200, 100, 50]) * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def write_png(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png_bytes())
    return path


def error_of(doc_or_text: dict[str, Any] | str, path: str = "job.toml", base_dir: Path | None = None) -> JobFileError:
    text = doc_or_text if isinstance(doc_or_text, str) else to_toml(doc_or_text)
    with pytest.raises(JobFileError) as info:
        parse_job_text(text, path, base_dir=base_dir)
    return info.value


# ----------------------------------------------------------------------------- quickstart


def test_quickstart_loads_with_its_values():
    job = load_job_file(QUICKSTART)
    assert job.name == "quickstart"
    assert job.trainer == "unconditional"
    assert job.source_path == str(QUICKSTART)
    assert job.data == DataSpec(source="synthetic:64", resolution=32, random_flip=False)
    assert job.data.is_synthetic and job.data.synthetic_count == 64
    assert job.model.kwargs() == {
        "in_channels": 3,
        "out_channels": 3,
        "block_out_channels": [32, 64],
        "layers_per_block": 1,
        "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
        "up_block_types": ["AttnUpBlock2D", "UpBlock2D"],
        "norm_num_groups": 8,
    }
    assert job.train.batch_size == 16
    assert job.train.max_steps == 40
    assert job.train.learning_rate == pytest.approx(1e-4)
    assert job.train.mixed_precision == "no"
    assert job.train.checkpoint_every_steps == 10
    assert job.ladder.allow == ("allocator", "micro_batch", "checkpointing")


def test_quickstart_defaults_filled():
    job = load_job_file(QUICKSTART)
    assert job.priority == 0
    assert job.workdir is None
    assert job.train.seed == 0
    assert job.train.keep_checkpoints == 2
    assert job.train.lr_warmup_steps == 0
    assert job.train.num_train_timesteps == 1000
    assert job.train.weight_decay == 0.0
    assert job.train.checkpoint_every_seconds is None
    assert job.train.micro_batch is None
    assert job.ladder.max_attempts == 12
    assert job.ladder.crash_retries == 2


def test_quickstart_round_trips_through_dict_and_json():
    job = load_job_file(QUICKSTART)
    assert JobSpec.parse(job.to_dict()) == job
    assert JobSpec.parse(json.loads(json.dumps(job.to_dict()))) == job
    assert JobSpec.parse(json.loads(json.dumps(job.to_dict(), sort_keys=False))) == job
    assert JobSpec.parse(job.to_dict()).to_dict() == job.to_dict()


def test_quickstart_initial_plan():
    plan = load_job_file(QUICKSTART).initial_plan()
    assert plan == Plan.initial(16, "no")
    assert plan.micro_batch == 16 and plan.grad_accum == 1


def test_minimal_job_gets_all_defaults():
    job = parse(base_doc())
    assert job.ladder == LadderSpec()
    assert job.ladder.allow == EXACT_RUNG_NAMES
    assert job.train.checkpoint_every_steps == 4  # max_steps 40 // 10
    assert job.train.seed == 0 and job.train.mixed_precision == "no"
    assert job.data.random_flip is False
    assert job.model["in_channels"] == 3 and job.model["out_channels"] == 3
    assert "dropout" not in job.model
    assert job.source_path == "job.toml"


@pytest.mark.parametrize(
    ("max_steps", "every"),
    [(1, 1), (9, 1), (10, 1), (19, 1), (20, 2), (40, 4), (1000, 100)],
)
def test_checkpoint_every_steps_default(max_steps: int, every: int):
    job = parse(with_changes({"train.max_steps": max_steps}))
    assert job.train.checkpoint_every_steps == every
    assert TrainSpec(batch_size=1, max_steps=max_steps, learning_rate=1e-3).checkpoint_every_steps == every


# ----------------------------------------------------------------------------- bad job files


def expected_substring(path: Path) -> str:
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith(EXPECT_PREFIX), f"{path.name}: first line must be '{EXPECT_PREFIX}<substring>'"
    expected = first[len(EXPECT_PREFIX):].strip()
    assert expected, f"{path.name}: empty expect substring"
    return expected


def test_bad_jobs_folder_is_populated():
    names = {p.stem for p in BAD_FILES}
    assert len(names) >= 16
    for required in (
        "syntax_error",
        "unknown_key",
        "wrong_type_batch",
        "batch_zero",
        "negative_steps",
        "missing_data_folder",
        "unknown_trainer",
        "unknown_rung",
        "bool_as_int",
        "float_steps",
        "missing_name",
        "bad_name",
        "block_lists_mismatch",
        "norm_groups_not_divisor",
        "resolution_not_divisible",
        "bad_mixed_precision",
        "empty",
        "micro_batch_too_big",
        "table_as_value",
        "synthetic_zero",
    ):
        assert required in names


@pytest.mark.parametrize("path", BAD_FILES, ids=[p.stem for p in BAD_FILES])
def test_bad_job_file_is_rejected_with_expected_message(path: Path):
    expected = expected_substring(path)
    with pytest.raises(JobFileError) as info:
        load_job_file(path)
    message = str(info.value)
    assert expected in message
    assert path.name in message
    assert "\n" not in message
    assert info.value.path == str(path)


@pytest.mark.parametrize("path", BAD_FILES, ids=[p.stem for p in BAD_FILES])
def test_bad_job_text_is_rejected_the_same_way(path: Path):
    """What a daemon spool does: parse the text under the original name."""
    expected = expected_substring(path)
    with pytest.raises(JobFileError) as info:
        parse_job_text(path.read_text(encoding="utf-8"), path.name, base_dir=path.parent)
    assert expected in str(info.value)
    assert str(info.value).startswith(f"{path.name}: ")


@pytest.mark.parametrize("path", BAD_FILES, ids=[p.stem for p in BAD_FILES])
def test_bad_job_error_key_matches_message(path: Path):
    with pytest.raises(JobFileError) as info:
        load_job_file(path)
    err = info.value
    if err.key is None:
        assert str(err) == f"{err.path}: {err.problem}"
    else:
        assert str(err) == f"{err.path}: {err.key}: {err.problem}"
        assert expected_substring(path).startswith(f"{err.key}: ")


# ----------------------------------------------------------------------------- inline bad cases

BAD_CASES: list[tuple[str, dict[str, Any], str]] = [
    # top level
    ("name_empty", {"name": ""}, 'name: expected a non-empty string, found ""'),
    ("name_too_long", {"name": "a" * 65}, "name: expected 1-64 characters"),
    ("name_leading_dot", {"name": ".hidden"}, "name: expected 1-64 characters"),
    ("name_leading_dash", {"name": "-x"}, "name: expected 1-64 characters"),
    ("name_slash", {"name": "a/b"}, "name: expected 1-64 characters"),
    ("name_int", {"name": 5}, "name: expected a string, found an integer (5)"),
    ("trainer_missing", {"trainer": _DELETE}, "trainer: required key is missing"),
    ("trainer_list", {"trainer": ["unconditional"]}, "trainer: expected a string, found a list"),
    ("priority_float", {"priority": 1.5}, "priority: expected an integer, found a float (1.5)"),
    ("priority_bool", {"priority": False}, "priority: expected an integer, found a boolean (false)"),
    ("workdir_int", {"workdir": 3}, "workdir: expected a string, found an integer (3)"),
    ("data_missing", {"data": _DELETE}, "data: required table [data] is missing"),
    ("model_missing", {"model": _DELETE}, "model: required table [model] is missing"),
    ("top_unknown", {"nmae": "x"}, "nmae: unknown key (expected one of: command, data, ladder, model, name, notify, priority, resources, train, trainer, workdir)"),
    # data
    ("source_missing", {"data.source": _DELETE}, "data.source: required key is missing"),
    ("source_int", {"data.source": 8}, "data.source: expected a string, found an integer (8)"),
    ("synthetic_negative", {"data.source": "synthetic:-1"}, "data.source: synthetic:N needs an integer N >= 1"),
    ("synthetic_word", {"data.source": "synthetic:many"}, "data.source: synthetic:N needs an integer N >= 1"),
    ("synthetic_empty", {"data.source": "synthetic:"}, "data.source: synthetic:N needs an integer N >= 1"),
    ("synthetic_float", {"data.source": "synthetic:1.5"}, "data.source: synthetic:N needs an integer N >= 1"),
    ("resolution_missing", {"data.resolution": _DELETE}, "data.resolution: required key is missing"),
    ("resolution_float", {"data.resolution": 32.0}, "data.resolution: expected an integer >= 8, found a float (32.0)"),
    ("resolution_7", {"data.resolution": 7}, "data.resolution: expected an integer >= 8, found 7"),
    ("random_flip_int", {"data.random_flip": 1}, "data.random_flip: expected true or false, found an integer (1)"),
    ("random_flip_str", {"data.random_flip": "yes"}, 'data.random_flip: expected true or false, found a string ("yes")'),
    ("data_unknown", {"data.resolutoin": 32}, "data.resolutoin: unknown key"),
    # model
    ("down_missing", {"model.down_block_types": _DELETE}, "model.down_block_types: required key is missing"),
    ("up_missing", {"model.up_block_types": _DELETE}, "model.up_block_types: required key is missing"),
    ("channels_empty", {"model.block_out_channels": []}, "model.block_out_channels: expected a non-empty list of integers >= 1, found []"),
    ("channels_zero", {"model.block_out_channels": [32, 0]}, "model.block_out_channels: expected a non-empty list of integers >= 1, found [32, 0]"),
    ("channels_float", {"model.block_out_channels": [32, 64.0]}, "model.block_out_channels: expected a non-empty list of integers >= 1, found [32, 64.0]"),
    ("channels_bool", {"model.block_out_channels": [32, True]}, "found [32, true]"),
    ("channels_scalar", {"model.block_out_channels": 32}, "model.block_out_channels: expected a non-empty list of integers >= 1, found an integer (32)"),
    ("down_scalar", {"model.down_block_types": "DownBlock2D"}, 'model.down_block_types: expected a list of down block type names, found a string ("DownBlock2D")'),
    ("down_mismatch", {"model.down_block_types": ["DownBlock2D"]}, "model.down_block_types: has 1 entries but block_out_channels has 2"),
    ("up_in_down", {"model.down_block_types": ["DownBlock2D", "UpBlock2D"]}, "model.down_block_types: unknown down block type 'UpBlock2D'"),
    ("down_in_up", {"model.up_block_types": ["AttnUpBlock2D", "DownBlock2D"]}, "model.up_block_types: unknown up block type 'DownBlock2D'"),
    ("in_channels_zero", {"model.in_channels": 0}, "model.in_channels: expected an integer >= 1, found 0"),
    ("out_channels_str", {"model.out_channels": "3"}, 'model.out_channels: expected an integer >= 1, found a string ("3")'),
    ("layers_zero", {"model.layers_per_block": 0}, "model.layers_per_block: expected an integer >= 1, found 0"),
    ("norm_groups_zero", {"model.norm_num_groups": 0}, "model.norm_num_groups: expected an integer >= 1, found 0"),
    ("default_norm_groups", {"model.norm_num_groups": _DELETE, "model.block_out_channels": [16, 32]}, "model.block_out_channels: entry 16 is not divisible by norm_num_groups 32 (the default)"),
    ("head_dim_zero", {"model.attention_head_dim": 0}, "model.attention_head_dim: expected an integer >= 1, found 0"),
    ("dropout_negative", {"model.dropout": -0.1}, "model.dropout: expected a number in [0, 1), found -0.1"),
    ("dropout_nan", {"model.dropout": math.nan}, "model.dropout: expected a number in [0, 1), found nan"),
    ("act_fn", {"model.act_fn": "tanh"}, 'model.act_fn: expected one of "silu", "swish", "mish", "gelu", "relu", found "tanh"'),
    ("time_embedding", {"model.time_embedding_type": "learned"}, 'model.time_embedding_type: expected one of "positional", "fourier", found "learned"'),
    ("center_input_int", {"model.center_input_sample": 0}, "model.center_input_sample: expected true or false, found an integer (0)"),
    ("flip_sin_str", {"model.flip_sin_to_cos": "true"}, "model.flip_sin_to_cos: expected true or false"),
    ("freq_shift_float", {"model.freq_shift": 0.5}, "model.freq_shift: expected an integer, found a float (0.5)"),
    ("downsample_padding_negative", {"model.downsample_padding": -1}, "model.downsample_padding: expected an integer >= 0, found -1"),
    ("mid_scale_zero", {"model.mid_block_scale_factor": 0}, "model.mid_block_scale_factor: expected a number > 0, found 0"),
    ("norm_eps_negative", {"model.norm_eps": -1e-5}, "model.norm_eps: expected a number > 0, found -1e-05"),
    ("sample_size", {"model.sample_size": 32}, "model.sample_size: unknown key"),
    ("resolution_three_blocks", {
        "data.resolution": 34,
        "model.block_out_channels": [32, 64, 64],
        "model.down_block_types": ["DownBlock2D"] * 3,
        "model.up_block_types": ["UpBlock2D"] * 3,
    }, "data.resolution: 34 is not divisible by 4"),
    # train
    ("max_steps_missing", {"train.max_steps": _DELETE}, "train.max_steps: required key is missing"),
    ("lr_missing", {"train.learning_rate": _DELETE}, "train.learning_rate: required key is missing"),
    ("lr_negative", {"train.learning_rate": -1e-4}, "train.learning_rate: expected a number > 0, found -0.0001"),
    ("lr_inf", {"train.learning_rate": math.inf}, "train.learning_rate: expected a number > 0, found inf"),
    ("lr_bool", {"train.learning_rate": True}, "train.learning_rate: expected a number > 0, found a boolean (true)"),
    ("seed_negative", {"train.seed": -1}, "train.seed: expected an integer >= 0, found -1"),
    ("mixed_precision_bool", {"train.mixed_precision": False}, 'train.mixed_precision: expected one of "no", "bf16", "fp16", found a boolean (false)'),
    ("mixed_precision_case", {"train.mixed_precision": "BF16"}, "did you mean 'bf16'?"),
    ("checkpoint_steps_zero", {"train.checkpoint_every_steps": 0}, "train.checkpoint_every_steps: expected an integer >= 1, found 0"),
    ("checkpoint_seconds_zero", {"train.checkpoint_every_seconds": 0}, "train.checkpoint_every_seconds: expected a number > 0, found 0"),
    ("checkpoint_seconds_str", {"train.checkpoint_every_seconds": "60"}, 'train.checkpoint_every_seconds: expected a number > 0, found a string ("60")'),
    ("keep_zero", {"train.keep_checkpoints": 0}, "train.keep_checkpoints: expected an integer >= 1, found 0"),
    ("keep_every_zero", {"train.keep_every_steps": 0}, "train.keep_every_steps: expected an integer >= 1, found 0"),
    ("keep_every_float", {"train.keep_every_steps": 20.0}, "train.keep_every_steps: expected an integer >= 1, found a float (20.0)"),
    (
        "keep_every_not_a_multiple", {"train.checkpoint_every_steps": 10, "train.keep_every_steps": 15},
        "train.keep_every_steps: expected a multiple of train.checkpoint_every_steps (10), found 15",
    ),
    (
        "keep_every_past_the_end", {"train.checkpoint_every_steps": 10, "train.keep_every_steps": 40},
        "train.keep_every_steps: expected less than train.max_steps (40), found 40: no checkpoint would be kept",
    ),
    ("warmup_negative", {"train.lr_warmup_steps": -1}, "train.lr_warmup_steps: expected an integer >= 0, found -1"),
    ("warmup_past_end", {"train.lr_warmup_steps": 41}, "train.lr_warmup_steps: must be less than train.max_steps (40), found 41"),
    ("timesteps_zero", {"train.num_train_timesteps": 0}, "train.num_train_timesteps: expected an integer >= 1, found 0"),
    ("weight_decay_negative", {"train.weight_decay": -0.01}, "train.weight_decay: expected a number >= 0, found -0.01"),
    ("micro_batch_zero", {"train.micro_batch": 0}, "train.micro_batch: expected an integer >= 1, found 0"),
    ("micro_batch_float", {"train.micro_batch": 4.0}, "train.micro_batch: expected an integer >= 1, found a float (4.0)"),
    ("train_unknown", {"train.epochs": 3}, "train.epochs: unknown key"),
    ("train_is_list", {"train": _DELETE, "ladder": {}}, "train: required table [train] is missing"),
    # ladder
    ("allow_str", {"ladder.allow": "allocator"}, 'ladder.allow: expected a list of rung names, found a string ("allocator")'),
    ("allow_ints", {"ladder.allow": [1, 2]}, "ladder.allow: expected a list of rung names, found a list ([1, 2])"),
    ("attempts_zero", {"ladder.max_attempts": 0}, "ladder.max_attempts: expected an integer >= 1, found 0"),
    ("crash_retries_float", {"ladder.crash_retries": 1.0}, "ladder.crash_retries: expected an integer >= 0, found a float (1.0)"),
    ("ladder_unknown", {"ladder.rungs": ["allocator"]}, "ladder.rungs: unknown key"),
]


@pytest.mark.parametrize(("changes", "expected"), [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES])
def test_bad_values(changes: dict[str, Any], expected: str):
    err = error_of(with_changes(changes))
    assert expected in str(err)
    assert str(err).startswith("job.toml: ")


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        ("name = 'x'\ntrainer = 'unconditional'\ndata = 5\n", "data", "expected a table ([data]), found an integer (5)"),
        ("name = 'x'\ntrainer = 'unconditional'\n[[train]]\nbatch_size = 1\n", "data", "required table [data] is missing"),
        ("name = { first = 'x' }\n", "name", "expected a string, found a table"),
        ("name = 2024-01-01\n", "name", "expected a string, found a date/time (2024-01-01)"),
        ("[name]\nvalue = 'x'\n", "name", "expected a string, found a table"),
        ("train.batch_size = 1\n", "name", "required key is missing"),
    ],
)
def test_bad_structure(text: str, key: str, expected: str):
    err = error_of(text)
    assert err.key == key
    assert expected in err.problem


def test_train_as_array_of_tables():
    doc = base_doc()
    text = to_toml({k: v for k, v in doc.items() if k != "train"}) + "[[train]]\nbatch_size = 1\n"
    err = error_of(text)
    assert err.key == "train"
    assert "expected a table ([train]), found a list" in err.problem


def test_first_problem_in_fixed_order():
    # unknown keys of a table come before its other problems; tables in file-key order
    doc = with_changes({"train.batch_size": 0, "train.bogus": 1, "data.resolution": 4})
    err = error_of(doc)
    assert err.key == "data.resolution"
    doc = with_changes({"train.batch_size": 0, "train.bogus": 1})
    assert error_of(doc).key == "train.bogus"
    doc = with_changes({"train.batch_size": 0, "train.max_steps": 0})
    assert error_of(doc).key == "train.batch_size"
    assert str(error_of(doc)) == str(error_of(doc))


# ----------------------------------------------------------------------------- did you mean


@pytest.mark.parametrize(
    ("dotted", "suggestion"),
    [
        ("train.max_stepz", "max_steps"),
        ("train.batchsize", "batch_size"),
        ("train.Batch_Size", "batch_size"),
        ("train.learning_rat", "learning_rate"),
        ("train.mixed_precison", "mixed_precision"),
        ("data.sourc", "source"),
        ("model.block_out_channel", "block_out_channels"),
        ("model.norm_num_group", "norm_num_groups"),
        ("ladder.alow", "allow"),
        ("ladder.max_attempt", "max_attempts"),
        ("nam", "name"),
        ("trainr", "trainer"),
    ],
)
def test_unknown_key_did_you_mean(dotted: str, suggestion: str):
    err = error_of(with_changes({dotted: 1}))
    assert err.key == dotted
    assert err.problem.startswith("unknown key (expected one of: ")
    assert f"did you mean '{suggestion}'?" in str(err)


def test_unknown_key_lists_allowed_keys_sorted():
    err = error_of(with_changes({"train.max_stepz": 40, "train.max_steps": _DELETE}))
    assert str(err).startswith(
        "job.toml: train.max_stepz: unknown key (expected one of: batch_size, checkpoint_every_seconds, "
    )
    assert str(err).endswith("did you mean 'max_steps'?")


@pytest.mark.parametrize(
    ("dotted", "hint"),
    [
        ("ladder.priority", "'priority' is a top-level key: put it above the first [table] header"),
        ("data.workdir", "'workdir' is a top-level key"),
        ("model.learning_rate", "'learning_rate' belongs in [train]"),
        ("train.resolution", "'resolution' belongs in [data]"),
        ("model.sample_size", "the trainer sets it from data.resolution"),
    ],
)
def test_misplaced_key_hint(dotted: str, hint: str):
    assert hint in str(error_of(with_changes({dotted: 1})))


@pytest.mark.parametrize(
    ("changes", "hint"),
    [
        ({"ladder.allow": ["allocater"]}, "did you mean 'allocator'?"),
        ({"ladder.allow": ["checkpoint"]}, "did you mean 'checkpointing'?"),
        ({"trainer": "unconditonal"}, "did you mean 'unconditional'?"),
        ({"model.act_fn": "sliu"}, "did you mean 'silu'?"),
        ({"model.down_block_types": ["Downblock2D", "AttnDownBlock2D"]}, "did you mean 'DownBlock2D'?"),
        ({"train.mixed_precision": "bf61"}, "did you mean 'bf16'?"),
    ],
)
def test_value_did_you_mean(changes: dict[str, Any], hint: str):
    assert hint in str(error_of(with_changes(changes)))


def test_no_hint_when_nothing_is_close():
    err = error_of(with_changes({"train.zzzzzz": 1}))
    assert "did you mean" not in str(err)


# ----------------------------------------------------------------------------- valid variations


@pytest.mark.parametrize(
    ("changes", "check"),
    [
        ({"train.learning_rate": 1}, lambda j: j.train.learning_rate == 1.0 and isinstance(j.train.learning_rate, float)),
        ({"train.weight_decay": 0}, lambda j: isinstance(j.train.weight_decay, float)),
        ({"train.checkpoint_every_seconds": 30}, lambda j: j.train.checkpoint_every_seconds == 30.0),
        ({"train.micro_batch": 16}, lambda j: j.initial_plan().micro_batch == 16),
        ({"train.micro_batch": 5}, lambda j: j.initial_plan().micro_batch_sizes() == [5, 5, 5, 1]),
        ({"train.mixed_precision": "bf16"}, lambda j: j.initial_plan().mixed_precision == "bf16"),
        ({"train.mixed_precision": "fp16"}, lambda j: j.train.mixed_precision == "fp16"),
        ({"train.lr_warmup_steps": 39}, lambda j: j.train.lr_warmup_steps == 39),
        ({"train.seed": 123456789012}, lambda j: j.train.seed == 123456789012),
        ({"priority": -5}, lambda j: j.priority == -5),
        ({"name": "a"}, lambda j: j.name == "a"),
        ({"name": "9.Job_name-x"}, lambda j: j.name == "9.Job_name-x"),
        ({"name": "x" * 64}, lambda j: len(j.name) == 64),
        ({"data.source": "synthetic:1"}, lambda j: j.data.synthetic_count == 1),
        ({"data.source": "synthetic:007"}, lambda j: j.data.source == "synthetic:7"),
        ({"data.random_flip": True}, lambda j: j.data.random_flip is True),
        ({"data.resolution": 8}, lambda j: j.data.resolution == 8),
        ({"ladder.allow": []}, lambda j: j.ladder.allow == ()),
        ({"ladder.allow": list(RUNG_NAMES)}, lambda j: j.ladder.allow == RUNG_NAMES),
        ({"ladder.allow": ["lora", "allocator"]}, lambda j: j.ladder.allow == ("lora", "allocator")),
        ({"ladder.max_attempts": 1, "ladder.crash_retries": 0}, lambda j: (j.ladder.max_attempts, j.ladder.crash_retries) == (1, 0)),
        ({"model.dropout": 0}, lambda j: j.model["dropout"] == 0.0 and isinstance(j.model["dropout"], float)),
        ({"model.dropout": 0.5, "model.act_fn": "gelu"}, lambda j: j.model.kwargs()["act_fn"] == "gelu"),
        ({"model.in_channels": 1, "model.out_channels": 1}, lambda j: j.model["in_channels"] == 1),
        ({"model.time_embedding_type": "fourier", "model.flip_sin_to_cos": False}, lambda j: j.model["time_embedding_type"] == "fourier"),
        ({"model.center_input_sample": True, "model.freq_shift": -1}, lambda j: j.model["freq_shift"] == -1),
        ({"model.downsample_padding": 0, "model.mid_block_scale_factor": 1}, lambda j: j.model["mid_block_scale_factor"] == 1.0),
        ({"model.norm_eps": 1e-6, "model.attention_head_dim": 8}, lambda j: j.model["attention_head_dim"] == 8),
        ({"model.norm_num_groups": _DELETE, "model.block_out_channels": [64, 128]}, lambda j: "norm_num_groups" not in j.model),
        ({
            "data.resolution": 8,
            "model.block_out_channels": [8, 8, 8, 8],
            "model.down_block_types": ["DownBlock2D", "ResnetDownsampleBlock2D", "SkipDownBlock2D", "AttnSkipDownBlock2D"],
            "model.up_block_types": ["AttnSkipUpBlock2D", "SkipUpBlock2D", "ResnetUpsampleBlock2D", "UpBlock2D"],
        }, lambda j: j.model.downsample_factor == 8),
    ],
)
def test_valid_variations(changes: dict[str, Any], check):
    job = parse(with_changes(changes))
    assert check(job)
    assert JobSpec.parse(json.loads(json.dumps(job.to_dict()))) == job


def test_dotted_keys_and_inline_tables_are_fine():
    text = (
        'name = "dotted"\ntrainer = "unconditional"\n'
        'data = { source = "synthetic:4", resolution = 16 }\n'
        'model.block_out_channels = [16]\nmodel.down_block_types = ["DownBlock2D"]\n'
        'model.up_block_types = ["UpBlock2D"]\nmodel.norm_num_groups = 4\n'
        "train.batch_size = 2\ntrain.max_steps = 3\ntrain.learning_rate = 0.001\n"
    )
    job = parse_job_text(text, "dotted.toml")
    assert job.data.resolution == 16 and job.model.block_out_channels == (16,)


def test_bom_is_accepted(tmp_path: Path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + to_toml(base_doc()).encode())
    assert load_job_file(path).name == "unit"


# ----------------------------------------------------------------------------- image folders and paths


def job_with_source(source: str, **extra: Any) -> dict[str, Any]:
    return with_changes({"data.source": source, **extra})


def test_image_folder_relative_to_job_file(tmp_path: Path):
    write_png(tmp_path / "images" / "a.png")
    job_file = tmp_path / "job.toml"
    job_file.write_text(to_toml(job_with_source("images")))
    job = load_job_file(job_file)
    assert job.data.source == str((tmp_path / "images").resolve())
    assert Path(job.data.source).is_absolute()
    assert not job.data.is_synthetic and job.data.synthetic_count is None
    assert job.source_path == str(job_file.resolve())


def test_image_folder_relative_does_not_depend_on_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    write_png(tmp_path / "jobs" / "imgs" / "x.png")
    (tmp_path / "elsewhere").mkdir()
    job_file = tmp_path / "jobs" / "job.toml"
    job_file.write_text(to_toml(job_with_source("./imgs")))
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert load_job_file(job_file).data.source == str((tmp_path / "jobs" / "imgs").resolve())
    # a relative job-file path is resolved against the cwd first
    monkeypatch.chdir(tmp_path)
    job = load_job_file(Path("jobs/job.toml"))
    assert job.data.source == str((tmp_path / "jobs" / "imgs").resolve())
    assert job.source_path == str(job_file.resolve())


def test_image_folder_dotdot_is_normalised(tmp_path: Path):
    write_png(tmp_path / "shared" / "a.png")
    (tmp_path / "jobs").mkdir()
    job_file = tmp_path / "jobs" / "job.toml"
    job_file.write_text(to_toml(job_with_source("../shared")))
    assert load_job_file(job_file).data.source == str((tmp_path / "shared").resolve())


def test_image_folder_absolute(tmp_path: Path):
    write_png(tmp_path / "abs" / "a.png")
    job = parse(job_with_source(str(tmp_path / "abs")), path="/somewhere/else/job.toml")
    assert job.data.source == str((tmp_path / "abs").resolve())


def test_parse_job_text_base_dir(tmp_path: Path):
    write_png(tmp_path / "base" / "images" / "a.png")
    text = to_toml(job_with_source("images"))
    job = parse_job_text(text, "spool/0001.toml", base_dir=tmp_path / "base")
    assert job.data.source == str((tmp_path / "base" / "images").resolve())
    assert job.source_path == "spool/0001.toml"
    # default base_dir: the folder of path
    job = parse_job_text(text, tmp_path / "base" / "job.toml")
    assert job.data.source == str((tmp_path / "base" / "images").resolve())
    err = error_of(text, path=str(tmp_path / "job.toml"))
    assert err.key == "data.source" and "does not exist" in err.problem


@pytest.mark.parametrize(
    "relative",
    ["deep/nested/dir/a.png", "b.JPG", "c.jpeg", "d.webp", "e.bmp", "f.Png"],
)
def test_image_folder_finds_images_recursively_any_case(tmp_path: Path, relative: str):
    folder = tmp_path / "imgs"
    (folder / "notes").mkdir(parents=True)
    (folder / "notes" / "readme.txt").write_text("not an image")
    target = folder / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(png_bytes())
    job = parse(job_with_source(str(folder)))
    assert job.data.source == str(folder.resolve())


def test_png_writer_makes_a_real_png(tmp_path: Path):
    image_module = pytest.importorskip("PIL.Image")
    path = write_png(tmp_path / "x.png")
    with image_module.open(path) as img:
        img.load()
        assert img.size == (2, 2) and img.mode == "RGB"


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        (lambda root: None, "folder {folder} does not exist (expected an image folder or synthetic:N)"),
        (lambda root: root.mkdir(), "no image files (.png, .jpg, .jpeg, .webp, .bmp) in folder {folder}"),
        (
            lambda root: (root.mkdir(), (root / "a.txt").write_text("x"), (root / "png").mkdir()),
            "no image files (.png, .jpg, .jpeg, .webp, .bmp) in folder {folder}",
        ),
        (lambda root: root.write_bytes(png_bytes()), "{folder} is not a folder (expected an image folder or synthetic:N)"),
    ],
    ids=["missing", "empty", "no_images", "is_a_file"],
)
def test_image_folder_problems(tmp_path: Path, setup, expected: str):
    folder = tmp_path / "imgs"
    setup(folder)
    job_file = tmp_path / "job.toml"
    job_file.write_text(to_toml(job_with_source("imgs")))
    with pytest.raises(JobFileError) as info:
        load_job_file(job_file)
    assert info.value.key == "data.source"
    assert info.value.problem == expected.format(folder=folder.resolve())
    assert str(info.value) == f"{job_file}: data.source: {info.value.problem}"


def test_workdir_relative_and_absolute(tmp_path: Path):
    job_file = tmp_path / "job.toml"
    job_file.write_text(to_toml(with_changes({"workdir": "runs/unit"})))
    job = load_job_file(job_file)
    assert job.workdir == str((tmp_path / "runs" / "unit").resolve())
    assert not (tmp_path / "runs").exists()  # not created by parsing
    job = parse(with_changes({"workdir": str(tmp_path / "w")}))
    assert job.workdir == str((tmp_path / "w").resolve())


# ----------------------------------------------------------------------------- unreadable files


def test_missing_file(tmp_path: Path):
    path = tmp_path / "nope.toml"
    with pytest.raises(JobFileError) as info:
        load_job_file(path)
    assert str(info.value) == f"{path}: job file not found"
    assert info.value.key is None


def test_directory(tmp_path: Path):
    with pytest.raises(JobFileError) as info:
        load_job_file(tmp_path)
    assert str(info.value) == f"{tmp_path}: is a directory, not a job file"


def test_not_utf8(tmp_path: Path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'# ok\nname = "caf\xe9"\n')
    with pytest.raises(JobFileError) as info:
        load_job_file(path)
    assert str(info.value).startswith(f"{path}: not valid UTF-8 text (byte 0xe9 on line 2)")


@pytest.mark.parametrize("content", [b"", b"\n\n  \t\n", b"# only a comment\n"], ids=["zero_bytes", "blank", "comment"])
def test_empty_file(tmp_path: Path, content: bytes):
    path = tmp_path / "empty.toml"
    path.write_bytes(content)
    with pytest.raises(JobFileError) as info:
        load_job_file(path)
    assert str(info.value).startswith(f"{path}: empty job file")


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ('name = "x"\ntrainer "unconditional"\n', "(at line 2, column 9)"),
        ("name = 'x'\nname = 'y'\n", ""),
        ("[data\n", "(at line 1"),
        ('name = "unterminated\n', "(at line 1"),
    ],
)
def test_toml_syntax_errors(text: str, where: str):
    err = error_of(text, path="bad.toml")
    assert err.key is None
    assert str(err).startswith("bad.toml: not valid TOML: ")
    assert where in str(err)
    assert "\n" not in str(err)


# ----------------------------------------------------------------------------- the error type


def test_job_file_error_shape():
    err = JobFileError("job.toml", "train.batch_size", "expected an integer >= 1, found 0")
    assert isinstance(err, ValueError)
    assert str(err) == "job.toml: train.batch_size: expected an integer >= 1, found 0"
    assert (err.path, err.key, err.problem) == ("job.toml", "train.batch_size", "expected an integer >= 1, found 0")
    whole = JobFileError(Path("dir/job.toml"), None, "empty job file")
    assert str(whole) == "dir/job.toml: empty job file"
    assert whole.path == "dir/job.toml"


def test_job_file_error_pickles():
    err = error_of(with_changes({"train.batch_size": 0}))
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is JobFileError
    assert (back.path, back.key, back.problem) == (err.path, err.key, err.problem)
    assert str(back) == str(err)


# ----------------------------------------------------------------------------- dict round trips


def rich_job(tmp_path: Path) -> JobSpec:
    write_png(tmp_path / "imgs" / "a.png")
    doc = with_changes(
        {
            "priority": 3,
            "workdir": "out",
            "data.source": "imgs",
            "data.random_flip": True,
            "model.dropout": 0.1,
            "model.act_fn": "mish",
            "train.micro_batch": 4,
            "train.checkpoint_every_seconds": 90.5,
            "train.mixed_precision": "fp16",
            "train.weight_decay": 0.01,
            "ladder.allow": ["offload", "allocator", "precision"],
            "ladder.max_attempts": 5,
        }
    )
    path = tmp_path / "rich.toml"
    path.write_text(to_toml(doc))
    return load_job_file(path)


def test_rich_job_round_trips(tmp_path: Path):
    job = rich_job(tmp_path)
    d = job.to_dict()
    assert d["train"]["micro_batch"] == 4 and d["workdir"] == str((tmp_path / "out").resolve())
    assert d["ladder"]["allow"] == ["offload", "allocator", "precision"]
    assert JobSpec.parse(d) == job
    assert JobSpec.parse(json.loads(json.dumps(d))) == job
    assert job.initial_plan() == Plan(batch_size=16, micro_batch=4, mixed_precision="fp16")


def test_to_dict_is_json_ready_and_independent(tmp_path: Path):
    job = rich_job(tmp_path)
    d = job.to_dict()
    assert json.loads(json.dumps(d)) == d
    d["model"]["block_out_channels"].append(7)
    d["ladder"]["allow"].clear()
    assert job.model.block_out_channels == (32, 64)
    assert job.ladder.allow == ("offload", "allocator", "precision")


def test_from_dict_does_not_touch_the_file_system(tmp_path: Path):
    job = rich_job(tmp_path)
    d = job.to_dict()
    for p in (tmp_path / "imgs").iterdir():
        p.unlink()
    (tmp_path / "imgs").rmdir()
    assert JobSpec.parse(d) == job


@pytest.mark.parametrize(
    ("mutate", "key"),
    [
        (lambda d: d["train"].__setitem__("batch_size", 0), "train.batch_size"),
        (lambda d: d.pop("name"), "name"),
        (lambda d: d["ladder"]["allow"].append("nope"), "ladder.allow"),
        (lambda d: d.__setitem__("extra", 1), "extra"),
        (lambda d: d.__setitem__("source_path", 5), "source_path"),
    ],
)
def test_from_dict_validates(mutate, key: str):
    d = load_job_file(QUICKSTART).to_dict()
    mutate(d)
    with pytest.raises(JobFileError) as info:
        JobSpec.parse(d)
    assert info.value.key == key


def test_from_dict_accepts_a_parsed_toml_dict_and_fills_defaults():
    job = JobSpec.parse(base_doc())
    assert job == parse(base_doc()).replace(source_path=None)
    assert job.ladder == LadderSpec()


COMMAND_JOB = (
    'name = "script"\ntrainer = "command"\npriority = 3\n[command]\nargv = ["python3", "train.py", "--bs={micro_batch}"]\n'
    'cwd = "/srv/scripts"\nenv = { HF_HUB_OFFLINE = "1" }\nprocesses = 2\n[command.when]\ngradient_checkpointing = ["--gc"]\n'
    '[train]\nbatch_size = 8\nmax_steps = 30\nmicro_batch = 2\n[notify]\nurls = ["json://h/x"]\n[resources]\nmemory = "1GiB"\n'
)


def stored_specs(tmp_path: Path) -> list[JobSpec]:
    """Jobs of every kind as intake makes them: the quickstart, one with every table set,
    and a command job (whose stored [train] leaves out the keys its script owns)."""
    command = parse_job_text(COMMAND_JOB, "script.toml", check_files=False)
    assert command.train.learning_rate is None and "learning_rate" not in command.to_dict()["train"]
    return [load_job_file(QUICKSTART), rich_job(tmp_path), command]


def test_load_rebuilds_a_stored_spec_as_it_was(tmp_path: Path):
    for job in stored_specs(tmp_path):
        stored = json.loads(json.dumps(job.to_dict()))
        assert JobSpec.load(stored) == job == JobSpec.parse(stored)
        assert JobSpec.load(job.to_dict()).to_dict() == job.to_dict()


def test_load_neither_validates_again_nor_looks_at_the_file_system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    job = rich_job(tmp_path)
    for p in (tmp_path / "imgs").iterdir():
        p.unlink()
    (tmp_path / "imgs").rmdir()

    def no_validation(*args: Any) -> JobSpec:
        raise AssertionError("a stored spec was validated again")

    from oomguard.jobs.spec import job as job_module

    monkeypatch.setattr(job_module, "parse_job", no_validation)
    monkeypatch.setattr(Path, "exists", lambda self: pytest.fail(f"looked at {self}"))
    assert JobSpec.load(job.to_dict()) == job
    # Accepted under the rules of its day, a stored job still loads if the rules tighten.
    stored = job.to_dict()
    stored["train"]["batch_size"] = 10**6
    assert JobSpec.load(stored).train.batch_size == 10**6


def test_load_ignores_keys_it_does_not_know():
    stored = load_job_file(QUICKSTART).to_dict()
    stored["train"]["from_a_newer_version"] = 1
    stored["data"]["also_newer"] = True
    assert JobSpec.load(stored) == load_job_file(QUICKSTART)


@pytest.mark.parametrize("part", ["data", "model", "train", "ladder"])
def test_part_round_trips(part: str):
    job = load_job_file(QUICKSTART)
    value = getattr(job, part)
    assert type(value).from_dict(json.loads(json.dumps(value.to_dict()))) == value


def test_part_from_dict_validates():
    with pytest.raises(JobFileError, match="train.batch_size: required key is missing"):
        TrainSpec.from_dict({"max_steps": 1, "learning_rate": 1.0})
    with pytest.raises(JobFileError, match="ladder.allow: unknown rung 'x'"):
        LadderSpec.from_dict({"allow": ["x"]})
    with pytest.raises(JobFileError, match="model.up_block_types: required key is missing"):
        ModelSpec.from_dict({"block_out_channels": [8], "down_block_types": ["DownBlock2D"]})
    with pytest.raises(JobFileError, match="data.resolution: expected an integer >= 8"):
        DataSpec.from_dict({"source": "synthetic:2", "resolution": 2})


# ----------------------------------------------------------------------------- frozen types


def test_specs_are_frozen_and_hashable():
    job = load_job_file(QUICKSTART)
    for obj, attr in [(job, "name"), (job.data, "resolution"), (job.train, "batch_size"), (job.ladder, "allow"), (job.model, "items")]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, attr, None)
    assert hash(job) == hash(load_job_file(QUICKSTART))


def test_model_kwargs_is_a_fresh_dict():
    model = load_job_file(QUICKSTART).model
    kw = model.kwargs()
    kw["block_out_channels"].append(128)
    kw["dropout"] = 0.5
    assert model.kwargs()["block_out_channels"] == [32, 64]
    assert "dropout" not in model.kwargs()
    assert model.get("dropout") is None and model.get("norm_num_groups") == 8
    with pytest.raises(KeyError):
        model["dropout"]


def test_model_spec_from_mapping():
    kw = {"block_out_channels": [8, 16], "down_block_types": ["DownBlock2D"] * 2, "up_block_types": ["UpBlock2D"] * 2}
    model = ModelSpec(kw)
    assert model.items[2] == ("block_out_channels", (8, 16))
    assert model.kwargs() == {"in_channels": 3, "out_channels": 3, **kw}
    assert list(model.kwargs()) == ["in_channels", "out_channels", *kw]
    assert ModelSpec(tuple(reversed(model.items))) == model
    assert model.downsample_factor == 2


def test_direct_construction_normalises():
    train = TrainSpec(batch_size=4, max_steps=100, learning_rate=1)
    assert train.checkpoint_every_steps == 10 and isinstance(train.learning_rate, float)
    ladder = LadderSpec(allow=["allocator"])
    assert ladder.allow == ("allocator",)
    job = JobSpec(
        name="direct",
        trainer="unconditional",
        data=DataSpec("synthetic:2", 8),
        model=ModelSpec(
            {"block_out_channels": [8], "down_block_types": ["DownBlock2D"], "up_block_types": ["UpBlock2D"], "norm_num_groups": 4}
        ),
        train=train,
    )
    assert JobSpec.parse(job.to_dict()) == job
    assert job.initial_plan() == Plan.initial(4)


# ----------------------------------------------------------------------------- import cost


def test_module_exports():
    for name in spec_module.__all__:
        assert hasattr(spec_module, name), name


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"resources.gpus": 0}, "resources.gpus: expected an integer in 1..64, found 0"),
        ({"resources.memory": "lots"}, "resources.memory: not a memory size: 'lots'"),
        ({"resources.share": "yes"}, "resources.share: expected true or false"),
        ({"resources.disk": "lots"}, "resources.disk: not a memory size: 'lots'"),
        ({"resources.disk": 4096}, 'resources.disk: expected at least 1MiB (room for a checkpoint), found 4096 bytes; write it as a size such as "20GiB"'),
        ({"resources.disk": [1]}, 'resources.disk: expected a size such as "20GiB", found a list ([1])'),
        ({"notify.events": ["done"]}, "notify.events: unknown notification event 'done' (expected one of: failed, finished, escalated, stalled, waiting_for_disk, creep)"),
        ({"notify.tags": "lab"}, "notify.tags: expected a list of non-empty strings, found a string (\"lab\")"),
    ],
)
def test_bad_resources_and_notify(changes: dict[str, Any], expected: str) -> None:
    assert expected in str(error_of(with_changes(changes)))


@pytest.mark.parametrize("urls", ["tgram://123:TOKEN/9", ["json://u:TOKEN@host/x", 3], ["no scheme TOKEN"]])
def test_a_bad_notification_url_is_never_echoed(urls: Any) -> None:
    message = str(error_of(with_changes({"notify.urls": urls})))
    assert message.startswith("job.toml: notify.urls: ") and "TOKEN" not in message


def test_resources_and_notify_round_trip() -> None:
    spec = parse_job_text(
        to_toml(with_changes({"resources.gpus": 2, "resources.share": True, "resources.memory": "20GiB", "notify.urls": ["json://h/x"], "notify.events": ["failed"]})),
        "job.toml", base_dir=Path.cwd(),
    )
    assert (spec.resources.gpus, spec.resources.share, spec.resources.memory) == (2, True, 20 * 2**30)
    assert spec.notify.urls == ("json://h/x",) and spec.notify.events == ("failed",)
    assert JobSpec.parse(json.loads(json.dumps(spec.to_dict()))) == spec


def test_retention_and_the_disk_budget_round_trip() -> None:
    spec = parse_job_text(
        to_toml(with_changes({"train.checkpoint_every_steps": 5, "train.keep_every_steps": 20, "resources.disk": "20GiB"})), "job.toml", base_dir=Path.cwd(),
    )
    assert (spec.train.keep_every_steps, spec.resources.disk) == (20, 20 * 2**30)
    assert JobSpec.parse(json.loads(json.dumps(spec.to_dict()))) == spec
    loaded = JobSpec.load(json.loads(json.dumps(spec.to_dict())))  # as the daemon reads it back from its store
    assert (loaded.train.keep_every_steps, loaded.resources.disk) == (20, 20 * 2**30)
    plain = parse_job_text(to_toml(base_doc()), "job.toml", base_dir=Path.cwd())
    assert (plain.train.keep_every_steps, plain.resources.disk) == (None, None)


@pytest.mark.parametrize(
    ("added", "expected"),
    [
        ("[train]\nkeep_every_steps = 10\n", "train.keep_every_steps: a command job's script has its own; remove it here (pass it in [command] argv)"),
        ('[resources]\ndisk = "20GiB"\n', "resources.disk: a command job's script writes and prunes its own checkpoints, which oomguard cannot keep within a budget: remove it"),
    ],
)
def test_a_command_job_has_neither_retention_nor_a_disk_budget(tmp_path: Path, added: str, expected: str) -> None:
    text = 'name = "x"\ntrainer = "command"\n[command]\nargv = ["python3", "-c", "pass"]\n' + (
        "[train]\nbatch_size = 4\nmax_steps = 30\n" + added.removeprefix("[train]\n") if added.startswith("[train]") else "[train]\nbatch_size = 4\nmax_steps = 30\n" + added
    )
    with pytest.raises(JobFileError) as raised:
        parse_job_text(text, tmp_path / "x.toml", check_files=False)
    assert str(raised.value).endswith(expected)


def test_an_unknown_key_in_a_command_job_lists_only_the_keys_a_command_job_may_use(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('name = "x"\ntrainer = "command"\nfoo = 1\n[command]\nargv = ["python3", "-c", "pass"]\n[train]\nbatch_size = 4\nmax_steps = 3\n')
    with pytest.raises(JobFileError) as top:
        load_job_file(job)
    assert "foo: unknown key (expected one of: command, ladder, name, notify, priority, resources, train, trainer, workdir)" in str(top.value)
    job.write_text('name = "x"\ntrainer = "command"\n[command]\nargv = ["python3", "-c", "pass"]\n[train]\nbatch_size = 4\nmax_steps = 3\nlearnin_rate = 1\n')
    with pytest.raises(JobFileError) as train:
        load_job_file(job)
    assert str(train.value).endswith("train.learnin_rate: unknown key (expected one of: batch_size, max_steps, micro_batch, mixed_precision)")
    job.write_text('name = "x"\ntrainer = "command"\n[command]\nargv = ["python3", "-c", "pass"]\n[train]\nbatch_size = 4\nmax_steps = 3\nseed = 1\n')
    with pytest.raises(JobFileError, match="train.seed: a command job's script has its own; remove it here"):
        load_job_file(job)


def test_a_tilde_in_a_job_file_is_the_home_of_the_jobs_owner_not_of_whoever_parses(tmp_path):
    """The daemon (root) parses other users' job files: bob's "~/runs" is bob's, not /root/runs."""
    text = 'name = "x"\ntrainer = "command"\nworkdir = "~/runs"\n[command]\nargv = ["python3", "-c", "pass"]\ncwd = "~"\n[train]\nbatch_size = 4\nmax_steps = 3\n'
    spec = parse_job_text(text, tmp_path / "x.toml", check_files=False, home="/home/ogtest-bob")
    assert spec.workdir == "/home/ogtest-bob/runs" and spec.command.cwd == "/home/ogtest-bob"
    assert parse_job_text(text, tmp_path / "x.toml", check_files=False).workdir == str(Path("~/runs").expanduser())
