"""The one HTTP client to the replicas, and the only module that knows what is under it.

The relay and the health loop talk to replicas through an ``httpx.AsyncClient`` whose
transport (``RelayTransport``) sends plain requests over the relay's own HTTP/1.1 client
(``relay/h1.py``) and WebSockets over aiohttp (``open_websocket``). Whatever goes wrong below
surfaces as one of Tokenlane's own errors (``proxy.errors.UpstreamError``): ``h1.py`` raises
them itself; aiohttp's and httpx's are mapped in one table here, the way httpx maps httpcore's
exceptions. Nothing above this module names an aiohttp or httpx-aiohttp type.

What the errors must tell apart is how far an exchange got, because that decides whether
another replica may take the request:

    UpstreamUnreached     the replica never saw the request (refused, DNS, TLS, connect
                          timeout)
    UpstreamNotHttp       what answered is no HTTP server (a wrong port, another protocol)
    UpstreamClosed        the connection closed or reset after the request was sent
    UpstreamReadTimeout   nothing arrived within the read timeout (the idle watchdog)

The relay sends over the transport's pool (``h1.H1Pool.send``) and reads a ``reply.Reply``:
the body as the socket gave it, or pumped chunk by chunk into the relay's handler (``pump``:
the relay's hot path, ``h1.py`` says why). ``handle_async_request`` wraps the same in httpx's
objects for the transport's other users (the health loop, tests).

Length: one job, the seam to the HTTP clients: the exception table, the transport and the
WebSocket wrapper must change together when a library moves.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx
from httpx_aiohttp.transport import AiohttpTransport
from multidict import CIMultiDict
from yarl import URL

from proxy.errors import (
    UpstreamClosed,
    UpstreamError,
    UpstreamNotHttp,
    UpstreamReadTimeout,
    UpstreamUnreached,
)
from proxy.relay.h1 import STALE_RESENDS, H1Pool, stale_resend_allowed, without_framing
from proxy.relay.reply import Reply

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


class RawResponseStream(httpx.AsyncByteStream):
    """A ``reply.Reply``'s body for the httpx users of the transport (the health loop, tests):
    each read returns what arrived since the last, never re-sliced. ``reply`` is the answer
    itself (its ``pump``, ``at_eof``)."""

    __slots__ = ("reply",)

    def __init__(self, reply: Reply) -> None:
        self.reply = reply

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.reply.chunks()

    async def aclose(self) -> None:
        await self.reply.aclose()


class RelayTransport(AiohttpTransport):
    """The relay's transport: plain requests over the relay's own HTTP/1.1 client
    (``relay/h1.py``); the aiohttp session underneath is only for WebSockets
    (``open_websocket``). No redirect, proxy, cookie or decompression handling: the relay
    sends plain requests to the replicas' own URLs and relays what comes back."""

    def __init__(self, *, on_stale_resend: Callable[[], None] = lambda: None, **kw: Any) -> None:
        super().__init__(**kw)
        # The relay sends over the pool itself (``H1Pool.send``, read as a ``reply.Reply``).
        self.pool = H1Pool(
            connect_timeout_s=CONNECT_TIMEOUT_S,
            keepalive_expiry_s=KEEPALIVE_EXPIRY_S,
            on_stale_resend=on_stale_resend,
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request``; raises only ``UpstreamError`` for what the exchange met."""
        url = request.url
        origin = self.pool.origin(url.scheme, url.raw_host, url.port)
        stream = request.stream
        streamed = not isinstance(stream, httpx.ByteStream)
        if streamed:  # read whole, and never sent twice (it may not be readable again)
            assert isinstance(stream, httpx.AsyncByteStream)
            body = b"".join([part async for part in stream])
        else:
            body = b"".join(stream)  # type: ignore[arg-type]  # a ByteStream is both kinds
        timeout = request.extensions.get("timeout") or {}
        pool = self.pool
        conn = await pool.send(
            origin,
            request.method,
            url.raw_path,
            without_framing(request.headers.raw),
            body,
            timeout.get("read"),
            resendable=not streamed,
        )
        reply = Reply(pool, origin, conn)
        return httpx.Response(
            status_code=reply.status_code,
            headers=reply.headers.raw,
            stream=RawResponseStream(reply),
            request=request,
            extensions=_EXTENSIONS,
        )

    async def aclose(self) -> None:
        self.pool.close()
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


def make_client(
    policy: Policy, *, on_stale_resend: Callable[[], None] = lambda: None
) -> UpstreamClient:
    """The upstream client. Plain requests go over ``h1.H1Pool``, whose connections to a
    replica are bounded by what admission lets in flight there (``max_in_flight``) plus the
    health loop's. The aiohttp session (WebSockets) ignores ``AsyncClient(limits=...)`` and
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
        connector = aiohttp.TCPConnector(
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


__all__ = [
    "CONNECT_TIMEOUT_S",
    "KEEPALIVE_EXPIRY_S",
    "POOL_TIMEOUT_S",
    "STALE_RESENDS",
    "RawResponseStream",
    "RelayTransport",
    "UpstreamClient",
    "make_client",
    "root_cause",
    "stale_resend_allowed",
    "timeout_extension",
]
