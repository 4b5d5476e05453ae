"""What the shim's wait wakes on, each as a descriptor a selector can watch: the command's exit
(a pidfd), a signal the shim handles (signal.set_wakeup_fd), and a failure mark appearing in the
attempt's folder (inotify, through watchdog). Idle, none of them costs a system call."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from oomguard.jobs.bootstrap import oomguard_ranks


def exit_descriptor(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` (a child not yet collected) ends: a
    pidfd (Linux 5.3+); None where there is none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


@contextmanager
def signal_wakeup() -> Iterator[int]:
    """A descriptor that becomes readable when a signal the shim handles arrives. The handlers
    run in the main thread between two of its steps, not inside a select (which Python restarts
    after them with the timeout it had): the wakeup fd ends the wait, so that the loop sees what
    a handler did (a SIGUSR1 now due to be passed on again)."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    try:
        yield read_end
    finally:
        signal.set_wakeup_fd(previous)
        os.close(read_end)
        os.close(write_end)


# The signals the shim handles: watchdog's threads start with them blocked, so that the kernel
# delivers them to the main thread (a signal taken by another thread would not end the main
# thread's sleep in processes.end_all until it woke on its own).
_HANDLED = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1}


@contextmanager
def mark_watch(attempt_dir: Path) -> Iterator[int | None]:
    """A descriptor that becomes readable when a failure mark (oomguard_ranks) may have appeared
    in the attempt's folder; None when the folder cannot be watched (the owner's inotify
    instances used up): then the shim looks for marks every POLL_SECONDS (daemon/shim.py).

    watchdog's Observer (inotify), told to report only files created or moved into the folder:
    the kernel then leaves out the writes (the log, which the shim itself writes, the metrics),
    which would otherwise wake its threads for every line. Only the heartbeat's replacement
    (about once a second, while a runner trains) reaches them, and not the shim's main thread."""
    from watchdog.events import FileCreatedEvent, FileMovedEvent, FileSystemEvent, FileSystemEventHandler
    from watchdog.observers import Observer

    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)

    class MarkSeen(FileSystemEventHandler):
        def on_any_event(self, event: FileSystemEvent) -> None:
            path = event.dest_path if event.event_type == "moved" else event.src_path
            if os.path.basename(os.fsdecode(path)).startswith(oomguard_ranks.MARK_PREFIX):
                try:
                    os.write(write_end, b"m")
                except BlockingIOError:
                    pass  # already readable: the shim will look

    observer = Observer()
    started = False
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED)
    try:
        observer.schedule(MarkSeen(), str(attempt_dir), recursive=False, event_filter=[FileCreatedEvent, FileMovedEvent])
        observer.start()
        started = True
    except OSError:
        pass
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    try:
        yield read_end if started else None
    finally:
        if started:
            observer.stop()
            observer.join(timeout=5)
        # The handler runs in the observer's thread: while that lives, its descriptor must not
        # be closed (the number could name the log's next file by the time it writes).
        if not observer.is_alive():
            os.close(read_end)
            os.close(write_end)


def empty(descriptor: int) -> None:
    """Read a wakeup descriptor empty (it only says that something happened)."""
    try:
        while os.read(descriptor, 4096):
            pass
    except BlockingIOError:
        pass
