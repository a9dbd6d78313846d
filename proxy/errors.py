"""Every exception Tokenlane raises itself, and their one rendering to HTTP and SSE.

    TokenlaneError
    ├── GatewayError                    -> status, OpenAI error body (rendered below)
    │   ├── BadRequest (400)            body not JSON / not an object / wrong field types
    │   ├── Unauthorized (401)          missing or wrong client key or admin token
    │   ├── Forbidden (403)             admin API from a non-loopback client, no token set
    │   ├── NotFound (404)              unknown path, unknown model, unknown replica
    │   ├── MethodNotAllowed (405)
    │   ├── PayloadTooLarge (413)       body over server.max_body_bytes
    │   ├── PolicyRefused (422)         an admin reload whose new policy is invalid
    │   ├── Rejected (429 / 503)        admission said no; carries Retry-After and a metric reason
    │   │   └── ShuttingDown (503)      arrived after SIGTERM: go to another instance
    │   ├── UpstreamFailed (502)        every attempt failed before anything reached the client
    │   └── UpstreamBusy (503)          every replica tried answered 429 / 503
    ├── PolicyError (ValueError)        a policy that cannot be used, each fault by its path
    ├── TokenizerError (ValueError)     a tokenizer_file that cannot be read
    ├── ScrapeError (ValueError)        a body that is not a vLLM metrics page
    ├── NoLaneMatched (LookupError)     no lane's `when` held
    ├── UnknownReplica (LookupError)    an operator named a URL no replica has
    ├── AmbiguousReplica (LookupError)  ... one that is in several pools
    ├── SharedUnavailable               Redis did not answer: go on with the local view
    └── ClientGone                      the client left before its request was whole

Raised where the fault is found; a ``GatewayError`` becomes an answer only through the
renderers at the end of this module (ASGI messages, a Starlette response, an SSE error event).
The others keep the builtin base they had (``ValueError``, ``LookupError``) so that callers
catching those still do. Bodies use OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``, as vLLM does since 2025-08; on the Anthropic Messages paths (``Dialect.ANTHROPIC``)
Anthropic's, ``{"type": "error", "error": {"type", "message"}}``, whose ``type`` that SDK reads
(see ``ANTHROPIC_TYPES``). The status and ``Retry-After`` are the same in both.

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

import json
from enum import StrEnum
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import Message, Send


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


class Dialect(StrEnum):
    """Whose error shape a path speaks: the gateway's own errors must parse in its clients'
    SDKs (the Anthropic SDK reads ``error.type``, the OpenAI SDK ``error.message``)."""

    OPENAI = "openai"  # chat, completions, responses and every relayed path of vLLM's
    ANTHROPIC = "anthropic"  # /v1/messages and /v1/messages/count_tokens
    RESPONSES = "responses"  # /v1/responses: OpenAI's bodies, typed in-band stream events


def dialect_of(path: str) -> Dialect:
    if path.startswith("/v1/messages"):
        return Dialect.ANTHROPIC
    if path.startswith("/v1/responses"):
        return Dialect.RESPONSES
    return Dialect.OPENAI


# Anthropic's error types by status (its API's errors page); 503 is its overloaded_error,
# which Anthropic itself sends as 529: the status stays the gateway's, the SDK retries both.
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class TokenlaneError(Exception):
    """The root of every exception the gateway raises itself."""


# ---------------------------------------------------------------------------- answered over HTTP


class GatewayError(TokenlaneError):
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
        self.code: str | int | None = code if code is not None else self.status
        self.headers = headers or {}

    def body(self, dialect: Dialect = Dialect.OPENAI) -> dict[str, Any]:
        if dialect is Dialect.ANTHROPIC:
            kind = ANTHROPIC_TYPES.get(self.status, "api_error")
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return error_body(self.message, self.type, self.param, self.code)


class BadRequest(GatewayError):
    status = 400
    type = "BadRequestError"


class Unauthorized(GatewayError):
    status = 401
    type = "AuthenticationError"


class Forbidden(GatewayError):
    status = 403
    type = "PermissionDeniedError"


class NotFound(GatewayError):
    status = 404
    type = "NotFoundError"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "MethodNotAllowed"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "RequestEntityTooLarge"


class PolicyRefused(GatewayError):
    """A reload asked over the admin API whose new policy is invalid: the old one stays, and
    the answer lists each problem (``problems``, next to ``error``)."""

    status = 422
    type = "UnprocessableEntityError"

    def __init__(self, problems: list[str]) -> None:
        super().__init__("the new policy is invalid; the old one stays")
        self.problems = list(problems)

    def body(self, dialect: Dialect = Dialect.OPENAI) -> dict[str, Any]:
        return {**super().body(dialect), "problems": self.problems}


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


class ShuttingDown(Rejected):
    """A request that arrived after SIGTERM (or was cut by the shutdown): not a rejection by
    admission, so not counted as one; the client should go to another instance."""

    def __init__(
        self, message: str = "the gateway is shutting down; retry on another instance"
    ) -> None:
        super().__init__(message, status=503, reason="shutdown", retry_after_s=1.0)


class UpstreamFailed(GatewayError):
    status = 502
    type = "BadGatewayError"


class StreamCut(GatewayError):
    """A stream that had started and could not be finished: told in-band, as vLLM ends a failed
    stream (``sse_error_event``), since its status line has gone."""

    status = 503
    type = "ServiceUnavailableError"


class UpstreamBusy(GatewayError):
    """Every replica tried answered 429 / 503: come back later (with ``Retry-After``)."""

    status = 503
    type = "ServiceUnavailableError"


# ---------------------------------------------------------------------------- handled inside


class PolicyError(TokenlaneError, ValueError):
    """A policy that cannot be used; ``problems`` names each fault by its path, ``details``
    (``config.Problem``, when known) says where each one is."""

    def __init__(self, problems: list[str], details: list[Any] | None = None) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems
        self.details = details or []

    @classmethod
    def of(cls, details: list[Any]) -> PolicyError:
        return cls([p.plain() for p in details], details)


class TokenizerError(TokenlaneError, ValueError):
    """A ``tokenizer_file`` that cannot be read as a tokenizer."""


class ScrapeError(TokenlaneError, ValueError):
    """The body is not a vLLM metrics page (no ``vllm:`` series the detectors need)."""


class NoLaneMatched(TokenlaneError, LookupError):
    """No lane's `when` held. A validated policy cannot get here: its last lane has no `when`."""


class UnknownReplica(TokenlaneError, LookupError):
    """No replica has that URL (in that pool)."""


class AmbiguousReplica(TokenlaneError, LookupError):
    """The URL is in several pools and no pool was named."""


class SharedUnavailable(TokenlaneError):
    """Redis did not answer in time, failed, or the breaker is open: use the local view.
    (``proxy.state.redislink.Unavailable`` is this class.)"""


class ClientGone(TokenlaneError):
    """The client disconnected before its request was whole: nobody to answer, nothing to
    log as a server error (a CancelledError out of the app would be, by uvicorn)."""


# ---------------------------------------------------------------------------- rendering

INTERNAL_MESSAGE = "internal error in the gateway; see its log"


def error_body(
    message: str, type_: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# -- the upstream seam (``proxy.relay.upstream``) ------------------------------------------------


class UpstreamError(TokenlaneError):
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


class StrayAnswer(TokenlaneError):
    """Inside the relay's HTTP client only (``relay/h1.py``): raised from the parser's callback
    at a message that begins after the answer ended, to stop the parse there. Never leaves
    the client."""


# -- the relay's attempts ---------------------------------------------------------------------


class HeadRefused(TokenlaneError):
    """Raised from an HTTP parser callback to stop parsing a request head that broke one of
    the edge's bounds (``proxy.edge.bounds``); the connection is answered and closed there."""


class InvalidResponse(TokenlaneError, RuntimeError):
    """A response an ASGI app asked the gateway's server for that HTTP/1.1 cannot carry (a
    header byte HTTP refuses, a status with no line, a body longer or shorter than its
    Content-Length): nothing of it is written. Also a ``RuntimeError``, as uvicorn raises
    there."""


class AttemptFault(TokenlaneError):
    """A fault the relay found itself (a status, an error event, its watchdog), on its way to
    the one place that judges faults."""

    def __init__(self, fault: Fault, detail: str) -> None:
        super().__init__(detail)
        self.fault = fault
        self.detail = detail


class RetryableFailure(TokenlaneError):
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


def internal_error(code: int | None = 500) -> GatewayError:
    """The answer to an unexpected exception: its detail goes to the log, never to the client.
    The relayed endpoints have always given it code 500, Starlette's routes a null ``code``."""
    err = GatewayError(INTERNAL_MESSAGE)
    err.code = code
    return err


def error_json(err: GatewayError, dialect: Dialect = Dialect.OPENAI) -> bytes:
    """The body of ``err``'s answer on the relayed paths (``json.dumps``' default spacing)."""
    return json.dumps(err.body(dialect)).encode()


def error_messages(
    err: GatewayError,
    request_id: str | None = None,
    extra: list[tuple[bytes, bytes]] | tuple[()] = (),
    dialect: Dialect = Dialect.OPENAI,
) -> tuple[Message, Message]:
    """``err`` as the two ASGI messages of a whole answer; ``extra`` is the request's
    ``Call.extra_headers`` (its key's rate-limit headers)."""
    body = error_json(err, dialect)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    for k, v in err.headers.items():
        headers.append((k.encode(), v.encode()))
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    headers += extra
    return (
        {"type": "http.response.start", "status": err.status, "headers": headers},
        {"type": "http.response.body", "body": body, "more_body": False},
    )


async def send_error(
    send: Send,
    err: GatewayError,
    request_id: str | None = None,
    extra: list[tuple[bytes, bytes]] | tuple[()] = (),
    dialect: Dialect = Dialect.OPENAI,
) -> None:
    """Answer with ``err`` over ASGI (the relayed paths, and auth in front of Starlette)."""
    start, body = error_messages(err, request_id, extra, dialect)
    await send(start)
    await send(body)


def error_response(err: GatewayError, dialect: Dialect = Dialect.OPENAI) -> JSONResponse:
    """``err`` as a Starlette response (models, admin, and Starlette's own 404 / 405 / 500):
    Starlette's compact JSON, with ``err``'s headers."""
    return JSONResponse(err.body(dialect), err.status, headers=err.headers)


def sse_error_event(err: GatewayError, dialect: Dialect = Dialect.OPENAI) -> bytes:
    """``err`` as the last events of a stream that already started, in the stream's own
    dialect: chat and completions end with an OpenAI-shaped error event and ``[DONE]``, as vLLM
    ends a failed stream; a Messages stream with Anthropic's ``event: error``; a Responses
    stream with its typed ``error`` event. Neither of the last two has ``[DONE]``."""
    if dialect is Dialect.ANTHROPIC:
        return b"event: error\ndata: " + error_json(err, dialect) + b"\n\n"
    if dialect is Dialect.RESPONSES:
        event = {"type": "error", "code": err.type, "message": err.message, "param": err.param}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
    return b"data: " + error_json(err) + b"\n\ndata: [DONE]\n\n"
