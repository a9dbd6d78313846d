"""Every internal of a library the code relies on, named, with the code that depends on it.

pyproject.toml bounds these libraries from above and constraints.txt pins them; this file is
what to run before raising a bound. Each check fails with a message that says which internal
moved and which Tokenlane code depends on it, so an upgrade that would silently change retry
semantics or the server's write path fails here first, by name.

Behaviour over real sockets is checked elsewhere (tests/test_upstream.py: the exceptions aiohttp
raises for each failure; tests/test_serve.py: the coalesced first write and the client-gone
hook); here are the shapes those rely on.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

import aiohttp
import httpx
import pytest
import uvicorn
import uvicorn.lifespan.on
import uvicorn.server
from httpx_aiohttp.transport import AiohttpResponseStream, AiohttpTransport
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle


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


def _client_timeout() -> None:
    t = aiohttp.ClientTimeout(sock_connect=1.0, sock_read=2.0, connect=3.0)
    assert (t.sock_connect, t.sock_read, t.connect, t.total) == (1.0, 2.0, 3.0, None)


def _stream_reader() -> None:
    assert inspect.iscoroutinefunction(aiohttp.StreamReader.readany)
    assert callable(aiohttp.StreamReader.at_eof)


def _response_stream() -> None:
    marker = object()
    stream = AiohttpResponseStream(marker)  # type: ignore[arg-type]
    assert stream._aiohttp_response is marker, "the aiohttp response is not _aiohttp_response"
    assert isinstance(stream, httpx.AsyncByteStream)
    source_has(AiohttpResponseStream.aclose, "_aiohttp_response")


def _transport() -> None:
    made = object()
    transport = AiohttpTransport(limits=httpx.Limits(), client=lambda: made)
    assert callable(transport.client), "AiohttpTransport no longer keeps client= as .client"
    assert transport.get_client() is made, "get_client() no longer calls a client factory"
    assert inspect.iscoroutinefunction(AiohttpTransport.aclose)
    source_has(AiohttpTransport.aclose, "self.client")


INTERNALS = [
    Internal(
        "aiohttp",
        "exception hierarchy (SocketTimeoutError, ConnectionTimeoutError < ServerTimeoutError "
        "< ClientConnectionError; ClientConnectorError; ClientPayloadError, ClientResponseError "
        "outside ClientConnectionError)",
        f"{UPSTREAM} _SENDING/_READING: whether a failed exchange reached the replica, which "
        "decides whether the request may be retried",
        _exception_hierarchy,
    ),
    Internal(
        "aiohttp",
        "ClientTimeout(sock_connect=, sock_read=, connect=) with total unset",
        f"{UPSTREAM} RelayTransport._client_timeout: the read timeout is the stream idle watchdog",
        _client_timeout,
    ),
    Internal(
        "aiohttp",
        "ClientSession.request(allow_redirects=, auto_decompress=, compress=, timeout=)",
        f"{UPSTREAM} RelayTransport.handle_async_request: bytes relayed as the replica sent them",
        lambda: has_params(
            aiohttp.ClientSession._request,
            "allow_redirects",
            "auto_decompress",
            "compress",
            "timeout",
        ),
    ),
    Internal(
        "aiohttp",
        "ClientSession(cookie_jar=, trust_env=, skip_auto_headers=), DummyCookieJar, "
        "TCPConnector(limit=, keepalive_timeout=)",
        f"{UPSTREAM} _session_factory: no cookies, no headers of aiohttp's own, bounded pool",
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
    Internal(
        "aiohttp",
        "TCPConnector._get(key, traces) takes a pooled connection (None if none); connect() "
        "calls it first",
        f"{UPSTREAM} PoolConnector: whether a failed send went out on a pooled connection, "
        "which decides whether it is sent again",
        lambda: (
            (
                has_params(aiohttp.TCPConnector._get, "key", "traces"),
                source_has(aiohttp.BaseConnector.connect, "await self._get(key, traces)"),
            )
            and None
        ),
    ),
    Internal(
        "aiohttp",
        "StreamReader.readany() and at_eof()",
        f"{UPSTREAM} RawResponseStream: one relayed chunk per socket read; a burst sent whole",
        _stream_reader,
    ),
    Internal(
        "aiohttp",
        "aiohttp.client_proto.ResponseHandler (the upstream connection's protocol)",
        "tests/test_relay.py test_tcp_nodelay_is_set_on_both_sides: finds upstream sockets",
        lambda: is_sub(aiohttp.client_proto.ResponseHandler, object),
    ),
    Internal(
        "httpx-aiohttp",
        "AiohttpResponseStream(response)._aiohttp_response, and aclose() releasing it",
        f"{UPSTREAM} RawResponseStream: reads and closes the aiohttp response under httpx's",
        _response_stream,
    ),
    Internal(
        "httpx-aiohttp",
        "AiohttpTransport(limits=, client=factory): .client, get_client(), aclose()",
        f"{UPSTREAM} RelayTransport: the session made on first use, closed with the client",
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
        "proxy/relay/relay.py raw_chunks and upstream.at_eof: chunks read as the socket gave them",
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
    Internal(
        "uvicorn",
        "HttpToolsProtocol.connection_made(transport), connection_lost(exc), and "
        "on_headers_complete() building self.cycle = RequestResponseCycle(scope=self.scope...)",
        "proxy/edge/connection.py NoDelayHttpToolsProtocol: TCP_NODELAY, START_WITH_BODY and the "
        "client-gone hook",
        lambda: (
            (
                has_params(HttpToolsProtocol.connection_made, "transport"),
                has_params(HttpToolsProtocol.connection_lost, "exc"),
                source_has(
                    HttpToolsProtocol.on_headers_complete,
                    "self.cycle = RequestResponseCycle(",
                    "scope=self.scope",
                ),
            )
            and None
        ),
    ),
    Internal(
        "uvicorn",
        "RequestResponseCycle: no __slots__ (its class is swapped), .transport written through "
        "in send(), .scope, .disconnected, .response_complete",
        "proxy/edge/connection.py CoalescingCycle: the response start and first body in one write",
        lambda: (
            (
                assert_equal("__slots__" in vars(RequestResponseCycle), False),
                source_has(
                    RequestResponseCycle.__init__,
                    "self.transport = transport",
                    "self.scope = scope",
                    "self.disconnected = False",
                    "self.response_complete = False",
                ),
                source_has(RequestResponseCycle.send, "self.transport.write("),
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
                assert_equal(callable(getattr(HttpToolsProtocol, "shutdown", None)), True),
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
