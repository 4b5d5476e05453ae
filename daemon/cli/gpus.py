"""`oomguard gpus` (the GPUs as the daemon's monitor last sampled them) and `oomguard neighbour`
(a process that holds memory on an emulated GPU, to try contention)."""

from __future__ import annotations

import argparse
import os
import signal
import time

from oomguard.daemon.cli.output import EXIT_FAILED, EXIT_OK, CliError, print_table
from oomguard.daemon.cli.state import jobs_on_gpus, open_store
from oomguard.daemon.paths import StateDir
from oomguard.daemon.text import escape
from oomguard.daemon.wakeup import Wakeup


def cmd_gpus(args: argparse.Namespace) -> int:
    """The GPUs as the daemon's monitor last sampled them, with the jobs on each."""
    from rich.table import Table

    from oomguard.strategies.units import format_bytes

    _, store = open_store(args.state_dir)
    samples = store.latest_gpu_samples()
    if not samples:
        raise CliError("no GPU samples yet: the daemon records them when it runs with GPUs (NVML) or --emulate-gpus", EXIT_FAILED)
    jobs_on = jobs_on_gpus(store, store.running_attempts())
    table = Table(title=f"GPUs (sampled {time.strftime('%H:%M:%S', time.localtime(max(s.at for s in samples)))})")
    for column in ("GPU", "name", "used", "free", "total", "processes", "oomguard jobs"):
        table.add_column(column, overflow="fold")
    for sample in samples:
        listed = ", ".join(f"{p.pid}: {format_bytes(p.used)}" for p in sample.processes)
        cells = (
            str(sample.gpu), sample.name or "", format_bytes(sample.used), format_bytes(sample.free),
            format_bytes(sample.total), listed, "; ".join(jobs_on.get(sample.gpu, [])),
        )
        table.add_row(*(escape(cell) for cell in cells))
    print_table(table)
    return EXIT_OK


def cmd_neighbour(args: argparse.Namespace) -> int:
    """An emulated neighbour: a process that holds memory on an emulated GPU for a while."""
    from oomguard.jobs.emulated_gpus import EmulatedGpuFolder
    from oomguard.strategies.units import format_torch_size
    from oomguard.strategies.units import parse_size

    state = StateDir(args.state_dir)
    folder = EmulatedGpuFolder(state.emulated_gpus)
    try:
        gpu = folder.gpu(args.gpu)
        steps = [parse_size(part) for part in args.take.split(",")]
    except FileNotFoundError as error:
        raise CliError(str(error)) from None
    except ValueError as error:
        raise CliError(f"{error}; `oomguard gpus` lists the GPUs") from None
    stop = Wakeup()  # set from the handlers: never a threading.Event there (daemon/wakeup.py)
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    pid = os.getpid()
    try:
        # Each size is held for --seconds, in turn: "10MiB,40MiB" grows from 10 to 40 MiB.
        for size in steps:
            folder.publish(gpu.index, pid, size, "neighbour")
            print(f"neighbour {pid} holds {format_torch_size(size)} on emulated GPU {gpu.index}", flush=True)
            if stop.wait(args.seconds):
                break
    finally:
        folder.withdraw(gpu.index, pid)
    print(f"neighbour {pid} released GPU {gpu.index}", flush=True)
    return EXIT_OK
