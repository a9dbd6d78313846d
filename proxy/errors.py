"""Errors the gateway makes itself, and their one mapping to HTTP.

    GatewayError                    -> status, OpenAI error body
    ├── BadRequest (400)            body not JSON / not an object / wrong field types
    ├── Unauthorized (401)          missing or wrong client key
    ├── NotFound (404)              unknown path, unknown model
    ├── MethodNotAllowed (405)
    ├── PayloadTooLarge (413)       body over server.max_body_bytes
    ├── Rejected (429 / 503)        admission said no; carries Retry-After and a metric reason
    ├── UpstreamFailed (502)        every attempt failed before anything reached the client
    └── UpstreamBusy (503)          every replica tried answered 429 / 503

Raised where the fault is found, rendered to HTTP only in ``app.py``. Bodies use OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, as vLLM does since 2025-08.
"""

from __future__ import annotations

from typing import Any


class GatewayError(Exception):
    status: int = 500
    type: str = "InternalServerError"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.status
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class BadRequest(GatewayError):
    status = 400
    type = "BadRequestError"


class Unauthorized(GatewayError):
    status = 401
    type = "AuthenticationError"


class NotFound(GatewayError):
    status = 404
    type = "NotFoundError"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "MethodNotAllowed"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "RequestEntityTooLarge"


class Rejected(GatewayError):
    """Admission refused: 429 (queue full, rate limited) or 503 (timeout, no replica)."""

    def __init__(
        self, message: str, *, status: int, reason: str, retry_after_s: float, **kw: Any
    ) -> None:
        super().__init__(message, **kw)
        self.status = status
        self.type = "RateLimitError" if status == 429 else "ServiceUnavailableError"
        self.code = status
        self.reason = reason
        self.headers.setdefault("retry-after", str(max(1, round(retry_after_s + 0.499))))


class UpstreamFailed(GatewayError):
    status = 502
    type = "BadGatewayError"


class UpstreamBusy(GatewayError):
    """Every replica tried answered 429 / 503: come back later (with ``Retry-After``)."""

    status = 503
    type = "ServiceUnavailableError"


def error_body(
    message: str, type_: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
