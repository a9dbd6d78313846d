"""The gateway's uvicorn protocol and its two ASGI extensions, over real loopback sockets:
a response start that carries its first body (one socket write), and a callback when the
client goes away; and the gateway's fallback under a plain uvicorn that has neither."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import json
import re
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
import pytest
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from loadtest.fake_upstream import running
from proxy.edge import endpoint
from proxy.edge.asgi_ext import (
    CLIENT_GONE,
    DIRECT_BODY,
    START_BODY,
    START_MORE_BODY,
    START_WITH_BODY,
    ClientGoneHook,
)
from proxy.edge.connection import GatewayProtocol
from proxy.edge.cycle import Cycle, MessageEvent
from proxy.edge.endpoint import request_id_from
from proxy.gateway import create_app
from proxy.policyfile import build_policy

from .gateway import policy_for, wait_ready
from .servers import serve_app
from .waiting import wait_until

CHAT = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "messages": [{"role": "user", "content": "hi"}]}
Handler = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def asgi(handler: Handler) -> Handler:
    """``handler`` for HTTP, with the lifespan protocol answered (serve_app turns it on)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        await handler(scope, receive, send)

    return app


async def send_start_with_body(
    scope: dict[str, Any],
    send: Any,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    more_body: bool,
) -> None:
    """As the relay sends a start: one message where the server takes it, else two."""
    start = {"type": "http.response.start", "status": 200, "headers": headers}
    if START_WITH_BODY in scope.get("extensions", {}):
        await send({**start, START_BODY: body, START_MORE_BODY: more_body})
    else:
        await send(start)
        await send({"type": "http.response.body", "body": body, "more_body": more_body})


# ---------------------------------------------------------------------------- recording


@dataclass
class Recorder:
    """What the server wrote on its connections, one entry per write/writelines call."""

    writes: list[bytes] = field(default_factory=list)
    lost: asyncio.Event = field(default_factory=asyncio.Event)


class _RecordingTransport:
    def __init__(self, transport: asyncio.Transport, recorder: Recorder) -> None:
        self._transport = transport
        self._recorder = recorder

    def write(self, data: bytes) -> None:
        self._recorder.writes.append(bytes(data))
        self._transport.write(data)

    def writelines(self, parts: list[bytes]) -> None:
        self._recorder.writes.append(b"".join(parts))
        self._transport.writelines(parts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Recording(asyncio.Protocol):
    """A server protocol (``inner``) whose transport's writes are recorded and whose
    connection losses are signalled: a wrapper, as the gateway's compiled protocol takes no
    subclass."""

    def __init__(self, inner: Any, recorder: Recorder) -> None:
        self.inner = inner
        self.recorder = recorder

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(
            _RecordingTransport(cast(asyncio.Transport, transport), self.recorder)
        )

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return cast(bool | None, self.inner.eof_received())

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)
        self.recorder.lost.set()


def recording(base: Callable[..., Any], recorder: Recorder) -> Callable[..., Any]:
    """A protocol factory for uvicorn's ``http``: ``base``'s protocols, recorded."""

    def make(**kw: Any) -> _Recording:
        return _Recording(base(**kw), recorder)

    return make


# ---------------------------------------------------------------------------- raw HTTP/1.1


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def get(path: str = "/", *extra: str) -> bytes:
    return ("\r\n".join([f"GET {path} HTTP/1.1", "host: test", *extra]) + "\r\n\r\n").encode()


async def read_response(reader: asyncio.StreamReader) -> Response:
    """One HTTP/1.1 response, its framing checked strictly (Content-Length or chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")[:-2]
    version, status, _ = lines[0].split(" ", 2)
    assert version == "HTTP/1.1"
    headers = {}
    for line in lines[1:]:
        name, value = line.split(":", 1)
        assert name.lower() not in headers, f"header {name} twice"
        headers[name.lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        assert "content-length" not in headers
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            if size == 0:
                assert await reader.readexactly(2) == b"\r\n"  # no trailers
                break
            parts.append(await reader.readexactly(size))
            assert await reader.readexactly(2) == b"\r\n"
        body = b"".join(parts)
    else:
        body = await reader.readexactly(int(headers["content-length"]))
    return Response(int(status), headers, body)


@contextlib.asynccontextmanager
async def connect(url: str) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection(*address(url))
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def exchange(url: str, *requests: bytes) -> list[Response]:
    """Each request in turn on one keep-alive connection."""
    answers = []
    async with asyncio.timeout(30), connect(url) as (reader, writer):
        for request in requests:
            writer.write(request)
            answers.append(await read_response(reader))
    return answers


# ---------------------------------------------------------------------------- scope


SEEN_HOOKS: list[Any] = []  # kept alive, so two hooks' ids can only match if they are one


async def echo_extensions(scope: dict[str, Any], receive: Any, send: Any) -> None:
    ext = scope.get("extensions") or {}
    hook = ext.get(CLIENT_GONE)
    SEEN_HOOKS.append(hook)
    body = json.dumps(
        {
            "keys": sorted(ext),
            "hook": type(hook).__name__,
            "hook_id": id(hook),
            "start_options": ext.get(START_WITH_BODY),
        }
    ).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def test_scope_advertises_both_extensions_under_our_protocol() -> None:
    async with serve_app(asgi(echo_extensions), http=GatewayProtocol) as url:
        first, second = (json.loads(r.body) for r in await exchange(url, get(), get()))
    assert first["keys"] == sorted([START_WITH_BODY, CLIENT_GONE, DIRECT_BODY])
    assert first["hook"] == ClientGoneHook.__name__
    assert first["start_options"] == {}
    # Each request has its own hook: a callback set for one is never fired for the next.
    assert second["keys"] == first["keys"]
    assert second["hook_id"] != first["hook_id"]


async def test_scope_advertises_no_extension_under_plain_uvicorn() -> None:
    async with serve_app(asgi(echo_extensions)) as url:
        (answer,) = await exchange(url, get())
    assert json.loads(answer.body)["keys"] == []


# ---------------------------------------------------------------------------- START_WITH_BODY

FRAMINGS = ["chunked", "content-length"]


def framing_headers(framing: str, body_length: int) -> list[tuple[bytes, bytes]]:
    headers = [(b"content-type", b"text/event-stream"), (b"x-test", b"kept")]
    if framing == "content-length":
        headers.append((b"content-length", str(body_length).encode()))
    return headers


def check_framing(response: Response, framing: str, body: bytes) -> None:
    assert response.status == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["x-test"] == "kept"
    if framing == "chunked":
        assert response.headers["transfer-encoding"] == "chunked"
    else:
        assert response.headers["content-length"] == str(len(body))
    assert response.body == body


@pytest.mark.parametrize("framing", FRAMINGS)
async def test_start_with_whole_body_is_a_correct_response_on_a_kept_connection(
    framing: str,
) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = f"data: {scope['path']}\n\n".encode()
        headers = framing_headers(framing, len(body))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": headers,
                START_BODY: body,
                START_MORE_BODY: False,
            }
        )

    async with serve_app(asgi(app), http=GatewayProtocol) as url:
        first, second = await exchange(url, get("/one"), get("/two"))
    check_framing(first, framing, b"data: /one\n\n")
    check_framing(second, framing, b"data: /two\n\n")
    assert "connection" not in first.headers  # kept alive


@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize("first", [b"data: first\n\n", b""])
async def test_start_with_first_body_then_more_body_concatenates_exactly(
    framing: str, first: bytes
) -> None:
    rest = [b"data: second\n\n", b"data: " + b"x" * 70_000 + b"\n\n", b"data: [DONE]\n\n"]
    whole = first + b"".join(rest)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = framing_headers(framing, len(whole))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": headers,
                START_BODY: first,
                START_MORE_BODY: True,
            }
        )
        for part in rest:
            await asyncio.sleep(0)
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async with serve_app(asgi(app), http=GatewayProtocol) as url:
        answers = await exchange(url, get(), get())
    for answer in answers:
        check_framing(answer, framing, whole)


async def test_start_with_body_honours_connection_close() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send_start_with_body(scope, send, [], b"bye", more_body=False)

    async with serve_app(asgi(app), http=GatewayProtocol) as url:
        async with asyncio.timeout(30), connect(url) as (reader, writer):
            writer.write(get("/", "connection: close"))
            answer = await read_response(reader)
            assert await reader.read() == b""  # the server closed after the response
    assert answer.body == b"bye"
    assert answer.headers["connection"] == "close"


async def test_pipelined_requests_each_get_the_start_with_body() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = scope["path"].encode()
        await send_start_with_body(scope, send, [], body, more_body=False)

    async with serve_app(asgi(app), http=GatewayProtocol) as url:
        async with asyncio.timeout(30), connect(url) as (reader, writer):
            writer.write(get("/a") + get("/b") + get("/c"))  # one segment, three requests
            answers = [await read_response(reader) for _ in range(3)]
    assert [a.body for a in answers] == [b"/a", b"/b", b"/c"]


async def test_status_headers_and_first_body_leave_in_one_write() -> None:
    body = b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send_start_with_body(scope, send, [(b"x-test", b"kept")], body, more_body=True)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def first_writes(protocol: Callable[..., Any]) -> list[bytes]:
        recorder = Recorder()
        async with serve_app(asgi(app), http=recording(protocol, recorder)) as url:
            (answer,) = await exchange(url, get())
        assert answer.body == body + b"data: [DONE]\n\n"
        return recorder.writes

    writes = await first_writes(GatewayProtocol)
    assert writes[0].startswith(b"HTTP/1.1 200")
    assert b"x-test: kept\r\n" in writes[0]
    assert writes[0].endswith(body + b"\r\n")  # the first chunk, framed, in the same write
    assert b"[DONE]" not in writes[0]
    # The control: plain uvicorn, the same app, two writes (this is what the recorder tells).
    plain = await first_writes(HttpToolsProtocol)
    assert plain[0].startswith(b"HTTP/1.1 200")
    assert body not in plain[0]
    assert body in plain[1]


# ---------------------------------------------------------------------------- CLIENT_GONE


@dataclass
class Waiting:
    """An app that sets the hook's callback, then waits (as a relay waits on its upstream)
    without listening on receive()."""

    respond_first: bool = False  # the response has begun (a stream) when the client leaves
    fired: list[float] = field(default_factory=list)
    waiting: asyncio.Event = field(default_factory=asyncio.Event)
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        hook: ClientGoneHook = scope["extensions"][CLIENT_GONE]

        def gone() -> None:
            self.fired.append(time.monotonic())
            self.wake.set()

        hook.callback = gone
        if self.respond_first:
            await send_start_with_body(scope, send, [], b"data: hi\n\n", more_body=True)
        self.waiting.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), 10)


async def leave_with_one_pipelined(url: str, started: asyncio.Event, *, reset: bool) -> None:
    """A client that sends ``/running`` with ``/queued`` pipelined behind it, reads the first
    one's opening chunk (``data: hi``, once the app set ``started``), and leaves (with a
    reset, ``reset``)."""
    reader, writer = await asyncio.open_connection(*address(url))
    writer.write(get("/running") + get("/queued"))
    await started.wait()
    await reader.readuntil(b"data: hi\n\n")
    if reset:
        reset_on_close(writer)
    writer.close()


def reset_on_close(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.mark.parametrize("respond_first", [False, True], ids=["before-response", "mid-stream"])
@pytest.mark.parametrize("close", ["fin", "reset"])
async def test_client_closing_while_the_app_waits_fires_the_callback_once(
    respond_first: bool, close: str
) -> None:
    app = Waiting(respond_first=respond_first)
    async with serve_app(asgi(app), http=GatewayProtocol) as url:
        async with asyncio.timeout(30):
            reader, writer = await asyncio.open_connection(*address(url))
            writer.write(get())
            await app.waiting.wait()
            if respond_first:
                await reader.readuntil(b"data: hi\n\n")
            if close == "reset":
                reset_on_close(writer)
            writer.close()
            closed_at = time.monotonic()
            await wait_until(lambda: bool(app.fired), what="bool(app.fired)")
            assert len(app.fired) == 1
            # Well before the app would end on its own; wide for a paused VM.
            assert app.fired[0] - closed_at < 5.0
            await asyncio.sleep(0.1)  # nothing fires it again
    assert len(app.fired) == 1


async def test_a_kept_connection_closes_after_its_keep_alive_and_not_before() -> None:
    """Between requests the connection's one timer times the keep-alive (no timer made per
    request), from each answer: a request sent well into the keep-alive after the last answer
    is served on the same connection, and so is one whose app takes longer than the
    keep-alive; once the keep-alive has passed with nothing sent, the server closes it."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] == "/slow":
            await asyncio.sleep(1.5)  # longer than the keep-alive: in progress, not idle
        await send_start_with_body(scope, send, [], scope["path"].encode(), more_body=False)

    async with serve_app(asgi(app), http=GatewayProtocol, timeout_keep_alive=1) as url:
        async with asyncio.timeout(60), connect(url) as (reader, writer):
            writer.write(get("/a"))
            first = await read_response(reader)
            await asyncio.sleep(0.7)  # idle, well into the keep-alive (the scenario, not a wait)
            writer.write(get("/b"))
            second = await read_response(reader)
            await asyncio.sleep(0.7)  # again: 1.4 s after the first answer, 0.7 after this one
            writer.write(get("/slow"))
            third = await read_response(reader)
            answered = time.monotonic()
            assert await reader.read() == b""  # the server closed it
            waited = time.monotonic() - answered
    assert (first.body, second.body, third.body) == (b"/a", b"/b", b"/slow")
    assert waited >= 0.9  # not before the keep-alive (a lower bound only: the box may be slow)


async def test_a_slow_answer_then_bad_bytes_on_a_kept_connection_is_answered_then_400() -> None:
    """A request followed by bytes that do not parse, in the same read, on a connection kept
    alive: the request is answered first, even when it takes longer than the keep-alive
    (the connection's timer stands down while it runs), then the 400."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] == "/slow":
            await asyncio.sleep(1.5)
        await send_start_with_body(scope, send, [], scope["path"].encode(), more_body=False)

    async with serve_app(asgi(app), http=GatewayProtocol, timeout_keep_alive=1) as url:
        async with asyncio.timeout(60), connect(url) as (reader, writer):
            writer.write(get("/a"))
            first = await read_response(reader)
            writer.write(get("/slow") + b"\x00\x01garbage\r\n\r\n")
            slow = await read_response(reader)
            rest = await reader.read()
    assert (first.body, slow.body) == (b"/a", b"/slow")
    assert rest.startswith(b"HTTP/1.1 400 ")


async def test_a_plain_app_hears_the_disconnect_with_a_request_pipelined_behind() -> None:
    """An app that waits on ``receive()`` for the client to leave (plain ASGI, no hook), with
    a second request pipelined behind it: the running one gets ``http.disconnect`` when the
    client closes (its cycle, not only the last one parsed, is told), and the queued one
    never runs."""
    started: list[str] = []
    heard: list[str] = []
    running = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        started.append(scope["path"])
        await send_start_with_body(scope, send, [], b"data: hi\n\n", more_body=True)
        running.set()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                heard.append(scope["path"])
                return

    async with serve_app(asgi(app), http=GatewayProtocol) as url:
        async with asyncio.timeout(30):
            await leave_with_one_pipelined(url, running, reset=False)
            await wait_until(lambda: bool(heard), what="the running request heard it")
    assert heard == ["/running"] and started == ["/running"]


async def test_client_closing_after_a_complete_response_fires_no_callback() -> None:
    fired: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        scope["extensions"][CLIENT_GONE].callback = lambda: fired.append(scope["path"])
        await send_start_with_body(scope, send, [], b"done", more_body=False)

    recorder = Recorder()
    async with serve_app(asgi(app), http=recording(GatewayProtocol, recorder)) as url:
        answers = await exchange(url, get("/a"), get("/b"))  # then the client closes
        assert [a.body for a in answers] == [b"done", b"done"]
        async with asyncio.timeout(30):
            await recorder.lost.wait()
        await asyncio.sleep(0.05)
    assert fired == []


async def test_client_closing_fires_only_the_callback_of_the_request_in_progress() -> None:
    fired: list[str] = []
    waiting = asyncio.Event()
    wake = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope["path"]

        def gone() -> None:
            fired.append(path)
            wake.set()

        scope["extensions"][CLIENT_GONE].callback = gone
        if path == "/done":
            await send_start_with_body(scope, send, [], b"done", more_body=False)
            return
        waiting.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), 10)

    async with serve_app(asgi(app), http=GatewayProtocol) as url:
        async with asyncio.timeout(30), connect(url) as (reader, writer):
            writer.write(get("/done"))
            assert (await read_response(reader)).body == b"done"
            writer.write(get("/waits"))
            await waiting.wait()
        await wait_until(lambda: bool(fired), what="bool(fired)")
    assert fired == ["/waits"]


async def test_the_running_request_hears_of_the_client_leaving_with_another_pipelined() -> None:
    # uvicorn's ``cycle`` is the last request parsed: with a second request pipelined behind a
    # running stream, that is the queued one, not the one whose upstream must be cancelled.
    # (uvicorn stops reading while a request waits behind another, so the loss shows at the
    # stream's next write, not at once.)
    fired: list[str] = []
    waiting = asyncio.Event()
    wake = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope["path"]

        def gone() -> None:
            fired.append(path)
            wake.set()

        scope["extensions"][CLIENT_GONE].callback = gone
        await send_start_with_body(scope, send, [], b"data: hi\n\n", more_body=True)
        waiting.set()
        for _ in range(200):  # a stream: a chunk every 50 ms
            if wake.is_set():
                return
            await asyncio.sleep(0.05)
            await send({"type": "http.response.body", "body": b"data: more\n\n", "more_body": True})

    async with serve_app(asgi(app), http=GatewayProtocol) as url:
        async with asyncio.timeout(30):
            await leave_with_one_pipelined(url, waiting, reset=True)
            closed_at = time.monotonic()
            await wait_until(lambda: bool(fired), what="bool(fired)")
            assert time.monotonic() - closed_at < 5.0  # the stream would run 10 s
    assert fired == ["/running"]


# ---------------------------------------------------------------------------- plain uvicorn


@contextlib.asynccontextmanager
async def plain_gateway(upstream_url: str) -> AsyncIterator[tuple[str, Any]]:
    """The gateway app under uvicorn's own protocol: no extensions, so its fallbacks run."""
    app = create_app(build_policy(policy_for({"p": [upstream_url]})), environ={})
    async with serve_app(app) as url:
        await wait_ready(url)
        yield url, app


async def test_gateway_under_plain_uvicorn_relays_a_stream() -> None:
    async with running(tokens=8) as up, plain_gateway(up.url) as (url, _):
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.post(url + "/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.content.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "".join(f" tok{i}" for i in range(8))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_gateway_under_plain_uvicorn_closes_the_upstream_when_the_client_leaves() -> None:
    async with running(tokens=500, interval_s=0.02) as up, plain_gateway(up.url) as (url, app):
        async with httpx.AsyncClient(timeout=10) as client:
            async with client.stream(
                "POST", url + "/v1/chat/completions", json={**CHAT, "stream": True}
            ) as resp:
                assert resp.status_code == 200
                n = 0
                async for _ in resp.aiter_lines():
                    n += 1
                    if n > 6:
                        break
            closed_at = time.monotonic()
        await wait_until(lambda: up.stats.disconnects > 0, what="up.stats.disconnects > 0")
        assert up.stats.disconnects == 1
        assert up.stats.disconnected_at[0] - closed_at < 5.0  # the stream would run 10 s
        replica = next(app.gateway.fleet.replicas())
        await wait_until(lambda: replica.in_flight == 0, what="replica.in_flight == 0")
        assert replica.in_flight == 0


# ---------------------------------------------------------------------------- request ids


def test_request_id_from_nothing_is_24_distinct_lowercase_hex_digits() -> None:
    ids = [request_id_from(None) for _ in range(10_000)]
    assert all(re.fullmatch(r"[0-9a-f]{24}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert re.fullmatch(r"[0-9a-f]{24}", request_id_from(b""))


def test_request_id_from_nothing_keeps_24_digits_where_its_count_wraps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(endpoint._ids, "value", 0xFFFFFFFFFE)  # its last 40-bit values, then 0
    ids = [request_id_from(None) for _ in range(3)]
    assert [i[14:] for i in ids] == ["ffffffffff", "0000000000", "0000000001"]
    assert len({i[:14] for i in ids}) == 1


def test_request_id_from_a_sane_client_id_keeps_it() -> None:
    for sane in (b"abc-123", b"req_1.2:3", b"A" * 128, b"0f8c2e1a-9b7d-4c3e-8a1f-2b3c4d5e6f70"):
        assert request_id_from(sane) == sane.decode()


def test_request_id_from_an_insane_client_id_replaces_it() -> None:
    for insane in (b"has space", b"A" * 129, b"new\nline", b'quote"', b"caf\xc3\xa9", b"a/b"):
        replaced = request_id_from(insane)
        assert re.fullmatch(r"[0-9a-f]{24}", replaced), insane


# ---------------------------------------------------------------------------- DIRECT_BODY


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize("framing", FRAMINGS)
async def test_direct_body_writes_what_send_would_and_only_when_it_may(
    framing: str, method: str
) -> None:
    parts = [b"data: a\n\n", b"data: " + b"x" * 70_000 + b"\n\n", b"data: [DONE]\n\n"]
    whole = b"first" + b"".join(parts)
    seen: list[bool] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        writer = scope["extensions"][DIRECT_BODY]
        seen.append(writer.direct())  # not started yet
        headers = framing_headers(framing, len(whole))
        await send_start_with_body(scope, send, headers, b"first", more_body=True)
        direct = writer.direct()
        seen.append(direct)
        for part in parts:
            if direct:
                if not writer.write_body(part):
                    await writer.drain()
            else:
                await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        seen.append(writer.direct())  # complete

    request = get() if method == "GET" else get().replace(b"GET", b"HEAD", 1)
    async with serve_app(asgi(app), http=GatewayProtocol) as url:
        if method == "HEAD":
            async with asyncio.timeout(30), connect(url) as (reader, writer):
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200")
            assert seen == [False, False, False]  # a HEAD answer has no body to write
            return
        answers = await exchange(url, request, request)
    for answer in answers:
        check_framing(answer, framing, whole)
    # Only a chunked body is written directly: with a Content-Length, send keeps the count.
    assert seen == [False, framing == "chunked", False] * 2


@pytest.mark.parametrize("more_body", [True, False])
@pytest.mark.parametrize("framing", FRAMINGS)
async def test_the_direct_start_is_the_response_send_writes_and_only_for_the_servers_send(
    framing: str, more_body: bool
) -> None:
    """``DIRECT_BODY``'s ``start`` writes the start and first body as the cycle's ``send``
    does, on a kept connection; it refuses (writing nothing) a ``send`` that is not the
    server's own, such as a middleware's wrapper, which ``send`` then takes."""
    rest = [b"data: b\n\n"] if more_body else []
    whole = b"data: a\n\n" + b"".join(rest)
    used: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        writer = scope["extensions"][DIRECT_BODY]
        start = {
            "type": "http.response.start",
            "status": 200,
            "headers": framing_headers(framing, len(whole)),
            START_BODY: b"data: a\n\n",
            START_MORE_BODY: more_body,
        }
        how = scope["path"]

        async def wrapped(message: dict[str, Any]) -> None:
            await send(message)

        if how == "/direct":
            assert writer.start(send, start)
        elif how == "/wrapped":
            assert not writer.start(wrapped, start)  # nothing written: send takes it
            await wrapped(start)
        else:
            await send(start)
        used.append(how)
        for part in rest:
            await send({"type": "http.response.body", "body": part, "more_body": False})

    # As the gateway serves (its own access line, none of uvicorn's: with uvicorn's access
    # log on, ``send`` writes a line per start and the writer leaves every start to it).
    async with serve_app(asgi(app), http=GatewayProtocol, access_log=False) as url:
        answers = await exchange(url, get("/direct"), get("/send"), get("/wrapped"), get("/direct"))
    assert used == ["/direct", "/send", "/wrapped", "/direct"]
    for answer in answers:
        check_framing(answer, framing, whole)
    heads = [{k: v for k, v in a.headers.items() if k != "date"} for a in answers]
    assert heads[0] == heads[1] == heads[2] == heads[3]


@pytest.mark.parametrize("last", [b"", b"data: [DONE]\n\n"])
async def test_the_direct_end_is_the_end_send_writes_and_a_pipelined_request_follows(
    last: bytes,
) -> None:
    """``DIRECT_BODY``'s ``end`` ends a direct response as the cycle's ``send`` does: the
    same bytes (its last data and the last chunk), the response complete, and the next
    request pipelined behind it answered (``send`` starts it through the protocol's
    ``on_response_complete``; an end without that left it waiting for ever)."""
    ended: list[bool] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        writer = scope["extensions"][DIRECT_BODY]
        headers = [(b"content-type", b"text/event-stream"), (b"x-test", b"kept")]
        start = {"type": "http.response.start", "status": 200, "headers": headers}
        assert writer.start(send, {**start, START_BODY: b"data: a\n\n", START_MORE_BODY: True})
        assert writer.write_body(b"data: b\n\n")
        if scope["path"] == "/direct":
            ended.append(writer.end(last))
            assert not writer.direct()  # complete
        else:
            await send({"type": "http.response.body", "body": last, "more_body": False})

    whole = b"data: a\n\ndata: b\n\n" + last
    # As the gateway serves: without uvicorn's access log (``test_the_direct_start_...``).
    config = {"http": GatewayProtocol, "access_log": False}
    async with serve_app(asgi(app), **config) as url:
        async with asyncio.timeout(30), connect(url) as (reader, writer):
            writer.write(get("/direct") + get("/send") + get("/direct"))  # one segment
            answers = [await read_response(reader) for _ in range(3)]
    assert ended == [True, True]
    for answer in answers:
        check_framing(answer, "chunked", whole)
    heads = [{k: v for k, v in a.headers.items() if k != "date"} for a in answers]
    assert heads[0] == heads[1] == heads[2]


# ---------------------------------------------------------------------------- a body all in


def post(path: str, body: bytes, *extra: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "host: test", f"content-length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def answer_body(body: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-length", str(len(body)).encode())]


async def test_a_body_all_in_is_taken_once_and_receive_then_waits_for_the_end() -> None:
    taken: list[bytes | None] = []
    after: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        writer = scope["extensions"][DIRECT_BODY]
        taken.append(writer.take_body())
        taken.append(writer.take_body())  # once: the body is no longer there to take
        # receive() after the body was taken waits, as after the first receive(): its task
        # has run its first step after one yield (asyncio runs ready callbacks in order).
        waiting = asyncio.ensure_future(receive())
        await asyncio.sleep(0)
        after.append("pending" if not waiting.done() else waiting.result()["type"])
        body = taken[-2] or b""
        await send({"type": "http.response.start", "status": 200, "headers": answer_body(body)})
        await send({"type": "http.response.body", "body": body})
        after.append((await waiting)["type"])  # the response's end ends the wait

    async with serve_app(asgi(app), http=GatewayProtocol) as url:
        # each body in one write with its head: all in before the app runs
        first, second = await exchange(url, post("/a", b'{"a": 1}'), post("/b", b"x" * 2_000))
    assert taken == [b'{"a": 1}', None, b"x" * 2_000, None]
    assert (first.body, second.body) == (b'{"a": 1}', b"x" * 2_000)
    assert after == ["pending", "http.disconnect"] * 2


async def test_a_body_that_waits_for_100_continue_is_left_to_receive() -> None:
    got: list[Any] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        got.append(scope["extensions"][DIRECT_BODY].take_body())
        message = await receive()  # sends the 100 Continue the client waits for
        got.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": answer_body(b"ok")})
        await send({"type": "http.response.body", "body": b"ok"})

    async with serve_app(asgi(app), http=GatewayProtocol) as url:
        async with asyncio.timeout(30), connect(url) as (reader, writer):
            # The body with its head, not waiting for the 100: all in, and still the 100 is owed.
            writer.write(post("/", b"hello", "expect: 100-continue"))
            assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            answer = await read_response(reader)
    assert answer.body == b"ok"
    assert got == [None, b"hello"]


async def test_a_body_still_coming_is_left_to_receive() -> None:
    got: list[Any] = []
    asked = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        got.append(scope["extensions"][DIRECT_BODY].take_body())
        asked.set()
        parts = []
        while True:
            message = await receive()
            parts.append(message["body"])
            if not message["more_body"]:
                break
        got.append(b"".join(parts))
        body = b"".join(parts)
        await send({"type": "http.response.start", "status": 200, "headers": answer_body(body)})
        await send({"type": "http.response.body", "body": body})

    request = post("/", b"0123456789")
    async with serve_app(asgi(app), http=GatewayProtocol) as url:
        async with asyncio.timeout(30), connect(url) as (reader, writer):
            writer.write(request[:-4])
            await asked.wait()  # the app looked while the last bytes were still unsent
            writer.write(request[-4:])
            answer = await read_response(reader)
    assert got == [None, b"0123456789"]
    assert answer.body == b"0123456789"


# ---------------------------------------------------------------------------- the cycle's event


@pytest.mark.parametrize("make", [asyncio.Event, MessageEvent], ids=["asyncio", "ours"])
async def test_the_message_event_behaves_as_asyncios(make: Callable[[], Any]) -> None:
    """The cycle's compiled event against asyncio.Event: the same steps, the same answers."""
    event = make()
    assert not event.is_set()
    event.set()
    assert event.is_set()
    assert await asyncio.wait_for(event.wait(), 5) is True
    event.clear()
    assert not event.is_set()
    # Two waiters, both woken by one set; a third, cancelled, is forgotten.
    woken: list[int] = []

    async def waiter(n: int) -> None:
        await event.wait()
        woken.append(n)

    first, second = asyncio.create_task(waiter(1)), asyncio.create_task(waiter(2))
    cancelled = asyncio.create_task(event.wait())
    await asyncio.sleep(0)  # all three are waiting
    assert not (first.done() or second.done() or cancelled.done())
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert len(event._waiters) == 2  # the cancelled one is forgotten (both keep a list)
    event.set()
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert sorted(woken) == [1, 2]
    assert len(event._waiters) == 0
    # Set, cleared before a waiter runs: it still wakes (as asyncio's: the set is what counts).
    event.clear()
    late = asyncio.create_task(waiter(3))
    await asyncio.sleep(0)
    event.set()
    event.clear()
    await asyncio.wait_for(late, 5)
    assert woken[-1] == 3 and not event.is_set()


async def test_a_served_request_leaves_its_cycle_to_be_freed_by_its_count() -> None:
    """The scope holds the cycle (its direct writer) and the cycle holds neither the scope nor,
    once its app returned, the connection: a served request's cycle is freed by its count when
    the request is over (here with the collector off), not left to the garbage collector. (A
    compiled cycle takes no weak reference: the live ones are counted among the objects the
    collector tracks.)"""

    def cycles() -> int:
        return sum(1 for o in gc.get_objects() if type(o) is Cycle)

    seen: list[int] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        writer = scope["extensions"][DIRECT_BODY]
        assert type(writer) is Cycle
        seen.append(cycles())  # at least this one: the count sees live cycles
        await send_start_with_body(scope, send, [], b"a", more_body=True)
        assert writer.direct() and writer.write_body(b"b") and writer.end(b"c")

    async with serve_app(asgi(app), http=GatewayProtocol) as url:
        gc.collect()
        gc.disable()
        try:
            answers = await exchange(url, *(get(f"/{n}") for n in range(20)))
            assert [a.body for a in answers] == [b"abc"] * 20
            await wait_until(lambda: cycles() == 0, what="every cycle freed")
        finally:
            gc.enable()
    assert len(seen) == 20 and min(seen) >= 1


async def test_a_relayed_stream_leaves_no_cyclic_garbage_in_the_gateway() -> None:
    """Eligible streams through the whole gateway (endpoint, relay, continuation's splice, the
    recorder): no kind of object is left as cyclic garbage once per request."""
    body = json.dumps({**CHAT, "stream": True}).encode()
    request = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body
    n = 30
    # Probes rare: the window below holds the requests, not the prober's own objects.
    policy = policy_for({"p": []}, health={"interval_s": 60})
    async with running(tokens=8) as up:
        policy["pools"]["p"]["replicas"] = [{"url": up.url}]
        app = create_app(build_policy(policy), environ={})
        async with serve_app(app, http=GatewayProtocol) as url:
            await wait_ready(url)
            await exchange(url, request, request)  # the pools, the stream's template learned
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                answers = await exchange(url, *([request] * n))
                gc.collect()
                kinds = collections.Counter(type(o).__qualname__ for o in gc.garbage)
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
    assert [a.status for a in answers] == [200] * n
    assert all(a.body.endswith(b"data: [DONE]\n\n") for a in answers)
    assert {kind: count for kind, count in kinds.items() if count >= n} == {}
