"""A rung's name appears in product code only in its own module (strategies/rungs/<name>.py).

The check reads the code's syntax trees rather than grepping it: a string constant that equals a
rung name is what ties code to a rung; docstrings, comments, identifiers (Plan fields such as
``plan.micro_batch``) and longer messages are not. The command this replaces, for people:

    grep -rnwE '"(allocator|micro_batch|checkpointing|attention|offload|precision|optimizer_8bit|lora|base_quantization)"' \\
        daemon jobs strategies
"""

from __future__ import annotations

import ast
from pathlib import Path

from oomguard.strategies import rungs

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("daemon", "jobs", "strategies")

# (file, name): why that string is not the rung. Each entry is a word that happens to be
# spelled like a rung and means something else.
ALLOWED: dict[tuple[str, str], str] = {
    # The job file's `[train] micro_batch` key (the micro-batch a job starts with), parsed and
    # reported under that key; the rung is strategies/rungs/micro_batch.py.
    ("jobs/spec/keys.py", "micro_batch"): "the job-file key train.micro_batch",
    ("jobs/spec/common.py", "micro_batch"): "the job-file key train.micro_batch",
    ("jobs/spec/command.py", "micro_batch"): "the job-file key train.micro_batch (checked against [command] processes)",
    # A text-to-image job's `model.method = "lora"`: the job trains adapters from its first
    # step, and saves them; the rung (strategies/rungs/lora.py) turns a full fine-tune into one.
    ("jobs/spec/text_to_image.py", "lora"): 'the job-file value model.method = "lora"',
}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def offenders(root: Path, names: tuple[str, ...]) -> list[str]:
    """``file:line: 'name'`` for every string constant in product code under ``root`` that
    spells a rung's name outside that rung's module and the allowlist."""
    found = []
    for folder in PRODUCT:
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=relative)
            docstrings = _docstrings(tree)
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docstrings:
                    continue
                name = node.value
                if name not in names or relative == f"strategies/rungs/{name}.py" or (relative, name) in ALLOWED:
                    continue
                found.append(f"{relative}:{node.lineno}: {name!r}")
    return found


def test_rung_names_are_spelled_only_in_their_own_modules():
    problems = offenders(ROOT, rungs.names())
    assert not problems, "rung names outside their modules (read the registry instead):\n" + "\n".join(problems)


def test_every_rung_has_its_own_module():
    for name in rungs.names():
        assert (ROOT / "strategies" / "rungs" / f"{name}.py").is_file(), name


def test_the_allowlist_holds_only_what_is_still_there():
    # An entry whose string has gone must go too, or it would hide a new use.
    for relative, name in ALLOWED:
        tree = ast.parse((ROOT / relative).read_text(encoding="utf-8"))
        assert any(isinstance(n, ast.Constant) and n.value == name for n in ast.walk(tree)), (relative, name)
