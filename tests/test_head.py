"""``edge/head.py``: a response's start and first body written as uvicorn's own cycle writes
them, byte for byte and state for state; None exactly where uvicorn's ``send`` raises."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import pytest
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from proxy.edge.head import DirectBody, start_with_body

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
async def test_the_start_is_what_uvicorn_writes_or_none_where_it_raises(case: Any) -> None:
    method, keep_alive, status, headers, body, more = case
    want = await uvicorns(method, keep_alive, status, headers, body, more)
    got = start_with_body(status, headers, list(DEFAULT), method, None, 0, keep_alive, body, more)
    if isinstance(want, type):
        assert got is None, f"uvicorn raised {want.__name__}"
        return
    assert got is not None
    data, (chunked, length, alive, complete, closed) = want
    assert b"".join(got.parts) == data
    assert (got.chunked, got.length, got.keep_alive, got.complete) == (
        chunked,
        length,
        alive,
        complete,
    )
    # uvicorn closes a finished response's connection that is not kept alive; so does the cycle
    # (``edge/connection.py``) on ``complete`` and not ``keep_alive``.
    assert closed == (got.complete and not got.keep_alive)


async def test_a_writer_whose_cycle_is_gone_writes_nothing() -> None:
    """The writer holds its cycle weakly (the scope holds the writer and the cycle the scope):
    once the request is over and the cycle freed, a late call writes nothing, as for a client
    gone, and never fails."""

    class Cycle:
        pass

    cycle = Cycle()
    writer = DirectBody(cast(RequestResponseCycle, cycle))
    assert writer.cycle is cycle
    del cycle
    assert writer.cycle is None
    assert writer.start(lambda message: None, {"type": "http.response.start"}) is False
    assert writer.direct() is False
    assert writer.write_body(b"late") is True
    assert writer.end(b"") is True
    await asyncio.wait_for(writer.drain(), 5)


def test_a_written_chunk_is_framed_at_every_size() -> None:
    """``write_body`` frames a chunk of a chunked body (its size in hex, CRLF, the bytes, CRLF,
    as the cycle's ``send`` frames one), for sizes from the table of size lines and past it."""
    written: list[bytes] = []

    class Flow:
        write_paused = False

    class Transport:
        def write(self, data: bytes) -> None:
            written.append(data)

    class Cycle:
        disconnected = False
        transport = Transport()
        flow = Flow()

    cycle = Cycle()
    writer = DirectBody(cast(RequestResponseCycle, cycle))
    for size in (1, 15, 16, 255, 2047, 2048, 4096, 70000):
        data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
        assert writer.write_body(data) is True
        assert written[-1] == b"%x\r\n%b\r\n" % (size, data), size
