"""SIGUSR1 before a cluster's time limit (Slurm's --signal, passed on by the shim) in a command
job's own script, which knows nothing of it.

At the first ``accelerator.backward`` of the optimizer step after the signal, the step before
it is complete: the script has stepped its learning-rate schedule, counted its global step and
saved its own checkpoint if one was due. There the Accelerator saves
``{project_dir}/checkpoint-{step}`` with ``save_state``, where diffusers' examples put theirs
(``ProjectConfiguration(project_dir=args.output_dir)``; their ``--resume_from_checkpoint
latest`` loads the newest), oomguard.json goes beside it (oomguard_accelerate.py), and the
process writes the attempt's outcome.json (kind "time_limit", for the daemon: a launcher
such as ``accelerate launch`` turns a child's exit code into its own 1) and ends with
EXIT_TIME_LIMIT. Nothing the script trained is lost.

Not acted on (the signal changes nothing, and the job is killed at its limit and goes on from
the script's own newest checkpoint): a script without an Accelerator or without a project
folder, and a job of several processes, whose ranks would have to agree on the step to stop at.

Loaded into the user's own interpreter: standard library only.
"""

import json
import os
import signal
import sys
import time

import oomguard_progress
from oomguard_imports import guarded
from oomguard_ranks import ATTEMPT_DIR_ENV

# strategies/outcome.py's EXIT_TIME_LIMIT (the bootstrap imports nothing of oomguard's).
EXIT_TIME_LIMIT = 76
OUTCOME = "outcome.json"


class _State:
    signalled_at = None  # time.monotonic() of the first SIGUSR1
    stepped_since = False  # an optimizer step ended after it


_STATE = _State()


def install():
    if os.environ.get("WORLD_SIZE", "1") != "1":
        return
    signal.signal(signal.SIGUSR1, _signalled)
    oomguard_progress.on_step(_stepped)


def _signalled(signum, frame):
    if _STATE.signalled_at is None:
        _STATE.signalled_at = time.monotonic()


def _stepped(step):
    if _STATE.signalled_at is not None:
        _STATE.stepped_since = True


def before_backward(accelerator):
    """Called by the Accelerator's backward (oomguard_accelerate.py) before it runs."""
    if _STATE.stepped_since:
        _stop(accelerator)


@guarded("checkpointing before the cluster's time limit")
def _stop(accelerator):
    _STATE.stepped_since = False  # once: if saving fails, the script trains on to its limit
    project = accelerator.project_dir
    if not project:
        _say("the cluster's time limit is near, but the Accelerator has no project_dir to checkpoint into; training on")
        return
    step = oomguard_progress.current_step()
    location = os.path.join(project, "checkpoint-{}".format(step))
    if not os.path.isdir(location):  # the script's own, when its interval fell on this step
        accelerator.save_state(location)
    waited = time.monotonic() - _STATE.signalled_at
    message = "the cluster's time limit is near (SIGUSR1): checkpointed at step {} in {}, {:.1f} s after the signal".format(step, location, waited)
    _say(message)
    _write_outcome({"kind": "time_limit", "step": step, "resumed_from": oomguard_progress.resumed_from(), "message": message})
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(EXIT_TIME_LIMIT)


def _write_outcome(outcome):
    attempt_dir = os.environ.get(ATTEMPT_DIR_ENV)
    if not attempt_dir:
        return
    temporary = os.path.join(attempt_dir, ".{}.tmp".format(OUTCOME))
    with open(temporary, "w") as out:
        json.dump(outcome, out)
    os.replace(temporary, os.path.join(attempt_dir, OUTCOME))


def _say(text):
    print("oomguard: " + text, file=sys.stderr, flush=True)
