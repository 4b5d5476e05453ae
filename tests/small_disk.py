"""A size-limited file system for the full-disk tests: a tmpfs mounted on a test's folder (root
only; skipped with the reason where mounting is not allowed, e.g. a container without
CAP_SYS_ADMIN), and a ballast file that leaves a chosen number of bytes free on it."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

KiB = 1024
MiB = 1024 * KiB
BALLAST = "ballast"


@contextmanager
def small_disk(folder: Path, size: int) -> Iterator[Path]:
    """``folder`` as a tmpfs of ``size`` bytes, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("a size-limited disk is a tmpfs mount, which needs root (CI runs these tests as root)")
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size // KiB}k,mode=0755", "tmpfs", str(folder)], capture_output=True, text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs on {folder} ({mounted.stderr.strip() or mounted.returncode}): a container without CAP_SYS_ADMIN?")
    try:
        yield folder
    finally:
        # Lazily: a runner the test could not stop must not leave the mount behind.
        subprocess.run(["umount", "--lazy", str(folder)], capture_output=True)


def free(folder: Path) -> int:
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


def fill(folder: Path, leave: int) -> Path:
    """A ballast file in ``folder`` that leaves about ``leave`` bytes free (to a page)."""
    ballast = folder / BALLAST
    size = free(folder) - leave
    assert size > 0, f"{folder} has only {free(folder)} bytes free, fewer than the {leave} to leave"
    chunk = b"\0" * MiB
    with ballast.open("wb") as f:
        while size > 0:
            size -= f.write(chunk[: min(size, len(chunk))])
    return ballast
