"""How much `oomguard status` lists without --all: its own module, so that the parser can
name the figures in its help without importing the store (daemon/cli/parser.py)."""

from __future__ import annotations

# Without --all or --page: every job that runs (or is about to), the head of the queue, and
# the jobs that ended last. A queue of 10,000 jobs is then one screen rather than 10,000 rows
# (18 s); the counts of all jobs come first.
STATUS_QUEUED_SHOWN = 20
STATUS_ENDED_SHOWN = 10
# Jobs per page of `status --page N` (every job in id order, a page at a time).
STATUS_PAGE_SIZE = 50
