"""The command job kind (``trainer = "command"``): any training script, unchanged, with the
plan's knobs as its arguments. Here the [command] table is read and checked, into a
:class:`CommandSpec`; what the script gets for one attempt is jobs/command.py (render).

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

A knob the script does not expose is not a rung for the job (:func:`exposed_rungs`). What is
looked at on the file system (its folder, program and script) is command_paths.py.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from oomguard.jobs.spec.common import TrainSpec
from oomguard.jobs.spec.keys import placeholders, when_keys
from oomguard.jobs.spec.reader import ReadContext, Section, describe_value, render_value, resolve_path
from oomguard.strategies import rungs
from oomguard.strategies.errors import CommandError


@dataclass(frozen=True)
class CommandSpec:
    """A checked [command] table: the argv and [command.when] arguments as templates (their
    placeholders filled in for each attempt: jobs/command.py render), the folder, the extra
    environment and the number of training processes."""

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


def parse_command(ctx: ReadContext, s: Section) -> CommandSpec:
    """[command], checked without looking at the file system (that is command_paths.py):
    argv, cwd, env, when and processes, then every placeholder and knob known (:func:`check`)."""
    argv = _argv(s)
    cwd = s.str("cwd", default=None)
    if cwd is not None:
        cwd = str(resolve_path(ctx, cwd, s.key("cwd")))
    elif ctx.submit_dir is not None:
        cwd = str(ctx.submit_dir)
    env_section = s.table("env", required=False)
    env = _env(env_section) if env_section is not None else {}
    when_section = s.table("when", required=False)
    when = _when(when_section) if when_section is not None else {}
    processes = s.int("processes", minimum=1, maximum=1024, default=1)
    command = CommandSpec(argv=tuple(argv), cwd=cwd, env=tuple(sorted(env.items())), when=tuple(sorted(when.items())), processes=processes)
    try:
        check(command)
    except CommandError as error:
        raise s.fail(error.where, str(error)) from None
    return command


def _argv(s: Section) -> list[str]:
    argv = s.get("argv", None)
    if argv is None:
        raise s.fail("argv", 'required key is missing (the command as a list of arguments, e.g. ["python", "train.py", "--train_batch_size={micro_batch}"])')
    if isinstance(argv, str):
        raise s.fail(
            "argv",
            f"expected a list of arguments, found a string: oomguard never runs a shell; write it as a list, e.g. {json.dumps(argv.split()[:3])}",
        )
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and a for a in argv):
        raise s.fail("argv", f"expected a non-empty list of non-empty strings, found {describe_value(argv)}")
    # execve() cannot pass a NUL: such an argument used to be accepted here and fail at every
    # attempt's start (ValueError: embedded null byte) instead of at submit time.
    for number, argument in enumerate(argv, 1):
        if "\x00" in argument:
            raise s.fail("argv", f"argument {number} ({render_value(argument)}) contains a NUL character (\\u0000), which no program can receive; remove it")
    return argv


def _env(section: Section) -> dict[str, str]:
    """[command.env]: any variable name, each value a string."""
    env: dict[str, str] = {}
    for name, value in section.raw.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(name)):
            raise section.fail(str(name), "not an environment variable name (letters, digits and _, not starting with a digit)")
        if not isinstance(value, str):
            # Its type only, never the value: it may be a secret, and errors reach the daemon's log.
            raise section.fail(str(name), f"expected a string, found {describe_value(value).partition(' (')[0]}")
        if "\x00" in value:
            raise section.fail(str(name), "contains a NUL character (\\u0000), which no environment variable can hold; remove it")
        env[str(name)] = value
    return env


def _when(section: Section) -> dict[str, tuple[str, ...]]:
    """[command.when]: the arguments each knob adds (one string is a list of one); the knobs
    themselves are checked against the ladder with the placeholders (:func:`check`)."""
    when: dict[str, tuple[str, ...]] = {}
    for knob in section.raw:
        arguments = section.raw[knob]
        if isinstance(arguments, str):
            arguments = [arguments]
        if not isinstance(arguments, list) or not all(isinstance(a, str) and a for a in arguments):
            raise section.fail(knob, f"expected a list of arguments, found {describe_value(arguments)}")
        if any("\x00" in a for a in arguments):
            raise section.fail(knob, "an argument contains a NUL character (\\u0000), which no program can receive; remove it")
        when[knob] = tuple(arguments)
    return when


def check_command_batch(s: Section, train: TrainSpec, processes: int) -> None:
    """A command's script runs micro_batch x grad_accum samples on each of its processes per
    optimizer step: train.batch_size splits evenly over the processes, and a first
    micro-batch divides each process's share."""
    if train.batch_size % processes:
        raise s.fail(
            "batch_size",
            f"{train.batch_size} cannot be split evenly over [command] processes = {processes}; "
            f"make it a multiple of {processes} (the batch of all processes together)",
        )
    per_process = train.batch_size // processes
    if train.micro_batch is not None and (train.micro_batch > per_process or per_process % train.micro_batch):
        divisors = [size for size in range(1, per_process + 1) if per_process % size == 0]
        raise s.fail(
            "micro_batch",
            f"expected a divisor of {per_process} (train.batch_size / [command] processes: the script runs micro_batch x "
            f"grad_accum samples), one of {', '.join(map(str, divisors[:12]))}{' ...' if len(divisors) > 12 else ''}; found {train.micro_batch}",
        )

