"""The HTTP edge's bounds: what a client may hold before its request is complete, and before
it is authenticated (header bytes and count, time to send a head, gaps in a body, a connection
that sends nothing, the number of open connections). Pure decisions over ``Bounds``; the
connection protocol (``proxy.edge.connection``) keeps the counts and one timer per connection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Final

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from proxy.config import ServerConfig
from proxy.errors import error_body

REFUSAL_REASONS: Final = (
    "header_bytes",  # 431: the URL, header names and values over max_request_header_bytes
    "header_count",  # 431: more than max_request_headers
    "head_timeout",  # 408: a head not complete within request_head_timeout_s of its first byte
    "body_timeout",  # 408: no body byte for request_body_timeout_s
    "silent",  # closed: a new connection that sent nothing for silent_connection_timeout_s
    "connection_cap",  # 503: more than max_connections open
    "malformed",  # 400: not HTTP/1.1 the parser accepts
)
# After a refusal the answer is written, the write side shut, and what the client still sends
# read and dropped for this long: closing at once with unread input makes the kernel send a
# reset, which can destroy the answer before the client reads it.
LINGER_S: Final = 2.0
# How long a kept-alive connection may wait for its next request (uvicorn's
# ``timeout_keep_alive``, which ``serve`` sets to this; uvicorn's own default is 5 s).
KEEP_ALIVE_S: Final = 30
# A head's framing beyond what is counted: ": " and CRLF per header line, and the request
# line's method, spaces and version.
_FRAMING_PER_LINE: Final = 4
_REQUEST_LINE_FRAMING: Final = 64


@dataclass(frozen=True, slots=True)
class Bounds:
    """The ``server.*`` bounds a connection is held to (a snapshot taken when it opens)."""

    max_header_bytes: int
    max_headers: int
    head_timeout_s: float
    body_timeout_s: float
    silent_timeout_s: float
    max_connections: int
    write_stall_timeout_s: float
    # Bytes an unfinished head may take on the wire. httptools buffers a header line until it
    # ends (by concatenation: quadratic), so one endless header is refused while it is still
    # arriving, once it cannot fit the counted bound whatever its framing.
    raw_head_cap: int
    keep_alive_s: float = KEEP_ALIVE_S

    @classmethod
    def of(cls, server: ServerConfig, keep_alive_s: float = KEEP_ALIVE_S) -> Bounds:
        return cls(
            max_header_bytes=server.max_request_header_bytes,
            max_headers=server.max_request_headers,
            head_timeout_s=server.request_head_timeout_s,
            body_timeout_s=server.request_body_timeout_s,
            silent_timeout_s=server.silent_connection_timeout_s,
            max_connections=server.max_connections,
            write_stall_timeout_s=server.write_stall_timeout_s,
            raw_head_cap=server.max_request_header_bytes
            + _FRAMING_PER_LINE * server.max_request_headers
            + _REQUEST_LINE_FRAMING,
            keep_alive_s=keep_alive_s,
        )


def head_refusal(size: int, count: int, bounds: Bounds) -> str | None:
    """Why a head with ``size`` bytes of URL, header names and values and ``count`` headers
    is refused (as Envoy counts: names and values, the path included), or None."""
    if count > bounds.max_headers:
        return "header_count"
    if size > bounds.max_header_bytes:
        return "header_bytes"
    return None


# A connection's phase, for its one timer.
IDLE: Final = "idle"  # between requests, or a request being answered: nothing to time here
SILENT: Final = "silent"  # accepted, nothing received yet
HEAD: Final = "head"  # part of a head received
BODY: Final = "body"  # head complete, body not
LINGER: Final = "linger"  # refused: the answer is out, input is dropped until the close
KEPT: Final = "kept"  # a response complete, the connection kept alive, no byte of the next request


@dataclass(frozen=True, slots=True)
class TimerCall:
    """What a connection's timer does when it fires: refuse for ``refuse``, else look again
    after ``again_in`` seconds, else nothing (the timer is dropped until a phase needs it)."""

    refuse: str | None = None
    again_in: float | None = None
    close: bool = False


def on_timer(phase: str, since: float, now: float, reading_paused: bool, b: Bounds) -> TimerCall:
    """The timer's decision. ``since``: when the phase began (for a body, its last byte).

    A body is timed only while the server reads: with reading paused the server is waiting
    on its own application (flow control), not on the client."""
    if phase == SILENT:
        limit, reason = b.silent_timeout_s, "silent"
    elif phase == HEAD:
        limit, reason = b.head_timeout_s, "head_timeout"
    elif phase == BODY:
        if reading_paused:
            return TimerCall(again_in=b.body_timeout_s)
        limit, reason = b.body_timeout_s, "body_timeout"
    elif phase == LINGER:
        left = since + LINGER_S - now
        return TimerCall(again_in=left) if left > 0 else TimerCall(close=True)
    elif phase == KEPT:
        left = since + b.keep_alive_s - now
        return TimerCall(again_in=left) if left > 0 else TimerCall(close=True)
    else:
        return TimerCall()
    left = since + limit - now
    return TimerCall(again_in=left) if left > 0 else TimerCall(refuse=reason)


def refusal_answer(reason: str, b: Bounds) -> bytes:
    """The bytes a refusal writes (none for a silent connection), in the gateway's error
    shape, with ``Connection: close``."""
    if reason == "silent":
        return b""
    extra = b""
    if reason == "header_bytes":
        status, kind = 431, "RequestHeaderFieldsTooLarge"
        message = f"request headers too large: over {b.max_header_bytes} bytes"
    elif reason == "header_count":
        status, kind = 431, "RequestHeaderFieldsTooLarge"
        message = f"too many request headers: over {b.max_headers}"
    elif reason == "head_timeout":
        status, kind = 408, "RequestTimeout"
        message = f"request head not complete within {b.head_timeout_s:g}s"
    elif reason == "body_timeout":
        status, kind = 408, "RequestTimeout"
        message = f"no request body received for {b.body_timeout_s:g}s"
    elif reason == "connection_cap":
        status, kind = 503, "ServiceUnavailableError"
        message = f"too many open connections (over {b.max_connections}); retry shortly"
        extra = b"retry-after: 1\r\n"
    elif reason == "malformed":
        status, kind = 400, "BadRequestError"
        message = "invalid HTTP request"
    else:
        raise ValueError(f"unknown refusal reason {reason!r}")
    body = json.dumps(error_body(message, kind, None, status)).encode()
    return b"".join(
        (
            STATUS_LINE[status],
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            extra,
            b"connection: close\r\n\r\n",
            body,
        )
    )
