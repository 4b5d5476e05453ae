"""The attempt shim: ``python -m oomguard.daemon.shim ATTEMPT_DIR -- COMMAND...``.

The daemon starts one per attempt, in a session of its own and (in system mode) as the job's
owner. The shim writes the attempt's configuration (given on its standard input) into the
attempt directory, starts COMMAND (the runner, or a user's command) with its output going to
the job log, waits for it, and records how it ended in ``exit.json``. The attempt therefore
does not depend on the daemon: a daemon that is restarted, upgraded or killed finds the exit
status there, or adopts the shim while it still runs (by pid and start time).

Signals: the daemon signals the whole process group (shim and command). The shim itself
outlives SIGTERM/SIGINT/SIGHUP so that it can record the command's exit; it uses a handler
rather than SIG_IGN because an ignored signal would stay ignored in the command it execs.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from oomguard.jobs.attempt import CONFIG, HEARTBEAT, LOG, METRICS, OUTCOME, write_json_atomic

EXIT_STATUS = "exit.json"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m oomguard.daemon.shim ATTEMPT_DIR -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    attempt_dir, command = Path(args[0]), args[2:]
    config = sys.stdin.read()
    attempt_dir.mkdir(parents=True, exist_ok=True)
    # A workdir used before (a job submitted again) may hold an earlier attempt's files here:
    # whatever the daemon reads next must be this attempt's.
    for stale in (OUTCOME, HEARTBEAT, METRICS, EXIT_STATUS):
        (attempt_dir / stale).unlink(missing_ok=True)
    if config:
        temporary = attempt_dir / f".{CONFIG}.tmp"
        temporary.write_text(config)
        temporary.replace(attempt_dir / CONFIG)
    received: list[str] = []

    def note(signum: int, frame: object) -> None:
        received.append(signal.Signals(signum).name)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, note)
    with (attempt_dir / LOG).open("ab") as log:
        try:
            child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        except OSError as error:
            log.write(f"oomguard: cannot start {command[0]}: {error.strerror}\n".encode())
            write_json_atomic(attempt_dir / EXIT_STATUS, {"returncode": 127, "ended_at": time.time(), "error": str(error)})
            return 127
        returncode = child.wait()
    write_json_atomic(attempt_dir / EXIT_STATUS, {"returncode": returncode, "ended_at": time.time(), "signals": received})
    return 0


if __name__ == "__main__":
    sys.exit(main())
