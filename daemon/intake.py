"""Intake: job files and requests from the spool, validated, checked against their owner's
rights and recorded; a job's workdir made as its owner; its secrets kept out of the store.

A bad file never stops the daemon: it is moved to rejected/ with what is wrong with it. A name
the store has seen is answered once (a CLI finds its answer by the name of its file)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from oomguard.daemon.as_user import make_user_directory, spawn_options
from oomguard.daemon.attempts import owner_of
from oomguard.daemon.events import Events, log_error
from oomguard.daemon.job_secrets import public_spec, secrets_of, shows_secrets
from oomguard.daemon.launch import Launcher
from oomguard.daemon.lifecycle import Lifecycle, State
from oomguard.daemon.paths import StateDir
from oomguard.daemon.spool import Arrival, Request, Spool, priority_refusal
from oomguard.daemon.store import TERMINAL_STATES, Store, owns
from oomguard.daemon.store_rows import JobRow
from oomguard.daemon.users import Account, check_may_change, system_mode
from oomguard.jobs.attempt import read_json
from oomguard.jobs.spec import JobSpec
from oomguard.strategies.errors import AmbiguousJobName, JobNotFound, PermissionRefused


class Secrets:
    """A job's [command.env] values and its own notification URLs, kept out of the shared store
    (it holds them masked: job_secrets.public_spec) in a file only the daemon can read,
    STATE/secrets/<id>.json; from there they go into the job's processes and to apprise."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def file(self, job_id: int) -> Path:
        return self.folder / f"{job_id}.json"

    def save(self, job_id: int, secrets: dict[str, Any]) -> None:
        path = self.file(job_id)
        if not secrets:
            path.unlink(missing_ok=True)  # an earlier job of this id (a transaction rolled back) left it
            return
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            json.dump(secrets, handle)

    def read(self, job_id: int) -> dict[str, Any]:
        data = read_json(self.file(job_id))
        return data if isinstance(data, dict) else {}

    def urls(self, job_id: int) -> tuple[str, ...]:
        return tuple(self.read(job_id).get("urls") or ())

    def env(self, job_id: int) -> dict[str, str]:
        return self.read(job_id).get("env") or {}


def hide_stored_secrets(store: Store, secrets: Secrets) -> None:
    """Jobs stored by an older oomguard hold their [command.env] values (and webhook paths)
    in clear in the store, which every user may read: their secrets move to the secrets
    files (for jobs that may still run), the store keeps the masked form, and SQLite
    overwrites the old text it frees (secure_delete) and folds its WAL back into the file."""
    stored = [(job.id, job.state, job.spec_dict()) for job in store.jobs()]
    leaking = [(job_id, state, spec) for job_id, state, spec in stored if shows_secrets(spec)]
    if not leaking:
        return
    store.db.execute("PRAGMA secure_delete = ON")
    with store.atomic():
        for job_id, state, spec in leaking:
            if state not in TERMINAL_STATES:
                # The file holds the real URLs already (the store had them redacted); the env is new.
                secrets.save(job_id, {**secrets_of(spec), **secrets.read(job_id)})
            store.update_job(job_id, spec=json.dumps(public_spec(spec)))
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.db.execute("PRAGMA secure_delete = OFF")
    print(f"oomguard: moved the [command.env] values and notification URLs of {len(leaking)} job(s) out of the store", flush=True)


class Intake:
    def __init__(
        self, state: StateDir, store: Store, lifecycle: Lifecycle, events: Events, launcher: Launcher, secrets: Secrets, *,
        spool: Spool | None, max_user_priority: int | None, admin_group: str | None,
    ) -> None:
        self.state = state
        self.store = store
        self.lifecycle = lifecycle
        self.events = events
        self.launcher = launcher  # runs a program as a user: the workdir is made as its owner
        self.secrets = secrets
        self.spool = spool
        # The highest priority a job from the spool may have unless its owner is root, the
        # daemon's own user or an admin (None: no cap).
        self.max_user_priority = max_user_priority
        self.admin_group = admin_group

    def add_job(self, spec: JobSpec, owner: Account, spool_file: str | None = None, workdir: str | None = None) -> int:
        full = spec.to_dict()
        # The store keeps the masked form; the secrets file is written in the same transaction,
        # so that no job is queued whose secrets were never written.
        with self.store.atomic():
            job_id = self.lifecycle.enqueue(
                name=spec.name,
                owner=owner.name,
                owner_uid=owner.uid,
                spec=public_spec(full),
                priority=spec.priority,
                workdir=workdir or spec.workdir,
                plan=spec.initial_plan().to_dict(),
                spool_file=spool_file,
                jobs_root=self.state.jobs,
            )
            self.secrets.save(job_id, secrets_of(full))
        job = self.store.job(job_id)
        try:
            self._prepare_workdir(job, owner, default=not (workdir or spec.workdir))
        except PermissionRefused as error:
            self.lifecycle.end(
                job, State.FAILED, f"cannot use its workdir: {error}", next_step="nothing: fix the workdir and submit the job again",
                code="workdir_refused", data={"workdir": job.workdir},
            )
            return job_id
        job = self.store.job(job_id)  # its workdir as made
        self.events.event(
            job, "queued", f"queued (owner {owner.name}, batch {spec.train.batch_size}, {spec.train.max_steps} steps, workdir {job.workdir})",
            code="queued", data={"batch_size": spec.train.batch_size, "max_steps": spec.train.max_steps},
        )
        return job_id

    def _prepare_workdir(self, job: JobRow, owner: Account, *, default: bool) -> None:
        """The job's workdir, owned by its owner: under the state directory the daemon makes it
        and hands it over; anywhere else it is made as the owner, so the kernel checks the
        owner may write there, and kept under its real path as the owner resolves it (the
        daemon later opens it without following links its users could make: attempts.files_of)."""
        workdir = Path(job.workdir)
        if default:
            workdir.mkdir(mode=0o750, parents=True, exist_ok=True)
            if system_mode() and owner.uid != os.geteuid():
                os.chown(workdir, owner.uid, owner.gid)
            return
        real = str(make_user_directory(workdir, owner, self.launcher.run_as))
        if real != job.workdir:
            self.store.update_job(job.id, workdir=real)

    def take_spool(self) -> None:
        if self.spool is None:
            return
        for path in self.spool.pending():
            try:
                self._take_file(path)
            except Exception as error:  # noqa: BLE001 - one bad file never stops the daemon
                log_error(f"reading {path.name} from the spool", error)
                try:
                    self.spool.reject(path, f"{path.name}: oomguard could not read it: {type(error).__name__}: {error}")
                except OSError as move_error:
                    log_error(f"moving {path.name} to rejected/", move_error)

    def _take_file(self, path: Path) -> None:
        assert self.spool is not None
        if self._taken_before(path):
            return
        result = self.spool.take(path)
        if isinstance(result, Arrival):
            try:
                spawn_options(result.owner)  # a daemon not run as root runs only its own user's jobs
                refusal = priority_refusal(result.owner, result.spec.priority, self.max_user_priority, self.admin_group, path.name)
                if refusal is not None:
                    raise PermissionRefused(refusal)
            except PermissionRefused as error:
                rejection = self.spool.reject(path, str(error))
                # The CLI that wrote the file finds the refusal by the file's name, as an answer.
                self.store.add_request(
                    file=result.spool_file, requester=result.owner.name, action="submit", job_key=result.spec.name,
                    job_id=None, accepted=0, answer=rejection.error,
                )
                print(f"rejected {path.name}: {rejection.error}", flush=True)
                return
            job_id = self.add_job(result.spec, result.owner, spool_file=result.spool_file)
            self.spool.accept(path, job_id)
        elif isinstance(result, Request):
            self.answer(result)
            self.spool.consume(path)
        else:
            print(f"rejected {result.file}: {result.error}", flush=True)

    def _taken_before(self, path: Path) -> bool:
        """An inbox file whose name the store has recorded already: the daemon recorded it and
        died before moving it (finish that), or someone else's file under a name that was used
        (refused: a CLI finds its answer by the name of its file, so a name is never answered
        twice, and never for another user). True when the file has been dealt with here."""
        assert self.spool is not None
        job = self.store.job_by_spool_file(path.name)
        request = self.store.request_by_file(path.name) if job is None else None
        if job is None and request is None:
            return False
        try:
            owner = self.spool.owner(path)  # lstat: a link is refused by take(), like any other
        except FileNotFoundError:
            return True
        except PermissionRefused:
            return False
        used = None
        if job is not None:
            if not owns(job, owner.uid, owner.name):
                used = f"job {job.id} of {job.owner}"
            elif os.path.lexists(self.spool.accepted / f"{job.id:06d}-{path.name}"):
                used = f"your job {job.id} ({job.name})"
            else:  # recorded before a crash that came before the move: just finish the move
                self.spool.accept(path, job.id)
                return True
        elif request is not None:
            if request.requester != owner.name:
                used = f"a file of {request.requester}"
            elif request.action == "submit":  # a job file refused earlier (moved to rejected/ first)
                used = f"your job file refused at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(request.at))}"
            else:  # answered before a crash that came before the removal
                self.spool.consume(path)
                return True
        error = (
            f"{path.name}: this name was used already, by {used}; the daemon answers each name once, so give the file a new "
            "name (`oomguard submit` and `oomguard cancel` pick a new unguessable one each time)"
        )
        print(f"rejected {path.name}: {self.spool.reject(path, error).error}", flush=True)
        return True

    def answer(self, request: Request) -> None:
        """Apply a user's request about a job if they may; the answer goes to the store, where
        the CLI that wrote the request reads it."""
        job: JobRow | None = None
        try:
            if request.action != "cancel":
                raise PermissionRefused(f"unknown request {request.action!r} (oomguard knows: cancel)")
            # A name means the requester's own job first (Store.job_for); the CLI sends an id.
            job = self.store.job_for(request.job, request.requester.uid, request.requester.name)
            label = f"job {job.id} ({job.name})"
            check_may_change(request.requester, owner_of(job).uid, "cancel", label, self.admin_group)
            if job.state in TERMINAL_STATES:
                raise PermissionRefused(f"{label} has already ended: {job.state}")
        except (PermissionRefused, JobNotFound, AmbiguousJobName) as error:
            answer, accepted = str(error), False
        else:
            self.store.request_cancel(job.id)
            answer, accepted = f"cancel requested for {label} by {request.requester.name}: the daemon checkpoints and stops it", True
            self.events.event(job, "cancel-requested", f"by {request.requester.name}", code="cancel-requested", data={"by": request.requester.name})
        self.store.add_request(
            file=request.spool_file, requester=request.requester.name, action=request.action, job_key=request.job,
            job_id=job.id if job else None, accepted=int(accepted), answer=answer,
        )
        if not accepted:
            print(f"refused a request of {request.requester.name}: {answer}", flush=True)
