"""Imported once, by the forkserver of tests/warm_runner.py only: what a runner imports before
it trains, in the order jobs/run.py imports it, so that every runner forked from the server
starts with it done. Never imported by the tests themselves: it sets diffusers' integration
flags and the thread count for the whole process."""

from __future__ import annotations

import os

# Read by torch as it loads: every runner forked from the server uses one thread (two test
# runners may share a small machine, and one thread keeps float reductions in the same order
# from run to run), as tests/jobs_helpers.py's runner_env() sets for a runner started by command.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

from oomguard.jobs import run  # noqa: E402
from oomguard.jobs.bootstrap.oomguard_noise import quiet_optional_kernel_warnings  # noqa: E402

quiet_optional_kernel_warnings()
run._without_unused_diffusers_integrations()

import diffusers  # noqa: E402,F401
import oomguard.jobs.loop  # noqa: E402,F401 - torch
import oomguard.jobs.trainers.unconditional  # noqa: E402,F401
from diffusers import DDPMScheduler, UNet2DModel  # noqa: E402,F401
