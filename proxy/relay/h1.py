"""The relay's own HTTP/1.1 client to the replicas: one asyncio protocol per connection, parsed
by ``httptools`` (the C parser uvicorn already runs for the client side), pooled per replica.

Why not the general client it replaces (aiohttp under httpx): a relayed token crossed four
Python layers (aiohttp's protocol and stream reader, a read timer re-armed per read, two
async generators) and woke the relay's task once per token. ``loadtest/bench_floor.py``
measures two bare relays on this machine: waking a task per chunk costs 8 to 17 µs of CPU
more than writing the chunk from the connection's callback, a third to a half of all the
Rust router spends per chunk (``docs/benchmarks.md``, "The relay's own client"). So a body
here is either read (``next_chunk``: the head of a stream, whole answers, everything
unusual) or *pumped* (``pump``): each chunk goes to a handler synchronously, from the
connection's own ``data_received``, and the relay writes it to the client there and then.

What this client does not do, because the relay never asks it to: redirects, cookies,
decompression, proxies, ``Expect: 100-continue``, HTTP/2. Errors are Tokenlane's own
(``proxy.errors``), told apart by how far the exchange got, as ``upstream.py`` documents.

Length: one job, the client: the connection's protocol, its pool and the send that takes a
connection from the pool (resending on a stale one) change together.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Callable
from typing import Final

import httptools

from proxy.errors import (
    StrayAnswer,
    UpstreamClosed,
    UpstreamError,
    UpstreamNotHttp,
    UpstreamReadTimeout,
    UpstreamUnreached,
)
from proxy.headers import LOWER
from proxy.relay.sse import contains

# A body held by a reader that is not reading (the client is slow, or the relay is busy with
# a chunk it parses) stops the replica's socket being read past this, as aiohttp's did.
HIGH_WATER: Final = 256 * 1024
_CRLF: Final = b"\r\n"

# A pumped chunk's handler (given what one read brought of the body) returns None to go on;
# anything else stops the pump and is what ``pump`` returns: the bytes it did not take (the
# chunk itself when it declines it, or what follows the part it took), which the caller reads
# the slow way, or ``PAUSE`` when it took the chunk but the client's socket is full.
Handler = Callable[[bytes], "bytes | None"]
PAUSE: Final = b""

# A request that met a close or reset on a connection taken from the pool, before any byte of
# an answer, is sent again on another connection, at most this many times. The server closed
# a connection it held idle (its keep-alive ran out, or it is shutting down: a rolling restart
# closes every idle connection at once), so it never read the request: RFC 9112 section 9.3.1
# lets a client resend what it knows was never applied, and a pooled connection closed under
# the request is what HAProxy's "http-reuse safe" and aiohttp's own resend (idempotent methods
# only) are for. A fresh connection that fails the same way is a replica that read the
# request and died: that is the retry rules' to judge (``relay/retry.py``), not resent here.
STALE_RESENDS: Final = 3
# Methods whose requests carry no body, so no Content-Length when they have none.
_NO_BODY_METHODS: Final = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})
# Set by ``request_head`` itself (``without_framing``).
_SET_HERE: Final = frozenset({b"host", b"content-length", b"transfer-encoding"})


class H1Connection(asyncio.Protocol):
    """One connection to a replica and the exchange on it (one at a time: no pipelining)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        # The read timeout's one timer, kept from one exchange to the next (``_arm``).
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._reset_exchange()

    def _reset_exchange(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head: asyncio.Future[None] | None = None
        self.got_bytes = False  # any byte of an answer: the replica read the request
        self.complete = False  # the whole message is in
        self.keep_alive = False
        self.length_known = False  # content-length or chunked: else the body ends at close
        self.head_only = False  # the answer to a HEAD: no body whatever its headers say
        self.interim = False  # inside a 1xx answer
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.waiter: asyncio.Future[None] | None = None
        self.error: UpstreamError | None = None
        self.handler: Handler | None = None
        self.declined: bytes | None = None  # what the handler gave back, delivered next
        self.handler_error: Exception | None = None
        self.paused = False
        self.read_timeout: float | None = None
        self.last_read = 0.0
        self.batch: list[bytes] | None = None  # inside ``data_received``'s parse
        # The parser stands between two chunks of a chunked body (``leading_chunks``): its
        # last callback ended a chunk and the read ended there, or whole chunks since did.
        self.at_boundary = False

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.head is None or self.complete:
            # Bytes with no request waiting for them (an idle connection, or past the end of
            # an answer): not HTTP this client can place. The connection is not used again.
            self.close()
            return
        self.got_bytes = True
        self.last_read = self.loop.time()
        # A pumped body's pieces in this read (``on_body``) go to the handler together, after
        # the parse: one call, and one write to the client, for the tokens that came at once.
        # Only while a handler waits (nothing during the parse sets one): other reads make no list.
        batch: list[bytes] | None = None
        if self.handler is not None and self.declined is None:
            batch = []
        self.batch = batch
        error: Exception | None = None
        rest = data
        if self.at_boundary:
            # Whole chunks at the start of the read are taken here, not by the parser, which
            # stays where it was (before a chunk's size line) for whatever follows them.
            pieces: list[bytes] = []
            taken = leading_chunks(data, pieces)
            for piece in pieces:
                self.on_body(piece)
            if taken:
                rest = data[taken:]
        if rest:
            try:
                self.parser.feed_data(rest)
            except (httptools.HttpParserUpgrade, httptools.HttpParserError) as exc:
                error = exc
            # Still between chunks only if the parse ended one and nothing came after it:
            # a size line's first bytes call nothing, but never end in CRLF. Never after an
            # error: what a closing transport still delivers must not skip the failed parser.
            self.at_boundary = error is None and self.at_boundary and rest.endswith(_CRLF)
        self.batch = None
        if batch:
            self._hand(batch[0] if len(batch) == 1 else b"".join(batch))
        if error is None:
            return
        if isinstance(error, httptools.HttpParserUpgrade):
            self._fail(UpstreamNotHttp("the replica switched protocols"))
        elif self.complete:
            # A message or garbage past the end (``on_message_begin`` stops the parse at a
            # second message): the answer stands; the connection is not used again.
            self.close()
        elif not self.head.done():
            self._fail(UpstreamNotHttp(f"not an HTTP answer: {error}"))
        else:
            self._fail(UpstreamClosed(f"a broken body: {error}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        if self.complete or self.head is None:
            return
        if exc is None and self.head.done() and not self.length_known and not self.head_only:
            # A body delimited by the close (RFC 9112 6.3): a clean one, not a reset.
            self.on_message_complete()
            return
        why = str(exc) if exc else "the replica closed the connection"
        self._fail(UpstreamClosed(why or type(exc).__name__))

    # -- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            raise StrayAnswer  # a message after the answer, in the same read

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        lower = name.translate(LOWER)  # ``name.lower()`` (``proxy.headers``)
        if lower == b"content-length" or (
            lower == b"transfer-encoding" and contains(value.lower(), b"chunked")
        ):
            self.length_known = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if 100 <= self.status < 200:  # an interim answer (103): the real one follows
            self.headers = []
            self.interim = True
            return
        self.keep_alive = self.parser.should_keep_alive()
        head = self.head
        if head is not None and not head.done():
            head.set_result(None)
        if self.head_only or self.status in (204, 304):
            self.keep_alive = False  # httptools would wait for a body that never comes
            self.on_message_complete()

    def on_chunk_header(self) -> None:
        self.at_boundary = False

    def on_chunk_complete(self) -> None:
        # httptools calls it once the CRLF after the chunk's bytes is read: the parser waits
        # for the next size line.
        self.at_boundary = True

    def on_body(self, body: bytes) -> None:
        batch = self.batch
        if batch is not None:
            batch.append(body)
            return
        self._hand(body)

    def _hand(self, body: bytes) -> None:
        """A body's bytes to the pump's handler, or kept for the reader."""
        handler = self.handler
        if handler is not None and self.declined is None:
            try:
                back = handler(body)
            except Exception as exc:  # the relay's bug: raised in its task, not lost here
                self.handler = None
                self.handler_error = exc
                self._wake()
                return
            if back is None:
                return
            self.handler = None
            self.declined = back
            self._wake()
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        if self.complete:
            return
        self.complete = True
        # The read timeout's timer is left armed: on a kept connection the next exchange
        # takes it over (``_arm``); one that fires between exchanges does nothing.
        self._wake()

    # -- the exchange ----------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self._stop_timer()
        head = self.head
        if head is not None and not head.done():
            head.set_exception(error)
            head.exception()  # retrieved here: a failed head nobody awaits is no warning
        self._wake()
        if self.transport is not None:
            self.transport.close()

    def _arm(self) -> None:
        """The read timeout's timer fires by ``last_read + read_timeout``. One armed sooner
        is kept (it looks at the last read when it fires, and arms again): a kept
        connection's exchanges share one timer, where each made and cancelled its own (a
        uvloop timer made, cancelled and freed is about 7,000 instructions, callgrind)."""
        timeout = self.read_timeout
        if timeout is None or self.complete:
            return
        at = self.last_read + timeout
        timer = self._timer
        if timer is not None:
            if self._timer_at <= at:
                return
            timer.cancel()
        self._timer_at = at
        self._timer = self.loop.call_at(at, self._idle_check)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _idle_check(self) -> None:
        """The read timeout, as a check of the last read rather than a timer re-armed on
        every read: a token costs one attribute store, not a timer."""
        self._timer = None
        timeout = self.read_timeout
        # Between exchanges (or in one with no read timeout): nothing to time.
        if self.complete or self.error is not None or timeout is None:
            return
        now = self.loop.time()
        if self.paused:  # we stopped reading, not the replica: look again a timeout later
            self._timer_at = now + timeout
            self._timer = self.loop.call_at(self._timer_at, self._idle_check)
            return
        if now - self.last_read >= timeout:
            self._fail(UpstreamReadTimeout(f"nothing from the replica for {timeout:g}s"))
            return
        self._arm()

    async def exchange(self, head: bytes, body: bytes, read_timeout: float | None) -> None:
        """Send a request; return once its status line and headers are in."""
        assert self.transport is not None
        self.head = self.loop.create_future()
        self.read_timeout = read_timeout
        self.last_read = self.loop.time()
        self._arm()
        if body:
            self.transport.writelines((head, body))
        else:
            self.transport.write(head)
        await self.head

    async def next_chunk(self) -> bytes:
        """What has arrived of the body since the last call, joined; b"" at its end."""
        while True:
            if self.declined:  # a chunk a cancelled pump was handed back
                chunk, self.declined = self.declined, None
                return chunk
            if self.chunks:
                chunks = self.chunks
                self.chunks = []
                self.buffered = 0
                if self.paused and self.transport is not None and not self.closed:
                    self.paused = False
                    self.last_read = self.loop.time()  # the replica was not silent: we were
                    self.transport.resume_reading()
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if self.error is not None:
                raise self.error
            if self.complete:
                return b""
            await self._wait()

    async def pump(self, handler: Handler) -> bytes | None:
        """Hand the body to ``handler`` as it arrives, synchronously, what one read brought in
        one call. Returns what the handler returned instead of None (the bytes it did not take,
        or a pause: its business), or None at the body's end. Chunks read before come first."""
        if self.declined == PAUSE:  # a pause a cancelled pump never returned: over
            self.declined = None
        while True:
            chunk = await self.next_chunk() if self.chunks or self.declined else None
            if chunk is not None:
                if not chunk:
                    return None
                back = handler(chunk)
                if back is not None:
                    return back
                continue
            if self.error is not None:
                raise self.error
            if self.complete:
                return None
            self.handler = handler
            try:
                await self._wait()
            finally:
                self.handler = None
            if self.handler_error is not None:
                error, self.handler_error = self.handler_error, None
                raise error
            if self.declined is not None:
                back, self.declined = self.declined, None
                return back

    async def _wait(self) -> None:
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def reusable(self) -> bool:
        return (
            self.complete
            and self.keep_alive
            and self.error is None
            and not self.closed
            and not self.chunks
            and self.declined is None
        )

    def close(self) -> None:
        self.closed = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()


class Origin:
    """Where a replica listens, and its idle connections (most recently used last)."""

    __slots__ = ("host", "host_header", "idle", "port", "ssl")

    def __init__(self, scheme: str, raw_host: bytes, port: int | None) -> None:
        # The host as it goes on the wire: IDNA-encoded, an IPv6 address without brackets.
        host = raw_host.decode("ascii").strip("[]")
        self.ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if scheme == "https" else None
        )
        default = 443 if self.ssl is not None else 80
        self.port = port or default
        self.host = host
        shown = f"[{host}]" if ":" in host else host
        self.host_header = (shown if self.port == default else f"{shown}:{self.port}").encode()
        self.idle: list[H1Connection] = []


class H1Pool:
    """Idle connections per replica, dropped after ``keepalive_expiry_s`` unused."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        keepalive_expiry_s: float,
        on_stale_resend: Callable[[], None] | None = None,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_expiry_s = keepalive_expiry_s
        self.on_stale_resend = on_stale_resend  # told of each request sent again (``send``)
        self.origins: dict[tuple[str, bytes, int | None], Origin] = {}

    def origin(self, scheme: str, raw_host: bytes, port: int | None) -> Origin:
        """A URL's origin (``httpx.URL``'s ``scheme``, ``raw_host``, ``port``), made once."""
        key = (scheme, raw_host, port)
        found = self.origins.get(key)
        if found is None:
            found = self.origins[key] = Origin(scheme, raw_host, port)
        return found

    def take_idle(self, origin: Origin, loop: asyncio.AbstractEventLoop) -> H1Connection | None:
        idle = origin.idle
        expired_before = loop.time() - self.keepalive_expiry_s
        while idle:
            conn = idle.pop()
            transport = conn.transport
            if (
                conn.closed
                or conn.idle_since < expired_before
                or transport is None
                or transport.is_closing()
            ):
                conn.close()
                continue
            conn._reset_exchange()
            return conn
        return None

    async def connect(self, origin: Origin) -> H1Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: H1Connection(loop),
                    origin.host,
                    origin.port,
                    ssl=origin.ssl,
                    server_hostname=origin.host if origin.ssl is not None else None,
                )
        except TimeoutError:
            raise UpstreamUnreached(f"no connection within {self.connect_timeout_s:g}s") from None
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamUnreached(str(exc) or type(exc).__name__) from exc
        return conn

    async def send(
        self,
        origin: Origin,
        method: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        read_timeout: float | None,
        *,
        resendable: bool = True,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> H1Connection:
        """Send a request and read its answer's head: the connection, its status and headers
        read, its body still to come. Raises only ``UpstreamError``. ``headers`` carry no
        Host, Content-Length or Transfer-Encoding (``request_head`` sets them; the relay's
        never hold them, ``without_framing`` takes them off others). ``resendable``: the body
        may go out twice (``STALE_RESENDS``). ``loop``: the running one, when the caller has it
        (``Call.loop``, without ``get_running_loop``'s system call)."""
        length = len(body) if body or method not in _NO_BODY_METHODS else None
        head = request_head(method, target, origin.host_header, headers, length)
        if loop is None:
            loop = asyncio.get_running_loop()
        resends = 0
        while True:
            conn = self.take_idle(origin, loop)
            from_pool = conn is not None
            if conn is None:
                conn = await self.connect(origin)
            conn.head_only = method == "HEAD"
            try:
                await conn.exchange(head, body, read_timeout)
            except UpstreamClosed:
                conn.close()
                # Closed before any byte of an answer on a connection taken from the pool: the
                # replica closed it idle and never read the request (``STALE_RESENDS``).
                if conn.got_bytes or not stale_resend_allowed(
                    from_pool, resends, streamed=not resendable
                ):
                    raise
                resends += 1
                if self.on_stale_resend is not None:
                    self.on_stale_resend()
                continue
            except BaseException:
                conn.close()
                raise
            return conn

    def release(self, origin: Origin, conn: H1Connection) -> None:
        """Back to the pool when the exchange ended cleanly; else closed. The oldest idle
        connections past their expiry are closed here too: taking the most recent first, a
        burst's surplus would otherwise stay open until the replica closed it."""
        idle = origin.idle
        if conn.reusable():
            conn.idle_since = now = conn.loop.time()
            expired_before = now - self.keepalive_expiry_s
            while idle and idle[0].idle_since < expired_before:
                idle.pop(0).close()
            idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for origin in self.origins.values():
            for conn in origin.idle:
                conn.close()
            origin.idle.clear()


def leading_chunks(data: bytes, pieces: list[bytes]) -> int:
    """The whole chunks of a chunked body at the start of ``data``, which begins at a chunk's
    size line: each one's bytes appended to ``pieces``; the offset after the last (0 for none).

    Why: a replica's stream is one chunk a token, usually one a read, and the parser's callbacks
    for it cost about as much as the rest of relaying the token. Taken here only what is plain
    (a size of one to eight hex digits, no extension, its bytes and CRLF all in the read); the
    last chunk (size 0, then trailers), and anything else, is left to the parser."""
    end = len(data)
    at = 0
    while at < end:
        # Scanned by hand: compiled, a version that found the line with ``bytes.find`` cost
        # three times this one over one token's chunk (``docs/benchmarks.md``).
        size = 0
        i = at
        limit = min(end, at + 8)
        while i < limit:
            c = data[i]
            if 48 <= c <= 57:
                size = size * 16 + c - 48
            elif 97 <= c <= 102:
                size = size * 16 + c - 87
            elif 65 <= c <= 70:
                size = size * 16 + c - 55
            else:
                break
            i += 1
        if i == at or i + 1 >= end or data[i] != 13 or data[i + 1] != 10:
            return at
        start = i + 2
        stop = start + size
        if size == 0 or stop + 2 > end or data[stop] != 13 or data[stop + 1] != 10:
            return at
        pieces.append(data[start:stop])
        at = stop + 2
    return at


def stale_resend_allowed(from_pool: bool, resends: int, *, streamed: bool) -> bool:
    """Whether a request that met a close or reset before any answer goes out again: only
    when its connection came from the pool (see ``STALE_RESENDS``) and its body can be sent
    twice."""
    return from_pool and not streamed and resends < STALE_RESENDS


def without_framing(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``headers`` less Host, Content-Length and Transfer-Encoding: for requests httpx built
    (the transport's other users, a traced attempt), whose Host ``request_head`` sets anew."""
    return [(k, v) for k, v in headers if k.translate(LOWER) not in _SET_HERE]


def request_head(
    method: str, target: bytes, host: bytes, headers: list[tuple[bytes, bytes]], length: int | None
) -> bytes:
    """The request line and headers: the caller's, with Host and Content-Length of ours."""
    parts = [method.encode(), b" ", target, b" HTTP/1.1\r\nhost: ", host, _CRLF]
    # Appended one by one: compiled, ``parts += (...)`` builds a tuple and extends by the
    # generic sequence protocol, per header.
    for name, value in headers:
        parts.append(name)
        parts.append(b": ")
        parts.append(value)
        parts.append(_CRLF)
    if length is not None:
        parts.append(b"content-length: ")
        parts.append(str(length).encode())
        parts.append(b"\r\n\r\n")
    else:
        parts.append(_CRLF)
    return b"".join(parts)


__all__ = [
    "HIGH_WATER",
    "PAUSE",
    "STALE_RESENDS",
    "H1Connection",
    "H1Pool",
    "Handler",
    "Origin",
    "leading_chunks",
    "request_head",
    "stale_resend_allowed",
    "without_framing",
]
