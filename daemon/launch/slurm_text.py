"""What goes to Slurm's CLI for one attempt and what comes back from it, as text: the batch
script, sbatch's options and environment, scontrol's fields, how a job ended, and whether a
pending job can ever start. No process is run here (daemon/launch/slurm.py runs them)."""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Mapping

from oomguard.daemon.config import SlurmConfig
from oomguard.daemon.launch import LaunchRequest, QueueState, SchedulerEnd
from oomguard.daemon.launch.local import SHIM_MODULE
from oomguard.strategies.errors import LaunchFailed
from oomguard.strategies.units import format_bytes, format_time_limit, parse_time_limit

# Ends the attempt's configuration in the batch script (JSON never has this line).
_CONFIG_END = "OOMGUARD_ATTEMPT_CONFIG"
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][\w/:]*)=")
_SLURM_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([KMGTP]?)$")
_POWERS = {"K": 1, "M": 2, "G": 3, "T": 4, "P": 5}  # a size without a unit is in MiB
# Why a pending job will never start as it was submitted (Slurm keeps it pending for ever unless
# EnforcePartLimits refuses it at once), and which of its requests to change.
NEVER_STARTS = {
    "PartitionTimeLimit": "its time limit is over the partition's MaxTime: lower resources.time_limit or slurm.time_limit",
    "PartitionNodeLimit": "it asks for more nodes than the partition allows",
    "QOSMaxWallDurationPerJobLimit": "its time limit is over its QOS's: lower resources.time_limit or slurm.time_limit, or choose another slurm.qos",
    "AssocMaxWallDurationPerJobLimit": "its time limit is over its account's: lower resources.time_limit or slurm.time_limit",
    "QOSMaxGRESPerJob": "it asks for more GPUs than its QOS allows: lower resources.gpus, or choose another slurm.qos",
    "QOSMaxMemoryPerJob": "it asks for more memory than its QOS allows: lower resources.host_memory",
    "QOSMaxCpuPerJobLimit": "it asks for more CPUs than its QOS allows: lower resources.cpus",
    "BadConstraints": "no node has what it asks for (gres, memory, CPUs, constraints): change [resources] or slurm.extra_options",
    "InvalidAccount": "its account is not valid: set slurm.account to one of yours (sacctmgr show assoc user=$USER)",
    "InvalidQOS": "its QOS is not valid for its account: change slurm.qos",
    "DependencyNeverSatisfied": "a dependency in slurm.extra_options can never be met: drop it",
}


def queue_state(state: str, reason: str | None, restarts: int) -> QueueState:
    """A job's place in Slurm's queue, with what to change when it will never start."""
    never = NEVER_STARTS.get(reason or "") if state == "PENDING" else None
    return QueueState(state, reason, restarts, never_starts=f"{reason}: {never}" if never else None)


def batch_script(request: LaunchRequest, python: str, *, log_limit_bytes: int | None = None) -> str:
    """The attempt's batch script: the shim exec'd (so that it is the batch shell, which
    --signal=B: signals), its configuration in a here-document. ``log_limit_bytes``: the cap on
    the attempt's log (the shim's --log-limit; None: its default)."""
    options = ["--workdir", str(request.workdir)]
    if request.cwd:
        options += ["--cwd", request.cwd]
    if log_limit_bytes is not None:
        options += ["--log-limit", str(log_limit_bytes)]
    # Slurm's SIGUSR1 reaches the batch shell only: the runner, and an accelerate script
    # through the bootstrap, checkpoint on it (a command that does not handle it ignores it).
    options.append("--pass-usr1")
    shim = [python, "-m", SHIM_MODULE, str(request.attempt_dir), *options, "--", *request.argv]
    config = request.stdin.decode()
    if _CONFIG_END in config.splitlines():
        raise LaunchFailed("the attempt's configuration holds the batch script's end marker", "rename what holds it in the job file")
    return f"#!/bin/sh\n# oomguard: {request.label}\nexec {shlex.join(shim)} <<'{_CONFIG_END}'\n{config.rstrip(chr(10))}\n{_CONFIG_END}\n"


def sbatch_options(request: LaunchRequest, config: SlurmConfig) -> list[str]:
    """What one attempt asks sbatch for: the job file's [resources], else the config's."""
    wanted = request.resources
    time_limit = wanted.time_limit or config.time_limit
    # A short attempt still gets the signal in time to checkpoint: at most half its limit early.
    lead = max(10, min(config.signal_seconds, time_limit // 2))
    output = str(request.attempt_dir / "slurm-%j.out").replace("%", "%%").replace("%%j", "%j")
    options = [
        "--parsable", f"--job-name={request.label}", f"--comment={request.attempt_dir}", f"--output={output}", "--open-mode=append",
        "--requeue", f"--signal=B:USR1@{lead}", f"--time={format_time_limit(time_limit)}", "--export=ALL",
    ]
    gpu_type = wanted.gpu_type or config.gpu_type
    if wanted.gpus:
        options.append(f"--gres=gpu:{gpu_type}:{wanted.gpus}" if gpu_type else f"--gres=gpu:{wanted.gpus}")
    host_memory = wanted.host_memory or config.host_memory
    most = config.max_host_memory
    if host_memory and most and host_memory > most:
        if host_memory < 2 * most:
            host_memory = most  # doubled past the most allowed: that most, once
        else:
            raise LaunchFailed(
                f"the attempt would ask for {format_bytes(host_memory)} of host memory, more than the "
                f"daemon config's slurm.max_host_memory ({format_bytes(most)})",
                "raise slurm.max_host_memory in the daemon config, or make the job use less host memory",
            )
    if host_memory:
        options.append(f"--mem={math.ceil(host_memory / 2**20)}M")
    cpus = wanted.cpus or config.cpus
    if cpus:
        options.append(f"--cpus-per-task={cpus}")
    for name, value in (("partition", config.partition), ("account", config.account), ("qos", config.qos)):
        if value:
            options.append(f"--{name}={value}")
    return [*options, *config.extra_options]


def submit_environment(attempt_env: Mapping[str, str], daemon_env: Mapping[str, str]) -> dict[str, str]:
    """sbatch's environment, which the job gets (--export=ALL): the attempt's, with where the
    cluster's configuration is (SLURM_CONF) and none of the variables of a Slurm job the
    daemon itself may run in (they would describe that job, not this one), nor the GPUs the
    daemon's machine shows (the job's are Slurm's to set)."""
    env = {
        name: value for name, value in attempt_env.items()
        if not name.startswith(("SLURM_", "SBATCH_")) and name not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
    }
    if "SLURM_CONF" in daemon_env:
        env["SLURM_CONF"] = daemon_env["SLURM_CONF"]
    return env


def parse_fields(line: str) -> dict[str, str]:
    """``scontrol show job -o``'s one line as {field: value}; a value may hold spaces (a path)."""
    starts = list(_FIELD.finditer(line))
    fields: dict[str, str] = {}
    for at, match in enumerate(starts):
        end = starts[at + 1].start() if at + 1 < len(starts) else len(line)
        fields[match.group(1)] = line[match.end() : end].strip()
    return fields


def scheduler_end(details: Mapping[str, str] | None) -> SchedulerEnd:
    """How Slurm ended a job, from its scontrol fields (state None: Slurm has forgotten it)."""
    if details is None:
        return SchedulerEnd(state=None)
    reason = details.get("Reason")
    return SchedulerEnd(
        state=details.get("JobState"), reason=None if reason in (None, "None") else reason,
        time_limit=_time_limit(details.get("TimeLimit")),
        # Slurm 22.05 prints TRES=; later versions AllocTRES= and ReqTRES=.
        host_memory=next((m for m in (_tres_memory(details.get(k)) for k in ("AllocTRES", "TRES", "ReqTRES")) if m is not None), None),
    )


def _time_limit(text: str | None) -> int | None:
    try:
        return parse_time_limit(text) if text else None
    except ValueError:
        return None  # UNLIMITED, Partition_Limit


def _tres_memory(text: str | None) -> int | None:
    """The mem= of a TRES list ("cpu=1,mem=100M,node=1"), in bytes (Slurm's units are powers of 1024)."""
    for item in (text or "").split(","):
        name, _, value = item.partition("=")
        match = _SLURM_SIZE.match(value) if name == "mem" else None
        if match:
            return int(float(match.group(1)) * 1024 ** _POWERS[match.group(2) or "M"])
    return None
