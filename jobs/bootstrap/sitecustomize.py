"""Loaded at start by every Python process of a command job: oomguard puts this folder first
on PYTHONPATH. It runs in the user's own interpreter, so it needs nothing but the standard
library unless device memory is emulated (tests, where the script runs on oomguard's Python).

- A process that dies of an out-of-memory error, or a rank of a multi-process job that dies
  of any error, says so for the shim to bring the attempt's other processes down
  (oomguard_ranks.py).
- With an emulated capacity set (OOMGUARD_EMULATE_DEVICE_MEMORY, or an emulated GPU), the
  script's tensors count against it from its first ``import torch``
  (oomguard.jobs.script_memory).
- Each optimizer step moves an emulated cap schedule on (a schedule follows the script's
  optimizer steps); under oomguard (an attempt directory set) it is also reported to the
  daemon (oomguard_progress.py), and what accelerate restores from a checkpoint is corrected for the
  relaunch's split (oomguard_accelerate.py); library warnings that say nothing to act on are
  kept out of the job log (oomguard_noise.py); SIGUSR1 before a cluster's time limit makes an
  accelerate script checkpoint and stop (oomguard_time_limit.py).
- Then the sitecustomize this one hides, if any, runs as before."""

import os
import sys

import oomguard_accelerate
import oomguard_noise
import oomguard_progress
import oomguard_ranks
import oomguard_time_limit


def _run_the_hidden_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for folder in sys.path:
        if os.path.abspath(folder or ".") == here:
            continue
        candidate = os.path.join(folder or ".", "sitecustomize.py")
        if os.path.isfile(candidate):
            with open(candidate, encoding="utf-8") as source:
                exec(compile(source.read(), candidate, "exec"), {"__name__": "sitecustomize", "__file__": candidate})
            return


def _emulate_device_memory() -> None:
    """Count the script's tensors against the emulated capacity, or end the process: Python
    reports an exception raised here ("Error in sitecustomize") and runs the script on, which
    would then never run out of memory and look as if it fit."""
    try:
        from oomguard.jobs.script_memory import install_when_torch_loads

        install_when_torch_loads()
    except Exception as error:
        sys.stderr.write(
            f"RuntimeError: oomguard could not apply the emulated device memory: {type(error).__name__}: {error} "
            f"(emulation needs the script to run on a Python with oomguard installed; this one is {sys.executable})\n"
        )
        sys.stderr.flush()
        os._exit(70)  # jobs/script_memory.py EXIT_NOT_APPLIED


oomguard_ranks.install()
EMULATED = bool(os.environ.get("OOMGUARD_EMULATE_DEVICE_MEMORY") or os.environ.get("OOMGUARD_EMULATED_GPUS"))
UNDER_OOMGUARD = bool(os.environ.get(oomguard_ranks.ATTEMPT_DIR_ENV))
if EMULATED:
    _emulate_device_memory()
if EMULATED or UNDER_OOMGUARD:
    # The optimizer-step hook moves an emulated cap schedule on (a script run by hand too),
    # and under oomguard reports each step.
    oomguard_progress.install()
if UNDER_OOMGUARD:
    oomguard_noise.quiet_optional_kernel_warnings()
    oomguard_accelerate.install()
    oomguard_time_limit.install()
_run_the_hidden_sitecustomize()
