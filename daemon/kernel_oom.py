"""The kernel's OOM killer, as an attempt meets it (Linux; standard library only, the shim uses it).

When host RAM runs out (or a memory cgroup's limit is reached) the kernel SIGKILLs the process
it scores highest. A SIGKILL carries no message, so the shim reads the kernel's count of such
kills (``oom_kill`` in /proc/vmstat, Linux >= 4.13) before the command starts and after it
ends: an attempt that failed while the count rose ran out of host memory, not of device
memory, and the daemon records it as ``host_oom`` rather than as a crash of unknown cause.
The count is machine-wide, so another OOM kill on the box at the same time reads the same;
either way host memory ran short while the attempt ran.

The shim also raises the training processes' ``oom_score_adj``, so that the kernel picks a
training process (whose job resumes from its checkpoint) before the daemon, the shim that
records the attempt, or a user's shell.
"""

from __future__ import annotations

import os
from pathlib import Path

VMSTAT = Path("/proc/vmstat")
# Added to the training processes' OOM score (-1000 never killed, 1000 killed first). 500
# puts a runner ahead of any process of similar size at the default 0; any process may raise
# its own score, so this needs no privilege.
TRAINING_OOM_SCORE_ADJ = 500


def kills(vmstat: Path = VMSTAT) -> int | None:
    """How many processes the kernel's OOM killer has ended since boot; None where the kernel
    does not say (not Linux, or older than 4.13)."""
    try:
        text = vmstat.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def kills_between(before: int | None, after: int | None) -> int | None:
    """OOM kills between two readings; None when either is unknown."""
    if before is None or after is None:
        return None
    return max(after - before, 0)


def prefer_me() -> None:
    """Raise this process's OOM score (run in the training command before it execs: its
    processes inherit it). Reports on standard error, which is the attempt's log, when the
    kernel refuses: the attempt still runs, only without that preference."""
    try:
        with open("/proc/self/oom_score_adj", "w") as score:
            score.write(str(TRAINING_OOM_SCORE_ADJ))
    except OSError as error:
        os.write(2, f"oomguard: could not raise this attempt's oom_score_adj ({error.strerror}); under host memory pressure the kernel may pick another process first\n".encode())
