"""A job's secrets, and the one form of a job that anyone but the daemon sees.

A job file holds two kinds of secret: the values of its ``[command.env]`` (HF_TOKEN,
WANDB_API_KEY, a database URL with a password: any value may be one, so every value is
treated as one) and its own ``[notify] urls`` (passwords, tokens in paths and queries).

``public_spec`` is the job as everyone may see it: env values masked (``HF_TOKEN=***``; the
``{placeholders}`` in a value stay, so the rungs a command exposes read the same), URLs as
notifier.redact_url masks them. It is what the store holds (a database every user may read),
and so what `show`, `status`, the attempt's attempt.json in the workdir, events and reports
are made from. The values themselves (``secrets_of``) go to ``STATE/secrets/<id>.json``, a
file only the daemon reads, and from there into the job's processes (``with_env``) and to
the notifier.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Mapping
from typing import Any

from oomguard.jobs.spec import CommandSpec

__all__ = ["ENV_MASK", "mask_env_value", "public_spec", "secrets_of", "shows_secrets", "with_env"]

ENV_MASK = "***"


def mask_env_value(template: str) -> str:
    """A [command.env] value as others may see it: every run of literal text masked, the
    placeholders kept (``"{workdir}/cache"`` -> ``"{workdir}***"``, ``"hf_abc"`` -> ``"***"``)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError:  # not a valid template (refused at submit): nothing of it is shown
        return ENV_MASK if template else ""
    shown: list[str] = []
    for literal, name, _spec, _conversion in parsed:
        if literal and shown[-1:] != [ENV_MASK]:
            shown.append(ENV_MASK)
        if name is not None:
            shown.append(f"{{{name}}}")
    return "".join(shown)


def public_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` (JobSpec.to_dict()) with its secrets masked: the one masked form of a job, for
    the store and everything made from it. Masking a masked spec changes nothing."""
    public = dict(spec)
    command = spec.get("command")
    if isinstance(command, Mapping) and command.get("env"):
        public["command"] = {**command, "env": {name: mask_env_value(str(value)) for name, value in command["env"].items()}}
    notify = spec.get("notify")
    if isinstance(notify, Mapping) and notify.get("urls"):
        from oomguard.daemon.notify_redact import is_redacted, redact_url  # apprise: only for jobs with URLs

        urls = [url if is_redacted(url) else redact_url(url) for url in notify["urls"]]
        public["notify"] = {**notify, "urls": urls}
    return public


def shows_secrets(spec: Mapping[str, Any]) -> bool:
    """Whether ``spec`` holds anything public_spec would mask (a job stored by an older oomguard)."""
    return public_spec(spec) != dict(spec)


def secrets_of(spec: Mapping[str, Any]) -> dict[str, Any]:
    """What public_spec masks of ``spec``, as ``STATE/secrets/<id>.json`` keeps it: ``urls``, the
    job's own notification URLs, and ``env``, its [command.env]. Empty when it has neither."""
    secrets: dict[str, Any] = {}
    notify = spec.get("notify")
    if isinstance(notify, Mapping) and notify.get("urls"):
        secrets["urls"] = list(notify["urls"])
    command = spec.get("command")
    if isinstance(command, Mapping) and command.get("env"):
        secrets["env"] = dict(command["env"])
    return secrets


def with_env(command: CommandSpec, env: Mapping[str, str]) -> CommandSpec:
    """``command`` (as the store holds it, values masked) with the real values of ``env``."""
    if not env:
        return command
    return dataclasses.replace(command, env=tuple((name, str(env.get(name, value))) for name, value in command.env))
