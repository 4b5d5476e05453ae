"""`oomguard diagnose LOGFILE`: read a training log and say whether it ran out of memory, which
memory, why, and what oomguard does about it. LOGFILE may be an attempt's folder, or its
output.log: a long log's end is then read from the tail files beside it (daemon/log_cap.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from oomguard.daemon.cli.output import EXIT_OK, CliError, say
from oomguard.jobs.attempt import LOG, LOG_TAIL, LOG_TAIL_OLDER

if TYPE_CHECKING:  # for the annotations only: oom_text is imported when a log is read
    from oomguard.strategies.oom_verdict import OomVerdict


# What oomguard does about each verdict of `diagnose`.
DIAGNOSE_ACTIONS = {
    "oom_fragmentation": "takes the allocator rung (expandable_segments:True, in a fresh process), so that PyTorch can use "
    "the reserved memory it holds in pieces; then the rest of the ladder if that is not enough",
    "oom_other_process": "waits for the other processes' memory to come back and retries the same plan, when its GPU "
    "figures show a neighbour grew while the job did not (contention); otherwise it takes the ladder as for any OOM",
    "oom": "takes the cheapest allowed rung of the ladder that fits (micro-batch, checkpointing, ...) and resumes from the "
    "last checkpoint",
    "host_oom": "nothing on the ladder: host RAM ran out, not the GPU; it retries the attempt as a crash (fewer data-loader "
    "workers or less host-side caching, or more RAM, is the fix)",
    "not_oom": "nothing on the ladder: this is not an out-of-memory error; it retries the same plan (ladder.crash_retries) "
    "and then gives up with a report; the same error at the same step twice ends the job at once",
}


# How `diagnose` names each verdict.
VERDICT_WORDS = {
    "oom": "out of device memory",
    "oom_fragmentation": "out of device memory: fragmentation",
    "oom_other_process": "out of device memory: other processes hold it",
    "host_oom": "out of host memory (RAM)",
    "not_oom": "not an out-of-memory error",
}


def cmd_diagnose(args: argparse.Namespace) -> int:
    verdict = _read_verdict(args.logfile)
    if args.json:
        print(json.dumps(verdict.to_dict(), indent=2))
        return EXIT_OK
    _print_verdict(verdict)
    return EXIT_OK


def _read_verdict(logfile: str) -> OomVerdict:
    """The verdict on a log file, or of standard input for "-"."""
    from oomguard.jobs.attempt import read_log_end
    from oomguard.strategies.oom_text import LOG_TAIL_BYTES, read_oom, read_oom_log

    if logfile == "-":
        return read_oom(sys.stdin.read())
    path = Path(logfile)
    attempt: Path | None = None  # the attempt folder whose log is read, end first
    if path.is_dir():
        if not (path / LOG).is_file():
            raise CliError(f"{path}: is a directory without a {LOG}; give a log file, or an attempt's folder, e.g. {path / 'attempts' / '001'}")
        attempt = path
    elif path.name == LOG and any((path.parent / name).exists() for name in (LOG_TAIL, LOG_TAIL_OLDER)):
        attempt = path.parent  # a long attempt log: output.log holds its start, the tail files its end
    try:
        if attempt is not None:
            return read_oom(read_log_end(attempt, LOG_TAIL_BYTES))
        return read_oom_log(path)
    except FileNotFoundError:
        raise CliError(f"{path}: no such file; give the path of a training log, or - to read standard input") from None
    except OSError as error:
        raise CliError(f"{path}: cannot read it ({error.strerror}); check its permissions") from None


def _print_verdict(verdict: OomVerdict) -> None:
    """The verdict for a reader: what ran out and where, why, the sizes the error gave, and
    what oomguard does about it."""
    from oomguard.strategies.units import describe_size

    where = ""
    if verdict.is_device_oom and verdict.device:
        where = f" ({verdict.device}" + (f":{verdict.gpu_index})" if verdict.gpu_index is not None else ")")
    print(f"verdict: {VERDICT_WORDS[verdict.kind]}{where}")
    say(f"why: {verdict.reason}")
    sizes = [
        ("requested", verdict.requested),
        ("device total", verdict.total),
        ("free on the device", verdict.free),
        ("allowed (per-process limit)", verdict.allowed),
        ("allocated by PyTorch", verdict.allocated),
        ("  of which in private pools", verdict.private_pools),
        ("reserved but unallocated", verdict.reserved_unallocated),
        ("this process in use", verdict.process_in_use),
        *((f"process {pid} in use", used) for pid, used in verdict.other_processes.items()),
    ]
    known = [(label, n) for label, n in sizes if n is not None]
    if known:
        print("sizes:")
        for label, n in known:
            print(f"  {label:<30} {describe_size(n):>12}")
    if verdict.message:
        say(f"error: {verdict.message}")
    print(f"oomguard: {DIAGNOSE_ACTIONS[verdict.kind]}")
