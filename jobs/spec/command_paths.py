"""What a command job's [command] table names on the file system, looked at when the job
file is submitted: the folder it runs in, its program, and the training script its argv runs
(found by reading the argv as its interpreter or launcher would: :func:`script_argument`).

Who looks, and as whom: daemon/spool.py _may_look_at_paths_for.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from oomguard.jobs.spec.command import CommandSpec
from oomguard.jobs.spec.reader import ReadContext, Section, did_you_mean, render_value
from oomguard.jobs.spec.unconditional import DATA_SCAN_ENTRIES


def check_command_paths(ctx: ReadContext, s: Section, command: CommandSpec, workdir: str | None) -> None:
    """The command can start: its folder ([command] cwd) is one, and the program and the script
    it names are there. Relative paths are taken from the folder the command runs in: [command]
    cwd, else the job's workdir. Who checks, and as whom: daemon/spool.py _may_look_at_paths_for."""
    if command.cwd is not None:
        problem = _guarded(lambda: _folder_problem(Path(command.cwd)), "folder", command.cwd)  # type: ignore[arg-type]
        if problem:
            raise s.fail("cwd", problem)
    runs_in = _RunsIn(ctx.base_dir, command.cwd, workdir)
    program, script = command.argv[0], script_argument(command.argv)
    problem = _guarded(lambda: _program_problem(program, runs_in), "program", program)
    if problem is None and script is not None and "{" not in script:  # a placeholder is known only when an attempt starts
        problem = _guarded(lambda: _script_problem(script, runs_in), "script", script)
    if problem:
        raise s.fail("argv", problem)


def _guarded(look: Callable[[], str | None], what: str, path: str) -> str | None:
    """``look()``, with a path the file system refuses to look at (too long, a folder the
    user may not search) as the problem itself."""
    try:
        return look()
    except OSError as e:
        fix = "; the job runs as you: give a path you can reach, or ask its owner to let you in" if e.errno == errno.EACCES else ""
        return f"cannot look at {what} {render_value(path)}: {e.strerror or e}{fix}"


def _folder_problem(folder: Path) -> str | None:
    fix = "set cwd to the folder your script runs in (its relative paths start there), or create it"
    if not folder.exists():
        return f"folder {folder} does not exist; {fix}"
    if not folder.is_dir():
        return f"{folder} is not a folder; {fix}"
    return None


@dataclass(frozen=True)
class _RunsIn:
    """The folder a command runs in, where the relative paths in its argv start: [command] cwd,
    else the job's workdir; with neither, a workdir the daemon makes, empty, when it queues the job."""

    job_file_folder: Path
    cwd: str | None
    workdir: str | None

    @property
    def folder(self) -> Path | None:
        return Path(self.cwd or self.workdir) if (self.cwd or self.workdir) else None

    @property
    def named(self) -> str:
        return f"[command] cwd, {self.cwd}" if self.cwd else f"the job's workdir, {self.workdir}"

    def path(self, written: str) -> Path | None:
        """Where ``written`` points; None for a relative path with no folder to start from."""
        if Path(written).is_absolute():
            return Path(written)
        return self.folder / written if self.folder is not None else None

    def unplaced(self, what: str, written: str) -> str:
        """Why a relative ``written`` cannot be found, and the cwd that would place it."""
        fix = (f'set [command] cwd = "{self.job_file_folder}" (where {written} is)' if (self.job_file_folder / written).exists()
               else "set [command] cwd to the folder that holds it")
        return f"{what} {written} is a relative path, but without [command] cwd the command runs in the job's workdir, an empty folder: {fix}, or give its full path"


def _program_problem(program: str, runs_in: _RunsIn) -> str | None:
    """Why ``program`` cannot be started (checked when the job file is submitted), or None."""
    if "{" in program:
        return f"the program itself ({program!r}) cannot be a placeholder"
    if "/" in program:
        path = runs_in.path(program)
        if path is None:
            return runs_in.unplaced("program", program)
        if not path.is_file():
            return f"program {program} not found ({path} does not exist)"
        if not os.access(path, os.X_OK):
            return f"program {path} is not executable (chmod +x it, or start it with its interpreter, e.g. [\"python\", \"{program}\"])"
        return None
    if shutil.which(program) is None:
        return f"program {program!r} not found on PATH; give its full path, or install it"
    return None


def _script_problem(script: str, runs_in: _RunsIn) -> str | None:
    """Why the script the command runs (:func:`script_argument`) is not there, or None."""
    path = runs_in.path(script)
    if path is None:
        return runs_in.unplaced("script", script)
    if path.is_dir():
        return f"script {script} is a folder, not a script file ({path}); name the script in argv"
    if path.exists():
        return None
    relative = "" if Path(script).is_absolute() else f" (relative to {runs_in.named})"
    return f"script {script} not found: {path} does not exist{relative}{did_you_mean(path.name, _python_files(path.parent))}; fix its path in argv"


def _python_files(folder: Path) -> list[str]:
    """The names of the scripts in ``folder``, for a did-you-mean; none when it cannot be listed.
    Bounded like a data folder's look (DATA_SCAN_ENTRIES): a huge folder gets no suggestion."""
    names: list[str] = []
    try:
        with os.scandir(folder) as entries:
            for seen, entry in enumerate(entries):
                if seen >= DATA_SCAN_ENTRIES:
                    return []
                if entry.name.endswith(".py") and not entry.name.startswith("."):
                    names.append(entry.name)
    except OSError:
        return []
    return names


# Programs that run a Python script named among their arguments: an interpreter (python,
# python3, python3.11, by any path), and the launchers in front of a training script.
_PYTHON = re.compile(r"python(?:\d+(?:\.\d+)*)?")
_LAUNCHERS = ("torchrun", "deepspeed")
_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch")
# The interpreter's options that take the next argument as their value.
_PYTHON_VALUE_OPTIONS = ("-W", "-X", "--check-hash-based-pycs")


def script_argument(argv: Sequence[str]) -> str | None:
    """The training script ``argv`` runs, as written: the first argument ending in .py after a
    Python interpreter or a launcher (``accelerate launch``, ``torchrun``, ``deepspeed``,
    ``python -m torch.distributed.run``), options skipped. None when it names none that way:
    ``python -c``, a module (``python -m pkg``, ``torchrun -m pkg``) or a program of its own."""
    program, arguments = Path(argv[0]).name, list(argv[1:])
    if _PYTHON.fullmatch(program):
        return _script_after_interpreter(arguments)
    if program == "accelerate" and arguments[:1] == ["launch"]:
        return _script_after_launcher(arguments[1:])
    if program in _LAUNCHERS:
        return _script_after_launcher(arguments)
    return None


def _script_after_interpreter(arguments: list[str]) -> str | None:
    """Python runs its first argument that is not one of its own options."""
    index = 0
    while index < len(arguments):
        argument = arguments[index]
        if argument in ("-m", "-c"):
            module = arguments[index + 1] if argument == "-m" and index + 1 < len(arguments) else None
            return _script_after_launcher(arguments[index + 2:]) if module in _LAUNCHER_MODULES else None
        if argument in _PYTHON_VALUE_OPTIONS:
            index += 2
        elif argument.startswith("-"):
            index += 1
        else:
            return argument if argument.endswith(".py") else None
    return None


def _script_after_launcher(arguments: list[str]) -> str | None:
    """A launcher's options come first; their values are not scripts (a config file is .yaml or
    .json), so its first argument ending in .py is the script, unless it runs a module."""
    for argument in arguments:
        if argument in ("-m", "--module"):
            return None
        if argument.endswith(".py") and not argument.startswith("-"):
            return argument
    return None

