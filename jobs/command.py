"""Command jobs: any training script, unchanged, with the plan's knobs as its arguments.

A job file with ``trainer = "command"`` gives an argv list (never a shell string) in which
placeholders stand for the plan's knobs, and arguments to add only when a knob is on::

    [command]
    argv = ["accelerate", "launch", "train_unconditional.py",
            "--train_batch_size={micro_batch}", "--gradient_accumulation_steps={grad_accum}",
            "--mixed_precision={mixed_precision}", "--output_dir={workdir}/out",
            "--resume_from_checkpoint=latest"]
    cwd = "."                                # default: the job's workdir
    env = { HF_HUB_OFFLINE = "1" }
    processes = 1                            # training processes it starts ({processes})
    [command.when]
    gradient_checkpointing = ["--gradient_checkpointing"]
    optimizer_8bit = ["--use_8bit_adam"]

Each placeholder is replaced inside its own argument, which stays one argument whatever the
value (nothing is split, quoted or given to a shell). A knob the script does not expose is not
a rung for the job (:func:`exposed_rungs`). No torch here: the CLI validates job files with it.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard.strategies import rungs
from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs.base import Placeholder

# Put first on a command job's PYTHONPATH when its device memory is emulated (script_memory.py).
BOOTSTRAP_DIR = Path(__file__).parent / "bootstrap"
# The attempt as the bootstrap's step reports need it, JSON (jobs/bootstrap/oomguard_progress.py).
ATTEMPT_ENV = "OOMGUARD_ATTEMPT"

# The placeholders of the job itself; the rungs' own come from their modules (CommandSide).
_JOB_PLACEHOLDERS = (
    Placeholder("batch_size", "the effective batch (micro_batch x grad_accum x processes)", listed=2),
    Placeholder("processes", "the training processes the command starts ([command] processes)", listed=3),
    Placeholder("workdir", "the job's work directory", listed=7),
    Placeholder("attempt", "the attempt number, from 1", listed=8),
)


def placeholders() -> dict[str, str]:
    """What a placeholder may name, with what it becomes for a plan, in the order messages
    and the README list them."""
    every = [*_JOB_PLACEHOLDERS, *(p for r in rungs.ladder() if r.command is not None for p in r.command.placeholders)]
    return {p.name: p.help for p in sorted(every, key=lambda p: p.listed)}


def when_keys() -> dict[str, str]:
    """The [command.when] keys (the knob that adds the arguments) with when they are on, in
    the order messages and the README list them."""
    every = [r.command.when for r in rungs.ladder() if r.command is not None and r.command.when is not None]
    return {w.key: w.help for w in sorted(every, key=lambda w: w.listed)}


def __getattr__(name: str) -> dict[str, str]:
    # PLACEHOLDERS and WHEN_KNOBS, the names these tables were imported by, computed from the
    # ladder as it is now (a test may register a rung).
    if name == "PLACEHOLDERS":
        return placeholders()
    if name == "WHEN_KNOBS":
        return when_keys()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class CommandError(ValueError):
    """A [command] table that cannot be run; str() says what and how to fix it. ``where`` is
    the key in [command] it concerns: "argv", "when.KNOB" or "env.NAME"."""

    def __init__(self, message: str, where: str = "argv") -> None:
        super().__init__(message)
        self.where = where


@dataclass(frozen=True)
class CommandSpec:
    argv: tuple[str, ...]
    cwd: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    when: tuple[tuple[str, tuple[str, ...]], ...] = field(default_factory=tuple)
    # How many training processes the command starts (accelerate launch --num_processes,
    # torchrun --nproc_per_node): the plan's batch is split over them.
    processes: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "argv": list(self.argv), "cwd": self.cwd, "env": dict(self.env), "when": {k: list(v) for k, v in self.when},
            "processes": self.processes,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CommandSpec:
        return cls(
            argv=tuple(data["argv"]),
            cwd=data.get("cwd"),
            env=tuple(sorted((data.get("env") or {}).items())),
            when=tuple(sorted((k, tuple(v)) for k, v in (data.get("when") or {}).items())),
            processes=int(data.get("processes", 1)),
        )

    def templates(self) -> list[tuple[str, str]]:
        """Every template with the key it stands under: ("argv", ...), ("when.KNOB", ...), ("env.NAME", ...)."""
        return [
            *(("argv", argument) for argument in self.argv),
            *((f"when.{knob}", argument) for knob, arguments in self.when for argument in arguments),
            *((f"env.{name}", value) for name, value in self.env),
        ]

    def placeholders(self) -> set[str]:
        names: set[str] = set()
        for where, argument in self.templates():
            names |= placeholders_in(argument, where)
        return names


def placeholders_in(argument: str, where: str = "argv") -> set[str]:
    """The placeholder names in one argument; CommandError for a malformed one."""
    try:
        return {name for _, name, _, _ in string.Formatter().parse(argument) if name is not None}
    except ValueError as error:
        named = "the value" if where.startswith("env.") else f"argument {_quoted(argument, where)}"
        raise CommandError(f"{named} is not a valid template ({error}); write {{{{ and }}}} for literal braces", where) from None


def _quoted(argument: str, where: str) -> str:
    """An argument as an error quotes it; never a [command.env] value, which may be a secret
    (HF_TOKEN): errors reach the daemon's log."""
    return "the value" if where.startswith("env.") else repr(argument)


def check(command: CommandSpec) -> None:
    """Every placeholder known and bare, every [command.when] key known. The error says where
    (``where``): an unknown placeholder in [command.env] used to be reported as command.argv."""
    known_placeholders, known_keys = placeholders(), when_keys()
    for where, argument in command.templates():
        for name in sorted(placeholders_in(argument, where)):
            if name not in known_placeholders or not re.fullmatch(r"[a-z_]+", name):
                known = ", ".join(f"{{{n}}}" for n in known_placeholders)
                raise CommandError(f"unknown placeholder {{{name}}} (known: {known})", where)
        # A conversion or format spec passed str.format here and took effect at every attempt's
        # start: "{micro_batch:>99999999}" built a 100 MB argument (execve refuses it: E2BIG),
        # "{lora_rank:d}" raised ValueError (the values are strings), "{workdir!r}" quoted the path.
        for _, name, spec, conversion in string.Formatter().parse(argument):
            if name is not None and (spec or conversion):
                written = f"{{{name}{'!' + conversion if conversion else ''}{':' + spec if spec else ''}}}"
                raise CommandError(
                    f"placeholder {written} in {_quoted(argument, where)} has a conversion or format spec; write just {{{name}}} "
                    f"(oomguard puts the value in as it is)",
                    where,
                )
    for knob, _ in command.when:
        if knob not in known_keys:
            raise CommandError(f"unknown [command.when] knob {knob!r} (known: {', '.join(known_keys)})", f"when.{knob}")


def argument_with(command: CommandSpec, placeholder: str) -> str | None:
    """The first argument (or ``NAME=value`` of [command.env]) that carries ``{placeholder}``,
    as the job file writes it; None when none does."""
    for where, argument in command.templates():
        if placeholder in placeholders_in(argument, where):
            return f"{where[4:]}={argument}" if where.startswith("env.") else argument
    return None


def batch_argument(command: CommandSpec) -> str | None:
    """The argument that passes the plan's micro-batch on to the script (the batch rung's
    first placeholder), as the job file writes it: the doctor watches that the script honours
    it. None when the command passes none."""
    for r in rungs.ladder():
        if r.role == "batch" and r.command is not None and r.command.placeholders:
            return argument_with(command, r.command.placeholders[0].name)
    return None


def exposed_rungs(command: CommandSpec) -> tuple[str, ...]:
    """The rungs this command can take (ladder order): those whose knobs it passes on to the
    script. A rung without a command side is never a command job's."""
    names = command.placeholders()
    when = {knob for knob, _ in command.when}
    exposed = []
    for r in rungs.ladder():
        if r.command is None:
            continue
        if all(any(_has(option, names, when) for option in need.split("|")) for need in r.command.needs):
            exposed.append(r.name)
    return tuple(exposed)


def _has(need: str, names: set[str], when: set[str]) -> bool:
    if need.startswith("when:"):
        return need[5:] in when
    return need.strip("{}") in names


def knob_is_on(plan: Plan, knob: str) -> bool:
    """Whether the rung of the [command.when] key ``knob`` is on under ``plan``."""
    for r in rungs.ladder():
        if r.command is not None and r.command.when is not None and r.command.when.key == knob:
            return r.is_on(plan)
    raise KeyError(knob)


def values(plan: Plan, workdir: Path, attempt: int) -> dict[str, str]:
    known = {"batch_size": str(plan.batch_size), "processes": str(plan.world_size), "workdir": str(workdir), "attempt": str(attempt)}
    for r in rungs.ladder():
        if r.command is not None:
            known.update(r.command.values(plan))
    return known


def render(command: CommandSpec, plan: Plan, workdir: Path, attempt: int) -> tuple[list[str], dict[str, str]]:
    """The argv and the extra environment for one attempt under ``plan``."""
    known = values(plan, workdir, attempt)
    argv = [argument.format_map(known) for argument in command.argv]
    for knob, arguments in command.when:
        if knob_is_on(plan, knob):
            argv.extend(argument.format_map(known) for argument in arguments)
    env = {name: value.format_map(known) for name, value in command.env}
    return argv, env


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


# The progress lines of diffusers' example scripts: tqdm's "Steps:  45%|####5     | 9/20 [...]"
# (train_text_to_image_lora.py, DreamBooth, scripts that print "Steps: 9/20"), and the
# "step=9" of the logs train_unconditional.py puts after its "Epoch 3" bar.
_STEPS = re.compile(r"Steps:[^\n\r]*?(\d+)/\d+|\bstep=(\d+)")


def last_step_count(log_text: str) -> int | None:
    """The optimizer step a script's log last reported, when it reports one."""
    found = _STEPS.findall(log_text)
    if not found:
        return None
    bar, logged = found[-1]
    return int(bar or logged)
