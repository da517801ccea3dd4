"""The channel from every child process to the launcher (TO_LAUNCHER, shared/channels.py; one for
the whole launch, not per replica): each child says once that it is ready (`ProcReady`, with what it
sized) or why it could not start or go on (`ProcFailed`); a worker rank still starting says so about
once a second (`ProcStarting`). The launcher (hyssm/launcher.py) owns the children and waits for every
ProcReady before it reports the server up, counting its start-up timeout from a child's last word."""

from __future__ import annotations

import msgspec


class ProcReady(msgspec.Struct, tag=True, kw_only=True):
    name: str
    info: dict[str, int | float | str | bool] = {}


class ProcFailed(msgspec.Struct, tag=True, kw_only=True):
    name: str
    error: str


class ProcStarting(msgspec.Struct, tag=True, kw_only=True):
    name: str
    phase: str


ToLauncher = ProcReady | ProcFailed | ProcStarting
