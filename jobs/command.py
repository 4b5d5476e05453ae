"""Command jobs at launch time: what the script gets for one attempt under its plan.

The [command] table itself (argv templates, placeholders, [command.when] knobs) is read and
checked at intake into a CommandSpec (jobs/spec/command.py). Here each placeholder is replaced
inside its own argument, which stays one argument whatever the value (nothing is split,
quoted or given to a shell); and a script's log is read for the step it reached. No torch
here: the daemon renders the argv of every attempt it starts.
"""

from __future__ import annotations

import re
from pathlib import Path

from oomguard.jobs.spec import CommandSpec
from oomguard.strategies import rungs
from oomguard.strategies.plan import Plan

# Put first on a command job's PYTHONPATH when its device memory is emulated (script_memory.py).
BOOTSTRAP_DIR = Path(__file__).parent / "bootstrap"
# The attempt as the bootstrap's step reports need it, JSON (jobs/bootstrap/oomguard_progress.py).
ATTEMPT_ENV = "OOMGUARD_ATTEMPT"


def knob_is_on(plan: Plan, knob: str) -> bool:
    """Whether the rung of the [command.when] key ``knob`` is on under ``plan``."""
    for r in rungs.ladder():
        if r.command is not None and r.command.when is not None and r.command.when.key == knob:
            return r.is_on(plan)
    raise KeyError(knob)


def values(plan: Plan, workdir: Path, attempt: int, gpus: int | None = None) -> dict[str, str]:
    """What each placeholder (jobs/spec/keys.py placeholders) becomes for one attempt placed on
    ``gpus`` GPUs (None: none placed; then as many as the plan has processes)."""
    known = {
        "batch_size": str(plan.batch_size), "processes": str(plan.world_size), "gpus": str(gpus if gpus else plan.world_size),
        "workdir": str(workdir), "attempt": str(attempt),
    }
    for r in rungs.ladder():
        if r.command is not None:
            known.update(r.command.values(plan))
    return known


def render(command: CommandSpec, plan: Plan, workdir: Path, attempt: int, gpus: int | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and the extra environment for one attempt under ``plan`` on ``gpus`` GPUs."""
    known = values(plan, workdir, attempt, gpus)
    argv = [argument.format_map(known) for argument in command.argv]
    for knob, arguments in command.when:
        if knob_is_on(plan, knob):
            argv.extend(argument.format_map(known) for argument in arguments)
    env = {name: value.format_map(known) for name, value in command.env}
    return argv, env


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
