"""A process of a command job that dies of an uncaught error says so, for the shim to act on.

Loaded by sitecustomize.py into the user's own interpreter, which may be another Python than
oomguard's: standard library only. When the process dies of an uncaught error that is an
out-of-memory error (in any process of the job), or of any uncaught error in a rank of a
multi-process job (its peers would otherwise wait in their next collective until its
timeout), it writes ``rank-failed.PID.json`` into the attempt directory before Python prints
the traceback. The shim sees the file within a fraction of a second and brings every process
of the attempt down (daemon/shim.py); the daemon reads the first one to say how the attempt
ended. An error the script catches itself (an in-process retry) writes nothing.
"""

import json
import os
import sys
import time

ATTEMPT_DIR_ENV = "OOMGUARD_ATTEMPT_DIR"
MARK_PREFIX = "rank-failed."
MARK_SUFFIX = ".json"


def is_out_of_memory(error_type, error):
    """torch.OutOfMemoryError (and torch.cuda's alias), or an error whose text is a device OOM
    ("CUDA error: out of memory", HIP's)."""
    if error_type.__name__ == "OutOfMemoryError":
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error)


def _world_size():
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def should_tear_down(error_type, error):
    if issubclass(error_type, (KeyboardInterrupt, SystemExit)):
        return False  # stopped on purpose
    return is_out_of_memory(error_type, error) or _world_size() > 1


def record(attempt_dir, error_type, error):
    """Write the mark atomically (a reader never sees half a file)."""
    mark = {
        "pid": os.getpid(),
        # What the process was, for the line the shim writes ("python3 train.py").
        "program": " ".join([os.path.basename(sys.executable)] + sys.argv[:1])[:200],
        "rank": os.environ.get("RANK"),
        "world_size": _world_size(),
        "out_of_memory": is_out_of_memory(error_type, error),
        "error": "{}: {}".format(error_type.__name__, error),
        "at": time.time(),
    }
    final = os.path.join(attempt_dir, "{}{}{}".format(MARK_PREFIX, os.getpid(), MARK_SUFFIX))
    temporary = final + ".tmp"
    with open(temporary, "w") as out:
        json.dump(mark, out)
    os.replace(temporary, final)


def install():
    attempt_dir = os.environ.get(ATTEMPT_DIR_ENV)
    if not attempt_dir:
        return
    previous = sys.excepthook

    def hook(error_type, error, traceback):
        if should_tear_down(error_type, error):
            try:
                record(attempt_dir, error_type, error)
            except OSError as failure:  # the traceback still goes to the log below
                sys.stderr.write("oomguard: cannot record this process's failure in {}: {}\n".format(attempt_dir, failure))
        previous(error_type, error, traceback)

    sys.excepthook = hook


def recorded(attempt_dir):
    """The marks in ``attempt_dir``, earliest first."""
    marks = []
    try:
        names = os.listdir(attempt_dir)
    except OSError:
        return marks
    for name in names:
        if not (name.startswith(MARK_PREFIX) and name.endswith(MARK_SUFFIX)):
            continue
        try:
            with open(os.path.join(attempt_dir, name), "rb") as source:
                mark = json.loads(source.read(64 * 1024).decode("utf-8", "replace"))
        except (OSError, ValueError):
            continue
        if isinstance(mark, dict) and isinstance(mark.get("at"), (int, float)) and isinstance(mark.get("error"), str):
            marks.append(mark)
    return sorted(marks, key=lambda mark: mark["at"])
