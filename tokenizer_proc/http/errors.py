"""HTTP errors: one exception type, one OpenAI-style JSON body.

Every rejected request gets `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx
status; `message` names the offending field. Handlers raise `ApiError`; the app turns it into
the response and counts it.
"""

from __future__ import annotations

import logging

import msgspec
from starlette.responses import Response

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "request_timeout",
    413: "request_too_large",
    431: "request_header_fields_too_large",
    503: "service_unavailable",
}


class ApiError(Exception):
    """A request that cannot be served. `param` is the field at fault, when there is one."""

    def __init__(self, status: int, message: str, param: str | None = None, err_type: str | None = None,
                 headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}  # extra response headers (Retry-After of a refusal)

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}

    def response(self) -> Response:
        return Response(msgspec.json.encode(self.body()), status_code=self.status, media_type="application/json",
                        headers=self.headers)  # fmt: skip


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def unavailable(message: str, retry_after_s: int | None = None) -> ApiError:
    """503; with `retry_after_s` it carries `Retry-After` (clients such as the openai SDK back off that long)."""
    headers = {"retry-after": str(retry_after_s)} if retry_after_s is not None else None
    return ApiError(503, message, headers=headers)


def internal_error(exc: BaseException) -> ApiError:
    """A failure that is no fault of the request: logged with its traceback, answered 500."""
    logger.error("internal error: %r", exc, exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", err_type="server_error")
