"""The HTTP edge under abuse, over real sockets: oversized and too many headers (431), a head
sent too slowly and a body that stalls (408), a connection that sends nothing (closed), too
many connections (503), bytes that do not parse after a valid request (its answer, then 400),
and no redirect built from the client's Host. Each refusal is counted by reason, and the
gateway serves other clients meanwhile. The pure decisions are table-tested first."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from loadtest.fake_upstream import running
from proxy.config import ServerConfig
from proxy.edge.bounds import (
    BODY,
    HEAD,
    IDLE,
    KEEP_ALIVE_S,
    KEPT,
    LINGER,
    LINGER_S,
    REFUSAL_REASONS,
    SILENT,
    Bounds,
    TimerCall,
    head_refusal,
    on_timer,
    refusal_answer,
)
from proxy.edge.connection import edge_for
from proxy.edge.routes import GatewayApp

from .gateway import gateway_process, policy_for, rss_bytes, running_gateway

CHAT = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "messages": [{"role": "user", "content": "hi"}]}
KiB = 1024
MiB = 1024 * KiB
B = Bounds.of(ServerConfig())


# ---------------------------------------------------------------------------- decisions


def test_defaults_are_envoys_header_bounds_and_admit_a_thousand_streams() -> None:
    assert (B.max_header_bytes, B.max_headers) == (60 * KiB, 100)
    assert (B.head_timeout_s, B.body_timeout_s, B.silent_timeout_s) == (10.0, 60.0, 10.0)
    assert B.max_connections >= 1000
    # An unfinished head is cut only once no framing could bring it within the bound.
    assert B.raw_head_cap >= B.max_header_bytes + 4 * B.max_headers


@pytest.mark.parametrize(
    ("size", "count", "reason"),
    [
        (0, 0, None),
        (60 * KiB, 100, None),
        (60 * KiB + 1, 100, "header_bytes"),
        (100, 101, "header_count"),
        (60 * KiB + 1, 101, "header_count"),
    ],
)
def test_head_refusal(size: int, count: int, reason: str | None) -> None:
    assert head_refusal(size, count, B) == reason


@pytest.mark.parametrize(
    ("phase", "since", "now", "paused", "call"),
    [
        (IDLE, 0.0, 99.0, False, TimerCall()),
        (SILENT, 0.0, 4.0, False, TimerCall(again_in=6.0)),
        (SILENT, 0.0, 10.0, False, TimerCall(refuse="silent")),
        (HEAD, 5.0, 9.0, False, TimerCall(again_in=6.0)),
        (HEAD, 5.0, 15.5, False, TimerCall(refuse="head_timeout")),
        (BODY, 0.0, 30.0, False, TimerCall(again_in=30.0)),
        (BODY, 0.0, 60.0, False, TimerCall(refuse="body_timeout")),
        (BODY, 0.0, 600.0, True, TimerCall(again_in=60.0)),  # the server paused reading
        (LINGER, 0.0, 0.5, False, TimerCall(again_in=LINGER_S - 0.5)),
        (LINGER, 0.0, LINGER_S, False, TimerCall(close=True)),
        (KEPT, 10.0, 12.0, False, TimerCall(again_in=KEEP_ALIVE_S - 2.0)),
        (KEPT, 10.0, 10.0 + KEEP_ALIVE_S, False, TimerCall(close=True)),
        (KEPT, 10.0, 10.0 + KEEP_ALIVE_S, True, TimerCall(close=True)),
    ],
)
def test_on_timer(phase: str, since: float, now: float, paused: bool, call: TimerCall) -> None:
    assert on_timer(phase, since, now, paused, B) == call


@pytest.mark.parametrize(
    ("reason", "status"),
    [
        ("header_bytes", 431),
        ("header_count", 431),
        ("head_timeout", 408),
        ("body_timeout", 408),
        ("connection_cap", 503),
        ("malformed", 400),
    ],
)
def test_refusal_answer_is_the_gateways_error_shape_and_closes(reason: str, status: int) -> None:
    head, body = refusal_answer(reason, B).split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    assert lines[0].startswith(b"HTTP/1.1 %d " % status)
    assert b"connection: close" in lines
    assert b"content-length: %d" % len(body) in lines
    error = json.loads(body)["error"]
    assert error["code"] == status and error["message"]
    assert (b"retry-after: 1" in lines) == (reason == "connection_cap")


def test_a_silent_connection_is_closed_without_an_answer() -> None:
    assert refusal_answer("silent", B) == b""
    assert set(REFUSAL_REASONS) >= {"silent", "header_bytes", "connection_cap"}


# ---------------------------------------------------------------------------- sockets


def refusals(app: GatewayApp, reason: str) -> float:
    return edge_for(app).refusals.labels(reason)._value.get()


async def wait_refusals(app: GatewayApp, reason: str, n: int, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while refusals(app, reason) < n:
        assert loop.time() < deadline, f"{reason}: {refusals(app, reason)} refusals, not {n}"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def gateway(**server: Any) -> AsyncIterator[tuple[str, GatewayApp]]:
    async with running(tokens=3) as up:
        policy = policy_for({"p": [up.url]}, server=server)
        async with running_gateway(policy) as (url, app):
            yield url, app


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def read_all(reader: asyncio.StreamReader, timeout_s: float = 30.0) -> bytes:
    """Everything until the server closes (or resets) the connection."""
    out = bytearray()
    with contextlib.suppress(ConnectionError):
        while chunk := await asyncio.wait_for(reader.read(65536), timeout_s):
            out += chunk
    return bytes(out)


async def served(url: str) -> None:
    """A normal client is answered (the gateway is not blocked by the abusers)."""
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text


def request_head(headers: list[tuple[str, str]], path: str = "/v1/chat/completions") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: gw", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n").encode()


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer.split(b" ", 2)[1])


async def test_headers_within_the_bounds_pass_and_one_over_is_a_431() -> None:
    body = json.dumps(CHAT).encode()
    ok_headers = [(f"x-h{i}", "v") for i in range(96)]  # + host, content-*, connection
    big = [("x-big", "a" * (60 * KiB - 200))]
    async with gateway() as (url, app):
        answers = {}
        for name, extra in [
            ("100 headers", ok_headers),
            ("101 headers", [*ok_headers, ("x-one-more", "v")]),
            ("just under", big),
            ("just over", [("x-big", "a" * (60 * KiB + 1))]),
        ]:
            reader, writer = await connect(url)
            head = request_head(
                [*extra, ("content-type", "application/json"), ("content-length", str(len(body)))]
            )
            writer.write(head + b"connection: close\r\n\r\n" + body)
            answers[name] = await read_all(reader)
            writer.close()
        assert status_of(answers["100 headers"]) == 200
        assert status_of(answers["just under"]) == 200
        assert status_of(answers["101 headers"]) == 431
        assert status_of(answers["just over"]) == 431
        assert b"RequestHeaderFieldsTooLarge" in answers["just over"]
        assert refusals(app, "header_count") == 1
        assert refusals(app, "header_bytes") == 1


async def test_a_huge_url_is_a_431() -> None:
    async with gateway() as (url, app):
        reader, writer = await connect(url)
        writer.write(b"GET /" + b"a" * (61 * KiB) + b" HTTP/1.1\r\nhost: gw\r\n\r\n")
        answer = await read_all(reader)
        writer.close()
        assert status_of(answer) == 431
        assert refusals(app, "header_bytes") == 1


async def _flood(writer: asyncio.StreamWriter, head: bytes, total: int, piece: bytes) -> int:
    """Send ``head`` then ``piece`` repeatedly up to ``total`` bytes; return bytes sent."""
    sent = 0
    with contextlib.suppress(ConnectionError):
        writer.write(head)
        while sent < total:
            writer.write(piece)
            await writer.drain()
            sent += len(piece)
    return sent


async def test_an_endless_header_is_refused_while_it_arrives_and_others_are_served() -> None:
    # 64 MiB in one header value (and, on another connection, 100,000 small headers): each is
    # refused once past the bound, not buffered to its end.
    async with gateway() as (url, app):
        r1, w1 = await connect(url)
        r2, w2 = await connect(url)
        big = asyncio.create_task(_flood(w1, request_head([]) + b"x-big: ", 64 * MiB, b"a" * MiB))
        many = asyncio.create_task(
            _flood(w2, request_head([]), 100_000 * 12, b"x-h: 123456\r\n" * 1000)
        )
        await served(url)
        assert status_of(await read_all(r1)) == 431
        assert status_of(await read_all(r2)) == 431
        await asyncio.gather(big, many)
        w1.close()
        w2.close()
        assert refusals(app, "header_bytes") == 1
        assert refusals(app, "header_count") == 1
        await served(url)


async def test_a_64_mib_header_does_not_grow_the_gateways_memory(tmp_path: Any) -> None:
    async with running(tokens=3) as up:
        async with gateway_process(policy_for({"p": [up.url]}), tmp_path) as (url, pid):
            await served(url)
            before = rss_bytes(pid)
            for _ in range(3):
                reader, writer = await connect(url)
                flood = asyncio.create_task(
                    _flood(writer, request_head([]) + b"x-big: ", 64 * MiB, b"a" * MiB)
                )
                assert status_of(await read_all(reader)) == 431
                await flood
                writer.close()
            await served(url)
            grown = rss_bytes(pid) - before
            async with httpx.AsyncClient() as client:
                text = (await client.get(url + "/metrics")).text
    # Unbounded, the header was buffered whole (RSS +141 MB for one); refused at 60 KiB the
    # growth is noise.
    assert grown < 16 * MiB, f"RSS grew {grown / MiB:.1f} MiB"
    assert 'tokenlane_connection_refusals_total{reason="header_bytes"} 3.0' in text


async def test_a_slowloris_head_gets_408_and_the_gateway_serves_meanwhile() -> None:
    async with gateway(request_head_timeout_s=0.5) as (url, app):
        conns = [await connect(url) for _ in range(20)]
        stop = asyncio.Event()

        async def drip(writer: asyncio.StreamWriter) -> None:
            # One header byte at a time, as a slowloris client sends them: the load, not a wait.
            with contextlib.suppress(ConnectionError):
                writer.write(request_head([]))
                while not stop.is_set() and not writer.is_closing():
                    writer.write(b"x")
                    await writer.drain()
                    await asyncio.sleep(0.05)

        drips = [asyncio.create_task(drip(w)) for _, w in conns]
        await served(url)
        answers = [await read_all(r) for r, _ in conns]
        stop.set()
        await asyncio.gather(*drips)
        for _, w in conns:
            w.close()
        assert [status_of(a) for a in answers] == [408] * 20
        assert refusals(app, "head_timeout") == 20
        await served(url)


async def test_a_stalled_body_gets_408() -> None:
    async with gateway(request_body_timeout_s=0.5) as (url, app):
        reader, writer = await connect(url)
        head = request_head([("content-type", "application/json"), ("content-length", "100")])
        writer.write(head + b"\r\n" + b'{"model": ')
        await served(url)
        answer = await read_all(reader)
        writer.close()
        assert status_of(answer) == 408
        assert refusals(app, "body_timeout") == 1


async def test_a_body_that_keeps_coming_slowly_is_not_cut() -> None:
    # Each gap is under the body timeout: the request completes however long it takes.
    body = json.dumps(CHAT).encode()
    # A gap of a tenth of the timeout, over more than the timeout in all: cut if the timer
    # ran from the head instead of from the last byte.
    async with gateway(request_body_timeout_s=5.0) as (url, app):
        reader, writer = await connect(url)
        head = request_head(
            [("content-type", "application/json"), ("content-length", str(len(body)))]
        )
        writer.write(head + b"connection: close\r\n\r\n")
        step = len(body) // 12 + 1
        for i in range(0, len(body), step):
            writer.write(body[i : i + step])
            await writer.drain()
            await asyncio.sleep(0.5)
        answer = await read_all(reader)
        writer.close()
        assert status_of(answer) == 200
        assert refusals(app, "body_timeout") == 0


async def test_a_silent_connection_is_closed_and_a_keep_alive_one_is_not_cut_early() -> None:
    async with gateway(silent_connection_timeout_s=0.3) as (url, app):
        silent = [await connect(url) for _ in range(50)]
        await served(url)
        answers = [await read_all(r) for r, _ in silent]
        for _, w in silent:
            w.close()
        assert answers == [b""] * 50
        assert refusals(app, "silent") == 50
        # A connection that sent its request is no longer "silent": it is answered, and
        # kept alive (uvicorn's keep-alive timeout, 5 s here, governs it from then on).
        async with httpx.AsyncClient(timeout=10) as client:
            first = await client.get(url + "/health")
            await wait_refusals(app, "silent", 50)
            second = await client.get(url + "/health")
        assert first.status_code == second.status_code == 200
        assert refusals(app, "silent") == 50


async def test_connections_over_the_cap_get_503_and_the_cap_frees_up() -> None:
    async with gateway(max_connections=3) as (url, app):
        held = [await connect(url) for _ in range(3)]
        reader, writer = await connect(url)
        answer = await read_all(reader)
        writer.close()
        assert status_of(answer) == 503 and b"retry-after: 1" in answer
        assert refusals(app, "connection_cap") == 1
        for _, w in held:
            w.close()
        for r, _ in held:
            await read_all(r)
        await served(url)


async def test_a_valid_request_then_garbage_gets_its_answer_then_a_400() -> None:
    async with gateway() as (url, app):
        reader, writer = await connect(url)
        writer.write(b"GET /health HTTP/1.1\r\nhost: gw\r\n\r\n\x00\x01garbage\r\n\r\n")
        answer = await read_all(reader)
        writer.close()
        first, _, rest = answer.partition(b"HTTP/1.1 400 ")
        assert status_of(first) == 200, answer
        assert rest, answer  # the 400 follows the answer, then the close
        assert refusals(app, "malformed") == 1
        # Garbage alone is a 400 at once.
        reader, writer = await connect(url)
        writer.write(b"\x00\x01garbage\r\n\r\n")
        assert status_of(await read_all(reader)) == 400
        writer.close()
        assert refusals(app, "malformed") == 2


@pytest.mark.parametrize("path", ["/admin/replicas/", "/health/", "/v1/models//", "/metrics/"])
async def test_a_trailing_slash_is_a_404_not_a_redirect_to_the_clients_host(path: str) -> None:
    async with gateway() as (url, _):
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.get(url + path, headers={"host": "evil.example"})
    assert r.status_code == 404, r.headers
    assert "location" not in r.headers
    assert r.json()["error"]["type"] == "NotFoundError"
