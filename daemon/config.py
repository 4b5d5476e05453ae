"""The daemon's configuration file (``oomguard daemon --config FILE``): where attempts run.

    backend = "slurm"              # "local" (the default): this machine's GPUs
    [slurm]
    partition = "gpu"
    account = "mylab"
    qos = "normal"
    time_limit = "24:00:00"        # one attempt's --time, unless the job file's resources.time_limit says
    signal_seconds = 300           # SIGUSR1 this long before the limit: the runner checkpoints and stops
    host_memory = "64GiB"          # --mem, unless the job file's resources.host_memory says
    max_host_memory = "256GiB"     # the most a host OOM at --mem may raise it to
    cpus = 8                       # --cpus-per-task, unless resources.cpus says
    gpu_type = "a100"              # --gres=gpu:a100:N, unless resources.gpu_type says
    extra_options = ["--constraint=ampere"]
    max_jobs = 32                  # attempts in Slurm (pending or running) at once
    poll_seconds = 10              # how often squeue is asked

Every problem is one line, ``{path}: {key}: {problem}``, naming the fix; nothing starts.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from oomguard.strategies.units import parse_size, parse_time_limit

Backend = Literal["local", "slurm"]
BACKENDS: tuple[Backend, ...] = ("local", "slurm")
_TOP_KEYS = ("backend", "slurm")
_SLURM_KEYS = (
    "partition", "account", "qos", "time_limit", "signal_seconds", "host_memory", "max_host_memory", "cpus", "gpu_type", "extra_options",
    "max_jobs", "poll_seconds",
)
# sbatch options oomguard sets itself for each attempt (long and short forms), and those that
# would break how it follows one: an extra option must not be one of them.
OWN_OPTIONS = (
    "--gres", "--gpus", "--gpus-per-node", "--gpus-per-task", "-G", "--mem", "--mem-per-cpu", "--mem-per-gpu", "--cpus-per-task", "-c",
    "--time", "-t", "--requeue", "--no-requeue", "--signal", "--output", "-o", "--error", "-e", "--open-mode", "--job-name", "-J",
    "--comment", "--export", "--parsable", "--wrap", "--chdir", "-D", "--partition", "-p", "--account", "-A", "--qos", "-q",
    "--array", "-a", "--hold", "-H", "--test-only", "--wait", "-W", "--uid", "--gid",
)


class ConfigError(ValueError):
    """A problem of the daemon's configuration file, in one line that names the key."""


@dataclass(frozen=True)
class SlurmConfig:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit: int = 24 * 3600  # seconds
    signal_seconds: int = 300
    host_memory: int | None = None  # bytes; None: the cluster's default (DefMemPerCPU)
    max_host_memory: int | None = None
    cpus: int | None = None
    gpu_type: str | None = None
    extra_options: tuple[str, ...] = ()
    max_jobs: int = 32
    poll_seconds: float = 10.0


@dataclass(frozen=True)
class DaemonConfig:
    backend: Backend = "local"
    slurm: SlurmConfig = field(default_factory=SlurmConfig)


def read_config(path: Path) -> DaemonConfig:
    """The configuration in ``path``; ConfigError naming the key and the fix."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"{path}: cannot read it: {error.strerror or error}; give --config a readable TOML file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: is not UTF-8 text; save it as UTF-8") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: is not valid TOML: {error}") from None
    return parse_config(data, str(path))


def parse_config(data: Mapping[str, Any], where: str) -> DaemonConfig:
    _known_keys(data, _TOP_KEYS, "", where)
    backend = data.get("backend", "local")
    if backend not in BACKENDS:
        raise ConfigError(f'{where}: backend: expected "local" or "slurm", found {backend!r}')
    table = data.get("slurm", {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: slurm: expected a table ([slurm]), found {type(table).__name__}")
    if table and backend != "slurm":
        raise ConfigError(f'{where}: slurm: the [slurm] table is set but backend is {backend!r}: add backend = "slurm", or drop [slurm]')
    return DaemonConfig(backend=backend, slurm=_slurm(table, where))


def _slurm(table: Mapping[str, Any], where: str) -> SlurmConfig:
    _known_keys(table, _SLURM_KEYS, "slurm.", where)
    read = _Reader(table, where)
    time_limit = read.time("time_limit", SlurmConfig.time_limit)
    signal_seconds = read.int("signal_seconds", SlurmConfig.signal_seconds, minimum=10)
    if signal_seconds >= time_limit:
        raise ConfigError(
            f"{where}: slurm.signal_seconds: {signal_seconds} s is not shorter than slurm.time_limit ({time_limit} s): the runner "
            "would be told to stop as it starts; lower signal_seconds or raise time_limit"
        )
    host_memory = read.size("host_memory")
    max_host_memory = read.size("max_host_memory")
    if host_memory is not None and max_host_memory is not None and max_host_memory < host_memory:
        raise ConfigError(f"{where}: slurm.max_host_memory: is below slurm.host_memory; raise it, or drop it (no limit)")
    extra = table.get("extra_options", [])
    if not isinstance(extra, list) or not all(isinstance(option, str) and option.startswith("-") for option in extra):
        raise ConfigError(f'{where}: slurm.extra_options: expected a list of sbatch options such as ["--constraint=ampere"]')
    for option in extra:
        # "--mem=4G", or a short option with its value joined ("-t60", "-pgpu").
        name = option.split("=", 1)[0] if option.startswith("--") else option[:2]
        if name in OWN_OPTIONS:
            raise ConfigError(
                f"{where}: slurm.extra_options: {name} is set by oomguard for each attempt (from the job file's [resources] and "
                "this file's keys) or would stop it following the attempt; drop it from extra_options"
            )
    return SlurmConfig(
        partition=read.name("partition"), account=read.name("account"), qos=read.name("qos"), time_limit=time_limit,
        signal_seconds=signal_seconds, host_memory=host_memory, max_host_memory=max_host_memory,
        cpus=read.int("cpus", None, minimum=1), gpu_type=read.name("gpu_type"), extra_options=tuple(extra),
        max_jobs=read.int("max_jobs", SlurmConfig.max_jobs, minimum=1), poll_seconds=read.seconds("poll_seconds", SlurmConfig.poll_seconds),
    )


def _known_keys(table: Mapping[str, Any], known: tuple[str, ...], prefix: str, where: str) -> None:
    for key in table:
        if key not in known:
            raise ConfigError(f"{where}: {prefix}{key}: unknown key (known: {', '.join(known)})")


class _Reader:
    """Typed getters of the [slurm] table, each failing with the key's name."""

    def __init__(self, table: Mapping[str, Any], where: str) -> None:
        self.table = table
        self.where = where

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.where}: slurm.{key}: {problem}")

    def name(self, key: str) -> str | None:
        value = self.table.get(key)
        if value is None:
            return None
        if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9_.:+-]{1,128}", value):
            raise self.fail(key, f"expected a name as Slurm writes it (letters, digits, _.:+-), found {value!r}")
        return value

    def int(self, key: str, default: Any, *, minimum: int) -> Any:
        value = self.table.get(key, default)
        if value is default:
            return value
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.fail(key, f"expected an integer >= {minimum}, found {value!r}")
        return value

    def seconds(self, key: str, default: float) -> float:
        value = self.table.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.1 <= value <= 3600:
            raise self.fail(key, f"expected seconds between 0.1 and 3600, found {value!r}")
        return float(value)

    def time(self, key: str, default: int) -> int:
        value = self.table.get(key)
        if value is None:
            return default
        try:
            return parse_time_limit(value)
        except ValueError as error:
            raise self.fail(key, str(error)) from None

    def size(self, key: str) -> int | None:
        value = self.table.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.fail(key, f'expected a size such as "64GiB", found {value!r}')
        try:
            return parse_size(value)
        except ValueError as error:
            raise self.fail(key, str(error)) from None
