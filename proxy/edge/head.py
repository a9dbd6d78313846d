"""A response's start and first body as uvicorn's httptools cycle writes them, in one compiled
pass (``proxy/compiled.py``), for the ``START_WITH_BODY`` extension (``edge/connection.py``);
its further chunks, and the request's body when it is all in, for the ``DIRECT_BODY``
extension (``DirectBody``); and the cycle's event (``MessageEvent``): the parts of each
request's cycle that are compiled.

uvicorn's ``RequestResponseCycle.send`` is interpreted: a relayed response's start and first
body went through it twice (the start, then the body), with a regular expression per header
name and value. The rules here are ``send``'s, step for step (the status line, each header
checked and lowered, Content-Length, chunked framing, ``Connection: close``, HEAD, 204 and
304); where ``send`` would raise (a header it refuses, a status it has no line for, a body
longer or shorter than its Content-Length) this returns None and the cycle lets ``send``
itself raise. ``tests/test_head.py`` holds the two to the same bytes and state.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    RequestResponseCycle,
)

from proxy.edge.asgi_ext import START_BODY, START_MORE_BODY

# The bytes uvicorn's expressions take in a header name and a header value, read off them.
_NAME_BYTES: Final = bytes(b for b in range(256) if HEADER_RE.search(bytes([b])) is None)
_VALUE_BYTES: Final = bytes(b for b in range(256) if HEADER_VALUE_RE.search(bytes([b])) is None)
_CRLF: Final = b"\r\n"
_SEP: Final = b": "
_LAST_CHUNK: Final = b"0\r\n\r\n"
# The size lines of chunks under 2 KiB (a token's event is a few hundred bytes), made once:
# a chunk framed by two concatenations costs about half what formatting it did (callgrind).
_SIZE_LINES: Final = [b"%x\r\n" % n for n in range(2048)]


def _size_line(n: int) -> bytes:
    """A chunk's size line, for a chunk of ``n`` bytes."""
    return _SIZE_LINES[n] if n < 2048 else b"%x\r\n" % n


class Start:
    """The bytes to write (in order, one vectored write) and the cycle's state after them."""

    __slots__ = ("chunked", "complete", "keep_alive", "length", "parts")

    def __init__(
        self,
        parts: list[bytes],
        chunked: bool | None,
        length: int,
        keep_alive: bool,
        complete: bool,
    ) -> None:
        self.parts = parts
        self.chunked = chunked  # None: neither (HEAD, 204, 304 without a length), as send
        self.length = length  # the cycle's expected_content_length: what is left to send
        self.keep_alive = keep_alive
        self.complete = complete


def start_with_body(
    status: int,
    headers: Iterable[tuple[bytes, bytes]],
    default_headers: list[tuple[bytes, bytes]],
    method: str,
    chunked: bool | None,
    length: int,
    keep_alive: bool,
    body: bytes,
    more_body: bool,
) -> Start | None:
    """The status line, ``default_headers`` then ``headers``, and ``body`` framed, as ``send``
    writes a start then a body message; ``chunked``, ``length`` and ``keep_alive`` are the
    cycle's state before them. None: ``send`` must decide (it raises)."""
    line = STATUS_LINE.get(status)
    if line is None:
        return None
    every = [*default_headers, *headers]
    # ``send`` searches each name and each value with an expression that is one character
    # class: a byte it refuses is left when every byte it takes is deleted, over all the
    # names (values) joined (sre scans ~10 ns a byte; ``translate`` ~1).
    if b"".join([name for name, _ in every]).translate(None, _NAME_BYTES):
        return None
    if b"".join([value for _, value in every]).translate(None, _VALUE_BYTES):
        return None
    parts = [line]
    closing = False
    for name, value in every:
        name = name.lower()
        if name == b"content-length" and chunked is None:
            try:
                length = int(value.decode())
            except ValueError:
                return None
            chunked = False
        elif name == b"transfer-encoding" and value.lower() == b"chunked":
            length = 0
            chunked = True
        elif name == b"connection":
            if b"close" in [token.lower().strip() for token in value.split(b",")]:
                keep_alive = False
                closing = True
        parts += (name, _SEP, value, _CRLF)
    if not keep_alive and not closing:
        parts.append(b"connection: close\r\n")
    if chunked is None and method != "HEAD" and status != 204 and status != 304:
        chunked = True
        parts.append(b"transfer-encoding: chunked\r\n")
    parts.append(_CRLF)
    if method == "HEAD":
        length = 0
    elif chunked:
        if body:
            parts += (_size_line(len(body)), body, _CRLF)
        if not more_body:
            parts.append(_LAST_CHUNK)
    else:
        if len(body) > length:
            return None
        length -= len(body)
        if body:
            parts.append(body)
    if not more_body and length != 0:
        return None
    return Start(parts, chunked, length, keep_alive, not more_body)


class DirectBody:
    """A cycle's ``DIRECT_BODY`` writer (``asgi_ext.BodyWriter``): a started stream's chunks,
    written from the upstream connection's callback, framed as uvicorn's ``send`` frames a
    chunk of a chunked body with more to come.

    Compiled, apart from the cycle: as the cycle's own interpreted methods, the write ran an
    interpreted frame for every relayed chunk, in a callback between system calls that leave
    the caches cold; compiled, a chunk costs 1.5 µs less user CPU (paired, 256 paced
    streams, ``docs/benchmarks.md``). The cycle's attributes are read at each call: the
    transport is swapped while ``CoalescingCycle.send`` collects a message's writes.

    The cycle is held by a weak reference: the scope holds the writer and the cycle the scope,
    and a strong one closed the loop, so that every request's cycle, scope, writer and event
    were left to the garbage collector (11 objects a request under ``gc.DEBUG_SAVEALL``, and the
    collections they caused) instead of being freed by their counts once the request is over.
    A writer whose cycle is gone writes nothing, as for a client gone."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = weakref.ref(cycle)

    @property
    def cycle(self) -> RequestResponseCycle | None:
        return self._cycle()

    def start(self, send: Callable[..., Any], message: Mapping[str, Any]) -> bool:
        """Write a ``START_WITH_BODY`` start now, as the cycle's ``send`` would write it, and
        say so; False (nothing written) where ``send`` must take it: the app's ``send`` is not
        the cycle's own (a middleware wraps it: CORS adds headers to the start), the state is
        not a fresh response's, or ``start_with_body`` leaves it to ``send`` (where it raises).
        The relay's start then costs no interpreted coroutine (``Responder.send_start``)."""
        cycle = self.cycle
        if (
            cycle is None
            or send != cycle.send
            or message["type"] != "http.response.start"
            or cycle.response_started
            or cycle.disconnected
            or cycle.access_log
            or cycle.flow.write_paused
        ):
            return False
        start = start_with_body(
            message["status"],
            message.get("headers", ()),
            cycle.default_headers,
            cycle.scope["method"],
            cycle.chunked_encoding,
            cycle.expected_content_length,
            cycle.keep_alive,
            message[START_BODY],
            bool(message.get(START_MORE_BODY, False)),
        )
        if start is None:
            return False
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        cycle.chunked_encoding = start.chunked
        cycle.expected_content_length = start.length
        cycle.keep_alive = start.keep_alive
        cycle.transport.writelines(start.parts)
        if start.complete:
            _complete(cycle)
        return True

    def take_body(self) -> bytes | None:
        cycle = self.cycle
        if (
            cycle is None
            or cycle.more_body
            or cycle.waiting_for_100_continue
            or cycle.disconnected
            or cycle.response_started
            or not cycle.message_event.is_set()
        ):
            return None
        # What ``receive`` does with a body that is all in: the bytes, the buffer emptied, the
        # event cleared (the next ``receive`` waits for the disconnect), reading resumed (the
        # protocol pauses it under a large body).
        body = bytes(cycle.body)
        cycle.body = bytearray()
        cycle.message_event.clear()
        cycle.flow.resume_reading()
        return body

    def direct(self) -> bool:
        cycle = self.cycle
        return cycle is not None and _direct(cycle)

    def write_body(self, data: bytes) -> bool:
        # A client gone already is skipped as send skips it (its relay is being cancelled).
        cycle = self.cycle
        if cycle is None or cycle.disconnected:
            return True
        cycle.transport.write(_size_line(len(data)) + data + _CRLF)
        return not cycle.flow.write_paused

    def end(self, data: bytes) -> bool:
        """What ``send`` does with the body message that ends a ``direct`` response: ``data``
        (if any) and the last chunk in one write, the response complete. False, with nothing
        written, while the client's socket is full: ``send`` takes it, and drains first."""
        cycle = self.cycle
        if cycle is None:
            return True  # the request is over: nothing to end
        if not _direct(cycle):
            return False  # not a direct response (ended already): ``send`` says what is wrong
        if cycle.disconnected:
            return True  # as ``send`` does: nothing is written, or ended, for a client gone
        if cycle.flow.write_paused:
            return False
        if data:
            cycle.transport.write(_size_line(len(data)) + data + _CRLF + _LAST_CHUNK)
        else:
            cycle.transport.write(_LAST_CHUNK)
        _complete(cycle)
        return True

    async def drain(self) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.disconnected:
            await cycle.flow.drain()


class MessageEvent:
    """``asyncio.Event``'s ``set``, ``clear``, ``is_set`` and ``wait``, as the cycle's
    ``message_event`` (uvicorn's cycle and protocol call ``set``, ``wait`` and ``clear``;
    ``edge/connection.py`` puts one in each cycle it serves, in place of the one uvicorn made):
    asyncio's is interpreted, and set and awaited on every request."""

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


def _direct(cycle: RequestResponseCycle) -> bool:
    """A started, chunked response, not complete and not a HEAD's: ``write_body`` may add to it."""
    return (
        cycle.response_started
        and not cycle.response_complete
        and cycle.chunked_encoding is True
        and cycle.scope["method"] != "HEAD"
    )


def _complete(cycle: RequestResponseCycle) -> None:
    """The response's last bytes are written: end it as ``send`` ends one, and the protocol
    starts a request pipelined behind it or arms the keep-alive timeout (``on_response``;
    without it a pipelined request waited for ever)."""
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    cycle.on_response()


__all__ = ["DirectBody", "MessageEvent", "Start", "start_with_body"]
