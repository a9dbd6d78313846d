"""One request and its response on a client connection (``proxy.edge.connection``): the ASGI
``receive`` and ``send`` the app is given, the task that runs it, and the ``DIRECT_BODY``
writer (``asgi_ext.BodyWriter``) through which a relay writes a stream's chunks without an
ASGI message. Compiled (``proxy/compiled.py``): every request and every relayed chunk goes
through it.

Its rules are uvicorn's ``RequestResponseCycle``'s, which the gateway ran until it served its
connections itself: a ``100 Continue`` written at the first ``receive`` of a request that
expects one; ``http.disconnect`` once the client is gone or the response is complete; a
``send`` that waits while the client's socket is full and writes nothing for a client gone;
an exception before the response started answered with a 500, after it with the connection
closed; the connection closed after a response that does not keep it alive. Measured side by
side with an app that answers at once (``loadtest/bench_server.py``), uvicorn's interpreted
protocol and cycle cost 54-68 µs of CPU a request, these 46-55, and a protocol that only
parses and writes 13-17 (``docs/benchmarks.md``, "The server's own protocol").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, Final

from proxy.edge.asgi_ext import START_BODY, START_MORE_BODY
from proxy.edge.head import response_start, write_chunk

log: Final = logging.getLogger("uvicorn.error")  # where uvicorn said it, for the same readers
# A request body buffered past this pauses reading until the app takes it.
HIGH_WATER: Final = 65536
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
_500_HEADERS: Final = [
    (b"content-type", b"text/plain; charset=utf-8"),
    (b"content-length", b"21"),
    (b"connection", b"close"),
]


class MessageEvent:
    """``asyncio.Event``'s ``set``, ``clear``, ``is_set`` and ``wait``, compiled: set and
    awaited on every request (asyncio's is interpreted)."""

    __slots__ = ("_set", "_waiters")

    def __init__(self) -> None:
        self._set = False
        self._waiters: list[asyncio.Future[None]] = []

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if not self._set:
            self._set = True
            for waiter in self._waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> bool:
        if self._set:
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
            return True
        finally:
            self._waiters.remove(waiter)


class Flow:
    """A connection's reading (paused while a body waits for its app, or a pipelined request
    for the one before it) and writing (paused while the client's socket is full)."""

    __slots__ = ("_writable", "read_paused", "transport", "write_paused")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.read_paused = False
        self.write_paused = False
        self._writable = MessageEvent()
        self._writable.set()

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()

    def pause_writing(self) -> None:
        if not self.write_paused:
            self.write_paused = True
            self._writable.clear()

    def resume_writing(self) -> None:
        if self.write_paused:
            self.write_paused = False
            self._writable.set()

    async def drain(self) -> None:
        await self._writable.wait()


class Cycle:
    """One request's ASGI side. ``on_response`` is the connection's: told once the response's
    last byte is written (the next pipelined request starts, or the keep-alive is timed); it
    is dropped when the app returns, so that the cycle and its connection do not hold each
    other. The scope is not held: its extensions hold the cycle (``DIRECT_BODY``)."""

    def __init__(
        self,
        transport: asyncio.Transport,
        flow: Flow,
        method: str,
        keep_alive: bool,
        expect_100_continue: bool,
        default_headers: list[tuple[bytes, bytes]],
        on_response: Callable[[], None],
    ) -> None:
        self.transport = transport
        self.flow = flow
        self.method = method
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        self.default_headers = default_headers
        self.on_response: Callable[[], None] | None = on_response
        self.disconnected = False
        self.body = bytearray()
        self.more_body = True
        self.message_event = MessageEvent()
        self.response_started = False
        self.response_complete = False
        self.chunked_encoding: bool | None = None
        self.expected_content_length = 0

    # ---------------------------------------------------------------- the app's task

    async def run_asgi(self, app: Callable[..., Any], scope: dict[str, Any]) -> None:
        try:
            result = await app(scope, self.receive, self.send)
        except BaseException as exc:
            log.error("Exception in ASGI application\n", exc_info=exc)
            if not self.response_started:
                await self.send_500_response()
            else:
                self.transport.close()
        else:
            if result is not None:
                log.error("ASGI callable should return None, but returned '%s'.", result)
                self.transport.close()
            elif not self.response_started and not self.disconnected:
                log.error("ASGI callable returned without starting response.")
                await self.send_500_response()
            elif not self.response_complete and not self.disconnected:
                log.error("ASGI callable returned without completing response.")
                self.transport.close()
        finally:
            self.on_response = None

    async def send_500_response(self) -> None:
        await self.send({"type": "http.response.start", "status": 500, "headers": _500_HEADERS})
        await self.send(
            {"type": "http.response.body", "body": b"Internal Server Error", "more_body": False}
        )

    # ---------------------------------------------------------------- ASGI

    async def receive(self) -> Mapping[str, Any]:
        if (
            self.waiting_for_100_continue
            and not self.disconnected
            and not self.transport.is_closing()
        ):
            self.transport.write(_CONTINUE)
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            self.flow.resume_reading()
            await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        message = {"type": "http.request", "body": bytes(self.body), "more_body": self.more_body}
        self.body = bytearray()
        return message

    async def send(self, message: Mapping[str, Any]) -> None:
        # A dict, as every app sends: typed so, its ``get`` is the dict's own, not a method call.
        if type(message) is not dict:
            message = dict(message)
        msg: dict[str, Any] = message
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(
                    f"Expected ASGI message 'http.response.start', but got '{kind}'."
                )
            self._start(msg)
        elif not self.response_complete:
            if kind != "http.response.body":
                raise RuntimeError(f"Expected ASGI message 'http.response.body', but got '{kind}'.")
            body = msg.get("body", b"")
            if type(body) is not bytes:
                body = bytes(body)  # a memoryview or bytearray (Starlette streams memoryviews)
            self._body(body, bool(msg.get("more_body", False)))
        else:
            raise RuntimeError(
                f"Unexpected ASGI message '{kind}' sent, after response already completed."
            )

    def _start(self, message: dict[str, Any]) -> None:
        """A response start, with its first body when it carries one (``START_WITH_BODY``),
        written in one vectored write."""
        body = message.get(START_BODY)
        if body is not None and type(body) is not bytes and type(body) is not list:
            body = bytes(body)
        start = response_start(
            message["status"],
            message.get("headers", ()),
            self.default_headers,
            self.method,
            self.chunked_encoding,
            self.expected_content_length,
            self.keep_alive,
            b"" if body is None else body,
            True if body is None else bool(message.get(START_MORE_BODY, False)),
        )
        self.response_started = True
        self.waiting_for_100_continue = False
        self.chunked_encoding = start.chunked
        self.expected_content_length = start.length
        self.keep_alive = start.keep_alive
        self.transport.writelines(start.parts)
        if start.complete:
            self._complete()

    def _body(self, body: bytes, more_body: bool) -> None:
        if self.method == "HEAD":
            self.expected_content_length = 0
        elif self.chunked_encoding:
            if body or not more_body:
                write_chunk(self.transport, body, not more_body)
        else:
            if len(body) > self.expected_content_length:
                raise RuntimeError("Response content longer than Content-Length")
            self.expected_content_length -= len(body)
            if body:
                self.transport.write(body)
        if not more_body:
            if self.expected_content_length != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self._complete()

    def _complete(self) -> None:
        """The response's last bytes are written: the connection closes if it is not kept,
        and is told (a pipelined request starts, or its keep-alive is timed)."""
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        on_response = self.on_response
        if on_response is not None:
            on_response()

    # ---------------------------------------------------------------- DIRECT_BODY

    def start(self, send: Callable[..., Any], message: Mapping[str, Any]) -> bool:
        """A ``START_WITH_BODY`` start written now, as ``send`` would write it; False (nothing
        written) where ``send`` must take it: ``send`` is not this cycle's (a middleware wraps
        it: CORS adds headers to the start), or the state is not a fresh response's."""
        if (
            send != self.send
            or message["type"] != "http.response.start"
            or self.response_started
            or self.disconnected
            or self.flow.write_paused
        ):
            return False
        self._start(message if type(message) is dict else dict(message))
        return True

    def take_body(self) -> bytes | None:
        """The whole request body, when it is in (as the first ``receive`` returns it)."""
        if (
            self.more_body
            or self.waiting_for_100_continue
            or self.disconnected
            or self.response_started
            or not self.message_event.is_set()
        ):
            return None
        body = bytes(self.body)
        self.body = bytearray()
        self.message_event.clear()  # the next ``receive`` waits for the disconnect
        self.flow.resume_reading()
        return body

    def direct(self) -> bool:
        """A started, chunked response, not complete and not a HEAD's."""
        return (
            self.response_started
            and not self.response_complete
            and self.chunked_encoding is True
            and self.method != "HEAD"
        )

    def write_body(self, data: bytes) -> bool:
        # A client gone already is skipped as ``send`` skips it (its relay is being cancelled).
        if self.disconnected:
            return True
        write_chunk(self.transport, data, False)
        return not self.flow.write_paused

    def end(self, data: bytes) -> bool:
        """``data`` (if any) and the last chunk in one write, the response complete. False,
        with nothing written, while the client's socket is full (``send`` drains first), or
        where the response is not ``direct`` (``send`` says what is wrong)."""
        if not self.direct():
            return False
        if self.disconnected:
            return True
        if self.flow.write_paused:
            return False
        write_chunk(self.transport, data, True)
        self._complete()
        return True

    async def drain(self) -> None:
        if not self.disconnected:
            await self.flow.drain()


__all__ = ["HIGH_WATER", "Cycle", "Flow", "MessageEvent"]
