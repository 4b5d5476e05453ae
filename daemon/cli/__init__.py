"""The `oomguard` command line. It never imports torch: every command starts in well under a
second, and only the runner processes it starts load the training stack.

Exit codes: 0 success; 1 the job failed or was cancelled (`run`), or the request was refused;
2 bad usage or invalid input (a bad job file or size); 3 no such job; 4 the state directory is
held by another daemon; 130 interrupted (Ctrl-C); 141 the reader of its output went away
(`oomguard logs 1 | head`).

Here: main, the entry point (console script and `python -m oomguard.daemon.cli`). The commands
live one group to a module: parser.py (the argument parser), jobs.py (submit, cancel, show,
logs, report), status.py, gpus.py (gpus, neighbour), diagnose.py, daemon_cmd.py (daemon), run.py
(run); what they share: output.py (exit codes, CliError, printing), state.py (the state
directory, its store and spool as the CLI reaches them), foreground.py (daemon and run).
"""

from __future__ import annotations

import sys

from oomguard.daemon.cli.output import EXIT_NOT_FOUND, EXIT_READER_GONE, CliError, stdout_to_devnull
from oomguard.daemon.cli.parser import build_parser
from oomguard.daemon.paths import default_state_dir
from oomguard.daemon.text import escape
from oomguard.strategies.errors import JobNotFound

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    try:
        return _run_command(argv)
    except BrokenPipeError:
        # The reader of its output went away (`oomguard logs 1 | head`): end quietly, as a
        # program stopped by SIGPIPE does, instead of with a traceback. `daemon` and `run` too:
        # their attempts run in sessions of their own and are adopted by the next daemon (or
        # `run` of the same job), as after any other stop; and the supervisor's own error
        # handling prints, so a broken pipe inside its loop ends up here, never against a job.
        stdout_to_devnull()
        return EXIT_READER_GONE


def _run_command(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        # --help (or a usage error) ends here; its text is flushed while a reader gone is
        # still a BrokenPipeError main() handles, not lost at the interpreter's exit.
        sys.stdout.flush()
        raise
    if args.state_dir is None:
        args.state_dir = default_state_dir()
    try:
        code = int(args.handler(args))
        # Written out here, where a reader gone is still an error main() handles, rather than
        # at the interpreter's exit.
        sys.stdout.flush()
        return code
    except CliError as error:
        # A message may quote a job file, a job's answer or a name: escaped, its own lines kept.
        print(f"oomguard: {escape(error, keep=chr(10))}", file=sys.stderr)
        return error.code
    except JobNotFound as error:
        print(f"oomguard: {escape(error)}", file=sys.stderr)
        return EXIT_NOT_FOUND
