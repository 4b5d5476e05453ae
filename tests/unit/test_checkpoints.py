import hashlib
import json
import os

import pytest

from oomguard.jobs import checkpoints
from oomguard.jobs.checkpoints import MANIFEST, Checkpoint
from oomguard.strategies.errors import CheckpointError

PLAN = {"batch_size": 8, "micro_batch": 4, "grad_accum": 2}


def state_writer(step, extra=b""):
    """A write_state callback: a few small files whose bytes depend on the step."""

    def write_state(directory):
        (directory / "model.safetensors").write_bytes(bytes([step % 256]) * 300 + extra)
        (directory / "optimizer.bin").write_bytes(f"optimizer at {step}".encode() * 10)
        (directory / "random_states_0.pkl").write_bytes(b"")
        (directory / "sub").mkdir()
        (directory / "sub" / "scheduler.json").write_text(json.dumps({"step": step}))

    return write_state


def save(root, step, keep=10, **kwargs):
    return checkpoints.save(root, step, PLAN, state_writer(step, **kwargs), keep)


def names(root):
    return sorted(p.name for p in root.iterdir())


@pytest.fixture
def root(tmp_path):
    return tmp_path / "checkpoints"


@pytest.fixture
def warnings():
    """Collects what latest_valid warns about."""
    return []


# Saving -----------------------------------------------------------------------------------


def test_save_writes_a_directory_with_a_manifest(root):
    checkpoint = save(root, 120)
    assert checkpoint == Checkpoint(path=root / "step-000120", step=120, plan=PLAN)
    assert names(root) == ["step-000120"]
    manifest = json.loads((checkpoint.path / MANIFEST).read_text())
    assert manifest["step"] == 120
    assert manifest["plan"] == PLAN
    assert isinstance(manifest["created_at"], float)
    assert set(manifest["files"]) == {"model.safetensors", "optimizer.bin", "random_states_0.pkl", os.path.join("sub", "scheduler.json")}
    for name, entry in manifest["files"].items():
        data = (checkpoint.path / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert manifest["files"]["random_states_0.pkl"]["sha256"] == hashlib.sha256(b"").hexdigest()


@pytest.mark.parametrize(("step", "name"), [(0, "step-000000"), (7, "step-000007"), (123456, "step-123456"), (1234567, "step-1234567")])
def test_directory_name(step, name):
    assert checkpoints.directory_name(step) == name


def test_verify_accepts_what_save_wrote(root):
    checkpoint = save(root, 3)
    assert checkpoints.verify(checkpoint.path) == checkpoint


def test_the_write_state_callback_gets_a_fresh_temporary_directory(root):
    seen = []

    def write_state(directory):
        seen.append((directory, sorted(directory.iterdir())))
        (directory / "x").write_text("x")

    checkpoints.save(root, 1, PLAN, write_state, keep=2)
    directory, contents = seen[0]
    assert directory.parent == root
    assert directory.name.startswith(".tmp-step-000001-")
    assert contents == []
    assert not directory.exists()


def test_a_failing_write_state_leaves_the_previous_checkpoints_alone(root, warnings):
    save(root, 1)

    def write_state(directory):
        (directory / "half").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        checkpoints.save(root, 2, PLAN, write_state, keep=1)
    assert checkpoints.latest_valid(root, warn=warnings.append).step == 1
    assert warnings == []


def test_saving_the_same_step_again_replaces_it(root):
    save(root, 5, extra=b"first")
    second = save(root, 5, extra=b"second run")
    assert names(root) == ["step-000005"]
    assert (second.path / "model.safetensors").read_bytes().endswith(b"second run")
    assert checkpoints.verify(second.path) == second


def test_saving_the_same_step_again_replaces_files_the_new_one_does_not_have(root):
    def first(directory):
        (directory / "stale.bin").write_text("from the first write")

    def second(directory):
        (directory / "fresh.bin").write_text("from the second write")

    checkpoints.save(root, 5, PLAN, first, keep=2)
    checkpoint = checkpoints.save(root, 5, PLAN, second, keep=2)
    assert sorted(p.name for p in checkpoint.path.iterdir()) == ["fresh.bin", MANIFEST]


# Pruning ----------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [1, 2, 3, 10])
def test_save_keeps_the_newest(root, keep):
    for step in (10, 20, 30, 40, 50):
        save(root, step, keep=keep)
    expected = [checkpoints.directory_name(s) for s in (10, 20, 30, 40, 50)][-keep:]
    assert names(root) == expected


@pytest.mark.parametrize(("keep", "left"), [(0, []), (1, [9]), (2, [8, 9]), (5, [1, 2, 8, 9]), (100, [1, 2, 8, 9])])
def test_prune(root, keep, left):
    for step in (1, 2, 8, 9):
        save(root, step)
    checkpoints.prune(root, keep)
    assert names(root) == [checkpoints.directory_name(s) for s in left]


def test_prune_removes_leftovers_of_other_processes_only(root):
    save(root, 1)
    own = root / f".tmp-step-000002-{os.getpid()}"
    other = root / ".tmp-step-000002-999999999"
    older = root / ".tmp-step-000001-12"
    for leftover in (own, other, older):
        leftover.mkdir()
        (leftover / "model.safetensors").write_bytes(b"half written")
    checkpoints.prune(root, keep=3)
    assert names(root) == [own.name, "step-000001"]


def test_save_removes_leftovers_of_an_interrupted_write(root):
    leftover = root / ".tmp-step-000002-424242"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half")
    save(root, 2)
    assert names(root) == ["step-000002"]


def test_prune_leaves_other_files_alone(root):
    save(root, 1)
    (root / "notes.txt").write_text("mine")
    (root / "stepping-stone").mkdir()
    checkpoints.prune(root, keep=1)
    assert names(root) == ["notes.txt", "step-000001", "stepping-stone"]


def test_prune_of_a_missing_directory_is_harmless(tmp_path):
    checkpoints.prune(tmp_path / "nothing", keep=2)


def test_steps_past_a_million_are_ordered_by_number(root, warnings):
    for step in (999_998, 999_999, 1_000_000, 1_000_001):
        save(root, step, keep=2)
    assert names(root) == ["step-1000000", "step-1000001"]
    assert checkpoints.latest_valid(root, warn=warnings.append).step == 1_000_001


def test_saving_behind_a_damaged_newer_checkpoint_keeps_the_new_one(root, warnings):
    """A run that fell back past a damaged checkpoint keeps what it saves after that."""
    save(root, 10, keep=1)
    damaged = save(root, 20, keep=1)
    (damaged.path / "optimizer.bin").write_bytes(b"torn")
    resumed = checkpoints.latest_valid(root, warn=warnings.append)
    assert resumed is None  # keep=1: the only one is damaged
    save(root, 15, keep=1)
    assert checkpoints.latest_valid(root, warn=warnings.append).step == 15


# Loading: the newest that verifies ----------------------------------------------------------


def truncate(path):
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:100])


def flip_byte(path):
    file = path / "optimizer.bin"
    data = bytearray(file.read_bytes())
    data[5] ^= 0x01
    file.write_bytes(bytes(data))


def remove_file(path):
    (path / "sub" / "scheduler.json").unlink()


def remove_manifest(path):
    (path / MANIFEST).unlink()


def bad_json(path):
    (path / MANIFEST).write_text('{"step": 2, "files": {')


def empty_manifest(path):
    (path / MANIFEST).write_bytes(b"")


def manifest_not_utf8(path):
    data = bytearray((path / MANIFEST).read_bytes())
    data[0] = 0xFF
    (path / MANIFEST).write_bytes(bytes(data))


def manifest_wrong_shape(text):
    def damage(path):
        (path / MANIFEST).write_text(text)

    damage.__name__ = f"manifest {text}"
    return damage


DAMAGE = [
    (truncate, "model.safetensors has 100 bytes, the manifest says 305"),
    (flip_byte, "optimizer.bin does not match its sha256"),
    (remove_file, "scheduler.json is missing"),
    (remove_manifest, f"no {MANIFEST}"),
    (bad_json, "is not valid JSON"),
    (empty_manifest, "is not valid JSON"),
    (manifest_not_utf8, MANIFEST),
    (manifest_wrong_shape("{}"), MANIFEST),
    (manifest_wrong_shape("[]"), MANIFEST),
    (manifest_wrong_shape("null"), MANIFEST),
    (manifest_wrong_shape('{"step": "two", "plan": {}, "files": {}}'), MANIFEST),
    (manifest_wrong_shape('{"step": 2, "plan": {}, "files": {"model.safetensors": 3}}'), MANIFEST),
]


@pytest.mark.parametrize(("damage", "reason"), DAMAGE, ids=lambda v: getattr(v, "__name__", None))
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(root, warnings, damage, reason):
    save(root, 1)
    newest = save(root, 2, extra=b"abcde")
    damage(newest.path)
    found = checkpoints.latest_valid(root, warn=warnings.append)
    assert found is not None and found.step == 1
    assert len(warnings) == 1
    assert warnings[0].startswith("skipping damaged checkpoint: ")
    assert "step-000002" in warnings[0]
    assert reason in warnings[0]
    with pytest.raises(CheckpointError):
        checkpoints.verify(newest.path)


def test_every_damaged_one_is_reported(root, warnings):
    for step in (1, 2, 3):
        save(root, step)
    truncate(root / "step-000003")
    remove_manifest(root / "step-000002")
    assert checkpoints.latest_valid(root, warn=warnings.append).step == 1
    assert ["step-000003" in warnings[0], "step-000002" in warnings[1]] == [True, True]


def test_nothing_valid_is_none(root, warnings):
    for step in (1, 2):
        save(root, step)
        flip_byte(root / checkpoints.directory_name(step))
    assert checkpoints.latest_valid(root, warn=warnings.append) is None
    assert len(warnings) == 2


@pytest.mark.parametrize("make", [lambda root: None, lambda root: root.mkdir()], ids=["missing", "empty"])
def test_no_checkpoints_is_none_without_warnings(root, warnings, make):
    make(root)
    assert checkpoints.latest_valid(root, warn=warnings.append) is None
    assert warnings == []


def test_leftovers_and_other_entries_are_not_checkpoints(root, warnings):
    save(root, 1)
    (root / ".tmp-step-000009-1").mkdir()
    (root / "step-000010").write_text("a file, not a directory")
    (root / "step-latest").mkdir()
    (root / "step-²").mkdir()
    found = checkpoints.latest_valid(root, warn=warnings.append)
    assert found.step == 1
    assert warnings == []


def test_latest_valid_warns_on_stderr_by_default(root, capsys):
    save(root, 1)
    save(root, 2)
    remove_manifest(root / "step-000002")
    assert checkpoints.latest_valid(root).step == 1
    assert "skipping damaged checkpoint" in capsys.readouterr().err
