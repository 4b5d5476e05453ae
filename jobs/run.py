"""The runner: ``python -m oomguard.jobs.run ATTEMPT_DIR``.

Reads ``attempt.json``, resumes from the newest valid checkpoint, trains, and always ends by
writing ``outcome.json`` and exiting with one of the codes in strategies/outcome.py:

    0  finished          3  out of device memory     75  stopped by SIGTERM after a checkpoint
    1  crashed           4  loss diverged (NaN/inf)   2  bad arguments or attempt directory
    5  disk full (it waits for room; its last       76  stopped by SIGUSR1 (a cluster's time
       verified checkpoint is kept)                     limit is near) after a checkpoint
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from oomguard.jobs.attempt import OUTCOME, AttemptConfig, Control, write_json_atomic
from oomguard.jobs.bootstrap.oomguard_noise import quiet_optional_kernel_warnings
from oomguard.jobs.ranks import RANK_ENV, rank_outcome_path, run_ranks
from oomguard.strategies import rungs
from oomguard.strategies.outcome import (
    EXIT_CRASHED,
    EXIT_DISK_FULL,
    EXIT_DIVERGED,
    EXIT_FINISHED,
    EXIT_INTERRUPTED,
    EXIT_OOM,
    EXIT_REPLAN,
    EXIT_TIME_LIMIT,
    EXIT_USAGE,
    Outcome,
)

EXIT_CODE_BY_KIND = {
    "finished": EXIT_FINISHED,
    "oom": EXIT_OOM,
    "diverged": EXIT_DIVERGED,
    "interrupted": EXIT_INTERRUPTED,
    "time_limit": EXIT_TIME_LIMIT,
    "crashed": EXIT_CRASHED,
    "disk_full": EXIT_DISK_FULL,
    "replan": EXIT_REPLAN,
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m oomguard.jobs.run ATTEMPT_DIR", file=sys.stderr)
        return EXIT_USAGE
    attempt_dir = Path(args[0])
    try:
        config = AttemptConfig.read(attempt_dir)
    except (OSError, ValueError, KeyError) as error:
        print(f"cannot read {attempt_dir / 'attempt.json'}: {error}", file=sys.stderr)
        return EXIT_USAGE
    problem = _plan_problem(config)
    if problem:
        print(f"cannot run {attempt_dir / 'attempt.json'}: {problem}", file=sys.stderr)
        return EXIT_USAGE
    rank = os.environ.get(RANK_ENV)
    if config.plan.world_size > 1 and rank is None:
        print(f"attempt {config.number} of job {config.job.name}: plan {config.plan.short()}", flush=True)
        return run_ranks(attempt_dir, config.plan.world_size)

    # The handler goes in before the slow imports: a SIGTERM that arrives while torch loads
    # must still end in a checkpoint and "interrupted", not in death by signal.
    control = Control()

    def request_stop(signum: int, frame: object) -> None:
        control.stop_requested = True

    def time_limit_near(signum: int, frame: object) -> None:
        # Slurm's --signal=B:USR1@N, passed on by the shim: checkpoint and stop, to go on in
        # the next attempt with the same plan.
        if control.time_limit_signal_at is None:
            control.time_limit_signal_at = time.monotonic()
        control.stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGUSR1, time_limit_near)
    if rank is None:
        print(f"attempt {config.number} of job {config.job.name}: plan {config.plan.short()}", flush=True)

    quiet_optional_kernel_warnings()
    if config.job.trainer == "unconditional":
        # The text-to-image trainer loads CLIP through transformers and its LoRA through peft.
        _without_unused_diffusers_integrations()
    # Imported after the cheap checks: torch takes seconds to import.
    from oomguard.jobs.faults import injected_fault
    from oomguard.jobs.loop import train

    try:
        outcome = train(config, attempt_dir, control, after_step=injected_fault())
    except Exception as error:  # noqa: BLE001 - every failure must end in an outcome.json
        tail = "".join(traceback.format_exception(error))[-4000:]
        print(tail, file=sys.stderr, flush=True)
        outcome = Outcome(kind="crashed", phase=control.phase, message=f"{type(error).__name__}: {error}", traceback_tail=tail)
    code = EXIT_CODE_BY_KIND[outcome.kind]
    # A rank's outcome is its own; the ranks' runner (jobs/ranks.py) writes the attempt's.
    written = attempt_dir / OUTCOME if rank is None else rank_outcome_path(attempt_dir, int(rank))
    write_json_atomic(written, {**outcome.to_dict(), "exit_code": code})
    if outcome.kind == "oom" and rank in (None, "0"):
        print(f"out of memory in {outcome.phase} at step {outcome.step}", flush=True)
    return code


def _without_unused_diffusers_integrations() -> None:
    """Keep diffusers from importing peft, transformers and bitsandbytes as it loads.

    diffusers imports them whenever they are installed, for integrations this runner does not
    use: its LoRA, quantized base and 8-bit optimizer call peft and bitsandbytes themselves
    (jobs/adapters.py, jobs/optimizers.py), when the plan needs them. The imports took about
    2.4 s of every attempt's start on 2 cores. Only availability flags are changed; where a
    diffusers version names them differently, nothing changes but the start-up time.
    """
    from diffusers.utils import import_utils

    for package in ("peft", "transformers", "bitsandbytes"):
        setattr(import_utils, f"_{package}_available", False)


def _plan_problem(config: AttemptConfig) -> str | None:
    """Why this runner cannot run the plan as written, if it cannot: a plan for another batch
    size, or for several processes, would silently train on part of each batch."""
    plan, batch_size = config.plan, config.job.train.batch_size
    if plan.batch_size != batch_size:
        return f"the plan splits a batch of {plan.batch_size}, but the job's train.batch_size is {batch_size}"
    resources = config.job.resources
    if not resources.gpus <= plan.world_size <= resources.widest:
        asked = f"{resources.gpus}-{resources.widest}" if resources.widest > resources.gpus else str(resources.gpus)
        return f"the plan is for {plan.world_size} processes, but the job runs one per GPU and asks for resources.gpus = {asked}"
    return rungs.conflict(plan)


if __name__ == "__main__":
    exit_code = main()
    # Everything is written (the outcome, the checkpoints, the log once flushed): skip the
    # interpreter's teardown of torch and diffusers, which took 1.5 s on 2 cores and only
    # delays the next attempt.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
