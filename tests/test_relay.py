"""The relay over real sockets against a paced fake vLLM: streaming, cancellation,
backpressure, retries before the first byte, and never after it."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from loadtest.fake_upstream import FakeUpstream, running
from proxy.errors import UpstreamClosed
from proxy.fleet.fleet import Fleet
from proxy.observe.metrics import Metrics
from proxy.policyfile import build_policy
from proxy.relay import respond
from proxy.relay.call import Attempt
from proxy.relay.relay import query_text

from .gateway import (
    a_call,
    content_of,
    gateway_process,
    generators_left_to_the_loop,
    policy_for,
    rss_bytes,
    running_gateway,
)
from .servers import free_port
from .test_upstream import HEAD, counting_client, listening
from .test_upstream import send as send_to
from .waiting import wait_until

CHAT = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "messages": [{"role": "user", "content": "hi"}]}


def chat_requests(up: FakeUpstream) -> list[tuple[dict, dict]]:
    """(body, headers) of the chat requests a fake received: canaries apart."""
    return [
        (b, h) for b, h in zip(up.stats.bodies, up.stats.headers, strict=True) if "messages" in b
    ]


async def test_first_content_reaches_the_client_before_upstream_sends_its_last() -> None:
    async with running(tokens=50, interval_s=0.02) as up:  # a token every 20 ms: ~1 s
        async with running_gateway(policy_for({"p": [up.url]})) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                before = up.stats.bytes_written
                written_at_first = None
                async with client.stream(
                    "POST", url + "/v1/chat/completions", json={**CHAT, "stream": True}
                ) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {") and written_at_first is None:
                            if content_of(line.encode()):
                                written_at_first = up.stats.bytes_written - before
                written = up.stats.bytes_written - before
    assert written_at_first is not None
    # Buffering would deliver everything once upstream sent its last; streaming delivers the
    # first token while most of the stream is still to come (counted in bytes, not in time,
    # which a paused machine stretches).
    assert written_at_first < written / 2, (written_at_first, written)


@pytest.mark.parametrize("interval_s", [0.0, 0.002], ids=["burst", "paced"])
@pytest.mark.parametrize("continuation", [False, True], ids=["plain", "eligible"])
async def test_a_relayed_stream_leaves_no_async_generator_to_the_loop(
    interval_s: float, continuation: bool
) -> None:
    """A relay that stops reading early (at its first content, at ``[DONE]``) leaves no
    suspended async generator of the gateway behind: the loop would close each in a task of
    its own, woken through its self-pipe, after every request."""
    async with running(tokens=8, interval_s=interval_s) as up:
        policy = policy_for({"p": [up.url]}, continuation={"enabled": continuation})
        async with running_gateway(policy) as (url, app):
            (replica,) = app.gateway.fleet.replicas()
            async with httpx.AsyncClient(timeout=10) as client:
                with generators_left_to_the_loop() as left:
                    for _ in range(3):
                        resp = await client.post(
                            url + "/v1/chat/completions", json={**CHAT, "stream": True}
                        )
                        assert resp.text.endswith("data: [DONE]\n\n")
                        # Its relay returned: what it held is gone.
                        await wait_until(lambda: replica.in_flight == 0, what="the slot freed")
                    gc.collect()
    asked = [b.get("return_token_ids") for b, _ in chat_requests(up)]
    assert asked == [True if continuation else None] * 3  # the path meant was taken
    assert left == []


@pytest.mark.parametrize("fail", [False, True], ids=["ended", "raised"])
async def test_chunks_handed_back_are_over_once_ended_or_raised(fail: bool) -> None:
    """``StreamFlow.handed_back`` ends for good when its pump ends or raises, as a generator
    does: it never pumps again (the response's connection may serve another request by then).
    A plain stream's flow with no client writer hands every chunk back; the replica then ends
    its body, or resets the connection."""
    first = asyncio.Event()
    go_on = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HEAD + b"9\r\ndata: a\n\n\r\n")
        await writer.drain()
        first.set()
        await go_on.wait()
        if fail:
            writer.transport.abort()  # a reset
        else:
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            await reader.read()

    client, _ = counting_client()
    try:
        async with listening(serve) as url:
            response = await send_to(client, url)
            reply = response.stream.reply  # type: ignore[attr-defined]
            policy = build_policy(policy_for({"p": ["http://a:1"]}))
            metrics = Metrics()
            (replica,) = Fleet(policy, {}, metrics=metrics).replicas()
            call = a_call(policy.lanes[0])
            flow = respond._Relayed(call, Attempt(replica, None), metrics, False, b"")
            chunks = flow.handed_back(reply)
            await first.wait()
            assert await chunks.__anext__() == b"data: a\n\n"  # handed back
            go_on.set()
            with pytest.raises(UpstreamClosed if fail else StopAsyncIteration):
                await chunks.__anext__()
            # Pumped again, the reset connection would raise again: it is not pumped.
            with pytest.raises(StopAsyncIteration):
                await chunks.__anext__()
            await reply.aclose()
    finally:
        await client.aclose()


async def test_role_chunk_is_held_and_sent_with_the_first_content() -> None:
    async with running(tokens=5) as up:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, _):
            up.first_token_delay_s = 0.3
            async with httpx.AsyncClient(timeout=10) as client:
                async with client.stream(
                    "POST", url + "/v1/chat/completions", json={**CHAT, "stream": True}
                ) as resp:
                    first = b""
                    async for raw in resp.aiter_raw():
                        first = raw
                        break
    # The first bytes the client sees already hold the role chunk and the first content.
    events = [e for e in first.split(b"\n\n") if e]
    assert len(events) >= 2
    assert b'"role":"assistant"' in events[0]
    assert content_of(events[1])


async def test_client_disconnect_closes_the_upstream_within_a_second() -> None:
    # A 30 s stream: closed within the bound below, it was the client's leaving that closed it.
    async with running(tokens=1500, interval_s=0.02) as up:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, app):
            async with httpx.AsyncClient(timeout=10) as client:
                async with client.stream(
                    "POST", url + "/v1/chat/completions", json={**CHAT, "stream": True}
                ) as resp:
                    n = 0
                    async for _ in resp.aiter_lines():
                        n += 1
                        if n > 6:
                            break
                closed_at = time.monotonic()
            await wait_until(lambda: up.stats.disconnects, what="upstream hears the disconnect")
            assert up.stats.disconnects == 1
            # Nominally within milliseconds; the slack is for a paused machine.
            assert up.stats.disconnected_at[0] - closed_at < 5.0
            # The replica's slot is free again.
            replica = next(app.gateway.fleet.replicas())
            await wait_until(lambda: replica.in_flight == 0, what="the replica's slot freed")


async def test_client_disconnect_of_a_plain_request_cancels_it_upstream() -> None:
    async with running(tokens=5) as up:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, app):
            up.first_token_delay_s = 5.0  # a request whose answer never comes
            async with httpx.AsyncClient(timeout=0.3) as client:
                with pytest.raises(httpx.ReadTimeout):
                    await client.post(url + "/v1/chat/completions", json={**CHAT, "stream": True})
            replica = next(app.gateway.fleet.replicas())
            await wait_until(lambda: replica.in_flight == 0, what="the replica's slot freed")
            assert replica.in_flight == 0


async def test_a_connection_refused_is_retried_on_another_replica() -> None:
    async with running(tokens=3) as good, running(tokens=3) as bad:
        policy = policy_for({"p": [good.url, bad.url]}, health={"interval_s": 60})
        async with running_gateway(policy) as (url, app):
            await bad.stop()  # healthy in the gateway's eyes, but now refuses connections
            async with httpx.AsyncClient(timeout=10) as client:
                for _ in range(6):
                    r = await client.post(url + "/v1/chat/completions", json=CHAT)
                    assert r.status_code == 200
                    assert r.headers["x-tokenlane-replica"] == f"127.0.0.1:{good.port}"
            retries = app.gateway.metrics.retries.labels("all", "connect")._value.get()
            assert retries >= 3  # round robin sent every other first attempt to the bad one


async def test_an_upstream_503_is_retried_and_a_400_is_not() -> None:
    async with running(tokens=3) as good, running(tokens=3) as busy:
        policy = policy_for({"p": [busy.url, good.url]}, health={"interval_s": 60})
        async with running_gateway(policy) as (url, _):
            busy.fail_status = 503
            async with httpx.AsyncClient(timeout=10) as client:
                for _ in range(4):
                    r = await client.post(url + "/v1/chat/completions", json=CHAT)
                    assert r.status_code == 200
                busy.fail_status = 400
                good.fail_status = 400
                r = await client.post(url + "/v1/chat/completions", json=CHAT)
                assert r.status_code == 400
        chats = chat_requests(busy) + chat_requests(good)
        assert len(chats) == 4 + 2 + 1  # two first attempts hit the 503 one; the 400 is final


async def test_first_token_timeout_retries_before_anything_was_sent() -> None:
    async with running(tokens=3) as slow, running(tokens=3) as fast:
        policy = policy_for(
            {"p": [slow.url, fast.url]},
            lanes=[{"name": "all", "pool": "p", "first_token_timeout_s": 0.3}],
            health={"interval_s": 60},
        )
        async with running_gateway(policy) as (url, app):
            slow.first_token_delay_s = 5.0
            async with httpx.AsyncClient(timeout=10) as client:
                for _ in range(2):
                    r = await client.post(
                        url + "/v1/chat/completions", json={**CHAT, "stream": True}
                    )
                    assert r.status_code == 200
                    assert r.text.rstrip().endswith("data: [DONE]")
                    assert r.headers["x-tokenlane-replica"] == f"127.0.0.1:{fast.port}"
            m = app.gateway.metrics.retries.labels("all", "first_token_timeout")
            assert m._value.get() >= 1


async def test_a_stream_cut_after_content_is_ended_with_an_error_event_not_retried() -> None:
    """The plain relay (continuation off): tests/test_continuation.py has the cut continued."""
    async with running(tokens=20) as cut, running(tokens=20) as other:
        policy = policy_for(
            {"p": [cut.url, other.url]},
            health={"interval_s": 60},
            continuation={"enabled": False},
        )
        async with running_gateway(policy) as (url, _):
            cut.cut_after = 3
            async with httpx.AsyncClient(timeout=10) as client:
                seen_cut = False
                for _ in range(2):
                    r = await client.post(
                        url + "/v1/chat/completions", json={**CHAT, "stream": True}
                    )
                    assert r.status_code == 200
                    if r.headers["x-tokenlane-replica"] == f"127.0.0.1:{cut.port}":
                        seen_cut = True
                        events = [e for e in r.text.split("\n\n") if e.strip()]
                        assert events[-1] == "data: [DONE]"
                        error = json.loads(events[-2][len("data: ") :])
                        assert set(error["error"]) == {"message", "type", "param", "code"}
        assert seen_cut
        # The cut stream was not retried: the other replica saw only its own request.
        assert len(chat_requests(other)) == 1


async def test_no_healthy_replica_answers_503_with_retry_after() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with running_gateway(policy_for({"p": [dead]}), ready=False) as (url, _):
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.post(url + "/v1/chat/completions", json=CHAT)
            assert r.status_code == 503
            assert int(r.headers["retry-after"]) >= 1
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert (await client.get(url + "/ready")).status_code == 503


async def test_every_attempt_failing_answers_502_in_openai_shape() -> None:
    async with running(tokens=3) as a, running(tokens=3) as b:
        policy = policy_for({"p": [a.url, b.url]}, health={"interval_s": 60})
        async with running_gateway(policy) as (url, _):
            await a.stop()
            await b.stop()
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(url + "/v1/chat/completions", json=CHAT)
            assert r.status_code == 502
            assert r.json()["error"]["type"] == "BadGatewayError"


async def test_body_headers_and_request_id_reach_the_replica_but_credentials_do_not() -> None:
    body = {**CHAT, "max_tokens": 3, "priority": 5, "vendor_extension": {"a": [1, 2.5, None]}}
    raw = json.dumps(body, indent=1).encode()  # odd spacing: forwarded byte for byte
    async with running(tokens=3) as up:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(
                    url + "/v1/chat/completions",
                    content=raw,
                    headers={
                        "content-type": "application/json",
                        "authorization": "Bearer client-secret",
                        "x-api-key": "client-secret",
                        "x-request-id": "req-123",
                        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                    },
                )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "req-123"
    assert r.headers["x-tokenlane-lane"] == "all"
    [(seen_body, seen)] = chat_requests(up)
    assert seen_body == body
    assert int(seen["content-length"]) == len(raw)
    assert seen["x-request-id"] == "req-123"
    assert seen["traceparent"].startswith("00-0af7")
    assert "client-secret" not in json.dumps(seen)


async def test_replica_key_is_sent_as_bearer_token() -> None:
    async with running(tokens=3) as up:
        policy = policy_for({"p": [up.url]})
        policy["pools"]["p"]["replicas"][0]["api_key_env"] = "REPLICA_KEY"
        async with running_gateway(policy, environ={"REPLICA_KEY": "rk-1"}) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(
                    url + "/v1/chat/completions",
                    json=CHAT,
                    headers={"authorization": "Bearer client-secret"},
                )
    assert r.status_code == 200
    [(_, seen)] = chat_requests(up)
    assert seen["authorization"] == "Bearer rk-1"


async def test_tcp_nodelay_is_set_on_both_sides() -> None:
    from proxy.edge.connection import GatewayProtocol
    from proxy.relay.h1 import H1Connection

    async with running(tokens=3) as up:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, _):
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            req = json.dumps({**CHAT, "stream": True}).encode()
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(req), req)
            )
            await reader.readuntil(b"data: [DONE]")
            downstream = [
                o.transport.get_extra_info("socket")
                for o in gc.get_objects()
                if isinstance(o, GatewayProtocol)
                and o.transport is not None
                and not o.transport.is_closing()
            ]
            upstream = [
                o.transport.get_extra_info("socket")
                for o in gc.get_objects()
                if isinstance(o, H1Connection)
                and o.transport is not None
                and o.transport.get_extra_info("peername")[1] == up.port
            ]
            # Only open sockets can be asked; require one of each, or the loop checks nothing.
            live_down = [s for s in downstream if s.fileno() != -1]
            live_up = [s for s in upstream if s.fileno() != -1]
            assert live_down and live_up, (len(downstream), len(upstream))
            for sock in live_down + live_up:
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            writer.close()


@pytest.mark.slow
async def test_a_stalled_reader_holds_back_its_upstream_and_not_the_others(tmp_path: Path) -> None:
    """One client stops reading for 5 s while 99 others stream: theirs keep flowing, the
    gateway's memory stays bounded, and the stalled stream's upstream writer is held back."""
    up = FakeUpstream(tokens=50, interval_s=0.02, record=False)
    await up.start()
    try:
        async with gateway_process(policy_for({"p": [up.url]}), tmp_path) as (url, pid):
            async with httpx.AsyncClient(
                timeout=30, limits=httpx.Limits(max_connections=200)
            ) as client:

                async def one_stream() -> float:
                    """The longest gap between two chunks of one normal stream."""
                    gap, last = 0.0, None
                    async with client.stream(
                        "POST", url + "/v1/chat/completions", json={**CHAT, "stream": True}
                    ) as resp:
                        async for _ in resp.aiter_raw():
                            t = time.monotonic()
                            gap = max(gap, t - last) if last else 0.0
                            last = t
                    return gap

                await asyncio.gather(*(one_stream() for _ in range(99)))  # warm-up
                base_rss = rss_bytes(pid)
                # The stalled client: a 100 MB stream on a socket nobody reads.
                big = json.dumps(
                    {
                        **CHAT,
                        "stream": True,
                        "max_tokens": 50_000,
                        "fake_token_bytes": 2000,
                        "fake_interval_ms": 0,
                    }
                ).encode()
                port = int(url.rsplit(":", 1)[1])
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
                sock.connect(("127.0.0.1", port))
                sock.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                    b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(big), big)
                )
                # Proof the stalled stream is under way and its upstream writer already held
                # back, before the others are timed against it.
                await wait_until(
                    lambda: up.stats.drain_waits > 0, what="the stalled stream's upstream held back"
                )
                t0 = time.monotonic()
                gaps = []
                while time.monotonic() - t0 < 5.0:
                    gaps += await asyncio.gather(*(one_stream() for _ in range(99)))
                written = up.stats.bytes_written
                grown = rss_bytes(pid) - base_rss
                sock.close()
    finally:
        await up.stop()
    # Held up behind the stalled one, the others would stop for the whole 5 s; a paused
    # machine alone stops them for well under 3. (On 2026-11-23 one run saw them stop ~4.3 s;
    # on 2026-11-26 neither that day's code nor main reproduced it (both passed with a soak
    # running beside; main's longest gap 0.3 s), so the test is no longer marked as failing.)
    print(f"longest gap of the other streams: {max(gaps) * 1000:.0f} ms, upstream wrote "
          f"{written / 2**20:.1f} MiB, gateway grew {grown / 2**20:.1f} MiB")  # fmt: skip
    assert max(gaps) < 3.0, f"other streams stopped flowing ({max(gaps):.1f}s)"
    assert grown < 5 * 1024 * 1024, f"gateway grew {grown / 2**20:.1f} MiB"
    # Unheld, the fake would have written the whole 100 MB in well under 5 s.
    assert up.stats.drain_waits > 0
    assert written < 60 * 1024 * 1024, f"upstream wrote {written / 2**20:.0f} MiB"


async def test_a_replicas_cookie_is_relayed_but_never_replayed_to_other_requests() -> None:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    seen_cookies: list[str | None] = []

    async def chat(request: Request) -> Response:
        seen_cookies.append(request.headers.get("cookie"))
        resp = JSONResponse({"choices": [{"message": {"content": "x"}}]})
        resp.set_cookie("session", "client-a-secret")
        return resp

    async def health(request: Request) -> Response:
        return Response()

    async def models(request: Request) -> Response:
        return JSONResponse({"data": [{"id": CHAT["model"]}]})

    upstream = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", chat, methods=["POST"]),
            Route("/health", health),
            Route("/v1/models", models),
        ]
    )
    from .servers import serve_app

    async with serve_app(upstream) as up_url:
        # A host name, as replicas have in compose: aiohttp's default jar ignores IP hosts.
        by_name = up_url.replace("127.0.0.1", "localhost")
        async with running_gateway(policy_for({"p": [by_name]})) as (url, _):
            async with httpx.AsyncClient(timeout=10) as a, httpx.AsyncClient(timeout=10) as b:
                first = await a.post(url + "/v1/chat/completions", json=CHAT)
                assert "client-a-secret" in first.headers.get("set-cookie", "")
                await b.post(url + "/v1/chat/completions", json=CHAT)
    assert len(seen_cookies) >= 2 and all(c is None for c in seen_cookies), seen_cookies


class _GzipUpstream(FakeUpstream):
    """A replica (or the proxy in front of it) that compresses its plain responses."""

    async def _respond(
        self, method: str, path: str, headers: dict[str, str], raw: bytes, w: asyncio.StreamWriter
    ) -> None:
        if path != "/v1/chat/completions":
            return await super()._respond(method, path, headers, raw, w)
        import gzip

        from loadtest.fake_upstream import _plain

        payload = gzip.compress(_plain(8))
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
        )


async def test_a_compressed_plain_response_reaches_the_client_unchanged() -> None:
    up = _GzipUpstream()
    await up.start()
    try:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                resp = await client.post(url + "/v1/chat/completions", json=CHAT)
    finally:
        await up.stop()
    # The body keeps the encoding its headers announce: the client (httpx) decodes it.
    assert resp.status_code == 200
    assert resp.headers["content-encoding"] == "gzip"
    assert resp.json()["choices"][0]["message"]["content"].startswith("tok0")


class _SilentHeadersUpstream(FakeUpstream):
    """A replica that takes client requests but sends not even a status line for a while."""

    headers_delay_s = 0.0

    async def _respond(
        self, method: str, path: str, headers: dict[str, str], raw: bytes, w: asyncio.StreamWriter
    ) -> None:
        if path == "/v1/chat/completions" and "x-tokenlane-canary" not in headers:
            await asyncio.sleep(self.headers_delay_s)
        await super()._respond(method, path, headers, raw, w)


async def test_first_token_timeout_counts_from_the_attempt_not_from_the_status_line() -> None:
    slow = _SilentHeadersUpstream(tokens=3)
    await slow.start()
    try:
        async with running(tokens=3) as fast:
            policy = policy_for(
                {"p": [slow.url, fast.url]},
                lanes=[{"name": "all", "pool": "p", "first_token_timeout_s": 0.3}],
                health={"interval_s": 60},
            )
            async with running_gateway(policy) as (url, _):
                slow.headers_delay_s = 10.0
                async with httpx.AsyncClient(timeout=10) as client:
                    for _ in range(2):  # round robin: one of them tries the slow one first
                        started = time.monotonic()
                        r = await client.post(
                            url + "/v1/chat/completions", json={**CHAT, "stream": True}
                        )
                        assert r.status_code == 200
                        assert r.headers["x-tokenlane-replica"] == f"127.0.0.1:{fast.port}"
                        assert time.monotonic() - started < 6.0  # not the 10 s
    finally:
        await slow.stop()


async def test_the_query_string_reaches_the_replica() -> None:
    async with running(tokens=2) as up:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(
                    url + "/v1/chat/completions?api-version=2024-10-01", json=CHAT
                )
                assert r.status_code == 200
    assert "/v1/chat/completions?api-version=2024-10-01" in up.stats.targets


async def test_a_replica_answering_something_not_http_is_retried_not_a_500() -> None:
    async with running(tokens=2) as odd, running(tokens=2) as good:
        policy = policy_for({"p": [odd.url, good.url]}, health={"interval_s": 60})
        async with running_gateway(policy) as (url, _):
            odd.garbage = True
            async with httpx.AsyncClient(timeout=10) as client:
                for _ in range(4):
                    r = await client.post(url + "/v1/chat/completions", json=CHAT)
                    assert r.status_code == 200, r.text
                    assert r.headers["x-tokenlane-replica"] == good.url.removeprefix("http://")


async def test_every_replica_overloaded_answers_503_with_retry_after_not_502() -> None:
    async with running(tokens=2) as a, running(tokens=2) as b:
        policy = policy_for({"p": [a.url, b.url]}, health={"interval_s": 60})
        async with running_gateway(policy) as (url, _):
            a.fail_status = b.fail_status = 503
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 503
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "ServiceUnavailableError"


async def post_raw(url: str, head: bytes, body: bytes) -> bytes:
    """A chat request with exactly the headers ``head`` (and a content-length); the status line."""
    host, port = url.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n%scontent-length: %d\r\n\r\n%s"
        % (head, len(body), body)
    )
    await writer.drain()
    status = await reader.readuntil(b"\r\n")
    writer.close()
    return status


async def test_upstream_gets_the_clients_headers_and_none_of_the_relays_own() -> None:
    # aiohttp adds Accept, Accept-Encoding: gzip and its User-Agent when a request has none;
    # a compressed answer the client never asked for would then be relayed raw.
    body = json.dumps(CHAT).encode()
    async with running(tokens=3) as up:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, _):
            head = b"x-trace: 7\r\ncontent-type: application/json\r\n"
            assert (await post_raw(url, head, body)).startswith(b"HTTP/1.1 200")
    (_, headers), *_ = chat_requests(up)
    # The forwarding headers are the gateway's own, by contract (docs/http.md, Headers).
    assert set(headers) == {"host", "x-trace", "content-type", "content-length", "x-request-id",
                            "x-forwarded-for", "forwarded"}  # fmt: skip
    assert headers["content-length"] == str(len(body))


async def test_a_body_sent_without_content_type_goes_upstream_without_one() -> None:
    # aiohttp would label it application/octet-stream, which vLLM refuses to read as JSON.
    async with running(tokens=3) as up:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, _):
            status = await post_raw(url, b"", json.dumps(CHAT).encode())
            assert status.startswith(b"HTTP/1.1 200")
    (_, headers), *_ = chat_requests(up)
    assert "content-type" not in headers


@pytest.mark.parametrize(
    ("raw", "sent"),
    [
        (b"q=%C3%A9&x=a+b", "q=%C3%A9&x=a+b"),  # already encoded: unchanged
        ("q=é".encode(), "q=%C3%A9"),  # raw UTF-8: its own bytes, encoded
        (b"a=\xff", "a=%FF"),  # not UTF-8 at all: still its own byte
    ],
)
def test_a_query_string_goes_upstream_as_its_own_bytes(raw: bytes, sent: str) -> None:
    url = httpx.URL("http://replica:8000/v1/models?" + query_text(raw))
    assert url.query.decode() == sent


async def test_a_calls_loop_is_its_tasks_without_asking_asyncio(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The relay reads its loop from the request's task (``Call.loop``): Python 3.11's
    # ``get_running_loop`` makes a ``getpid`` system call each time.
    loop = asyncio.get_running_loop()
    call = a_call(build_policy(policy_for({"p": ["http://127.0.0.1:1"]})).lanes[0])
    assert call.task is None
    asked: list[int] = []
    real = asyncio.get_running_loop

    def counted() -> asyncio.AbstractEventLoop:
        asked.append(1)
        return real()

    monkeypatch.setattr(asyncio, "get_running_loop", counted)
    assert call.loop() is loop  # no task named: asyncio is asked
    assert asked == [1]
    call.task = asyncio.current_task()
    assert call.loop() is loop
    assert asked == [1]  # its task's loop: not asked again
