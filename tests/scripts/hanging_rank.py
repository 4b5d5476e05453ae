"""A rank of a multi-process job for oomguard's shim tests, without torch (fast).

Rank 0 runs out of memory (an error class named OutOfMemoryError, as torch's is) and then
hangs while exiting, as a rank stuck tearing down its communicator does. The other ranks wait
"in a collective" forever and ignore SIGTERM, so only SIGKILL ends them."""

import atexit
import os
import signal
import sys
import time


class OutOfMemoryError(RuntimeError):
    pass


rank = int(os.environ["RANK"])
print(f"rank {rank}: pid {os.getpid()} training", flush=True)
if rank == 0:
    time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0.5)
    atexit.register(time.sleep, 600)
    raise OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 23.65 GiB of which 3.06 MiB is free.")
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(600)
