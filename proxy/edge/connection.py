"""One client connection as the gateway serves it: uvicorn's httptools protocol with
TCP_NODELAY, the ``START_WITH_BODY``, ``CLIENT_GONE`` and ``DIRECT_BODY`` extensions, and the
edge bounds (``proxy.edge.bounds``) held per connection.

The protocol finds what its server's connections share (``Edge``: the bounds in force and the
refusal counters) through the app it serves: any object with a ``gateway`` that has ``policy``
and ``metrics`` (``EdgeOwner``), so this module needs nothing of the composition root.

Length: one job, the gateway's side of a client connection: the cycle's extensions
(``START_WITH_BODY``, ``CLIENT_GONE``, ``DIRECT_BODY``) and the bounds share the protocol's
state and its one timer, and change together when uvicorn moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import weakref
from collections.abc import Callable
from typing import Any, Protocol, cast

import httptools
from prometheus_client import CollectorRegistry, Counter
from starlette.types import Message
from uvicorn.protocols.http.httptools_impl import (
    HttpToolsProtocol,
    RequestResponseCycle,
)

from proxy.config import Policy, ServerConfig
from proxy.edge.asgi_ext import (
    CLIENT_GONE,
    DIRECT_BODY,
    START_BODY,
    START_MORE_BODY,
    START_WITH_BODY,
    ClientGoneHook,
)
from proxy.edge.bounds import (
    BODY,
    HEAD,
    IDLE,
    LINGER,
    LINGER_S,
    REFUSAL_REASONS,
    SILENT,
    Bounds,
    head_refusal,
    on_timer,
    refusal_answer,
)
from proxy.edge.head import DirectBody, MessageEvent
from proxy.errors import HeadRefused
from proxy.observe.metrics import Metrics

log = logging.getLogger("tokenlane")
_NO_OPTIONS: dict[str, object] = {}  # an extension's (empty) options, shared


class EdgeOwner(Protocol):
    """What the edge reads of the gateway: the policy in force and the metrics registry."""

    policy: Policy
    metrics: Metrics


class _Capture:
    """Stands in for the connection's transport while one message's writes are collected;
    ``flush`` sends them in one vectored write. A close (``Connection: close``) flushes and
    closes at once, as uvicorn expects before it looks for the next request."""

    __slots__ = ("closed", "parts", "transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.parts: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def flush(self) -> None:
        if self.parts:
            self.transport.writelines(self.parts)  # one write, no joined copy
            self.parts = []

    def close(self) -> None:
        self.flush()
        self.transport.close()
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed or self.transport.is_closing()


class CoalescingCycle(RequestResponseCycle):
    """uvicorn's request/response cycle that also takes the ``START_WITH_BODY`` extension: a
    response start carrying its first body, written to the socket in one write.

    Under plain ASGI the status line and headers leave in one write and the first chunk in
    another: two TCP segments, and on a busy host two wake-ups of the client before it sees
    any content. Relayed responses always have their first chunk in hand when they start."""

    direct_body: DirectBody | None = None  # this cycle's DIRECT_BODY writer (set with the class)

    # uvicorn types ``send`` with its own event TypedDicts; an ASGI app hands us any message
    # mapping (starlette's ``Message``), and ours carry the START_WITH_BODY keys besides.
    async def send(self, message: Message) -> None:  # type: ignore[override]
        body = message.get(START_BODY)
        if body is None:
            await super().send(cast(Any, message))
            return
        writer = self.direct_body
        if writer is not None and writer.start(self.send, message):
            return
        more = bool(message.get(START_MORE_BODY, False))
        transport = self.transport
        capture = _Capture(transport)
        self.transport = capture  # type: ignore[assignment]
        try:
            await super().send(cast(Any, message))
            await super().send({"type": "http.response.body", "body": body, "more_body": more})
        finally:
            self.transport = transport
        if not self.disconnected:
            capture.flush()


class Edge:
    """What one server's connections share: the policy's current bounds and the refusal
    counter (``tokenlane_connection_refusals_total{reason}``, on the gateway's registry)."""

    def __init__(
        self, server: Callable[[], ServerConfig], registry: CollectorRegistry | None
    ) -> None:
        self._server = server
        self._of: tuple[ServerConfig, Bounds] | None = None
        self.refusals = Counter(
            "tokenlane_connection_refusals",
            "Connections refused or closed by the gateway's HTTP edge before a request was "
            "complete, by reason.",
            ["reason"],
            registry=registry,
        )
        self._series = {reason: self.refusals.labels(reason) for reason in REFUSAL_REASONS}
        self.write_stalls = Counter(
            "tokenlane_write_stalls",
            "Responses cut because the client read nothing of them for "
            "server.write_stall_timeout_s.",
            registry=registry,
        )

    def bounds(self) -> Bounds:
        """The bounds of the policy in force (a reload applies to new connections)."""
        server = self._server()
        cached = self._of
        if cached is None or cached[0] is not server:
            cached = self._of = (server, Bounds.of(server))
        return cached[1]

    def refused(self, reason: str, client: tuple[str, int] | None) -> None:
        self._series[reason].inc()
        peer = f"{client[0]}:{client[1]}" if client else "?"
        log.info("connection from %s refused: %s", peer, reason)

    def stalled(self, client: tuple[str, int] | None, stall_s: float) -> None:
        self.write_stalls.inc()
        peer = f"{client[0]}:{client[1]}" if client else "?"
        log.warning("client %s read nothing for %gs: response cut", peer, stall_s)


_EDGES: weakref.WeakKeyDictionary[EdgeOwner, Edge] = weakref.WeakKeyDictionary()
_DEFAULT_SERVER = ServerConfig()


def _server_of(owner: EdgeOwner) -> Callable[[], ServerConfig]:
    # A weak reference: the edge is cached by gateway and must not keep it alive.
    ref = weakref.ref(owner)

    def server() -> ServerConfig:
        gw = ref()
        return gw.policy.server if gw is not None else _DEFAULT_SERVER

    return server


def _is_owner(obj: object) -> bool:
    return isinstance(getattr(obj, "policy", None), Policy) and isinstance(
        getattr(obj, "metrics", None), Metrics
    )


def edge_for(app: object) -> Edge:
    """The ``Edge`` of the gateway behind ``app`` (found through middleware wrappers' ``app``);
    a plain ASGI app gets the default bounds and a counter of its own."""
    for _ in range(8):
        gateway = getattr(app, "gateway", None)
        if _is_owner(gateway):
            owner = cast(EdgeOwner, gateway)
            edge = _EDGES.get(owner)
            if edge is None:
                edge = _EDGES[owner] = Edge(_server_of(owner), owner.metrics.registry)
            return edge
        app = getattr(app, "app", None)
        if app is None:
            break
    return Edge(lambda: _DEFAULT_SERVER, None)


class NoDelayHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with TCP_NODELAY on every accepted connection (neither
    asyncio nor uvicorn sets it, and Nagle's algorithm would hold back a small SSE chunk
    until the previous one is acknowledged), serving the ``START_WITH_BODY`` extension.

    It also holds each connection to the edge bounds (``Bounds``): header bytes and count
    counted as the parser reports them, the bytes of an unfinished head, one timer per
    connection for a silent socket, a slow head and a stalled body, and the connection cap.
    A request followed by bytes that do not parse gets its answer first; then the 400."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)
        self._hooks: list[tuple[RequestResponseCycle, ClientGoneHook]] = []
        config: Any = self.config
        edge = config.__dict__.get("tokenlane_edge")
        if edge is None:
            edge = config.tokenlane_edge = edge_for(config.loaded_app)
        self._edge: Edge = edge
        b = self._bounds = edge.bounds()
        self._head_open = True  # waiting for (the rest of) a head
        self._head_raw = 0  # its bytes on the wire so far, counted by read
        self._head_size = 0  # its URL, header names and values, as parsed
        self._head_count = 0
        self._refusal: str | None = None  # set when a bound broke or the connection is done
        self._bad_input = False  # input that does not parse, after a request to answer first
        self._phase = SILENT
        self._since = self.loop.time()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._stall: asyncio.TimerHandle | None = None  # armed only while writes are paused
        self._arm(b.silent_timeout_s)
        if len(self.connections) > b.max_connections:
            self._refuse("connection_cap")

    # ---------------------------------------------------------------- input

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return  # lingering after a refusal: input is dropped
        self._unset_keepalive_if_required()
        if self._head_open:
            self._head_raw += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._phase = IDLE  # the connection is another protocol's from here
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            self._parse_failed()
            return
        if self._head_open:
            if not self._head_raw:
                self._phase = IDLE  # a request ended with this read; none begun after it
            elif self._head_raw > self._bounds.raw_head_cap:
                self._refuse("header_bytes")
            elif self._phase is not HEAD:
                self._phase = HEAD
                self._since = self.loop.time()
                self._arm(self._bounds.head_timeout_s)
        elif self._phase is BODY:
            self._since = self.loop.time()  # progress; the timer, armed, looks when it fires
        else:
            self._phase = BODY
            self._since = self.loop.time()
            self._arm(self._bounds.body_timeout_s)

    def _parse_failed(self) -> None:
        """Input that does not parse (or broke a bound in a parser callback)."""
        if self._refusal is not None:  # a bound, from a callback
            reason, self._refusal = self._refusal, None
            self._refuse(reason)
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # A request parsed before the bad bytes (in the same read) is answered first: stop
            # reading; the 400 follows its response (``on_response_complete``).
            self._bad_input = True
            self.flow.pause_reading()
            return
        self._refuse("malformed")

    # asyncio's contract: returning True keeps the transport half-open (uvicorn's own
    # annotation says None, as it never does).
    def eof_received(self) -> bool | None:  # type: ignore[override]
        if self._phase is LINGER:
            self.transport.close()  # the client read its refusal and left
        return None

    # ---------------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_size = 0
        self._head_count = 0

    def on_url(self, url: bytes) -> None:
        self.url += url
        self._head_size += len(url)
        if self._head_size > self._bounds.max_header_bytes:
            self._refusal = "header_bytes"
            raise HeadRefused

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value)
        self._head_count += 1
        b = self._bounds
        if self._head_size > b.max_header_bytes or self._head_count > b.max_headers:
            self._refusal = head_refusal(self._head_size, self._head_count, b)
            raise HeadRefused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._head_raw = 0
        super().on_headers_complete()
        # The request's cycle exists now and its app task has not run yet (a pipelined one
        # starts later). The extensions are advertised only when the cycle really is ours: a
        # uvicorn that built its cycle another way gets plain ASGI from the relay, never a
        # start whose body the server would drop.
        cycle = self.cycle
        if cycle is None or cycle.scope is not self.scope:
            return  # an upgrade, or nothing new
        if type(cycle) is RequestResponseCycle:
            cycle.__class__ = CoalescingCycle
        if type(cycle) is CoalescingCycle:
            # Not awaited or set yet: the compiled event in its place (``MessageEvent``).
            cycle.message_event = cast(asyncio.Event, MessageEvent())
            hook = ClientGoneHook()
            writer = cycle.direct_body = DirectBody(cycle)
            ours = {START_WITH_BODY: _NO_OPTIONS, CLIENT_GONE: hook, DIRECT_BODY: writer}
            theirs = self.scope.get("extensions")
            self.scope["extensions"] = cast(Any, {**theirs, **ours} if theirs else ours)
            # Every request of the connection not answered yet: with pipelining, the one
            # running is no longer ``self.cycle`` (the last one parsed) when the client leaves.
            live = [(c, h) for c, h in self._hooks if not c.response_complete]
            live.append((cycle, hook))
            self._hooks = live

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_open = True

    def on_response_complete(self) -> None:
        if self._bad_input and not self.pipeline and not self.transport.is_closing():
            self.server_state.total_requests += 1
            self._refuse("malformed")  # every request before the bad bytes is answered
            return
        super().on_response_complete()

    # ---------------------------------------------------------------- timer and refusals

    def _arm(self, delay: float) -> None:
        """The connection's one timer fires within ``delay`` (it may be due sooner already)."""
        at = self.loop.time() + delay
        timer = self._timer
        if timer is not None:
            if self._timer_at <= at:
                return  # it fires first, and looks at the phase then
            timer.cancel()
        self._timer_at = at
        self._timer = self.loop.call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        call = on_timer(
            self._phase, self._since, self.loop.time(), self.flow.read_paused, self._bounds
        )
        if call.refuse is not None:
            self._refuse(call.refuse)
        elif call.close:
            self.transport.close()
        elif call.again_in is not None:
            self._arm(call.again_in)

    def _refuse(self, reason: str) -> None:
        """Answer (for a silent connection: nothing), count, log, and close: at once when
        nothing was sent, else after a linger in which input is read and dropped."""
        self._refusal = reason
        self._edge.refused(reason, self.client)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # The application gets its disconnect now and writes nothing more.
            cycle.disconnected = True
            cycle.message_event.set()
        answer = refusal_answer(reason, self._bounds)
        transport = self.transport
        if not answer:
            transport.close()
            return
        transport.write(answer)
        self.flow.resume_reading()  # the input is drained while lingering
        try:
            transport.write_eof()
        except (OSError, RuntimeError, NotImplementedError):
            transport.close()
            return
        self._phase = LINGER
        self._since = self.loop.time()
        self._arm(LINGER_S)

    # ---------------------------------------------------------------- a client that stops reading

    def pause_writing(self) -> None:
        """The transport's buffer is over its high-water mark: the client is not keeping up.
        Only now is a timer armed, so a client that reads costs nothing per chunk."""
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(
                self._bounds.write_stall_timeout_s, self._write_stalled
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _write_stalled(self) -> None:
        """Nothing was read for the whole timeout: cut the connection. Its requests learn it
        through their ``CLIENT_GONE`` hooks (which cancel their upstreams), marked as cut."""
        self._stall = None
        if self.transport.is_closing():
            return
        stall_s = self._bounds.write_stall_timeout_s
        self._edge.stalled(self.client, stall_s)
        for cycle, hook in self._hooks:
            if not cycle.response_complete:
                hook.reason = f"client read nothing for {stall_s:g}s: response cut"
        self.transport.abort()  # unread bytes are dropped: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        for cycle, hook in self._hooks:
            if not cycle.response_complete:
                hook.fire()
        self._hooks = []
