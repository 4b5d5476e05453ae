"""What a module imports, seen from a fresh interpreter (the test process has torch loaded
already): the daemon's side must stay free of torch, diffusers and matplotlib, which take
seconds to load and are not what a supervisor or a job-file check needs (the daemon and CLI
themselves: tests/integration/test_cli.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def modules_loaded_by(code: str, heavy: tuple[str, ...]) -> list[str]:
    check = f"{code}\nimport sys\nprint(sorted(m for m in {heavy!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return ast.literal_eval(result.stdout.strip())


@pytest.mark.parametrize(
    ("code", "heavy"),
    [
        ("import oomguard.daemon.report", ("matplotlib", "torch")),
        ("import oomguard.jobs.spec", ("torch", "diffusers", "accelerate")),
    ],
    ids=["report", "spec"],
)
def test_a_daemon_side_module_loads_no_heavy_library(code: str, heavy: tuple[str, ...]) -> None:
    assert modules_loaded_by(code, heavy) == []


def test_the_sizes_module_alone_does_not_import_torch() -> None:
    # The file itself, so that whatever the package __init__ imports does not matter.
    path = ROOT / "jobs" / "sizes.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('sizes_alone', {str(path)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules[spec.name] = module\n"
        "spec.loader.exec_module(module)\n"
        "assert module.parse_size('48MiB') == 48 * 2**20\n"
    )
    assert modules_loaded_by(code, ("torch",)) == []
