"""What ends a foreground loop's wait early (a file in the inbox, a child's exit, a signal): a
byte in a pipe.

Not a ``threading.Event``: a signal handler runs in the main thread between two bytecodes of
whatever it was doing, and an Event set from a handler that interrupted that Event's own
``wait``/``clear`` blocks on the lock the interrupted frame holds; the daemon then hung for
good, deaf to SIGTERM (seen in CI with a command job's children ending in a burst). Writing a
byte takes no lock, so setting a Wakeup from a handler, another thread or both is safe.
"""

from __future__ import annotations

import os
import select


class Wakeup:
    """Never closed: a handler may still write to it while the process exits, and a closed
    descriptor's number may by then be another file's."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self._read, select.POLLIN)

    def set(self) -> None:
        try:
            os.write(self._write, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of earlier wakeups: the waiter wakes all the same

    def clear(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass  # empty

    def wait(self, timeout: float) -> bool:
        """Until set or ``timeout`` seconds; True if set. A signal that interrupts the wait
        without setting it does not end it (poll is retried, PEP 475). poll, not select: a
        descriptor numbered 1024 or more is fine."""
        return bool(self._poll.poll(timeout * 1000))
