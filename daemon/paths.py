"""Where the daemon keeps its state. One StateDir is one daemon's world: its database, its
spool and (unless a job names its own) the jobs' work directories."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def default_state_dir() -> Path:
    """$OOMGUARD_STATE_DIR, else $XDG_STATE_HOME/oomguard, else ~/.local/state/oomguard."""
    if os.environ.get("OOMGUARD_STATE_DIR"):
        return Path(os.environ["OOMGUARD_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "oomguard"


@dataclass(frozen=True)
class StateDir:
    root: Path

    @property
    def database(self) -> Path:
        return self.root / "oomguard.db"

    @property
    def inbox(self) -> Path:
        return self.root / "spool" / "inbox"

    @property
    def accepted(self) -> Path:
        return self.root / "spool" / "accepted"

    @property
    def rejected(self) -> Path:
        return self.root / "spool" / "rejected"

    @property
    def jobs(self) -> Path:
        return self.root / "jobs"

    @property
    def secrets(self) -> Path:
        """Jobs' own notification URLs, readable by the daemon only."""
        return self.root / "secrets"

    @property
    def emulated_gpus(self) -> Path:
        return self.root / "emulated-gpus"

    def create(self) -> StateDir:
        for folder in (self.inbox, self.accepted, self.rejected, self.jobs):
            folder.mkdir(parents=True, exist_ok=True)
        return self
