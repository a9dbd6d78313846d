"""``edge/head.py`` and the cycle's ``send`` (``edge/cycle.py``): a response's start and first
body written as uvicorn's own cycle writes them, byte for byte and state for state; refused
(``InvalidResponse``, nothing written) exactly where uvicorn's ``send`` raises."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any, cast

import pytest
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from proxy.edge import head
from proxy.edge.asgi_ext import START_BODY, START_MORE_BODY
from proxy.edge.cycle import Cycle, Flow
from proxy.edge.head import response_start, write_chunk
from proxy.errors import InvalidResponse

DEFAULT = [(b"date", b"Fri, 27 Nov 2026 21:13:43 GMT"), (b"server", b"uvicorn")]
SSE = (b"content-type", b"text/event-stream; charset=utf-8")


class Written:
    """A transport that keeps what is written to it."""

    def __init__(self) -> None:
        self.data = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def writelines(self, parts: list[bytes]) -> None:
        self.data += b"".join(parts)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


async def uvicorns(
    method: str, keep_alive: bool, status: int, headers: list[Any], body: bytes, more: bool
) -> tuple[bytes, tuple[Any, ...]] | type[BaseException]:
    """What uvicorn's cycle writes for the start then the body, and its state after; or the
    type of what it raised."""
    transport = Written()
    log = logging.getLogger("test-head")
    cycle = RequestResponseCycle(
        scope={"method": method, "headers": [], "http_version": "1.1"},  # type: ignore[typeddict-item]
        transport=transport,  # type: ignore[arg-type]
        flow=FlowControl(transport),  # type: ignore[arg-type]
        logger=log,
        access_logger=log,
        access_log=False,
        default_headers=list(DEFAULT),
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=keep_alive,
        on_response=lambda: None,
    )
    try:
        await cycle.send({"type": "http.response.start", "status": status, "headers": headers})
        await cycle.send({"type": "http.response.body", "body": body, "more_body": more})
    except Exception as exc:
        return type(exc)
    state = (
        cycle.chunked_encoding,
        cycle.expected_content_length,
        cycle.keep_alive,
        cycle.response_complete,
        transport.closed,
    )
    return transport.data, state


CASES = {
    "a stream's start and first chunk": ("POST", True, 200, [SSE], b"data: a\n\n", True),
    "a stream whole in its first read": ("POST", True, 200, [SSE], b"data: [DONE]\n\n", False),
    "a large first body, more to come": ("POST", True, 200, [SSE], b"d" * 5000, True),
    "a large body whole": ("POST", True, 200, [SSE], b"d" * 70000, False),
    "a stream's start with an empty first body": ("POST", True, 200, [SSE], b"", True),
    "a whole body with its length": (
        "POST",
        True,
        200,
        [(b"content-type", b"application/json"), (b"content-length", b"2")],
        b"{}",
        False,
    ),
    "the replica's chunked framing kept": (
        "POST",
        True,
        200,
        [(b"Transfer-Encoding", b"chunked")],
        b"x",
        True,
    ),
    "a HEAD answer with a length": ("HEAD", True, 200, [(b"content-length", b"9")], b"", False),
    "204 with no body": ("POST", True, 204, [], b"", False),
    "the replica closing": ("POST", True, 200, [(b"Connection", b"keep-alive, Close")], b"x", True),
    "the client closing": ("POST", False, 200, [SSE], b"data: a\n\n", False),
    "a 503 with its length": (
        "POST",
        True,
        503,
        [(b"content-length", b"4"), (b"x-tokenlane-lane", b"all")],
        b"busy",
        False,
    ),
    "a body longer than its length": ("POST", True, 200, [(b"content-length", b"1")], b"xy", False),
    "a body shorter than its length": ("POST", True, 200, [(b"content-length", b"3")], b"x", False),
    "a length that is no number": ("POST", True, 200, [(b"content-length", b"x")], b"", False),
    "a header name uvicorn refuses": ("POST", True, 200, [(b"bad name", b"v")], b"x", True),
    "a header value uvicorn refuses": ("POST", True, 200, [(b"x-a", b"v\nw")], b"x", True),
    "a status with no line": ("POST", True, 700, [SSE], b"x", True),
    "bytes a name may hold": ("POST", True, 200, [(b"x-\x80!#$%&'*+.^_`|~", b"v")], b"x", True),
    "a name with a colon": ("POST", True, 200, [SSE, (b"x:y", b"v")], b"x", True),
    "a name with DEL": ("POST", True, 200, [(b"x\x7f", b"v")], b"x", True),
    "bytes a value may hold": ("POST", True, 200, [(b"x-a", b"\t\x80\xff ()<>")], b"x", True),
    "a value with NUL": ("POST", True, 200, [SSE, (b"x-a", b"v\x00")], b"x", True),
    "a value with CR": ("POST", True, 200, [(b"x-a", b"v\rw")], b"x", True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
async def test_the_start_is_what_uvicorn_writes_or_refused_where_it_raises(case: Any) -> None:
    method, keep_alive, status, headers, body, more = case
    want = await uvicorns(method, keep_alive, status, headers, body, more)
    if isinstance(want, type):
        with pytest.raises(InvalidResponse):
            response_start(status, headers, list(DEFAULT), method, None, 0, keep_alive, body, more)
        return
    got = response_start(status, headers, list(DEFAULT), method, None, 0, keep_alive, body, more)
    data, (chunked, length, alive, complete, closed) = want
    assert b"".join(got.parts) == data
    assert (got.chunked, got.length, got.keep_alive, got.complete) == (
        chunked,
        length,
        alive,
        complete,
    )
    # uvicorn closes a finished response's connection that is not kept alive; so does the cycle
    # (``edge/cycle.py``) on ``complete`` and not ``keep_alive``.
    assert closed == (got.complete and not got.keep_alive)


def _cycle(method: str, keep_alive: bool) -> tuple[Cycle, Written, list[str]]:
    transport = Written()
    told: list[str] = []
    cycle = Cycle(
        cast(asyncio.Transport, transport),
        Flow(cast(asyncio.Transport, transport)),
        method,
        keep_alive,
        False,
        list(DEFAULT),
        lambda: told.append("complete"),
    )
    return cycle, transport, told


def _as_parts(body: bytes) -> list[bytes]:
    """``body`` cut where the relay cuts a burst (its parts, an empty one among them)."""
    third = len(body) // 3
    return [body[:third], b"", body[third : 2 * third], body[2 * third :]]


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
@pytest.mark.parametrize(
    "with_body", [False, True, "parts"], ids=["two messages", "START_WITH_BODY", "as parts"]
)
async def test_the_cycles_send_writes_what_uvicorns_writes(case: Any, with_body: Any) -> None:
    """The server's ``send``, a start then a body (or the start carrying it, as bytes or as
    parts), against uvicorn's own cycle given the same: the same bytes and state, or an error
    where uvicorn raised one (a start that carries its body is then refused whole, nothing
    written; given as two messages, a body that breaks its length is refused after its start
    went out)."""
    method, keep_alive, status, headers, body, more = case
    want = await uvicorns(method, keep_alive, status, headers, body, more)
    cycle, transport, told = _cycle(method, keep_alive)
    start: dict[str, Any] = {"type": "http.response.start", "status": status, "headers": headers}
    if with_body:
        given = _as_parts(body) if with_body == "parts" else body
        start |= {START_BODY: given, START_MORE_BODY: more}

    async def send_both() -> None:
        await cycle.send(start)
        if not with_body:
            await cycle.send({"type": "http.response.body", "body": body, "more_body": more})

    if isinstance(want, type):
        with pytest.raises(RuntimeError):
            await send_both()
        if with_body:
            assert transport.data == b""  # refused whole: nothing of it written
        return
    await send_both()
    data, (chunked, length, alive, complete, closed) = want
    assert transport.data == data
    state = (cycle.chunked_encoding, cycle.expected_content_length, cycle.keep_alive)
    assert state == (chunked, length, alive)
    assert (cycle.response_complete, transport.closed) == (complete, closed)
    assert told == (["complete"] if complete else [])


def test_a_chunk_is_framed_at_every_size() -> None:
    """A chunk of a chunked body: its size in hex, CRLF, the bytes, CRLF (as uvicorn frames
    one), for sizes from the table of size lines and past it, written whole or as parts (from
    4 KiB); the last one ends the body."""

    def written(data: bytes, last: bool) -> bytes:
        transport = Written()
        write_chunk(cast(asyncio.WriteTransport, transport), data, last)
        return transport.data

    for size in (1, 15, 16, 255, 2047, 2048, 4095, 4096, 70000):
        data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
        assert written(data, False) == b"%x\r\n%b\r\n" % (size, data), size
        assert written(data, True) == b"%x\r\n%b\r\n0\r\n\r\n" % (size, data), size
    assert written(b"", True) == b"0\r\n\r\n"


@pytest.mark.parametrize("with_body", [False, True], ids=["two messages", "START_WITH_BODY"])
async def test_bodies_and_headers_as_apps_give_them_are_written_as_bytes(with_body: bool) -> None:
    """What ASGI apps send besides bytes and tuples, and uvicorn takes: a ``memoryview`` or
    ``bytearray`` body (Starlette's ``StreamingResponse`` passes memoryviews on) and header
    pairs as lists; written as the same bytes (the compiled build checks types strictly)."""
    cycle, transport, told = _cycle("GET", True)
    start: dict[str, Any] = {
        "type": "http.response.start",
        "status": 200,
        "headers": [[b"x-a", b"1"]],
    }
    if with_body:
        start |= {START_BODY: memoryview(b"ab"), START_MORE_BODY: True}
        await cycle.send(start)
    else:
        await cycle.send(start)
        await cycle.send(
            {"type": "http.response.body", "body": memoryview(b"ab"), "more_body": True}
        )
    await cycle.send({"type": "http.response.body", "body": bytearray(b"c"), "more_body": False})
    assert transport.data == (
        b"HTTP/1.1 200 OK\r\ndate: Fri, 27 Nov 2026 21:13:43 GMT\r\nserver: uvicorn\r\n"
        b"x-a: 1\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n1\r\nc\r\n0\r\n\r\n"
    )
    assert told == ["complete"]


async def test_random_starts_are_what_uvicorn_writes_or_refused_where_it_raises() -> None:
    """Random starts of tuples of bytes (every relayed start's shape, read typed) against
    uvicorn's own cycle: the same bytes and state, or a refusal where it raises."""
    rng = random.Random(12)
    names = [b"content-type", b"Content-Length", b"content-length", b"Transfer-Encoding",
             b"transfer-encoding", b"Connection", b"connection", b"x-request-id", b"bad name",
             b"x:y", b"x\x7f", b"X-A"]  # fmt: skip
    values = [b"chunked", b"Chunked", b"close", b"keep-alive, Close", b"keep-alive", b"2",
              b"0", b"x", b"-1", b"text/event-stream", b"v\nw", b"v\x00", b"\t\x80\xff"]  # fmt: skip
    seen = set()
    for _ in range(1500):
        pairs = [(rng.choice(names), rng.choice(values)) for _ in range(rng.randrange(5))]
        method = rng.choice(["GET", "POST", "HEAD"])
        keep_alive = rng.random() < 0.8
        status = rng.choice([200, 204, 304, 503, 700])
        body = rng.choice([b"", b"xy", b"d" * 5000])
        more = rng.random() < 0.5
        assert head._names_and_values(DEFAULT, pairs) is not None  # the typed reading
        want = await uvicorns(method, keep_alive, status, pairs, body, more)
        args = (status, pairs, list(DEFAULT), method, None, 0, keep_alive, body, more)
        if isinstance(want, type):
            with pytest.raises(InvalidResponse):
                response_start(*args)
            seen.add("refused")
            continue
        got = response_start(*args)
        data, (chunked, length, alive, complete, _) = want
        assert b"".join(got.parts) == data, args
        assert (got.chunked, got.length, got.keep_alive, got.complete) == (
            chunked, length, alive, complete,
        ), args  # fmt: skip
        seen.add("framed")
    assert seen == {"refused", "framed"}  # both outcomes met


def test_pairs_of_another_shape_take_the_generic_path_unread() -> None:
    pairs = [(b"x-a", b"1")]
    assert head._names_and_values(DEFAULT, pairs) == ([b"date", b"server", b"x-a"],
                                                      [DEFAULT[0][1], b"uvicorn", b"1"])  # fmt: skip
    assert head._names_and_values(DEFAULT, [[b"x-a", b"1"]]) is None  # a list pair
    assert head._names_and_values(DEFAULT, [(b"x-a", bytearray(b"1"))]) is None
    assert head._names_and_values(DEFAULT, [(b"x-a", b"1", b"2")]) is None
    given = iter(pairs)
    assert head._names_and_values(DEFAULT, given) is None
    assert list(given) == pairs  # an iterator is left whole, for the generic path to read
    # The generic path: lists and bytes-like objects read as bytes, anything else refused.
    assert head._any_names_and_values(DEFAULT, iter([[b"x-a", bytearray(b"1")]])) == (
        [b"date", b"server", b"x-a"], [DEFAULT[0][1], b"uvicorn", b"1"],
    )  # fmt: skip
    for bad in ([("x-a", b"1")], [(b"x-a", 1)], [(b"x-a", b"1", b"2")]):
        with pytest.raises((TypeError, ValueError)):
            head._any_names_and_values(DEFAULT, bad)
