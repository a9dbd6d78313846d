"""One client connection as the gateway serves it: HTTP/1.1 parsed by httptools, each request
run as an ASGI app (``proxy.edge.cycle``) under uvicorn's ``Server`` (which binds, runs the
lifespan and signals, and shuts down), TCP_NODELAY, the ``START_WITH_BODY``, ``CLIENT_GONE``
and ``DIRECT_BODY`` extensions, and the edge bounds (``proxy.edge.bounds``) held per connection.

The gateway's own, compiled (``proxy/compiled.py``): uvicorn's httptools protocol, which it ran
before, is interpreted, and cost more CPU a request than the relay's own work on it
(``proxy/edge/cycle.py`` has the figures). Its behaviour is kept: keep-alive (timed by the
connection's one timer, not a timer per request), pipelining (one request answered at a time,
in order, reading paused meanwhile), ``Expect: 100-continue``, a WebSocket upgrade handed to
uvicorn's WebSocket protocol, and a graceful ``shutdown``.

uvicorn's ``limit_concurrency`` and its access log are not served: the gateway's own bounds
(``server.max_connections``, the lanes' queues) and its JSON access log do those jobs.

The protocol finds what its server's connections share (``Edge``: the bounds in force and the
refusal counters) through the app it serves: any object with a ``gateway`` that has ``policy``
and ``metrics`` (``EdgeOwner``), so this module needs nothing of the composition root.

Length: one job, the gateway's side of a client connection. Parsing, the bounds and the
keep-alive share the protocol's state and its one timer; each request's ASGI side is
``proxy.edge.cycle``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import socket
import urllib.parse
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Final, Protocol, cast

import httptools
from prometheus_client import CollectorRegistry, Counter
from uvicorn.protocols.utils import get_local_addr, get_remote_addr, is_ssl

from proxy.config import Policy, ServerConfig
from proxy.edge.asgi_ext import (
    CLIENT_GONE,
    DIRECT_APP,
    DIRECT_BODY,
    START_WITH_BODY,
    ClientGoneHook,
)
from proxy.edge.bounds import (
    BODY,
    HEAD,
    IDLE,
    KEPT,
    LINGER,
    LINGER_S,
    REFUSAL_REASONS,
    SILENT,
    Bounds,
    head_refusal,
    on_timer,
    refusal_answer,
)
from proxy.edge.cycle import HIGH_WATER, Cycle, Flow
from proxy.errors import HeadRefused
from proxy.headers import LOWER
from proxy.observe.metrics import Metrics

log: Final = logging.getLogger("tokenlane")
uvicorn_log: Final = logging.getLogger("uvicorn.error")
_NO_OPTIONS: Final[dict[str, object]] = {}  # an extension's (empty) options, shared
_parse_url: Final = httptools.parse_url  # a Final: compiled, not a module lookup a request


class EdgeOwner(Protocol):
    """What the edge reads of the gateway: the policy in force and the metrics registry."""

    policy: Policy
    metrics: Metrics


class Edge:
    """What one server's connections share: the policy's current bounds and the refusal
    counter (``tokenlane_connection_refusals_total{reason}``, on the gateway's registry)."""

    def __init__(
        self, server: Callable[[], ServerConfig], registry: CollectorRegistry | None
    ) -> None:
        self._server = server
        self._of: tuple[ServerConfig, float, Bounds] | None = None
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

    def bounds(self, keep_alive_s: float) -> Bounds:
        """The bounds of the policy in force (a reload applies to new connections)."""
        server = self._server()
        cached = self._of
        if cached is None or cached[0] is not server or cached[1] != keep_alive_s:
            cached = self._of = (server, keep_alive_s, Bounds.of(server, keep_alive_s))
        return cached[2]

    def refused(self, reason: str, client: tuple[str, int] | None) -> None:
        self._series[reason].inc()
        peer = f"{client[0]}:{client[1]}" if client else "?"
        log.info("connection from %s refused: %s", peer, reason)

    def stalled(self, client: tuple[str, int] | None, stall_s: float) -> None:
        self.write_stalls.inc()
        peer = f"{client[0]}:{client[1]}" if client else "?"
        log.warning("client %s read nothing for %gs: response cut", peer, stall_s)


_EDGES: Final[weakref.WeakKeyDictionary[EdgeOwner, Edge]] = weakref.WeakKeyDictionary()
_DEFAULT_SERVER: Final = ServerConfig()


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


class GatewayProtocol:
    """One client connection: the parser's callbacks build each request's scope and
    ``Cycle``, whose app runs in a task of its own; the connection's one timer holds it to the
    edge bounds (a silent socket, a slow head, a stalled body, the keep-alive between
    requests, the linger after a refusal), and the connection cap is checked as it opens. A
    request followed by bytes that do not parse gets its answer first; then the 400.

    Made by uvicorn's ``Server`` as its ``http`` protocol class, with its config, its shared
    state (the open connections and the apps' tasks, which its shutdown waits for, and the
    default headers it keeps dated) and the lifespan's state."""

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not config.loaded:
            config.load()
        self.config: Any = config
        # The app's direct entry where it offers one (``asgi_ext.DIRECT_APP``), else the app.
        self.app: Any = getattr(config.loaded_app, DIRECT_APP, config.loaded_app)
        self.loop: asyncio.AbstractEventLoop = _loop or asyncio.get_event_loop()
        self.server_state: Any = server_state
        self.connections: set[Any] = server_state.connections
        self.tasks: set[asyncio.Task[None]] = server_state.tasks
        self.app_state = app_state
        self.root_path: str = config.root_path
        self.asgi_version: str = config.asgi_version
        self.fresh_context: bool = bool(getattr(config, "reset_contextvars", False))
        self.parser: Any = httptools.HttpRequestParser(self)
        # Answer a request whose bytes are followed by the client's close, as uvicorn does.
        with contextlib.suppress(AttributeError):
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        edge = config.__dict__.get("tokenlane_edge")
        if edge is None:
            edge = config.tokenlane_edge = edge_for(config.loaded_app)
        self._edge: Edge = edge
        # Typed: ``edge`` is read from the config's dict (Any), and so, untyped, would be
        # every read of a bound (a generic attribute lookup, three a header).
        self._bounds: Bounds = edge.bounds(float(config.timeout_keep_alive))
        # Per connection
        self.transport: asyncio.Transport = cast(asyncio.Transport, None)  # until made
        self.flow = Flow(self.transport)
        self.server: tuple[str, int | None] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.pipeline: deque[tuple[Cycle, dict[str, Any], ClientGoneHook]] = deque()
        self.cycle: Cycle | None = None
        self._hooks: list[tuple[Cycle, ClientGoneHook]] = []
        # Per request, while its head is parsed
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.scope: dict[str, Any] = {}
        self.expect_100_continue = False
        self._upgrading = False  # a WebSocket upgrade, handed over once the parser stops
        # The bounds
        self._head_open = True  # waiting for (the rest of) a head
        self._head_raw = 0  # its bytes on the wire so far, counted by read
        self._head_size = 0  # its URL, header names and values, as parsed
        self._head_count = 0
        self._refusal: str | None = None  # set when a bound broke or the connection is done
        self._bad_input = False  # input that does not parse, after a request to answer first
        self._phase = SILENT
        self._since = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._stall: asyncio.TimerHandle | None = None  # armed only while writes are paused

    # ---------------------------------------------------------------- the connection

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.connections.add(self)
        self.transport = transport
        self.flow = Flow(transport)
        self.server = get_local_addr(transport)
        self.client = get_remote_addr(transport)
        self.scheme = "https" if is_ssl(transport) else "http"
        # Neither asyncio nor uvicorn sets it, and Nagle's algorithm would hold back a small
        # SSE chunk until the previous one is acknowledged.
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._since = self.loop.time()
        self._arm(self._bounds.silent_timeout_s)
        if len(self.connections) > self._bounds.max_connections:
            self._refuse("connection_cap")

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        self._disconnect_all(fire=True)
        self.flow.resume_writing()
        if exc is None:
            self.transport.close()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        self._hooks = []
        for queued in self.pipeline:
            queued[0].on_response = None  # never to run: it would hold the connection
        self.pipeline.clear()
        self.parser = None  # it holds this protocol's callbacks: a cycle of references

    def _disconnect_all(self, *, fire: bool) -> None:
        """Every request of the connection not answered yet is told the client is gone (with
        pipelining, the one running is not ``self.cycle``, the last one parsed): its
        ``receive`` returns ``http.disconnect``, its writes stop; ``fire``: its ``CLIENT_GONE``
        hook too (the connection is lost; a refusal's loss follows it)."""
        for c, hook in self._hooks:
            if not c.response_complete:
                c.disconnected = True
                c.message_event.set()
                if fire:
                    hook.fire()

    # asyncio's contract: returning True keeps the transport half-open.
    def eof_received(self) -> bool | None:
        if self._phase == LINGER:
            self.transport.close()  # the client read its refusal and left
        return None

    def shutdown(self) -> None:
        """The server's graceful shutdown: an idle connection closes now, a busy one after
        its response."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            self.transport.close()
        else:
            cycle.keep_alive = False

    def pause_writing(self) -> None:
        """The transport's buffer is over its high-water mark: the client is not keeping up.
        Only now is a timer armed, so a client that reads costs nothing per chunk."""
        self.flow.pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(
                self._bounds.write_stall_timeout_s, self._write_stalled
            )

    def resume_writing(self) -> None:
        self.flow.resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    # ---------------------------------------------------------------- input

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return  # lingering after a refusal: input is dropped
        if self._head_open:
            self._head_raw += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._phase = IDLE  # the connection is another protocol's from here
            if self._should_upgrade():
                self._upgrade()
            else:
                uvicorn_log.warning("Unsupported upgrade request.")
            return
        except httptools.HttpParserError:
            self._parse_failed()
            return
        if self._head_open:
            if not self._head_raw:
                self._between()  # a request ended with this read; none begun after it
            elif self._head_raw > self._bounds.raw_head_cap:
                self._refuse("header_bytes")
            elif self._phase != HEAD:
                self._phase = HEAD
                self._since = self.loop.time()
                self._arm(self._bounds.head_timeout_s)
        elif self._phase == BODY:
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
            self._phase = IDLE  # the request is in progress: nothing for the timer to time
            return
        self._refuse("malformed")

    # ---------------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        self.url = b""
        self.expect_100_continue = False
        self._upgrading = False
        self.headers = []
        self.scope = {
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
        }
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
        name = name.translate(LOWER)  # ``lower()``, as one of mypyc's own operations
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._head_raw = 0
        parser = self.parser
        scope = self.scope
        http_version: str = parser.get_http_version()
        method: str = parser.get_method().decode("ascii")
        scope["method"] = method
        if http_version != "1.1":
            scope["http_version"] = http_version
        if parser.should_upgrade() and self._should_upgrade():
            self._upgrading = True  # the parser stops here; ``data_received`` hands it over
            return
        parsed: Any = _parse_url(self.url)
        raw_path: bytes = parsed.path
        query: bytes | None = parsed.query
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        root = self.root_path
        scope["path"] = root + path if root else path
        scope["raw_path"] = root.encode("ascii") + raw_path if root else raw_path
        scope["query_string"] = b"" if query is None else query
        cycle = Cycle(
            self.transport,
            self.flow,
            method,
            http_version != "1.0" and parser.should_keep_alive(),
            self.expect_100_continue,
            self.server_state.default_headers,
            self.on_response_complete,
        )
        hook = ClientGoneHook()
        scope["extensions"] = {START_WITH_BODY: _NO_OPTIONS, CLIENT_GONE: hook, DIRECT_BODY: cycle}
        previous = self.cycle
        self.cycle = cycle
        if previous is None or previous.response_complete:
            # Answered in order: with the last one parsed answered, so is every one before it.
            self._hooks = [(cycle, hook)]
            self._run(cycle, scope, hook)
        else:
            # Pipelined: it waits for the one before it, and reading for both. Every request
            # not answered yet is kept with its hook: with pipelining, the one running is no
            # longer ``self.cycle`` (the last one parsed) when the client leaves.
            self._hooks.append((cycle, hook))
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, scope, hook))

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if cycle is None or cycle.response_complete or self._upgrading:
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER:
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        self._head_open = True
        cycle = self.cycle
        if cycle is None or cycle.response_complete or self._upgrading:
            return
        cycle.more_body = False
        cycle.message_event.set()

    def _run(self, cycle: Cycle, scope: dict[str, Any], hook: ClientGoneHook) -> None:
        coro = cycle.run_asgi(self.app, scope)
        if self.fresh_context:
            task = self.loop.create_task(coro, context=contextvars.Context())
        else:
            task = self.loop.create_task(coro)
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)
        hook.task = task

    def on_response_complete(self) -> None:
        """A response's last byte is written: the next pipelined request starts, or the
        connection waits for one, its keep-alive timed."""
        self.server_state.total_requests += 1
        if self._refusal is not None or self.transport.is_closing():
            return  # refused meanwhile (lingering, then closed), or closing
        if self._bad_input and not self.pipeline:
            self._refuse("malformed")  # every request before the bad bytes is answered
            return
        self.flow.resume_reading()
        if self.pipeline:
            self._run(*self.pipeline.pop())
        elif self._head_open and not self._head_raw:
            self._between()

    def _between(self) -> None:
        """No request being read: once the last one is answered (and none is queued behind
        it), the keep-alive is timed."""
        cycle = self.cycle
        if cycle is not None and cycle.response_complete and not self.pipeline:
            self._phase = KEPT
            self._since = self.loop.time()
            self._arm(self._bounds.keep_alive_s)
        else:
            self._phase = IDLE

    # ---------------------------------------------------------------- WebSocket upgrade

    def _should_upgrade(self) -> bool:
        """A WebSocket upgrade, with a WebSocket protocol to hand the connection to."""
        if self.config.ws_protocol_class is None:
            return False
        connection: list[bytes] = []
        upgrade = None
        for name, value in self.headers:
            if name == b"connection":
                connection = [token.lower().strip() for token in value.split(b",")]
            elif name == b"upgrade":
                upgrade = value.lower()
        return b"upgrade" in connection and upgrade == b"websocket"

    def _upgrade(self) -> None:
        """The connection to uvicorn's WebSocket protocol, fed the request's head again."""
        self.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        head = [self.scope["method"].encode(), b" ", self.url, b" HTTP/1.1\r\n"]
        for name, value in self.headers:
            head += (name, b": ", value, b"\r\n")
        head.append(b"\r\n")
        protocol = self.config.ws_protocol_class(
            config=self.config, server_state=self.server_state, app_state=self.app_state
        )
        protocol.connection_made(self.transport)
        protocol.data_received(b"".join(head))
        self.transport.set_protocol(protocol)
        self.parser = None  # it holds this protocol's callbacks, and parses no more

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
        self._disconnect_all(fire=False)  # the apps get their disconnect now, and write no more
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


__all__ = ["Edge", "EdgeOwner", "GatewayProtocol", "edge_for"]
