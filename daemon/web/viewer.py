"""Who is asking, and what they may see: the multi-user rules of the CLI (README, Threat model).
Everyone may see what the store holds of every job in the queue (id, name, owner, state, plan,
note); a job's own files (its heartbeat's progress, metrics, outcome files) and its page only
its owner, root, the server's own user and members of --admin-group."""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.daemon.attempts import owner_uid
from oomguard.daemon.store_rows import JobRow
from oomguard.daemon.users import Account, is_admin, user_name
from oomguard.strategies.errors import UnknownUser


@dataclass(frozen=True)
class Viewer:
    uid: int
    name: str
    sees_all: bool

    def may_read(self, job: JobRow) -> bool:
        return self.sees_all or owner_uid(job) == self.uid

    @property
    def scope(self) -> str:
        return "every job's details" if self.sees_all else "your own jobs' details, and every job's row"


def viewer_for(uid: int, server_uid: int, admin_group: str | None) -> Viewer:
    name = user_name(uid)
    try:
        admin = is_admin(Account.from_uid(uid), admin_group)
    except UnknownUser:  # a uid without a passwd entry (a container's): no group to be admin by
        admin = False
    return Viewer(uid=uid, name=name, sees_all=uid in (0, server_uid) or admin)
