"""`oomguard run FILE --workdir DIR`: one job in the foreground, without a daemon; run again,
it continues the same job from its checkpoint."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from oomguard.daemon.cli.foreground import DaemonLock, StopSignals
from oomguard.daemon.cli.output import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, CliError, print_event
from oomguard.daemon.cli.state import device_from_option, job_record, latest_heartbeat, open_store
from oomguard.daemon.store import TERMINAL_STATES
from oomguard.jobs.spec import load_job_file
from oomguard.strategies.errors import JobFileError


def progress_line(heartbeat: dict[str, Any]) -> str:
    """A heartbeat in one line; a command job's script may not show its loss, and its first step
    in a process has no speed yet."""
    from oomguard.strategies.units import format_bytes

    parts = [f"step {heartbeat.get('step')}/{heartbeat.get('max_steps')}"]
    if isinstance(heartbeat.get("loss"), (int, float)):
        parts.append(f"loss {heartbeat['loss']:.4f}")
    if isinstance(heartbeat.get("samples_per_s"), (int, float)):
        parts.append(f"{heartbeat['samples_per_s']:.1f} samples/s")
    if isinstance(heartbeat.get("peak_bytes"), int):
        parts.append(f"peak {format_bytes(heartbeat['peak_bytes'])}")
    if isinstance(heartbeat.get("reserved_bytes"), int):
        parts.append(f"reserved {format_bytes(heartbeat['reserved_bytes'])}")
    return "  ".join(parts)


def cmd_run(args: argparse.Namespace) -> int:
    from oomguard.daemon.supervisor import Supervisor
    from oomguard.daemon.users import Account

    try:
        spec = load_job_file(Path(args.file))
    except JobFileError as error:
        raise CliError(f"rejected: {error}") from None
    device = device_from_option(args.emulate_device_memory, args.emulate_allocator)
    workdir = Path(args.workdir).resolve()
    if (workdir / "final").exists():
        raise CliError(f"{workdir} already holds a finished run ({workdir / 'final'}); choose another --workdir or remove it")
    state, store = open_store(workdir / ".oomguard")
    lock = DaemonLock(state.root / "daemon.lock")
    quiet = args.json
    supervisor = Supervisor(state, store, device=device, on_event=None if quiet else print_event)
    unfinished = [j for j in store.jobs() if j.name == spec.name and j.state not in TERMINAL_STATES]
    if unfinished:
        job_id = unfinished[-1].id
        if not quiet:
            print(f"continuing job {job_id} ({spec.name}) in {workdir}", flush=True)
    else:
        job_id = supervisor.add_job(spec, Account.current(), workdir=str(workdir))
    signals = StopSignals(supervisor)
    last_progress, last_step = 0.0, None
    while True:
        signals.act()
        supervisor.tick()
        if supervisor.job_done(job_id) or (supervisor.stopping and not supervisor.active()):
            break
        if not quiet and time.monotonic() - last_progress >= 5:
            heartbeat = latest_heartbeat(store, job_id)
            if heartbeat and heartbeat.get("step") != last_step and store.job(job_id).state == "running":
                last_step = heartbeat.get("step")
                print(f"    {progress_line(heartbeat)}", flush=True)
            last_progress = time.monotonic()
        time.sleep(0.2)
    job = store.job(job_id)
    if args.json:
        print(json.dumps(job_record(store, job), indent=2))
    store.close()
    lock.file.close()
    if supervisor.stopping and job.state not in TERMINAL_STATES:
        if not quiet:
            print(f"stopped; run the same command again to continue from the checkpoint in {workdir}", flush=True)
        return EXIT_INTERRUPTED
    return EXIT_OK if job.state == "finished" else EXIT_FAILED
