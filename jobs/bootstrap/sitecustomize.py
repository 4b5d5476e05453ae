"""Loaded at start by every Python process of a command job: oomguard puts this folder first
on PYTHONPATH. With an emulated capacity set (OOMGUARD_EMULATE_DEVICE_MEMORY, or an emulated
GPU), the script's tensors count against it from its first ``import torch``
(oomguard.jobs.script_memory). Then the sitecustomize this one hides, if any, runs as before."""

import os
import sys


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


if os.environ.get("OOMGUARD_EMULATE_DEVICE_MEMORY") or os.environ.get("OOMGUARD_EMULATED_GPUS"):
    from oomguard.jobs.script_memory import install_when_torch_loads

    install_when_torch_loads()
_run_the_hidden_sitecustomize()
