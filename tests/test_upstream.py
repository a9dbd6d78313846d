"""The upstream seam over real sockets: each way an exchange with a replica can go wrong comes
out as the one Tokenlane error that says how far it got, from the send and from the body."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import httpx
import pytest
import yarl
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.errors import (
    UpstreamClosed,
    UpstreamError,
    UpstreamNotHttp,
    UpstreamReadTimeout,
    UpstreamUnreached,
)
from proxy.policyfile import build_policy
from proxy.relay import upstream
from proxy.relay.reply import Reply
from proxy.relay.upstream import UpstreamClient, make_client, timeout_extension

from .gateway import policy_for
from .servers import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


@contextlib.asynccontextmanager
async def listening(serve: Handler) -> AsyncIterator[str]:
    """A TCP server on a free local port running ``serve`` per connection; yields its URL."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[str, asyncio.Event]]:
    """A TCP server answering with ``handler``; yields its URL and an event set once a whole
    request head has been read (the request reached the "replica")."""
    got_request = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            got_request.set()
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async with listening(serve) as url:
        yield url, got_request


@pytest.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    c, _ = counting_client()
    try:
        yield c
    finally:
        await c.aclose()


async def send(client: UpstreamClient, url: str, read: float | None = None) -> httpx.Response:
    request = httpx.Request(
        "POST",
        url + "/v1/chat/completions",
        stream=httpx.ByteStream(b"{}"),
        extensions={"timeout": timeout_extension(read)},
    )
    return await client.transport.handle_async_request(request)


def reply_of(response: httpx.Response) -> Reply:
    """The ``reply.Reply`` under a response of the transport (what the relay reads)."""
    stream = response.stream
    assert isinstance(stream, upstream.RawResponseStream)
    return stream.reply


async def read_body(response: httpx.Response) -> bytes:
    stream = response.stream
    assert isinstance(stream, httpx.AsyncByteStream)
    return b"".join([chunk async for chunk in stream])


async def test_a_refused_connection_never_reached_the_replica(client: UpstreamClient) -> None:
    with pytest.raises(UpstreamUnreached) as info:
        await send(client, f"http://127.0.0.1:{free_port()}")
    assert "refused" in info.value.why.lower() or "connect" in info.value.why.lower()


async def test_a_close_after_the_request_is_closed_not_unreached(client: UpstreamClient) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        return

    async with raw_server(hang_up) as (url, got_request):
        with pytest.raises(UpstreamClosed):
            await send(client, url)
        assert got_request.is_set()


async def test_an_answer_that_is_not_http(client: UpstreamClient) -> None:
    async def babble(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the client gives up

    async with raw_server(babble) as (url, _):
        with pytest.raises(UpstreamNotHttp):
            await send(client, url)


async def test_silence_before_the_status_line_is_a_read_timeout(client: UpstreamClient) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async with raw_server(silent) as (url, _):
        with pytest.raises(UpstreamReadTimeout):
            await send(client, url, read=0.2)


async def test_silence_mid_body_is_a_read_timeout(client: UpstreamClient) -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + b"6\r\ndata: \r\n")
        await writer.drain()
        await reader.read()

    async with raw_server(stall) as (url, _):
        response = await send(client, url, read=0.2)
        assert response.status_code == 200
        with pytest.raises(UpstreamReadTimeout):
            await read_body(response)
        await response.aclose()


async def test_a_body_cut_short_is_closed_and_its_reader_over(client: UpstreamClient) -> None:
    """The cut is ``UpstreamClosed``; the reader that raised it is over for good, as a
    generator would be (its connection may serve another request by then)."""

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + b"6\r\ndata: \r\n")
        await writer.drain()

    async with raw_server(cut) as (url, _):
        response = await send(client, url)
        reads = reply_of(response).chunks()
        assert await reads.__anext__() == b"data: "
        with pytest.raises(UpstreamClosed):
            await reads.__anext__()
        with pytest.raises(StopAsyncIteration):
            await reads.__anext__()
        await response.aclose()


async def test_none_of_the_seams_errors_is_a_timeout_or_os_error() -> None:
    # The relay's own watchdog is an asyncio timeout (TimeoutError); an upstream read timeout
    # must never be mistaken for it, nor caught as an OSError by code that means sockets.
    for cls in (UpstreamUnreached, UpstreamNotHttp, UpstreamClosed, UpstreamReadTimeout):
        assert issubclass(cls, UpstreamError)
        assert not issubclass(cls, (TimeoutError, OSError))


async def test_the_client_raises_the_seams_errors_too(client: UpstreamClient) -> None:
    # The health loop goes through AsyncClient.get: the same mapping applies.
    with pytest.raises(UpstreamUnreached):
        await client.get(f"http://127.0.0.1:{free_port()}/health", timeout=2)


def _conn_key() -> object:
    # ClientConnectorError wants a connection key and an OSError.
    from types import SimpleNamespace

    return SimpleNamespace(ssl=False, host="127.0.0.1", port=1)


# What aiohttp attaches to a response error: its __str__ reads the URL from it.
REQUEST_INFO = aiohttp.RequestInfo(
    yarl.URL("http://replica.test/v1/completions"), "POST", CIMultiDictProxy(CIMultiDict())
)

SEND_TABLE = [
    (aiohttp.SocketTimeoutError("read"), UpstreamReadTimeout),
    (aiohttp.ConnectionTimeoutError("connect"), UpstreamUnreached),
    (aiohttp.ClientConnectorError(_conn_key(), OSError(111, "refused")), UpstreamUnreached),  # type: ignore[arg-type]
    (aiohttp.ServerDisconnectedError(), UpstreamClosed),
    (aiohttp.ClientOSError(104, "reset"), UpstreamClosed),
    (aiohttp.ClientPayloadError("cut"), UpstreamNotHttp),
    (aiohttp.ClientResponseError(REQUEST_INFO, (), message="bad status line"), UpstreamNotHttp),
]
READ_TABLE = [
    (aiohttp.SocketTimeoutError("read"), UpstreamReadTimeout),
    (aiohttp.ServerTimeoutError("read"), UpstreamReadTimeout),
    (aiohttp.ServerDisconnectedError(), UpstreamClosed),
    (aiohttp.ClientPayloadError("cut"), UpstreamClosed),
    (aiohttp.ClientOSError(104, "reset"), UpstreamClosed),
]


@pytest.mark.parametrize(("exc", "want"), SEND_TABLE, ids=lambda v: type(v).__name__)
def test_the_send_mapping(exc: BaseException, want: type[UpstreamError]) -> None:
    with pytest.raises(want) as info, upstream._mapped(upstream._SENDING):
        raise exc
    assert info.value.__cause__ is exc
    assert type(info.value) is want


@pytest.mark.parametrize(("exc", "want"), READ_TABLE, ids=lambda v: type(v).__name__)
def test_the_read_mapping(exc: BaseException, want: type[UpstreamError]) -> None:
    with pytest.raises(want), upstream._mapped(upstream._READING):
        raise exc


def test_an_httpx_error_is_mapped_by_its_aiohttp_cause() -> None:
    with pytest.raises(UpstreamClosed), upstream._mapped(upstream._READING):
        try:
            raise aiohttp.ServerDisconnectedError()
        except aiohttp.ServerDisconnectedError as exc:
            raise httpx.ConnectTimeout("mapped by httpx-aiohttp") from exc


def test_anything_else_passes_unchanged() -> None:
    with pytest.raises(KeyError), upstream._mapped(upstream._SENDING):
        raise KeyError("a bug")


def test_the_root_cause_is_the_innermost_text() -> None:
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except OSError as inner:
            raise aiohttp.ClientOSError(111, "Cannot connect") from inner
    except aiohttp.ClientOSError as exc:
        assert upstream.root_cause(exc) == "[Errno 111] Connection refused"


def test_a_cause_whose_text_cannot_be_made_is_named_by_its_type() -> None:
    # aiohttp's ClientResponseError.__str__ reads request_info, which may be missing.
    exc = aiohttp.ClientResponseError(None, (), message="bad status line")  # type: ignore[arg-type]
    assert upstream.root_cause(exc) == "ClientResponseError"


# -- a pooled connection closed under the request ---------------------------------------------

OK_KEEP_ALIVE = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


@contextlib.asynccontextmanager
async def closes_idle_connections() -> AsyncIterator[tuple[str, list[int]]]:
    """A server that answers the first request on each connection and keeps it open, then
    drops the connection when a second request arrives on it without answering: what a
    replica closing idle keep-alive connections (shutting down, or its keep-alive run out)
    does to a request that raced the close. Yields its URL and the requests each connection
    got (one entry per connection)."""
    per_connection: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        per_connection.append(0)
        me = len(per_connection) - 1
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                per_connection[me] += 1
                if per_connection[me] > 1:
                    return  # closed unanswered
                await reader.readexactly(2)  # the b"{}" body
                writer.write(OK_KEEP_ALIVE)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async with listening(serve) as url:
        yield url, per_connection


def counting_client() -> tuple[UpstreamClient, list[int]]:
    resent: list[int] = []
    c = make_client(
        build_policy(policy_for({"p": ["http://127.0.0.1:1"]})),
        on_stale_resend=lambda: resent.append(1),
    )
    return c, resent


async def test_a_request_on_a_pooled_connection_closed_under_it_is_sent_again() -> None:
    c, resent = counting_client()
    try:
        async with closes_idle_connections() as (url, per_connection):
            first = await send(c, url)
            assert await read_body(first) == b"ok"
            await first.aclose()
            assert per_connection == [1]
            # The second goes out on the pooled connection, which the server drops unanswered:
            # it is sent again, on a new connection, and answered.
            second = await send(c, url)
            assert second.status_code == 200
            assert await read_body(second) == b"ok"
            await second.aclose()
            assert per_connection == [2, 1]
            assert len(resent) == 1
    finally:
        await c.aclose()


async def test_a_fresh_connection_closed_under_the_request_is_not_sent_again() -> None:
    # The replica read the request on a connection made for it, then hung up: it may have
    # begun the work. That is for the retry rules, not a silent resend.
    c, resent = counting_client()

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        return

    try:
        async with raw_server(hang_up) as (url, got_request):
            with pytest.raises(UpstreamClosed):
                await send(c, url)
            assert got_request.is_set()
            assert resent == []
    finally:
        await c.aclose()


async def test_a_streamed_body_is_not_sent_again() -> None:
    # A streamed body is consumed by the send that failed: there is nothing to send again.
    c, resent = counting_client()

    async def body() -> AsyncIterator[bytes]:
        yield b"{}"

    try:
        async with closes_idle_connections() as (url, per_connection):
            first = await send(c, url)
            await read_body(first)
            await first.aclose()
            request = httpx.Request(
                "POST",
                url + "/v1/chat/completions",
                content=body(),
                headers={"content-length": "2"},
                extensions={"timeout": timeout_extension(None)},
            )
            with pytest.raises(UpstreamClosed):
                await c.transport.handle_async_request(request)
            assert per_connection == [2]
            assert resent == []
    finally:
        await c.aclose()


@pytest.mark.parametrize(
    ("from_pool", "resends", "streamed", "want"),
    [
        (True, 0, False, True),
        (True, upstream.STALE_RESENDS - 1, False, True),
        (True, upstream.STALE_RESENDS, False, False),  # bounded: a pool of closed connections
        (False, 0, False, False),  # a fresh connection: the replica read it
        (True, 0, True, False),  # a streamed body is gone
    ],
)
def test_stale_resend_allowed(from_pool: bool, resends: int, streamed: bool, want: bool) -> None:
    assert upstream.stale_resend_allowed(from_pool, resends, streamed=streamed) is want


# -- a body's reader, over for good ----------------------------------------------------------


async def test_a_bodys_reader_ended_never_reads_the_next_request_on_its_connection() -> None:
    """A reader read to its end stays ended, as a generator does, even once its pooled
    connection serves another request: it never hands over that request's body."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            for answer in (b"one", b"two"):
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(2)  # the b"{}" body
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\n" + answer)
                await writer.drain()
        writer.close()

    c, _ = counting_client()
    try:
        async with listening(serve) as url:
            first = await send(c, url)
            reads = reply_of(first).chunks()
            assert [chunk async for chunk in reads] == [b"one"]
            await first.aclose()  # its connection back to the pool
            second = await send(c, url)  # on that connection
            with pytest.raises(StopAsyncIteration):
                await reads.__anext__()
            assert await read_body(second) == b"two"
            await second.aclose()
    finally:
        await c.aclose()
