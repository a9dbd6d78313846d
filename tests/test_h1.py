"""The relay's own HTTP/1.1 client (``proxy/relay/h1.py``) over real sockets: bodies read and
pumped, the handler's hand-backs and pauses, backpressure, the read timeout, framing corners
and the pool."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import socket
import struct
import threading
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from proxy.errors import UpstreamClosed, UpstreamReadTimeout
from proxy.relay import h1
from proxy.relay.h1 import PAUSE, Handler
from proxy.relay.reply import Reply
from proxy.relay.upstream import UpstreamClient, timeout_extension

from . import test_upstream
from .test_upstream import HEAD, listening, raw_server, read_body, reply_of, send

client = test_upstream.client  # the same fixture: a fresh upstream client per test


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


@contextlib.asynccontextmanager
async def answering_each_request(answer: bytes) -> AsyncIterator[tuple[str, list[int]]]:
    """A server answering every request (a 2-byte body) on each connection with ``answer``;
    yields its URL and the connections made to it so far (a list with one item, a count)."""
    connections = [0]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(2)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            writer.write(answer)
            await writer.drain()

    async with listening(serve) as url:
        yield url, connections


def connection_of(response: httpx.Response) -> h1.H1Connection:
    return reply_of(response).conn


async def pump(response: httpx.Response, handler: Handler) -> bytes | None:
    """The rest of ``response``'s body handed to ``handler`` (``Reply.pump``, as the relay)."""
    return await reply_of(response).pump(handler)


async def test_a_pumped_body_goes_to_the_handler_in_order_and_a_declined_chunk_comes_back(
    client: UpstreamClient,
) -> None:
    step = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunk(b"a"))
        await writer.drain()
        for part in (b"b", b"stop", b"c", b"d"):
            await step.wait()
            step.clear()
            writer.write(chunk(part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    seen: list[bytes] = []

    def handler(data: bytes) -> bytes | None:
        seen.append(data)
        step.set()  # the server sends the next chunk only once this one was handled
        return data if data == b"stop" else None

    async with raw_server(serve) as (url, _):
        response = await send(client, url)
        assert await pump(response, handler) == b"stop"
        assert seen == [b"a", b"b", b"stop"]
        # The chunks after a hand-back are kept for the next pump, in order.
        assert await pump(response, handler) is None
        assert seen == [b"a", b"b", b"stop", b"c", b"d"]
        await response.aclose()


async def test_pause_stops_the_pump_after_the_chunk_was_taken(client: UpstreamClient) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunk(b"one") + chunk(b"two") + b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    taken: list[bytes] = []

    def handler(data: bytes) -> bytes | None:
        taken.append(data)
        return PAUSE

    async with raw_server(serve) as (url, _):
        response = await send(client, url)
        while (back := await pump(response, handler)) is not None:
            assert back == PAUSE
        # Each read was taken once; what arrived together may come joined.
        assert b"".join(taken) == b"onetwo"
        await response.aclose()


async def test_a_handler_that_raises_raises_in_the_relays_task(client: UpstreamClient) -> None:
    release = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD)
        await writer.drain()
        await release.wait()
        writer.write(chunk(b"x"))
        await writer.drain()
        await reader.read()

    def handler(data: bytes) -> bytes | None:
        raise ValueError("a bug in the relay")

    async with raw_server(serve) as (url, _):
        response = await send(client, url)
        # Whether the chunk meets the handler in the connection's callback or in the pump's
        # own loop (it came before the pump waited), the error is the task's.
        task = asyncio.ensure_future(pump(response, handler))
        release.set()
        with pytest.raises(ValueError, match="a bug in the relay"):
            await task
        await response.aclose()


async def test_a_reader_that_does_not_read_stops_the_socket_being_read(
    client: UpstreamClient,
) -> None:
    big = b"x" * 65536
    sent = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD)
        for _ in range(64):  # 4 MiB, far past the high-water mark
            writer.write(chunk(big))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        sent.set()
        await reader.read()

    async with raw_server(serve) as (url, _):
        response = await send(client, url, read=0.3)
        conn = connection_of(response)

        async def paused() -> bool:
            while not conn.paused:
                await asyncio.sleep(0.01)
            return True

        await asyncio.wait_for(paused(), 30)
        assert conn.buffered <= h1.HIGH_WATER + 2 * len(big) + 1024
        # Paused by us, not silent: the read timeout (0.3 s) does not fire meanwhile.
        await asyncio.sleep(0.6)
        assert conn.error is None
        assert len(await read_body(response)) == 64 * len(big)
        assert sent.is_set()
        await response.aclose()


async def test_silence_while_pumped_is_a_read_timeout(client: UpstreamClient) -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunk(b"data: a\n\n"))
        await writer.drain()
        await reader.read()

    async with raw_server(stall) as (url, _):
        response = await send(client, url, read=0.2)
        with pytest.raises(UpstreamReadTimeout):
            await pump(response, lambda data: None)
        await response.aclose()


async def test_a_reset_while_pumped_is_closed(client: UpstreamClient) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunk(b"data: a\n\n"))
        await writer.drain()

    async with raw_server(cut) as (url, _):
        response = await send(client, url)
        with pytest.raises(UpstreamClosed):
            await pump(response, lambda data: None)
        await response.aclose()


async def test_framing_corners(client: UpstreamClient) -> None:
    answers = {
        # A body that ends with the connection (no length, not chunked).
        b"/close": b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end",
        # An interim answer first, then the real one.
        b"/early": b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nreal",
        b"/empty": b"HTTP/1.1 204 No Content\r\n\r\n",
    }

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readuntil(b"\r\n")
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answers[line.split()[1]])
        await writer.drain()
        writer.close()

    async with listening(serve) as url:
        for path, status, body in (
            (b"/close", 200, b"until the end"),
            (b"/early", 200, b"real"),
            (b"/empty", 204, b""),
        ):
            request = httpx.Request(
                "GET", url + path.decode(), extensions={"timeout": timeout_extension(5.0)}
            )
            response = await client.transport.handle_async_request(request)
            assert response.status_code == status, path
            assert await read_body(response) == body, path
            if path == b"/early":
                assert (b"link", b"</a>") not in response.headers.raw
            await response.aclose()


async def test_a_head_answer_has_no_body_whatever_its_length(client: UpstreamClient) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with listening(serve) as url:
        request = httpx.Request("HEAD", url + "/", extensions={"timeout": timeout_extension(2.0)})
        response = await client.transport.handle_async_request(request)
        assert response.status_code == 200
        assert await read_body(response) == b""
        await response.aclose()


async def test_a_connection_is_reused_until_its_keep_alive_expires(
    client: UpstreamClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    async with answering_each_request(ok) as (url, connections):
        for _ in range(3):
            response = await send(client, url)
            assert await read_body(response) == b"ok"
            await response.aclose()
        assert connections == [1]
        # Past the expiry an idle connection is dropped, not used (the replica may be closing
        # it): the next request opens a new one.
        pool = client.transport.pool
        monkeypatch.setattr(pool, "keepalive_expiry_s", -1.0)
        response = await send(client, url)
        assert await read_body(response) == b"ok"
        await response.aclose()
        assert connections == [2]


async def test_a_kept_connections_exchanges_share_one_read_timeout_timer(
    client: UpstreamClient,
) -> None:
    """The read timeout's timer outlives an exchange: the next one on the connection takes it
    over instead of making its own (a timer made and cancelled per request, before)."""
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    async with answering_each_request(ok) as (url, connections):
        timers = []
        for _ in range(3):
            response = await send(client, url, read=60.0)
            conn = connection_of(response)
            assert await read_body(response) == b"ok"
            await response.aclose()
            timers.append(conn._timer)
        assert connections == [1]
        assert timers[0] is not None and not timers[0].cancelled()
        assert timers[1] is timers[0] and timers[2] is timers[0]


async def test_a_shorter_read_timeout_on_a_kept_connection_is_not_the_earlier_timers(
    client: UpstreamClient,
) -> None:
    """A kept timer due later than the next exchange's timeout is replaced: the second
    request, silent, fails at its own 0.2 s, not at the first one's 60 s."""
    first_answered = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(2)  # the first request's body (its head was read)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        first_answered.set()
        await reader.read()  # the second request: never answered

    async with raw_server(serve) as (url, _):
        response = await send(client, url, read=60.0)
        conn = connection_of(response)
        assert await read_body(response) == b"ok"
        await response.aclose()
        await first_answered.wait()
        async with asyncio.timeout(30):  # a wide margin: broken, it would wait 60 s
            with pytest.raises(UpstreamReadTimeout):
                await send(client, url, read=0.2)
        assert conn.error is not None  # it was that same connection that timed out


async def test_a_read_timeout_timer_firing_between_exchanges_leaves_the_connection_usable(
    client: UpstreamClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    fired = asyncio.Event()
    check = h1.H1Connection._idle_check

    def noting(conn: h1.H1Connection) -> None:
        check(conn)
        fired.set()

    monkeypatch.setattr(h1.H1Connection, "_idle_check", noting)
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    async with answering_each_request(ok) as (url, connections):
        response = await send(client, url, read=0.1)
        conn = connection_of(response)
        assert await read_body(response) == b"ok"
        await response.aclose()
        async with asyncio.timeout(30):  # a wide margin over its 0.1 s
            await fired.wait()  # due while the connection is idle in the pool
        assert conn.error is None and not conn.closed
        response = await send(client, url, read=0.1)
        assert connection_of(response) is conn
        assert await read_body(response) == b"ok"
        await response.aclose()
        assert connections == [1]


async def test_a_body_left_unread_closes_its_connection(client: UpstreamClient) -> None:
    # Each answer is never finished.
    async with answering_each_request(HEAD + chunk(b"part")) as (url, connections):
        for _ in range(2):
            response = await send(client, url)
            await response.aclose()  # the client left mid-body
        assert connections == [2]


async def test_paused_past_the_read_timeout_the_check_waits_instead_of_spinning(
    client: UpstreamClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks = 0
    check = h1.H1Connection._idle_check

    def counting(conn: h1.H1Connection) -> None:
        nonlocal checks
        checks += 1
        check(conn)

    monkeypatch.setattr(h1.H1Connection, "_idle_check", counting)
    big = b"x" * 65536

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunk(big) * 64 + b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with raw_server(serve) as (url, _):
        response = await send(client, url, read=0.2)
        conn = connection_of(response)
        while not conn.paused:
            await asyncio.sleep(0.01)
        before = checks
        await asyncio.sleep(1.0)  # five timeouts' worth, paused by us
        assert checks - before <= 10  # one look per timeout, not one per loop iteration
        assert conn.error is None
        await response.aclose()


async def test_a_second_answer_in_the_same_read_is_not_part_of_the_first(
    client: UpstreamClient,
) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi"
            b"HTTP/1.1 500 Oops\r\ncontent-length: 3\r\nx-extra: 1\r\n\r\nbad"
        )
        await writer.drain()
        await reader.read()

    async with listening(serve) as url:
        request = httpx.Request("GET", url + "/", extensions={"timeout": timeout_extension(2.0)})
        response = await client.transport.handle_async_request(request)
        assert await read_body(response) == b"hi"
        assert response.status_code == 200
        assert (b"x-extra", b"1") not in response.headers.raw
        conn = connection_of(response)
        await response.aclose()
        assert conn.closed  # never pooled: what else it holds is unknown
        assert all(not o.idle for o in client.transport.pool.origins.values())


async def test_bytes_after_a_pumped_end_never_reach_the_handler(client: UpstreamClient) -> None:
    go = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunk(b"a"))
        await writer.drain()
        await go.wait()
        writer.write(b"0\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nbad")
        await writer.drain()
        await reader.read()

    seen: list[bytes] = []

    def handler(data: bytes) -> bytes | None:
        seen.append(data)
        go.set()
        return None

    async with raw_server(serve) as (url, _):
        response = await send(client, url)
        assert await pump(response, handler) is None
        await response.aclose()
    assert seen == [b"a"]


async def test_a_chunk_handed_back_to_a_cancelled_pump_comes_first_next_time(
    client: UpstreamClient,
) -> None:
    go, end = asyncio.Event(), asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD)
        await writer.drain()
        await go.wait()
        writer.write(chunk(b"declined"))
        await writer.drain()
        await end.wait()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with raw_server(serve) as (url, _):
        response = await send(client, url)
        conn = connection_of(response)
        task: asyncio.Future[bytes | None] | None = None

        def declining(data: bytes) -> bytes | None:
            assert task is not None
            task.cancel()  # in the same loop step (the client left): the pump never returns
            return data

        task = asyncio.ensure_future(pump(response, declining))
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert conn.declined == b"declined"
        end.set()
        while not conn.complete:
            await asyncio.sleep(0.005)
        got = []
        while (back := await pump(response, lambda data: data)) is not None:
            got.append(back)
        await response.aclose()
    assert got == [b"declined"]


async def test_a_body_ended_by_a_reset_is_cut_not_whole(client: UpstreamClient) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\n\r\npartial")  # delimited by the close
        await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # a reset, not a close

    async with listening(serve) as url:
        request = httpx.Request("GET", url + "/", extensions={"timeout": timeout_extension(2.0)})
        response = await client.transport.handle_async_request(request)
        with pytest.raises(UpstreamClosed):
            await read_body(response)
        await response.aclose()


async def test_the_chunks_of_one_read_reach_the_handler_in_one_call() -> None:
    """A read holding several chunks of a pumped body is handed over whole, after its parse:
    the relay writes the tokens that came at once in one write. Chunks split over reads come
    as they came; what the handler declines is kept, in order, for the reader."""
    loop = asyncio.get_running_loop()
    conn = h1.H1Connection(loop)
    conn.head = loop.create_future()
    conn.data_received(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    assert conn.head.done()
    seen: list[bytes] = []

    def handler(data: bytes) -> bytes | None:
        seen.append(data)
        return data if data.startswith(b"no") else None

    conn.handler = handler
    conn.data_received(chunk(b"a") + chunk(b"b") + chunk(b"c"))
    conn.data_received(chunk(b"d")[:2])  # inside the size line: no body yet
    conn.data_received(chunk(b"d")[2:] + chunk(b"e") + chunk(b"g")[:4])
    assert seen == [b"abc", b"deg"]  # a chunk's bytes as they come, its end still to come
    conn.data_received(b"\r\n" + chunk(b"no") + chunk(b"f") + b"0\r\n\r\n")
    assert seen[-1] == b"nof" and conn.declined == b"nof" and conn.handler is None
    assert conn.complete and not conn.chunks


def _noted_in(seen: list[bytes], data: bytes) -> None:
    seen.append(data)


async def test_a_reads_body_reaches_the_handler_before_the_error_found_after_it() -> None:
    """A pumped read that holds a chunk and then a broken one, or a second answer after the
    end, hands the chunk to the handler first; then the answer fails (a broken body) or stands
    (the connection is not used again), as when each chunk was handed over on its own."""
    loop = asyncio.get_running_loop()
    for tail, broken in ((b"zz\r\nbad\r\n", True), (b"0\r\n\r\nHTTP/1.1 200 OK\r\n\r\n", False)):
        conn = h1.H1Connection(loop)
        conn.head = loop.create_future()
        conn.data_received(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        seen: list[bytes] = []
        conn.handler = functools.partial(_noted_in, seen)
        conn.data_received(chunk(b"x") + tail)
        assert seen == [b"x"]
        if broken:
            assert isinstance(conn.error, UpstreamClosed) and "broken body" in str(conn.error)
        else:
            assert conn.complete and conn.error is None and conn.closed


@pytest.mark.parametrize(
    ("data", "pieces", "taken"),
    [
        (b"", [], 0),
        (chunk(b"hello"), [b"hello"], 7 + 3),
        (chunk(b"a") + chunk(b"bc"), [b"a", b"bc"], 6 + 7),
        (b"A\r\n" + b"x" * 10 + b"\r\n", [b"x" * 10], 15),  # upper-case hex
        (b"0a\r\n" + b"y" * 10 + b"\r\n", [b"y" * 10], 16),  # a leading zero
        (b"00000005\r\nhello\r\n", [b"hello"], 17),  # eight digits, the most taken
        (chunk(b"a") + b"0\r\n\r\n", [b"a"], 6),  # the last chunk is the parser's
        (chunk(b"a") + chunk(b"bcd")[:5], [b"a"], 6),  # a chunk cut short by the read
        (chunk(b"a") + b"3", [b"a"], 6),  # a size line cut short
        (b"5;ext=1\r\nhello\r\n", [], 0),  # an extension
        (b"5 \r\nhello\r\n", [], 0),  # a space in the size line
        (b"\r\nhello\r\n", [], 0),  # no size
        (b"5\r\nhelloXY", [], 0),  # no CRLF after the bytes
        (b"5\r\nhello\r", [], 0),
        (b"123456789\r\n", [], 0),  # a size of nine digits
        (b"g\r\n", [], 0),
    ],
)
def test_leading_chunks_takes_only_plain_whole_chunks(
    data: bytes, pieces: list[bytes], taken: int
) -> None:
    got: list[bytes] = []
    assert h1.leading_chunks(data, got) == taken
    assert got == pieces


class _CountedParser:
    """The connection's parser, its feeds counted (what the parser was left to read)."""

    def __init__(self, parser: object) -> None:
        self.parser = parser
        self.fed: list[bytes] = []

    def feed_data(self, data: bytes) -> None:
        self.fed.append(data)
        self.parser.feed_data(data)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.parser, name)


async def test_whole_chunks_between_chunks_bypass_the_parser_which_still_reads_the_rest() -> None:
    """Once the parser stands between two chunks, reads of whole chunks are taken without it,
    and it reads whatever follows them from where it was: the last chunk, a split chunk."""
    loop = asyncio.get_running_loop()
    conn = h1.H1Connection(loop)
    conn.head = loop.create_future()
    counted = _CountedParser(conn.parser)
    conn.parser = counted  # type: ignore[assignment]
    conn.data_received(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    seen: list[bytes] = []
    conn.handler = functools.partial(_noted_in, seen)
    conn.data_received(chunk(b"first"))  # the parser's: it ends a chunk, and the read too
    assert conn.at_boundary and len(counted.fed) == 2
    conn.data_received(chunk(b"two") + chunk(b"three"))
    conn.data_received(chunk(b"four"))
    assert len(counted.fed) == 2 and seen == [b"first", b"twothree", b"four"]
    conn.data_received(chunk(b"five") + chunk(b"six")[:3])  # the cut one goes to the parser
    assert counted.fed[-1] == chunk(b"six")[:3] and not conn.at_boundary
    conn.data_received(chunk(b"six")[3:])
    assert conn.at_boundary and seen[-2:] == [b"five", b"six"]
    conn.data_received(chunk(b"seven") + b"0\r\n\r\n")
    assert counted.fed[-1] == b"0\r\n\r\n"
    assert conn.complete and conn.error is None and seen[-1] == b"seven"


async def test_a_broken_chunk_ends_the_bypass() -> None:
    """A read that ends a chunk and then breaks the framing fails the answer, and leaves no
    boundary behind: bytes a closing transport still delivers go to the failed parser, never
    to the handler."""
    loop = asyncio.get_running_loop()
    conn = h1.H1Connection(loop)
    conn.head = loop.create_future()
    conn.data_received(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    seen: list[bytes] = []
    conn.handler = functools.partial(_noted_in, seen)
    conn.data_received(chunk(b"one")[:4])
    conn.data_received(chunk(b"one")[4:] + b"XYZ\r\n")  # ends a chunk, then no size line
    assert isinstance(conn.error, UpstreamClosed) and not conn.at_boundary
    assert b"".join(seen) == b"one"
    conn.data_received(chunk(b"late"))
    assert b"".join(seen) == b"one"


async def test_a_chunked_body_split_anywhere_comes_whole_and_in_order() -> None:
    """Chunked bodies of random chunks (extensions among them) cut into random reads, pumped
    and read: the bytes that come out are the body, the answer complete, no error."""
    rng = random.Random(37)
    loop = asyncio.get_running_loop()
    for case in range(300):
        # Random bytes, and bytes that look like chunks themselves: a boundary wrongly assumed
        # inside a chunk would take them for chunks.
        parts = [
            rng.choice((rng.randbytes(rng.choice((1, 2, 15, 16, 17, 255, 300))), chunk(b"abc")))
            for _ in range(rng.randint(1, 12))
        ]
        wire = (
            b"".join(
                (b"%X;e=1\r\n%b\r\n" if rng.random() < 0.1 else b"%x\r\n%b\r\n") % (len(p), p)
                for p in parts
            )
            + b"0\r\n\r\n"
        )
        conn = h1.H1Connection(loop)
        conn.head = loop.create_future()
        conn.data_received(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        seen: list[bytes] = []
        if case % 2:
            conn.handler = functools.partial(_noted_in, seen)
        cuts = sorted(rng.sample(range(1, len(wire)), min(len(wire) - 1, rng.randint(0, 8))))
        for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True):
            conn.data_received(wire[a:b])
        got = b"".join(seen) if case % 2 else b"".join(conn.chunks)
        assert got == b"".join(parts), case
        assert conn.complete and conn.error is None, case


@contextlib.contextmanager
def answering_from_a_thread(answer: bytes) -> Iterator[str]:
    """A server in a thread of its own answering each request (a 2-byte body) of the one
    connection it accepts with ``answer``: nothing of it runs in the test's loop."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            buffered = b""
            while data := conn.recv(65536):
                buffered += data
                while (end := buffered.find(b"\r\n\r\n")) >= 0 and len(buffered) >= end + 6:
                    buffered = buffered[end + 6 :]
                    conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()


async def test_a_send_given_its_loop_never_asks_asyncio_for_it(
    client: UpstreamClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Python 3.11's ``get_running_loop`` makes a ``getpid`` system call each time: the relay
    # hands the pool the request's loop (``Call.loop``) instead.
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    loop = asyncio.get_running_loop()
    asked: list[int] = []
    real = asyncio.get_running_loop

    def counted() -> asyncio.AbstractEventLoop:
        asked.append(1)
        return real()

    with answering_from_a_thread(ok) as url:
        pool = client.transport.pool
        target = httpx.URL(url)
        origin = pool.origin(target.scheme, target.raw_host, target.port)
        for given in (None, loop, loop):
            monkeypatch.setattr(asyncio, "get_running_loop", counted)
            conn = await pool.send(origin, "POST", b"/", [], b"hi", None, loop=given)
            monkeypatch.setattr(asyncio, "get_running_loop", real)
            assert conn.status == 200
            reply = Reply(pool, origin, conn)
            assert await reply.aread() == b"ok"
            await reply.aclose()  # back to the pool
            if given is None:
                assert asked  # the counter counts: without a loop, asyncio was asked
                asked.clear()
        assert asked == []  # with one, never (the pooled connection, twice)
