"""Checkpoints that survive a crash at any moment.

``WORKDIR/checkpoints/step-000120/`` holds the training state and a ``manifest.json`` with the
size and sha256 of every file. A checkpoint is written under a temporary name, fsynced and
renamed, so a directory named ``step-*`` is always complete; older ones are pruned only after
the new one verifies. Loading takes the newest checkpoint that verifies and says why it
skipped any damaged one.
"""

from __future__ import annotations
from oomguard.strategies.errors import CheckpointError

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
PREFIX = "step-"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    plan: dict[str, Any]


def directory_name(step: int) -> str:
    return f"{PREFIX}{step:06d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    _fsync_directory(root)


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    checkpoints_dir: Path, step: int, plan: dict[str, Any], write_state: Callable[[Path], None], keep: int, keep_every: int | None = None,
) -> Checkpoint:
    """Write a checkpoint for ``step``: ``write_state(directory)`` fills a fresh directory; then
    prune to the ``keep`` newest and those kept for good (``keep_every``: see prune)."""
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    temporary = checkpoints_dir / f".tmp-{directory_name(step)}-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        write_state(temporary)
        files = {
            str(p.relative_to(temporary)): {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(temporary.rglob("*"))
            if p.is_file()
        }
        manifest = {"step": step, "plan": plan, "created_at": time.time(), "files": files}
        (temporary / MANIFEST).write_text(json.dumps(manifest, indent=2))
        _fsync_tree(temporary)
    except BaseException:
        # A write that failed half-way (a full disk above all) leaves nothing behind: its
        # bytes are what the next try needs, and the verified checkpoints stay as they were.
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    final = checkpoints_dir / directory_name(step)
    if final.exists():
        # Same step written again (e.g. a retry that stopped where the last one did).
        shutil.rmtree(final)
    temporary.rename(final)
    _fsync_directory(checkpoints_dir)
    checkpoint = verify(final)
    # The new checkpoint is kept even when newer (damaged) ones outnumber ``keep``: a run that
    # fell back past a damaged checkpoint must not delete what it has just saved.
    prune(checkpoints_dir, keep, protect=final, keep_every=keep_every)
    return checkpoint


def verify(path: Path) -> Checkpoint:
    """The checkpoint at ``path`` if every file matches the manifest; CheckpointError if not."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {MANIFEST}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: {MANIFEST} is not valid JSON ({error})") from None
    try:
        # A damaged manifest may still parse: read every field before trusting any.
        step = int(manifest["step"])
        plan = manifest["plan"]
        files = {str(name): (int(entry["size"]), str(entry["sha256"])) for name, entry in manifest["files"].items()}
        if not isinstance(plan, dict):
            raise TypeError(f"plan is {type(plan).__name__}, not an object")
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"{path}: {MANIFEST} is not a checkpoint manifest ({type(error).__name__}: {error})") from None
    for name, (size, sha256) in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        if file.stat().st_size != size:
            raise CheckpointError(f"{path}: {name} has {file.stat().st_size} bytes, the manifest says {size}")
        if _sha256(file) != sha256:
            raise CheckpointError(f"{path}: {name} does not match its sha256 in the manifest")
    return Checkpoint(path=path, step=step, plan=plan)


def recorded_bytes(checkpoints_dir: Path, block: int = 4096) -> int | None:
    """The bytes the newest checkpoint takes on disk as its manifest records them (each file
    rounded up to ``block``, the manifest included): what the next one will need. None when no
    checkpoint has a manifest that reads. The manifest is not verified against the files: this
    is an estimate, read before every checkpoint, and verifying hashes every byte."""
    for path in candidates(checkpoints_dir):
        try:
            manifest_size = (path / MANIFEST).stat().st_size
            files = json.loads((path / MANIFEST).read_text())["files"]
            sizes = [int(entry["size"]) for entry in files.values()] + [manifest_size]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        return sum(-(-max(size, 1) // block) * block for size in sizes)
    return None


def folder_bytes(path: Path, block: int = 4096) -> int:
    """The bytes the files under ``path`` take (each rounded up to ``block``, as recorded_bytes
    counts a checkpoint): what a disk budget holds them to. Files that vanish while it counts
    (a prune) count nothing."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                size = os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
            total += -(-max(size, 1) // block) * block
    return total


def _step_of(path: Path) -> int | None:
    digits = path.name[len(PREFIX):]
    return int(digits) if path.name.startswith(PREFIX) and digits.isascii() and digits.isdigit() else None


def candidates(checkpoints_dir: Path) -> list[Path]:
    """Checkpoint directories, newest step first (by number: step-1000000 is newer than
    step-999999 although it sorts before it as text)."""
    if not checkpoints_dir.is_dir():
        return []
    found = [p for p in checkpoints_dir.iterdir() if p.is_dir() and _step_of(p) is not None]
    return sorted(found, key=lambda p: _step_of(p), reverse=True)  # type: ignore[arg-type, return-value]


def valid_newest_first(checkpoints_dir: Path, warn: Callable[[str], None] = lambda text: print(text, file=sys.stderr)) -> Iterator[Checkpoint]:
    """The checkpoints that verify, newest first; damaged ones are reported through ``warn``
    and skipped."""
    for path in candidates(checkpoints_dir):
        try:
            yield verify(path)
        except CheckpointError as error:
            warn(f"skipping damaged checkpoint: {error}")


def latest_valid(checkpoints_dir: Path, warn: Callable[[str], None] = lambda text: print(text, file=sys.stderr)) -> Checkpoint | None:
    """The newest checkpoint that verifies."""
    return next(valid_newest_first(checkpoints_dir, warn), None)


def kept_for_good(path: Path, keep_every: int | None) -> bool:
    """Whether the checkpoint at ``path`` is one the job keeps whatever comes after it (its step
    a multiple of train.keep_every_steps)."""
    step = _step_of(path)
    return keep_every is not None and step is not None and step > 0 and step % keep_every == 0


def prune(checkpoints_dir: Path, keep: int, protect: Path | None = None, keep_every: int | None = None) -> None:
    """Keep the ``keep`` newest checkpoints, ``protect`` and those kept for good (``keep_every``:
    a step that is a multiple of it, beyond the ``keep`` newest); remove leftovers of
    interrupted writes."""
    for path in candidates(checkpoints_dir)[keep:]:
        if path != protect and not kept_for_good(path, keep_every):
            shutil.rmtree(path)
    for leftover in checkpoints_dir.glob(".tmp-*"):
        pid = leftover.name.rsplit("-", 1)[-1]
        if pid != str(os.getpid()):
            shutil.rmtree(leftover, ignore_errors=True)
