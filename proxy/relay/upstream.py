"""The one HTTP client to the replicas, and the only module that knows what is under it.

The relay and the health loop talk to replicas through an ``httpx.AsyncClient`` over an aiohttp
transport (``httpx-aiohttp``), trimmed for a proxy. Whatever goes wrong below surfaces as one of
Tokenlane's own errors (``proxy.errors.UpstreamError``), mapped in one table here, the way httpx
maps httpcore's exceptions: nothing above this module names an aiohttp or httpx-aiohttp type, and
an upgrade of either changes this module (and ``tests/test_internals.py``), not the retry rules.

What the mapping must tell apart is how far an exchange got, because that decides whether
another replica may take the request:

    UpstreamUnreached     the replica never saw the request (refused, DNS, TLS, connect or pool
                          timeout)
    UpstreamNotHttp       what answered is no HTTP server (a wrong port, another protocol)
    UpstreamClosed        the connection closed or reset after the request was sent
    UpstreamReadTimeout   nothing arrived within the read timeout (the idle watchdog)

The transport (``RelayTransport``) converts requests and responses for the general case no
more than it must: ``httpx_aiohttp.AiohttpTransport`` makes a new ``ClientTimeout`` per request,
looks the body up through ``request.content`` and reads a response in 16 KiB slices through
two generator layers. A relay sends the same few timeouts over and over and wants each chunk
as it arrived, so the subclass keeps those conversions once and reads what the socket gave
(``readany``).

Length: one job, the seam to the HTTP client: the exception table, the transport and the raw reader
must change together when a library moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx
from httpx_aiohttp.transport import AiohttpResponseStream, AiohttpTransport
from multidict import CIMultiDict
from yarl import URL

from proxy.errors import (
    UpstreamClosed,
    UpstreamError,
    UpstreamNotHttp,
    UpstreamReadTimeout,
    UpstreamUnreached,
)

if TYPE_CHECKING:
    from proxy.config import Policy

CONNECT_TIMEOUT_S = 3.0
POOL_TIMEOUT_S = 5.0
# An idle pooled connection is dropped (on its next acquire) after this long. vLLM's uvicorn
# closes idle keep-alive connections after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a POST sent on
# one it is closing meets a close or reset before any answer. Half of 5 s keeps that race off
# the common path even when the gateway's host stalls for a second between taking a
# connection from the pool and writing the request (virtual machines do); a reconnect every
# 2.5 s of idleness costs nothing that matters. What the race still costs is resent (below).
KEEPALIVE_EXPIRY_S = 2.5
# A request that met a close or reset on a connection taken from the pool, before any byte of
# an answer, is sent again on another connection, at most this many times. The server closed
# a connection it held idle (its keep-alive ran out, or it is shutting down: a rolling restart
# closes every idle connection at once), so it never read the request: RFC 9112 section 9.3.1
# lets a client resend what it knows was never applied, and a pooled connection closed under
# the request is what HAProxy's "http-reuse safe" and aiohttp's own resend (idempotent methods
# only) are for. A fresh connection that fails the same way is a replica that read the
# request and died: that is the retry rules' to judge (``relay/retry.py``), not resent here.
STALE_RESENDS = 3

# Whether the connection the current request went out on came from the pool. Set by the
# connector within the request's own task, read when the send fails (a context variable: a
# pool shared by many concurrent requests has no per-request slot of its own).
_FROM_POOL: contextvars.ContextVar[bool] = contextvars.ContextVar("_FROM_POOL", default=False)

_EXTENSIONS = {"http_version": b"HTTP/1.1"}

# -- the one mapping --------------------------------------------------------------------------
# Most specific first: the first class the exception is an instance of wins. aiohttp's timeout
# errors are also ``TimeoutError`` and ``OSError``; none of ours is, so an upstream timeout is
# never mistaken for the relay's own watchdog (an ``asyncio.timeout``).

# While the request goes out and the status line comes back.
_SENDING: tuple[tuple[type[BaseException], type[UpstreamError]], ...] = (
    (aiohttp.SocketTimeoutError, UpstreamReadTimeout),  # silent before the status line
    (aiohttp.ConnectionTimeoutError, UpstreamUnreached),  # connect or pool timeout
    (aiohttp.ClientConnectorError, UpstreamUnreached),  # refused, DNS, TLS
    # Closed or reset on an established connection: the request may have reached the replica.
    (aiohttp.ClientConnectionError, UpstreamClosed),
    # The rest is an answer that is not HTTP (a bad status line, broken headers).
    (aiohttp.ClientError, UpstreamNotHttp),
)
# While the body is read: the answer had begun, so the request was sent.
_READING: tuple[tuple[type[BaseException], type[UpstreamError]], ...] = (
    (aiohttp.ServerTimeoutError, UpstreamReadTimeout),
    (aiohttp.ClientError, UpstreamClosed),
)


@contextlib.contextmanager
def _mapped(table: tuple[tuple[type[BaseException], type[UpstreamError]], ...]) -> Iterator[None]:
    """Re-raise what the layers below raise as Tokenlane's ``UpstreamError`` (the original as
    its cause); anything else is a bug and passes unchanged."""
    try:
        yield
    except UpstreamError:
        raise
    except (aiohttp.ClientError, httpx.HTTPError) as exc:
        # httpx-aiohttp's own mapping (in the parent's aclose) keeps aiohttp's error as the
        # cause: that cause is what says how far the exchange got.
        below = exc.__cause__ if isinstance(exc.__cause__, aiohttp.ClientError) else exc
        for source, target in table:
            if isinstance(below, source):
                raise target(root_cause(exc)) from exc
        # httpx's own errors (a URL it refuses, a body it cannot decode): no HTTP exchange
        # worth the name happened.
        raise UpstreamNotHttp(root_cause(exc)) from exc


def root_cause(exc: BaseException) -> str:
    """The innermost cause's text (a refused connection is an ``OSError`` two causes down)."""
    cause = exc
    for _ in range(16):  # chains are short; a cycle must not hang the error path
        nxt = cause.__cause__ or cause.__context__
        if nxt is None or nxt is cause:
            break
        cause = nxt
    try:
        text = str(cause) or type(cause).__name__
    except Exception:  # a library's __str__ may itself fail on a half-built exception
        text = type(cause).__name__
    return text[:200]


# -- the transport ----------------------------------------------------------------------------


class RawResponseStream(AiohttpResponseStream):
    """A response body as the socket delivered it: each read returns what is buffered (one
    relayed chunk per upstream write when the relay keeps up), never re-sliced."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        content = self._aiohttp_response.content
        with _mapped(_READING):
            while True:
                chunk = await content.readany()
                if not chunk:
                    return
                yield chunk

    def at_eof(self) -> bool:
        """Everything the replica sent has been read: the last read held the end too."""
        return self._aiohttp_response.content.at_eof()

    async def aclose(self) -> None:
        with _mapped(_READING):
            await super().aclose()


class RelayTransport(AiohttpTransport):
    """``AiohttpTransport`` with per-request work cached: the aiohttp timeout of each
    ``httpx`` timeout dict the relay reuses, and no redirect, proxy or SNI handling (the relay
    sends plain requests to the replicas' own URLs and follows no redirect)."""

    def __init__(self, *, on_stale_resend: Callable[[], None] = lambda: None, **kw: Any) -> None:
        super().__init__(**kw)
        self.on_stale_resend = on_stale_resend
        # id(timeout dict) -> (the dict, kept alive so its id stays its own; the aiohttp timeout)
        self._timeouts: dict[int, tuple[dict[str, float | None], aiohttp.ClientTimeout]] = {}

    def _client_timeout(self, timeout: dict[str, float | None]) -> aiohttp.ClientTimeout:
        cached = self._timeouts.get(id(timeout))
        if cached is not None and cached[0] is timeout:
            return cached[1]
        aio = aiohttp.ClientTimeout(
            sock_connect=timeout.get("connect"),
            sock_read=timeout.get("read"),
            connect=timeout.get("pool"),
        )
        if len(self._timeouts) > 256:  # reloads make new dicts; the old ones go
            self._timeouts.clear()
        self._timeouts[id(timeout)] = (timeout, aio)
        return aio

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request``; raises only ``UpstreamError`` for what the exchange met."""
        session = self.client
        if not isinstance(session, aiohttp.ClientSession):
            session = self.client = self.get_client()
        stream = request.stream
        if isinstance(stream, httpx.ByteStream):
            # The bytes themselves (a one-part join returns its part): also for a request
            # built from a stream, which has no ``.content`` until read.
            data: Any = b"".join(stream) or None
        else:  # a streamed body: aiohttp frames it itself
            data = stream
            request.headers.pop("transfer-encoding", None)
        timeout = self._client_timeout(request.extensions.get("timeout") or {})
        resends = 0
        while True:
            try:
                with _mapped(_SENDING):
                    response = await session.request(
                        request.method,
                        str(request.url),
                        headers=request.headers,
                        data=data,
                        allow_redirects=False,
                        auto_decompress=False,
                        compress=False,
                        timeout=timeout,
                    )
                break
            except UpstreamClosed:
                # A streamed body is consumed by the first send: it cannot go again.
                if not stale_resend_allowed(_FROM_POOL.get(), resends, streamed=data is stream):
                    raise
                resends += 1
                self.on_stale_resend()
        return httpx.Response(
            status_code=response.status,
            headers=response.raw_headers,
            stream=RawResponseStream(response),
            request=request,
            extensions=_EXTENSIONS,
        )

    async def aclose(self) -> None:
        with _mapped(_READING):
            await super().aclose()


# -- WebSockets ----------------------------------------------------------------------------------

# A WebSocket handshake that answers something other than 101: the replica refused the upgrade
# (its status, e.g. 401 or 404) — told apart from not reaching it at all.
_HANDSHAKE: tuple[tuple[type[BaseException], type[UpstreamError]], ...] = (
    (aiohttp.WSServerHandshakeError, UpstreamNotHttp),
    *_SENDING,
)


class UpstreamWebSocket:
    """One WebSocket to a replica (``/v1/realtime``), in the relay's words: messages are
    ``("text", str)``, ``("bytes", bytes)`` or ``("close", code)``; failures are
    ``UpstreamError``. Nothing above this module sees aiohttp's WebSocket types."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws

    @property
    def protocol(self) -> str | None:
        """The subprotocol the replica chose, if any."""
        return self._ws.protocol

    async def send(self, data: str | bytes) -> None:
        """A text message for a ``str``, a binary one for ``bytes``."""
        with _mapped(_READING):
            if isinstance(data, str):
                await self._ws.send_str(data)
            else:
                await self._ws.send_bytes(data)

    async def receive(self) -> tuple[str, str | bytes | int]:
        with _mapped(_READING):
            msg = await self._ws.receive()
        if msg.type is aiohttp.WSMsgType.TEXT:
            return "text", msg.data
        if msg.type is aiohttp.WSMsgType.BINARY:
            return "bytes", msg.data
        if msg.type is aiohttp.WSMsgType.ERROR:
            raise UpstreamClosed(root_cause(msg.data) if msg.data else "websocket error")
        # CLOSE, CLOSING, CLOSED: the replica's close code (1006: gone without one)
        code = self._ws.close_code
        return "close", code if code is not None else 1006

    async def close(self, code: int = 1000) -> None:
        with contextlib.suppress(Exception):
            await self._ws.close(code=code)


async def open_websocket(
    client: UpstreamClient,
    url: str,
    *,
    headers: list[tuple[bytes, bytes]],
    protocols: list[str],
    timeout_s: float,
) -> UpstreamWebSocket:
    """Open a WebSocket to ``url`` (``ws://`` from the replica's ``http://``) on the upstream
    client's own session, with the client's headers; raises ``UpstreamError``."""
    transport = client.transport
    session = transport.client
    if not isinstance(session, aiohttp.ClientSession):
        session = transport.client = transport.get_client()
    ws_url = "ws" + url[4:] if url.startswith("http") else url
    sent = CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in headers)
    try:
        async with asyncio.timeout(timeout_s):  # the handshake: connect, upgrade
            with _mapped(_HANDSHAKE):
                ws = await session.ws_connect(
                    URL(ws_url, encoded=True),  # the query as the client wrote it
                    headers=sent,
                    protocols=protocols,
                    timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=timeout_s),
                    autoclose=True,
                    autoping=True,
                    compress=0,
                    max_msg_size=0,
                )
    except TimeoutError:
        raise UpstreamUnreached(f"no WebSocket handshake within {timeout_s:g}s") from None
    return UpstreamWebSocket(ws)


# -- the client -------------------------------------------------------------------------------


class UpstreamClient(httpx.AsyncClient):
    """An ``AsyncClient`` that also names its transport, for the relay's direct sends, and
    raises only ``UpstreamError`` (what httpx adds on top, e.g. a body it cannot decode, is
    mapped too)."""

    def __init__(self, *, transport: RelayTransport, **kw: Any) -> None:
        super().__init__(transport=transport, **kw)
        self.transport = transport

    async def send(self, request: httpx.Request, **kw: Any) -> httpx.Response:
        with _mapped(_READING):
            return await super().send(request, **kw)


async def fetch(
    client: UpstreamClient,
    method: str,
    url: str,
    *,
    headers: dict[str, str],
    timeout_s: float,
    json: Any = None,
) -> httpx.Response:
    """A whole small exchange (the health monitor's /health, /metrics, /v1/models and canary),
    read to its end and closed.

    Sent through the transport, as the relay sends: ``AsyncClient.send`` binds each response
    and its stream to each other, a reference cycle only the cycle collector frees, and the
    gateway raises the collector's threshold (``edge/serve.py``). At two replicas probed every
    0.2 s that garbage grew the process by ~14 MB a minute before a collection came."""
    request = client.build_request(method, url, headers=headers, json=json, timeout=timeout_s)
    response = await client.transport.handle_async_request(request)
    try:
        with _mapped(_READING):
            await response.aread()
    finally:
        await response.aclose()
    return response


def stale_resend_allowed(from_pool: bool, resends: int, *, streamed: bool) -> bool:
    """Whether a request that met a close or reset before any answer goes out again: only
    when its connection came from the pool (see ``STALE_RESENDS``) and its body can be sent
    twice."""
    return from_pool and not streamed and resends < STALE_RESENDS


class PoolConnector(aiohttp.TCPConnector):
    """aiohttp's connector, telling the request's task whether its connection was pooled.

    ``_get`` is aiohttp's "take an idle connection from the pool" step (``connect`` calls it
    first, and again after waiting for a free slot); ``tests/test_internals.py`` holds it to
    that, so an aiohttp upgrade that renames it fails there and not silently here."""

    async def _get(self, key: Any, traces: Any) -> Any:
        conn = await super()._get(key, traces)
        _FROM_POOL.set(conn is not None)
        return conn


def make_client(
    policy: Policy, *, on_stale_resend: Callable[[], None] = lambda: None
) -> UpstreamClient:
    """The upstream client. The aiohttp transport ignores ``AsyncClient(limits=...)`` and
    defaults to 100 connections, so it gets the limits itself, sized to what the policy can
    ever have in flight. ``on_stale_resend`` is called for each request sent again because
    its pooled connection had been closed under it."""
    total = sum(r.max_in_flight for p in policy.pools.values() for r in p.replicas)
    limits = httpx.Limits(
        max_connections=max(256, total + 64),
        max_keepalive_connections=max(256, total + 64),
        keepalive_expiry=KEEPALIVE_EXPIRY_S,
    )
    timeout = httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=None, write=30.0, pool=POOL_TIMEOUT_S)
    return UpstreamClient(
        transport=RelayTransport(
            limits=limits, client=_session_factory(limits), on_stale_resend=on_stale_resend
        ),
        timeout=timeout,
        limits=limits,
        # A proxy forwards what it is given: no redirects followed, no headers of its own.
        follow_redirects=False,
        headers={},
    )


def _session_factory(limits: httpx.Limits) -> Callable[[], aiohttp.ClientSession]:
    """The aiohttp session under the transport, made on first use (inside the event loop).

    A proxy keeps no cookies: aiohttp's default jar would store a replica's ``Set-Cookie`` and
    replay it on other clients' requests (and costs a lookup per request), and adds no headers
    of its own. The connector gets the same explicit limits."""

    def make() -> aiohttp.ClientSession:
        connector = PoolConnector(
            limit=limits.max_connections or 0,
            keepalive_timeout=limits.keepalive_expiry,
        )
        return aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
            # What the client sent goes upstream, nothing of aiohttp's own: its default
            # "Accept-Encoding: gzip, deflate" would invite a compressed answer that the relay
            # passes on, raw, to a client that never asked for one.
            # (and its "Content-Type: application/octet-stream" on a body sent without one,
            # which vLLM, reading such a body as JSON, would refuse).
            skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),
        )

    return make


def timeout_extension(read: float | None) -> dict[str, float | None]:
    """A request's ``timeout`` extension with the relay's connect, write and pool bounds."""
    return httpx.Timeout(
        connect=CONNECT_TIMEOUT_S, read=read, write=30.0, pool=POOL_TIMEOUT_S
    ).as_dict()


def at_eof(response: httpx.Response) -> bool:
    """Whether everything the replica sent for ``response`` has been read already."""
    stream = response.stream
    return isinstance(stream, RawResponseStream) and stream.at_eof()


def raw_chunks(response: httpx.Response) -> AsyncIterator[bytes]:
    """The response body as the transport reads it: ``aiter_raw()`` without its per-chunk
    re-chunking and byte counting (the relay's finally closes the response)."""
    stream = response.stream
    assert isinstance(stream, httpx.AsyncByteStream)
    return stream.__aiter__()


__all__ = [
    "CONNECT_TIMEOUT_S",
    "KEEPALIVE_EXPIRY_S",
    "POOL_TIMEOUT_S",
    "STALE_RESENDS",
    "PoolConnector",
    "RawResponseStream",
    "RelayTransport",
    "UpstreamClient",
    "at_eof",
    "make_client",
    "raw_chunks",
    "root_cause",
    "stale_resend_allowed",
    "timeout_extension",
]
