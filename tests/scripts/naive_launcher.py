"""A launcher that does nothing about a failed rank: it starts N copies of a command as ranks
(each in a session of its own, as torchrun does, with RANK and WORLD_SIZE set) and waits for
all of them, however long the others take. Written for oomguard's tests of the shim.

    python naive_launcher.py [--ignore-sigterm] N COMMAND [ARG...]

With --ignore-sigterm it outlives SIGTERM and waits on for its ranks: then only a signal
that reaches the ranks themselves ends it.
"""

import os
import signal
import subprocess
import sys


def main() -> int:
    arguments = sys.argv[1:]
    if arguments[0] == "--ignore-sigterm":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # before the ranks start: they must not inherit it
        arguments = arguments[1:]
    world_size, command = int(arguments[0]), arguments[1:]
    ranks = [
        subprocess.Popen(
            command, env={**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size)}, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL),
        )
        for rank in range(world_size)
    ]
    print(f"launcher: started ranks {[rank.pid for rank in ranks]}", flush=True)
    return max(rank.wait() for rank in ranks)


if __name__ == "__main__":
    sys.exit(main())
