"""Errors the gateway makes itself, their one mapping to HTTP, and the words for what failed.

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

Errors that never reach a client as such (the relay turns them into one of the above):

    UpstreamError                   an HTTP exchange with a replica failed (``relay.upstream``)
    ├── UpstreamUnreached           the replica never saw the request
    ├── UpstreamNotHttp             what answered is no HTTP server
    ├── UpstreamClosed              closed or reset after the request was sent
    └── UpstreamReadTimeout         nothing arrived within the read timeout
    AttemptFault                    an attempt met a ``Fault`` the relay itself detected
    RetryableFailure                an attempt failed before the client had anything

The vocabulary (``StrEnum``, so metric labels and logs keep their strings): ``Fault`` is what
an attempt met, ``FailureKind`` what the fleet is told, ``RetryReason`` the
``tokenlane_retries_total`` reason label.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class FailureKind(StrEnum):
    """What the fleet is told about an attempt that failed (``Fleet.attempt_finished``)."""

    CONNECT = "connect"  # the replica never took the request
    RESET = "reset"  # the connection closed after the request was sent
    UPSTREAM_5XX = "upstream_5xx"  # a 5xx status, or an error event before the first token
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"  # no first token within the lane's bound
    STREAM_IDLE = "stream_idle"  # nothing arrived for the idle bound, or ejected mid-attempt


class RetryReason(StrEnum):
    """The ``reason`` label of ``tokenlane_retries_total``: why an attempt was retried."""

    CONNECT = "connect"
    UPSTREAM_5XX = "upstream_5xx"  # overloaded (429/503), 5xx, reset after send, error event
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"  # silent before the first token
    REPLICA_EJECTED = "replica_ejected"  # a health verdict ended the attempt (a rescue)


class Fault(StrEnum):
    """What an attempt met, before the retry rules say what it means (``relay.retry``)."""

    UNREACHED = "unreached"  # connect failed, or the answer was not HTTP
    CLOSED = "closed"  # the connection closed or reset after the request was sent
    READ_TIMEOUT = "read_timeout"  # nothing arrived within stream_idle_timeout_s
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"  # the attempt's first-token watchdog fired
    DEADLINE = "deadline"  # the watchdog fired at the request's deadline (retry.deadline_s)
    EJECTED = "ejected"  # a health verdict on the replica interrupted the attempt
    BUSY_429 = "busy_429"  # the replica answered 429
    BUSY_503 = "busy_503"  # the replica answered 503
    STATUS_5XX = "status_5xx"  # the replica answered 500, 502 or 504
    ERROR_EVENT = "error_event"  # the stream carried an error event before any content


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


# -- the upstream seam (``proxy.relay.upstream``) ------------------------------------------------


class UpstreamError(Exception):
    """An HTTP exchange with a replica failed; the subclass says how far it got. The message
    is the innermost cause's text (e.g. "Connection refused")."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class UpstreamUnreached(UpstreamError):
    """The request never reached the replica: refused, unreachable, connect or pool timeout."""


class UpstreamNotHttp(UpstreamError):
    """What answered is no HTTP server (a bad status line, broken headers): a wrong port or
    another protocol. Nothing was generated."""


class UpstreamClosed(UpstreamError):
    """The connection closed or was reset after the request was sent (or mid-body)."""


class UpstreamReadTimeout(UpstreamError):
    """Nothing arrived within the request's read timeout."""


# -- the relay's attempts ---------------------------------------------------------------------


class AttemptFault(Exception):
    """A fault the relay found itself (a status, an error event, its watchdog), on its way to
    the one place that judges faults."""

    def __init__(self, fault: Fault, detail: str) -> None:
        super().__init__(detail)
        self.fault = fault
        self.detail = detail


class RetryableFailure(Exception):
    """An attempt failed before anything reached the client; another replica may take it,
    unless ``retry`` is False (the request then fails with this failure)."""

    def __init__(
        self,
        reason: RetryReason,
        failure: FailureKind | None,
        detail: str,
        *,
        overloaded: bool = False,
        retry: bool = True,
    ) -> None:
        super().__init__(detail)
        self.reason = reason  # tokenlane_retries_total reason
        self.failure = failure  # what the fleet is told (None: not the replica's fault)
        self.detail = detail
        self.overloaded = overloaded  # the replica said 429 / 503: busy, not broken
        self.retry = retry
