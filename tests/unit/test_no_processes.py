"""The unit layer's guard (tests/unit/conftest.py) refuses every way of starting a process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.unit.conftest import ProcessStarted


def test_popen_and_run_are_refused() -> None:
    with pytest.raises(ProcessStarted):
        subprocess.Popen([sys.executable, "-c", "pass"])
    with pytest.raises(ProcessStarted):
        subprocess.run([sys.executable, "-c", "pass"], check=False)


def test_fork_is_refused() -> None:
    with pytest.raises(ProcessStarted):
        os.fork()
