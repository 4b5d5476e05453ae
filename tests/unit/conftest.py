"""The unit layer starts no process: every test here runs in this one, with fakes for the
launcher and the clock (tests/fakes.py). This guard turns any attempt to start one into a
failure that names the test, instead of a slow or flaky test."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

# matplotlib builds its font cache the first time it is imported in a fresh environment (a new
# venv, CI), asking fontconfig's fc-list in a process: done here, before the guard, so that the
# report tests draw with the cache as they would on any later run.
import matplotlib.font_manager  # noqa: F401, E402


class ProcessStarted(AssertionError):
    """A unit test tried to start a process."""


@pytest.fixture(autouse=True)
def no_processes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ProcessStarted(f"a unit test may not start a process (args: {args!r:.200}); use tests/fakes.py, or move it to tests/integration")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse)
    yield
