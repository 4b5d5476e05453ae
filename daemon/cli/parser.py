"""The `oomguard` argument parser: one small function per command (or group of commands),
each adding its sub-parser with the handler that runs it. The order they are added in is the
order `oomguard --help` lists them."""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable
from pathlib import Path

from oomguard.daemon.cli.status_limits import STATUS_ENDED_SHOWN, STATUS_PAGE_SIZE, STATUS_QUEUED_SHOWN
from oomguard.jobs.device import EMULATE_DEVICE_MEMORY_ENV
from oomguard.jobs.emulated_allocator import EMULATE_ALLOCATOR_ENV


def _handler(module: str, function: str) -> Callable[[argparse.Namespace], int]:
    """The command's function, imported only when that command runs: `oomguard status` must
    not pay for what `daemon`, `run` or `report` import (the whole CLI imported ~150 ms of
    modules before any command began; a status of a 10,000-job queue is to take 200 ms)."""

    def run(args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(f"oomguard.daemon.cli.{module}"), function)(args))

    run.__qualname__ = f"{module}.{function}"
    return run

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oomguard", description="Keeps diffusion training jobs alive through GPU out-of-memory errors.")
    parser.add_argument(
        "--state-dir", type=Path, default=None, help="the daemon's state directory (default: $OOMGUARD_STATE_DIR or ~/.local/state/oomguard)"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_daemon(commands)
    _add_submit_and_status(commands)
    _add_gpu_commands(commands)
    _add_job_commands(commands)
    _add_diagnose(commands)
    _add_run(commands)
    _add_gc(commands)
    _add_serve(commands)
    return parser


def _add_emulate_device_memory(command: argparse.ArgumentParser) -> None:
    """--emulate-device-memory and --emulate-allocator, which `daemon` and `run` both take."""
    command.add_argument(
        "--emulate-device-memory", metavar="SIZE", default=os.environ.get(EMULATE_DEVICE_MEMORY_ENV),
        help=f"emulated device capacity, e.g. 48MiB or 64MiB,40MiB@15 (default: ${EMULATE_DEVICE_MEMORY_ENV})",
    )
    command.add_argument(
        "--emulate-allocator", metavar="MODE", default=os.environ.get(EMULATE_ALLOCATOR_ENV),
        help="how the emulated device allocates: exact (live bytes, the default), caching (PyTorch's caching allocator: "
        f"rounding, reserved memory, fragmentation, a 512 MiB context), caching/1024 (its sizes divided by 1024), "
        f"each with ,overhead=SIZE (default: ${EMULATE_ALLOCATOR_ENV})",
    )


def _add_daemon(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    daemon = commands.add_parser("daemon", help="run the supervisor in the foreground")
    daemon.add_argument(
        "--config", metavar="FILE", type=Path, default=None,
        help='the daemon\'s configuration (TOML): backend = "slurm" and a [slurm] table to run attempts on a Slurm cluster (README: Running on a Slurm cluster)',
    )
    daemon.add_argument(
        "--max-parallel", type=int, default=None,
        help="attempts running at once, at most (default: as many as the GPUs take; 1 without GPUs)",
    )
    daemon.add_argument(
        "--emulate-gpus", metavar="GPUS", default=None,
        help="emulated GPUs instead of NVML, e.g. 2x64MiB or 64MiB,48MiB (`oomguard neighbour` takes memory on them)",
    )
    daemon.add_argument("--admin-group", metavar="GROUP", default=None, help="members of GROUP may cancel anyone's job (system mode)")
    daemon.add_argument(
        "--max-user-priority", type=int, default=None, metavar="N",
        help="the highest priority a job may have unless its owner is root, the daemon's own user or in --admin-group (default 100)",
    )
    daemon.add_argument(
        "--notify-config", metavar="FILE", action="append", default=None,
        help="an apprise configuration file (repeatable; default: apprise's own, e.g. ~/.config/apprise/apprise.yml, /etc/apprise.yml)",
    )
    daemon.add_argument("--notify-throttle", type=float, default=600.0, metavar="SECONDS", help="the same message for the same job at most once per SECONDS (default 600)")
    daemon.add_argument(
        "--stall-after", type=float, default=1800.0, metavar="SECONDS", help="report an attempt as stalled after SECONDS without a heartbeat, and a job that waited that long for a GPU (default 1800)"
    )
    daemon.add_argument(
        "--log-limit", metavar="SIZE", default=None,
        help="keep each attempt's output log within SIZE: its first quarter in output.log, its newest output in output.tail.log(.1) (default 64MiB)",
    )
    daemon.add_argument(
        "--forget-after", metavar="DAYS", default=None,
        help="forget jobs this many days after they ended, and keep each job's events bounded (default 30; `never` keeps every job)",
    )
    daemon.add_argument("--gpu-sample-seconds", type=float, default=5.0, help=argparse.SUPPRESS)
    _add_emulate_device_memory(daemon)
    daemon.add_argument(
        "--stop-jobs", action="store_true",
        help="on SIGTERM/Ctrl-C, checkpoint and stop running attempts and requeue them (default: leave them running for the next daemon)",
    )
    daemon.add_argument("--poll-interval", type=float, default=0.5, help=argparse.SUPPRESS)
    daemon.set_defaults(handler=_handler("daemon_cmd", "cmd_daemon"))


def _add_submit_and_status(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    submit = commands.add_parser("submit", help="validate job files and queue them (all or none: a bad file refuses the batch)")
    submit.add_argument("files", nargs="+", metavar="FILE")
    submit.add_argument(
        "--wait", type=float, default=10.0, help="seconds to wait for the daemon to queue them, from its last answer (default 10)",
    )
    submit.set_defaults(handler=_handler("submit", "cmd_submit"))

    status = commands.add_parser(
        "status",
        help=f"a table of the jobs: those running, the next {STATUS_QUEUED_SHOWN} queued and the last {STATUS_ENDED_SHOWN} ended (--all: every job)",
    )
    listing = status.add_mutually_exclusive_group()
    listing.add_argument("--all", action="store_true", help="list every job, however many")
    listing.add_argument(
        "--page", type=int, metavar="N", default=None, help=f"list page N of every job in id order, {STATUS_PAGE_SIZE} to a page",
    )
    status.set_defaults(handler=_handler("status", "cmd_status"))


def _add_gpu_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`gpus`, and `report` (listed between it and `neighbour`, as ever)."""
    commands.add_parser("gpus", help="the GPUs, what is on them, and which jobs").set_defaults(handler=_handler("gpus", "cmd_gpus"))

    report = commands.add_parser("report", help="a PNG of a job's memory over time per attempt, OOMs, rungs and samples/s")
    report.add_argument("job", help="job id or name")
    report.add_argument("-o", "--output", metavar="PNG", help="where to write it (default: oomguard-job-ID.png here)")
    report.set_defaults(handler=_handler("jobs", "cmd_report"))

    neighbour = commands.add_parser("neighbour", help="hold memory on an emulated GPU for a while (to try contention)")
    neighbour.add_argument("--gpu", type=int, default=0, help="the emulated GPU (default 0)")
    neighbour.add_argument("--take", required=True, metavar="SIZES", help="memory to hold, e.g. 40MiB; 10MiB,40MiB holds each in turn")
    neighbour.add_argument("--seconds", type=float, default=10.0, help="how long to hold each size (default 10)")
    neighbour.set_defaults(handler=_handler("gpus", "cmd_neighbour"))


def _add_job_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`show`, `logs` and `cancel`: about one job of the queue."""
    show = commands.add_parser("show", help="one job with its attempts, plans and outcomes")
    show.add_argument("job", help="job id or name")
    show.add_argument("--json", action="store_true")
    show.set_defaults(handler=_handler("jobs", "cmd_show"))

    logs = commands.add_parser("logs", help="the training output of a job's attempts")
    logs.add_argument("job", help="job id or name")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    logs.set_defaults(handler=_handler("jobs", "cmd_logs"))

    cancel = commands.add_parser("cancel", help="checkpoint and stop a job (yours, or any if you are root or an admin)")
    cancel.add_argument("job", help="job id or name")
    cancel.add_argument("--wait", type=float, default=10.0, help="seconds to wait for the daemon's answer (default 10)")
    cancel.set_defaults(handler=_handler("jobs", "cmd_cancel"))


def _add_gc(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gc = commands.add_parser(
        "gc", help="forget ended jobs older than --older-than days now and compact long event lists (the daemon does it hourly)",
    )
    gc.add_argument("--older-than", metavar="DAYS", type=float, default=None, help="days since a job ended (default 30)")
    gc.set_defaults(handler=_handler("gc", "cmd_gc"))


def _add_diagnose(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    diagnose = commands.add_parser("diagnose", help="read a training log: did it run out of memory, which memory, and why")
    diagnose.add_argument("logfile", metavar="LOGFILE", help="a log file (its last error decides), or - for standard input")
    diagnose.add_argument("--json", action="store_true", help="print the verdict as a JSON object")
    diagnose.set_defaults(handler=_handler("diagnose", "cmd_diagnose"))


def _add_run(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = commands.add_parser("run", help="run one job in the foreground (no daemon needed)")
    run.add_argument("file")
    run.add_argument("--workdir", required=True, help="where checkpoints, attempts and the final model go")
    _add_emulate_device_memory(run)
    run.add_argument("--json", action="store_true", help="print only the final job record as JSON")
    run.set_defaults(handler=_handler("run", "cmd_run"))


def _add_serve(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`serve` (the web dashboard) and `web-url` (a user's own link to it)."""
    serve = commands.add_parser("serve", help="a read-only web dashboard of the queue, the GPUs and each job (on localhost)")
    serve.add_argument("--listen", default="127.0.0.1:8470", metavar="HOST:PORT", help="a loopback address to listen on (default 127.0.0.1:8470)")
    serve.add_argument("--socket", metavar="PATH", help="its Unix socket, where users are known by the kernel (default STATE/web.sock)")
    serve.add_argument("--admin-group", metavar="GROUP", help="members see every job's details, as root does (as the daemon's --admin-group)")
    serve.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"], help="the server's log (default warning)")
    serve.set_defaults(handler=_handler("serve", "cmd_serve"))

    web_url = commands.add_parser("web-url", help="your own link to the dashboard (asked over its Unix socket)")
    web_url.add_argument("--socket", metavar="PATH", help="the dashboard's Unix socket (default STATE/web.sock)")
    web_url.set_defaults(handler=_handler("serve", "cmd_web_url"))
