"""A launcher that does nothing about a failed rank: it starts N copies of a command as ranks
(each in a session of its own, as torchrun does, with RANK and WORLD_SIZE set) and waits for
all of them, however long the others take. Written for oomguard's tests of the shim.

    python naive_launcher.py N COMMAND [ARG...]
"""

import os
import subprocess
import sys


def main() -> int:
    world_size, command = int(sys.argv[1]), sys.argv[2:]
    ranks = [
        subprocess.Popen(command, env={**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size)}, start_new_session=True)
        for rank in range(world_size)
    ]
    print(f"launcher: started ranks {[rank.pid for rank in ranks]}", flush=True)
    return max(rank.wait() for rank in ranks)


if __name__ == "__main__":
    sys.exit(main())
