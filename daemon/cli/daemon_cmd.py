"""`oomguard daemon`: the supervisor in the foreground (for systemd: Type=notify, watchdog
pings), one per state directory; its standard output is its log."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomguard.daemon.cli.foreground import DaemonLock, StopSignals
from oomguard.daemon.cli.output import EXIT_OK, CliError, print_event
from oomguard.daemon.cli.state import device_from_option, create_state_dir, current_user
from oomguard.daemon.paths import StateDir
from oomguard.daemon.store import Store
from oomguard.daemon.text import escape
from oomguard.daemon.wakeup import Wakeup
from oomguard.strategies.errors import InsecureStateDir, NoGpus

if TYPE_CHECKING:  # for the annotations only: the daemon's modules are imported when it starts
    from oomguard.daemon.config import DaemonConfig, SlurmConfig
    from oomguard.daemon.launch import Launcher
    from oomguard.daemon.monitor import GpuMonitor
    from oomguard.daemon.sd_notify import SystemdNotifier
    from oomguard.daemon.spool import Spool
    from oomguard.daemon.supervisor import Supervisor


class InertOutput:
    """The daemon's standard output (its log), with every control character but the newline
    escaped (text.escape) whatever printed it: the last guard of the log against a user's text
    that some message quotes (a name in a refusal, an error's text). Where a line ends is
    decided where a record is made (print_event, Supervisor.event)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(escape(text, keep="\n"))
        return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, ...
        return getattr(self.stream, name)


def cmd_daemon(args: argparse.Namespace) -> int:
    plain = sys.stdout
    sys.stdout = InertOutput(plain)
    try:
        return _daemon(args)
    finally:
        sys.stdout = plain


def _daemon(args: argparse.Namespace) -> int:
    from oomguard.daemon.notifier import Notifier
    from oomguard.daemon.sd_notify import SystemdNotifier
    from oomguard.daemon.spool import Spool
    from oomguard.daemon.supervisor import Supervisor

    max_user_priority = _max_user_priority(args)
    config = _config(args)
    launcher = _launcher(config, _log_limit(args.log_limit))
    state, lock = _claim_state_dir(args.state_dir)
    store = Store(state.database)
    # On a cluster Slurm places attempts: no GPU of this machine is watched or placed on.
    monitor = _gpu_monitor(args, state, store) if config.backend == "local" else None
    max_parallel = args.max_parallel if args.max_parallel is not None or config.backend == "local" else config.slurm.max_jobs
    config_paths = [Path(p) for p in args.notify_config] if args.notify_config else None
    notifier = Notifier(config_paths, throttle_seconds=args.notify_throttle)
    # What wakes the loop before its poll interval is up: a file in the inbox, an attempt's
    # shim (our child) ending.
    wake = Wakeup()
    spool = Spool(state.inbox, state.accepted, state.rejected, arrived=wake)
    supervisor = Supervisor(
        state, store, max_parallel=max_parallel, device=device_from_option(args.emulate_device_memory, args.emulate_allocator), on_event=print_event,
        spool=spool, gpus=monitor, notifier=notifier, admin_group=args.admin_group, stall_seconds=args.stall_after,
        max_user_priority=max_user_priority, launcher=launcher, forget_after_seconds=_forget_after(args.forget_after),
    )
    signals = StopSignals(supervisor, stop_jobs=args.stop_jobs, wake=wake)
    signal.signal(signal.SIGCHLD, lambda signum, frame: wake.set())
    spool.start()
    systemd = SystemdNotifier()
    stopping = _StoppingNotice(systemd)
    mode = _mode()
    try:  # from here on, whatever ends the daemon (a reader of its output gone too) goes through finally
        if monitor is not None:
            print(f"GPUs: {monitor.source.description}", flush=True)
        if config.backend == "slurm":
            print(f"attempts go to Slurm ({_where(config.slurm)}), at most {max_parallel} at once", flush=True)
        print(f"oomguard daemon {os.getpid()} watching {state.inbox} ({mode})", flush=True)
        systemd.ready(f"watching {state.inbox}")
        _supervise(supervisor, spool, systemd, stopping, args.poll_interval, wake, signals)
    finally:
        stopping.send()
        spool.stop()
        # Messages already queued get a moment to go out; retries do not hold the daemon up.
        notifier.flush(timeout=5.0)
        notifier.close()
        store.close()
        lock.file.close()
    print("oomguard daemon stopped", flush=True)
    return EXIT_OK


def _max_user_priority(args: argparse.Namespace) -> int:
    """--max-user-priority (checked, with its default), once --max-parallel is checked too."""
    from oomguard.daemon.spool import DEFAULT_MAX_USER_PRIORITY

    if args.max_parallel is not None and args.max_parallel < 1:
        raise CliError(f"--max-parallel must be at least 1, got {args.max_parallel}")
    max_user_priority = DEFAULT_MAX_USER_PRIORITY if args.max_user_priority is None else args.max_user_priority
    if not -(2**63) <= max_user_priority <= 2**63 - 1:
        raise CliError(f"--max-user-priority must fit a 64-bit integer (a job's priority does), got {max_user_priority}")
    return max_user_priority


def _config(args: argparse.Namespace) -> DaemonConfig:
    """--config's file (the defaults without one), checked before anything starts."""
    from oomguard.daemon.config import ConfigError, DaemonConfig, read_config

    if args.config is None:
        return DaemonConfig()
    try:
        config = read_config(args.config)
    except ConfigError as error:
        raise CliError(str(error)) from None
    if config.backend == "slurm" and args.emulate_gpus:
        raise CliError("--emulate-gpus: on a Slurm cluster Slurm places attempts on GPUs; emulate their memory with --emulate-device-memory")
    return config


def _forget_after(text: str | None) -> float | None:
    """--forget-after in seconds (None: `never`)."""
    from oomguard.daemon.store_gc import DAY_SECONDS, DEFAULT_FORGET_AFTER_DAYS

    if text is None:
        return DEFAULT_FORGET_AFTER_DAYS * DAY_SECONDS
    if text == "never":
        return None
    try:
        days = float(text)
    except ValueError:
        days = -1.0
    if not 0 < days < float("inf"):
        raise CliError(f"--forget-after takes a number of days above 0, or `never`, not {text!r}")
    return days * DAY_SECONDS


def _log_limit(text: str | None) -> int | None:
    """--log-limit in bytes, checked (None: the shim's default, daemon/log_cap.py)."""
    if text is None:
        return None
    from oomguard.daemon.log_cap import check_limit
    from oomguard.strategies.units import parse_size

    try:
        return check_limit(parse_size(text))
    except ValueError as error:
        raise CliError(f"--log-limit: {error}") from None


def _launcher(config: DaemonConfig, log_limit_bytes: int | None) -> Launcher:
    """The Launcher of the config's backend, keeping each attempt's log within ``log_limit_bytes``."""
    if config.backend == "local":
        from oomguard.daemon.launch.local import LocalLauncher

        return LocalLauncher(log_limit_bytes=log_limit_bytes)
    from oomguard.daemon.launch.slurm import NoSlurm, SlurmLauncher

    try:
        launcher = SlurmLauncher(config.slurm, log_limit_bytes=log_limit_bytes)
        launcher.check()
    except NoSlurm as error:
        raise CliError(f"backend = \"slurm\": {error}") from None
    return launcher


def _where(slurm: SlurmConfig) -> str:
    named = [f"{key} {value}" for key, value in (("partition", slurm.partition), ("account", slurm.account), ("qos", slurm.qos)) if value]
    return ", ".join(named) or "the cluster's default partition"


def _claim_state_dir(state_dir: Path) -> tuple[StateDir, DaemonLock]:
    """The state directory, created, locked for this daemon and given its modes."""
    from oomguard.daemon.users import secure_state_dir

    state = create_state_dir(state_dir)
    state.secrets.mkdir(mode=0o700, exist_ok=True)
    lock = DaemonLock(state.root / "daemon.lock")
    try:
        # Before the store is opened: closing any descriptor of the database file would drop
        # this process's SQLite locks (POSIX record locks belong to the process, not the fd).
        secure_state_dir(
            state.root, state.inbox, [state.accepted, state.rejected, state.secrets],
            [state.database, Path(f"{state.database}-wal"), Path(f"{state.database}-shm")],
        )
    except InsecureStateDir as error:
        raise CliError(f"{error}; fix the state directory or choose another --state-dir") from None
    return state, lock


def _gpu_monitor(args: argparse.Namespace, state: StateDir, store: Store) -> GpuMonitor | None:
    """The monitor of the GPUs (NVML, or --emulate-gpus); None, said, when there are none."""
    from oomguard.daemon.gpus import open_gpus
    from oomguard.daemon.monitor import GpuMonitor

    try:
        return GpuMonitor(open_gpus(args.emulate_gpus, state.emulated_gpus), store, every_seconds=args.gpu_sample_seconds)
    except ValueError as error:
        raise CliError(f"--emulate-gpus: {error}") from None
    except NoGpus as error:
        print(f"oomguard: {error}", flush=True)
        return None


def _mode() -> str:
    from oomguard.daemon.users import system_mode

    return "system mode: jobs run as their owners" if system_mode() else f"user mode: jobs run as {current_user()}"


class _StoppingNotice:
    """systemd's STOPPING=1, sent once: when attempts start checkpointing, else as the daemon ends."""

    def __init__(self, systemd: SystemdNotifier) -> None:
        self.systemd = systemd
        self.sent = False

    def send(self) -> None:
        if not self.sent:
            self.systemd.stopping()
            self.sent = True


def _supervise(
    supervisor: Supervisor, spool: Spool, systemd: SystemdNotifier, stopping: _StoppingNotice, poll_interval: float, wake: Wakeup,
    signals: StopSignals,
) -> None:
    """The daemon's loop, until the supervisor has stopped: a tick, then a wait of at most
    ``poll_interval`` that a file in the inbox, a shim's exit or a signal ends at once (and none
    while the inbox holds more files than a tick takes)."""
    while True:
        wake.clear()
        signals.act()
        if supervisor.stopped():
            break
        supervisor.tick()
        systemd.tick()
        if supervisor.stopping:
            # Attempts are checkpointing: systemd waits for them (TimeoutStopSec).
            stopping.send()
        if not spool.has_pending():
            wake.wait(poll_interval)
