"""`oomguard gc`: the store's collection (daemon/store_gc.py) now rather than at the daemon's
next hour: ended jobs older than --older-than days are forgotten, long event lists compacted.
It writes the store, so it is for whoever may (the daemon's user, root); the daemon may run."""

from __future__ import annotations

import argparse
import os
import time

from oomguard.daemon.cli.output import EXIT_FAILED, EXIT_OK, CliError
from oomguard.daemon.paths import StateDir


def cmd_gc(args: argparse.Namespace) -> int:
    from oomguard.daemon.store import Store
    from oomguard.daemon.store_gc import DAY_SECONDS, DEFAULT_FORGET_AFTER_DAYS, collect

    days = DEFAULT_FORGET_AFTER_DAYS if args.older_than is None else args.older_than
    if not 0 <= days < float("inf"):
        raise CliError(f"--older-than takes a number of days, 0 or more, not {days:g}")
    state = StateDir(args.state_dir)
    if not state.database.exists():
        raise CliError(f"no oomguard database at {state.database}: is --state-dir the daemon's state directory?")
    if not os.access(state.database, os.W_OK) or not os.access(state.root, os.W_OK):
        raise CliError(f"cannot write {state.database}: only the daemon's user (or root) may forget jobs; ask them to run `oomguard gc`", EXIT_FAILED)
    store = Store(state.database)
    try:
        collected = collect(store, state, older_than_seconds=days * DAY_SECONDS, now=time.time())
    finally:
        store.close()
    print(collected.summary())
    return EXIT_OK
