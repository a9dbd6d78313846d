"""ASGI extensions between the gateway's server (``serve``) and its relay.

All three are advertised in ``scope["extensions"]`` by ``connection.GatewayProtocol``;
under any other ASGI server they are absent and the relay does what plain ASGI allows (two
messages for a start and its first body; a task per request listening for the disconnect;
each chunk and the request's body through ``send`` and ``receive``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

# A response start may carry its first body (``START_BODY``, ``START_MORE_BODY``): both leave
# in one socket write instead of two, one TCP segment before the client sees content. The body
# is bytes, or a list of bytes written in order as one body (the relay's parts of a burst,
# which a join would copy once more: a stream's whole length, before the socket copies it).
START_WITH_BODY: Final = "tokenlane.start_with_body"
START_BODY: Final = "tokenlane.body"
START_MORE_BODY: Final = "tokenlane.more_body"

# The server calls back when the client's connection is lost before the response is complete,
# so a relay needs no task of its own waiting on ``receive()`` for ``http.disconnect``.
CLIENT_GONE: Final = "tokenlane.client_gone"


# The server writes a started response's further body chunks when asked directly, not as ASGI
# messages: a relay writes each chunk from its upstream connection's callback, with no task
# woken per chunk (``relay/h1.py`` says what that saves). The value is the ``BodyWriter``,
# which also hands over a request body that is all in without a ``receive`` (an interpreted
# coroutine and its message dict, on the way to the replica).
DIRECT_BODY: Final = "tokenlane.direct_body"

# Not an extension but an app's offer to the server: a method of this name, called with the ASGI
# arguments, returns the coroutine that serves the request (the app's ``__call__`` awaits it);
# the server creates the request's task from it directly, with no frame of the app's between.
DIRECT_APP: Final = "serve_direct"


class BodyWriter(Protocol):
    def start(self, send: Callable[..., Any], message: Mapping[str, Any]) -> bool:
        """Write a ``START_WITH_BODY`` response start (``message``) now, as ``send`` would,
        when ``send`` is the server's own (no middleware between); False, with nothing
        written, where ``send`` must take it."""
        ...

    def direct(self) -> bool:
        """Whether ``write_body`` may be used now: the response is started, chunked, and not
        the answer to a HEAD (else the relay sends ASGI messages as ever)."""
        ...

    def write_body(self, data: bytes) -> bool:
        """What ``send`` does with a non-empty body message that has more to come; False when
        the client's socket is full (``drain`` before writing more)."""
        ...

    def end(self, data: bytes) -> bool:
        """What ``send`` does with the body message that ends a ``direct`` response (its
        last ``data``, maybe empty); False, with nothing written, where ``send`` must take it
        (the client's socket is full)."""
        ...

    async def drain(self) -> None:
        """Until the client's socket takes more (or the client is gone)."""
        ...

    def take_body(self) -> bytes | None:
        """The whole request body when all of it is in, as the first ``receive`` returns it
        (a later ``receive`` then waits for the client to leave, as after that one); None
        where ``receive`` must take it (some body still to come, a ``100 Continue`` to send)."""
        ...


class ClientGoneHook:
    """One request's disconnect callback, set by the app and fired once by the server."""

    __slots__ = ("callback", "reason", "task")

    def __init__(self) -> None:
        self.callback: Callable[[], None] | None = None
        # The task running the request's app, set by the server as it starts it: the app
        # cancels it when the client leaves, without asking asyncio which task it is in.
        self.task: asyncio.Task[None] | None = None
        # Set by the server when it cut the connection itself (a client that stopped reading).
        self.reason: str | None = None

    def fire(self) -> None:
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()


__all__ = [
    "CLIENT_GONE",
    "DIRECT_APP",
    "DIRECT_BODY",
    "START_BODY",
    "START_MORE_BODY",
    "START_WITH_BODY",
    "BodyWriter",
    "ClientGoneHook",
]
