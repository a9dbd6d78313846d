"""Every internal of a library the code relies on, named, with the code that depends on it.

pyproject.toml bounds these libraries from above and constraints.txt pins them; this file is
what to run before raising a bound. Each check fails with a message that says which internal
moved and which Tokenlane code depends on it, so an upgrade that would silently change retry
semantics or the server's write path fails here first, by name.

Behaviour over real sockets is checked elsewhere (tests/test_upstream.py and tests/test_h1.py:
the errors each failure raises; tests/test_serve.py: the coalesced first write, the client-gone
hook and the direct body writer); here are the shapes those rely on.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

import aiohttp
import httptools
import httpx
import prometheus_client.metrics
import prometheus_client.mmap_dict
import prometheus_client.values
import pytest
import uvicorn
import uvicorn.lifespan.on
import uvicorn.server
from httpx_aiohttp.transport import AiohttpTransport
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from proxy.edge.connection import GatewayProtocol


@dataclass(frozen=True)
class Internal:
    library: str  # distribution name, for its version in the message
    what: str  # the internal, as the code uses it
    used_by: str  # the Tokenlane code that depends on it, and for what
    check: Callable[[], None]  # raises AssertionError (or AttributeError...) if it moved

    def __str__(self) -> str:
        return f"{self.library}: {self.what}"


def has_params(func: Callable[..., object], *names: str) -> None:
    params = inspect.signature(func).parameters
    missing = [n for n in names if n not in params]
    assert not missing, f"{func.__qualname__} lost parameter(s) {missing}"


def source_has(func: Callable[..., object], *snippets: str) -> None:
    src = inspect.getsource(func)
    missing = [s for s in snippets if s not in src]
    assert not missing, f"{func.__qualname__} no longer contains {missing}"


def is_sub(cls: type, *bases: type) -> None:
    for base in bases:
        assert issubclass(cls, base), f"{cls.__name__} is no longer a {base.__name__}"


def not_sub(cls: type, base: type) -> None:
    assert not issubclass(cls, base), f"{cls.__name__} is now a {base.__name__}"


# -- aiohttp and httpx-aiohttp: the upstream seam ------------------------------------------------

UPSTREAM = "proxy/relay/upstream.py"


def _exception_hierarchy() -> None:
    is_sub(aiohttp.SocketTimeoutError, aiohttp.ServerTimeoutError)
    is_sub(aiohttp.ConnectionTimeoutError, aiohttp.ServerTimeoutError)
    is_sub(aiohttp.ServerTimeoutError, aiohttp.ClientConnectionError)
    is_sub(aiohttp.ClientConnectorError, aiohttp.ClientConnectionError)
    is_sub(aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionError)
    is_sub(aiohttp.ClientConnectionError, aiohttp.ClientError)
    is_sub(aiohttp.ClientPayloadError, aiohttp.ClientError)
    is_sub(aiohttp.ClientResponseError, aiohttp.ClientError)
    # A cut body and a bad status line must not read as "closed on an established connection".
    not_sub(aiohttp.ClientPayloadError, aiohttp.ClientConnectionError)
    not_sub(aiohttp.ClientResponseError, aiohttp.ClientConnectionError)


def _transport() -> None:
    made = object()
    transport = AiohttpTransport(limits=httpx.Limits(), client=lambda: made)
    assert callable(transport.client), "AiohttpTransport no longer keeps client= as .client"
    assert transport.get_client() is made, "get_client() no longer calls a client factory"
    assert inspect.iscoroutinefunction(AiohttpTransport.aclose)
    source_has(AiohttpTransport.aclose, "self.client")


def _response_parser() -> None:
    class Seen:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def on_message_begin(self) -> None:
            self.calls.append("begin")
            if self.calls.count("begin") > 1:
                raise KeyError("stop")

        def on_header(self, name: bytes, value: bytes) -> None:
            self.calls.append("header")

        def on_headers_complete(self) -> None:
            # Asked here, as H1Connection asks: after the message, the parser has moved on.
            self.calls.append(f"head {parser.get_status_code()} {parser.should_keep_alive()}")

        def on_body(self, body: bytes) -> None:
            self.calls.append("body")

        def on_message_complete(self) -> None:
            self.calls.append("end")

    seen = Seen()
    parser = httptools.HttpResponseParser(seen)
    # A callback's exception stops the parse and comes out of feed_data as a parser error
    # whose context is the callback's exception.
    with pytest.raises(httptools.HttpParserCallbackError) as raised:
        parser.feed_data(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n")
    assert isinstance(raised.value.__context__, KeyError)
    is_sub(httptools.HttpParserCallbackError, httptools.HttpParserError)
    assert_equal(seen.calls, ["begin", "header", "head 200 True", "body", "end", "begin"])
    assert issubclass(httptools.HttpParserUpgrade, Exception)


def _chunk_boundary() -> None:
    class Seen:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def on_chunk_header(self) -> None:
            self.calls.append("size")

        def on_body(self, body: bytes) -> None:
            self.calls.append(body.decode())

        def on_chunk_complete(self) -> None:
            self.calls.append("chunk end")

        def on_message_complete(self) -> None:
            self.calls.append("end")

    seen = Seen()
    parser = httptools.HttpResponseParser(seen)
    parser.feed_data(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r")
    # The chunk ends once the CRLF after its bytes is read, not before.
    assert_equal(seen.calls, ["size", "abc"])
    parser.feed_data(b"\n")
    assert_equal(seen.calls, ["size", "abc", "chunk end"])
    # Then the parser waits for a size line: chunks taken without it leave it there.
    parser.feed_data(b"2\r\nde\r\n0\r\n\r\n")
    assert_equal(seen.calls[3:], ["size", "de", "chunk end", "size", "chunk end", "end"])


def _value_class() -> None:
    source_has(prometheus_client.metrics.Counter._metric_init, "values.ValueClass(")
    source_has(prometheus_client.metrics.Histogram._metric_init, "values.ValueClass(")
    has_params(
        prometheus_client.values.MutexValue.__init__,
        "typ", "metric_name", "name", "labelnames", "labelvalues", "help_text",
    )  # fmt: skip
    has_params(prometheus_client.mmap_dict.mmap_key, "metric_name", "name", "labelnames")
    for method in ("read_value", "write_value"):
        assert callable(getattr(prometheus_client.mmap_dict.MmapedDict, method))


def _histogram_child() -> None:
    # What Gaps adds in a batch is what observe adds one at a time.
    source_has(
        prometheus_client.metrics.Histogram.observe,
        "self._sum.inc(amount)", "enumerate(self._upper_bounds)", "if amount <= bound:",
        "self._buckets[i].inc(1)",
    )  # fmt: skip
    child = prometheus_client.metrics.Histogram(
        "internal_gaps", "x", ["l"], buckets=(0.1, 1.0), registry=None
    ).labels("a")
    assert_equal(child._upper_bounds, [0.1, 1.0, float("inf")])
    assert len(child._buckets) == 3
    for value in (*child._buckets, child._sum):
        assert callable(value.inc)


def _websocket_handover() -> None:
    from uvicorn.protocols.utils import get_local_addr, get_remote_addr, is_ssl

    async def app(scope: object, receive: object, send: object) -> None: ...

    config = uvicorn.Config(app, log_level="warning")
    config.load()  # the class the gateway's server would hand an upgrade to ("auto")
    ws = config.ws_protocol_class
    assert ws is not None
    has_params(ws.__init__, "config", "server_state", "app_state")
    has_params(ws.connection_made, "transport")
    assert callable(ws.data_received)
    for helper in (get_local_addr, get_remote_addr, is_ssl):
        has_params(helper, "transport")
    # The hand-over as uvicorn's own protocol does it (the head fed again, then set_protocol).
    source_has(
        HttpToolsProtocol.handle_websocket_upgrade,
        "protocol.connection_made(self.transport)",
        "protocol.data_received(",
        "self.transport.set_protocol(protocol)",
    )


INTERNALS = [
    Internal(
        "aiohttp",
        "exception hierarchy (SocketTimeoutError, ConnectionTimeoutError < ServerTimeoutError "
        "< ClientConnectionError; ClientConnectorError; ClientPayloadError, ClientResponseError "
        "outside ClientConnectionError)",
        f"{UPSTREAM} _SENDING/_READING: for WebSockets (plain requests raise Tokenlane's own "
        "errors in relay/h1.py), whether a failed exchange reached the replica",
        _exception_hierarchy,
    ),
    Internal(
        "aiohttp",
        "ClientSession(cookie_jar=, trust_env=, skip_auto_headers=), DummyCookieJar, "
        "TCPConnector(limit=, keepalive_timeout=)",
        f"{UPSTREAM} _session_factory (WebSockets): no cookies, no headers of aiohttp's own",
        lambda: (
            (
                has_params(
                    aiohttp.ClientSession.__init__, "cookie_jar", "trust_env", "skip_auto_headers"
                ),
                has_params(aiohttp.TCPConnector.__init__, "limit", "keepalive_timeout"),
                aiohttp.DummyCookieJar,
            )
            and None
        ),
    ),
    # -- httptools: the relay's own client (relay/h1.py) -----------------------------------------
    Internal(
        "httptools",
        "HttpResponseParser(protocol): on_message_begin, on_header, on_headers_complete, "
        "on_body, on_message_complete callbacks; get_status_code(), should_keep_alive(); "
        "HttpParserError, HttpParserUpgrade; a callback's exception stops the parse (raised as "
        "HttpParserCallbackError, the exception its context)",
        "proxy/relay/h1.py H1Connection: the answer's head, its body (pumped), its end, and "
        "bytes past the end (StrayAnswer)",
        _response_parser,
    ),
    Internal(
        "httptools",
        "HttpResponseParser: on_chunk_header at a size line's end, on_chunk_complete once the "
        "CRLF after the chunk's bytes is read, the parser then waiting for the next size line",
        "proxy/relay/h1.py H1Connection.at_boundary, leading_chunks: whole chunks taken without "
        "the parser while it stands between two",
        _chunk_boundary,
    ),
    Internal(
        "httpx-aiohttp",
        "AiohttpTransport(limits=, client=factory): .client, get_client(), aclose()",
        f"{UPSTREAM} RelayTransport: the WebSockets' session made on first use, closed with it",
        _transport,
    ),
    # -- httpx -----------------------------------------------------------------------------------
    Internal(
        "httpx",
        "Timeout(...).as_dict() with keys connect, read, write, pool",
        f"{UPSTREAM} timeout_extension and RelayTransport._client_timeout",
        lambda: assert_equal(
            set(httpx.Timeout(1.0).as_dict()), {"connect", "read", "write", "pool"}
        ),
    ),
    Internal(
        "httpx",
        "Response(stream=s).stream is s (a transport's stream is not wrapped)",
        "proxy/relay/upstream.py RawResponseStream: tests reach the relay's Reply through "
        "response.stream",
        lambda: _stream_kept(),
    ),
    Internal(
        "httpx",
        "ByteStream iterates its bytes synchronously",
        f"{UPSTREAM} RelayTransport.handle_async_request: the body sent as one buffer",
        lambda: assert_equal(b"".join(httpx.ByteStream(b"abc")), b"abc"),
    ),
    Internal(
        "httpx",
        "AsyncClient.send(request, **kw) is where a request (and a non-streamed body) completes",
        f"{UPSTREAM} UpstreamClient.send: the health loop sees only UpstreamError",
        lambda: (
            (
                has_params(httpx.AsyncClient.send, "request"),
                source_has(httpx.AsyncClient.send, "aread()"),
            )
            and None
        ),
    ),
    # -- uvicorn: the server's protocol and cycle ------------------------------------------------
    # -- prometheus-client: counters a restarted worker takes over --------------------------------
    Internal(
        "prometheus-client",
        "values.ValueClass read whenever a series is made, called as MutexValue is; "
        "mmap_dict.MmapedDict(path).read_value/write_value and mmap_key(...)",
        "proxy/workers/kept.py: a worker's counters and histograms kept in its slot's file",
        _value_class,
    ),
    Internal(
        "prometheus-client",
        "a Histogram child's _upper_bounds (ending +Inf), _buckets and _sum (values with inc), "
        "as Histogram.observe uses them",
        "proxy/observe/gaps.py Gaps: a stream's inter-token times added in batches",
        _histogram_child,
    ),
    Internal(
        "uvicorn",
        "Server.startup makes Config.http_protocol_class(config=, server_state=, app_state=) "
        "per connection; ServerState .connections, .tasks (awaited at shutdown), "
        ".default_headers (dated on each tick), .total_requests; Server.shutdown calls each "
        "connection's shutdown(); Config .loaded/load(), .loaded_app, .root_path, "
        ".asgi_version, .timeout_keep_alive, .ws_protocol_class",
        "proxy/edge/connection.py GatewayProtocol: the gateway's own protocol under uvicorn's "
        "Server",
        lambda: (
            (
                source_has(
                    uvicorn.Server.startup,
                    "config.http_protocol_class",
                    "config=config",
                    "server_state=self.server_state",
                    "app_state=self.lifespan.state",
                ),
                source_has(uvicorn.Server.shutdown, "connection.shutdown()"),
                source_has(uvicorn.Server.on_tick, "self.server_state.default_headers"),
                assert_equal(
                    sorted(vars(uvicorn.server.ServerState())),
                    ["connections", "default_headers", "tasks", "total_requests"],
                ),
                source_has(
                    uvicorn.Config.__init__,
                    "self.root_path = root_path",
                    "self.timeout_keep_alive = timeout_keep_alive",
                ),
                source_has(uvicorn.Config.load, "self.loaded_app", "self.ws_protocol_class"),
                assert_equal(isinstance(uvicorn.Config.asgi_version, property), True),
            )
            and None
        ),
    ),
    Internal(
        "uvicorn",
        "a WebSocket protocol class made as (config=, server_state=, app_state=), then "
        "connection_made(transport) and data_received(the request's head); protocols.utils "
        "get_local_addr, get_remote_addr, is_ssl",
        "proxy/edge/connection.py GatewayProtocol: an upgrade handed over, the scope's addresses",
        _websocket_handover,
    ),
    Internal(
        "uvicorn",
        "httptools_impl.HEADER_RE, HEADER_VALUE_RE and STATUS_LINE (bytes by status), as "
        "RequestResponseCycle.send checks and writes a start",
        "proxy/edge/head.py response_start (tests/test_head.py holds it, and the cycle's send, "
        "to uvicorn's own send)",
        lambda: (
            (
                assert_equal(httptools_impl.STATUS_LINE[200], b"HTTP/1.1 200 OK\r\n"),
                assert_equal(httptools_impl.HEADER_RE.search(b"a b") is not None, True),
                assert_equal(httptools_impl.HEADER_VALUE_RE.search(b"a\nb") is not None, True),
                source_has(
                    RequestResponseCycle.send,
                    "HEADER_RE.search(name)",
                    "HEADER_VALUE_RE.search(value)",
                    "STATUS_LINE[status_code]",
                ),
            )
            and None
        ),
    ),
    Internal(
        "uvicorn",
        "Server.startup(sockets), handle_exit(sig, frame), on_tick(counter) -> bool, "
        ".should_exit, .force_exit, .started, capture_signals()",
        "proxy/edge/serve.py GatewayServer (the drain before shutdown); tests/servers.py and "
        "loadtest/sim/server.py (servers that leave the process's signals alone)",
        lambda: (
            (
                has_params(uvicorn.Server.startup, "sockets"),
                has_params(uvicorn.Server.handle_exit, "sig", "frame"),
                has_params(uvicorn.Server.on_tick, "counter"),
                source_has(uvicorn.Server.main_loop, "await self.on_tick("),
                source_has(
                    uvicorn.Server.__init__,
                    "self.should_exit = False",
                    "self.force_exit = False",
                    "self.started = False",
                ),
                assert_equal(callable(getattr(uvicorn.Server, "capture_signals", None)), True),
            )
            and None
        ),
    ),
    Internal(
        "uvicorn",
        "Server.servers, Server.server_state.connections, Server.lifespan.state, "
        "Config.http_protocol_class, the protocol's shutdown()",
        "loadtest/sim/listener.py Listener: the simulator's listen faults (close, reopen)",
        lambda: (
            (
                source_has(uvicorn.Server.__init__, "self.server_state = ServerState()"),
                source_has(uvicorn.Server.startup, "self.servers"),
                assert_equal(hasattr(uvicorn.server.ServerState(), "connections"), True),
                source_has(uvicorn.Config.load, "self.http_protocol_class"),
                source_has(uvicorn.lifespan.on.LifespanOn.__init__, "self.state"),
                assert_equal(callable(getattr(GatewayProtocol, "shutdown", None)), True),
            )
            and None
        ),
    ),
]


def assert_equal(got: object, want: object) -> None:
    assert got == want, f"got {got!r}, expected {want!r}"


def _stream_kept() -> None:
    stream = httpx.ByteStream(b"")
    assert httpx.Response(200, stream=stream).stream is stream


@pytest.mark.parametrize("internal", INTERNALS, ids=str)
def test_internal_is_where_the_code_expects_it(internal: Internal) -> None:
    try:
        internal.check()
    except (AssertionError, AttributeError, TypeError, ValueError, OSError) as exc:
        version = "?"
        with contextlib.suppress(metadata.PackageNotFoundError):
            version = metadata.version(internal.library)
        pytest.fail(
            f"{internal.library} {version}: internal moved: {internal.what}\n"
            f"  ({type(exc).__name__}: {exc})\n"
            f"  relied on by {internal.used_by}",
            pytrace=False,
        )


def test_only_the_seam_imports_aiohttp() -> None:
    # The one place that knows what is under the upstream client (the bounds above hold only
    # if nothing else reaches past it).
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "proxy"
    importers = sorted(
        str(p.relative_to(root.parent))
        for p in root.rglob("*.py")
        if any(
            line.lstrip().startswith(("import aiohttp", "from aiohttp", "from httpx_aiohttp"))
            for line in p.read_text().splitlines()
        )
    )
    assert importers == [UPSTREAM], importers
