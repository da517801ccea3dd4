"""The exceptions `hyssm.Engine` raises; each message names the problem in one line."""

from __future__ import annotations

from shared.config import ConfigError
from shared.errors import HyssmError

__all__ = ["ConfigError", "EngineDeadError", "EngineError", "RequestError"]


class EngineError(HyssmError):
    """The engine could not start, or could not answer a request."""


class EngineDeadError(EngineError):
    """A process of the engine died (or the engine was shut down): every waiting and later call raises it."""


class RequestError(EngineError, ValueError):
    """The server refused the request (HTTP 4xx over the wire): `status`, and `param` naming the field."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
