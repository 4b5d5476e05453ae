"""What a module imports, seen from a fresh interpreter (the test process has torch loaded
already): the daemon's side must stay free of torch, diffusers and matplotlib, which take
seconds to load and are not what a supervisor or a job-file check needs (the daemon and CLI
themselves: tests/integration/test_cli.py). The job contract (jobs/spec/) is also read as
syntax trees: none of its modules names the doctor, the planner, the memory model or a
training library in an import that runs when it loads."""

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
        (
            "import oomguard.jobs.spec",
            ("torch", "diffusers", "accelerate", "oomguard.strategies.doctor", "oomguard.strategies.planner", "oomguard.strategies.memory_model"),
        ),
    ],
    ids=["report", "spec"],
)
def test_a_daemon_side_module_loads_no_heavy_library(code: str, heavy: tuple[str, ...]) -> None:
    assert modules_loaded_by(code, heavy) == []


@pytest.mark.parametrize(
    ("path", "check"),
    [
        ("strategies/units.py", "module.parse_size('48MiB') == 48 * 2**20"),
        ("jobs/sizes.py", "module.CapSchedule.parse('48MiB').limit_at(0) == 48 * 2**20"),
    ],
    ids=["units", "sizes"],
)
def test_the_sizes_modules_alone_do_not_import_torch(path: str, check: str) -> None:
    # The file itself, so that whatever its package's __init__ imports does not matter (jobs/sizes.py
    # imports strategies/units.py, which must be torch-free too).
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('sizes_alone', {str(ROOT / path)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules[spec.name] = module\n"
        "spec.loader.exec_module(module)\n"
        f"assert {check}\n"
    )
    assert modules_loaded_by(code, ("torch",)) == []


# What the job contract (jobs/spec/) may not import at all: the doctor and what only it needs
# (the contract builds a Policy, strategies/policy.py, and nothing more of the ladder's
# decisions), and the training libraries, which the daemon must not pay for.
SPEC_MAY_NOT_IMPORT = (
    "oomguard.strategies.doctor",
    "oomguard.strategies.planner",
    "oomguard.strategies.memory_model",
    "torch",
    "diffusers",
    "accelerate",
)


def imported_names(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) for every import at module level, ``if`` blocks and ``try`` included
    (a function's own imports run only when it is called)."""
    found = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
            # `from oomguard.strategies import doctor` names the module as an imported name.
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, (ast.If, ast.Try)):
            todo += [*node.body, *node.orelse, *getattr(node, "finalbody", []), *(s for h in getattr(node, "handlers", []) for s in h.body)]
    return found


def test_the_job_contract_imports_neither_the_doctor_nor_a_training_library() -> None:
    modules = sorted((ROOT / "jobs" / "spec").glob("*.py"))
    assert modules, "jobs/spec/ has no modules"
    problems = [
        f"{path.relative_to(ROOT)}:{line}: imports {name}"
        for path in modules
        for line, name in imported_names(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        if any(name == banned or name.startswith(banned + ".") for banned in SPEC_MAY_NOT_IMPORT)
    ]
    assert problems == []


def test_the_import_check_sees_a_banned_import() -> None:
    tree = ast.parse("import sys\nif sys:\n    from oomguard.strategies import doctor\ntry:\n    import torch.nn\nexcept ImportError:\n    pass\n")
    names = [name for _, name in imported_names(tree)]
    assert "oomguard.strategies.doctor" in names and "torch.nn" in names
