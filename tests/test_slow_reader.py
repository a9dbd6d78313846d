"""A client that stops reading a stream (its socket buffer full) is cut after
``server.write_stall_timeout_s``: its upstream is cancelled (the replica sees the disconnect and
aborts the sequence), the replica's slot is released, and the cut is counted and logged. A
client that keeps reading is never cut, however long its stream."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx

from loadtest.fake_upstream import running
from proxy.edge.connection import edge_for

from .gateway import policy_for, running_gateway
from .waiting import wait_until

CHAT = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "messages": [{"role": "user", "content": "hi"}]}


async def _stop_reading_client(url: str, body: dict[str, object]) -> socket.socket:
    """A client with a small receive buffer that sends a request and then never reads."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, int(port)))
    raw = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n"
    ).encode()
    await loop.sock_sendall(sock, head + raw)
    return sock


async def test_a_client_that_stops_reading_is_cut_and_its_upstream_cancelled() -> None:
    async with running(record=False) as up:
        policy = policy_for({"p": [up.url]}, server={"write_stall_timeout_s": 0.5})
        async with running_gateway(policy) as (url, app):
            gw = app.gateway
            stalls = edge_for(app).write_stalls
            # ~20 MB paced through the relay: far more than the socket buffers hold.
            body = {**CHAT, "stream": True, "max_tokens": 20000, "fake_token_bytes": 1000,
                    "fake_interval_ms": 0}  # fmt: skip
            sock = await _stop_reading_client(url, body)
            try:
                await wait_until(lambda: up.stats.drain_waits, what="the replica held back")
                await wait_until(lambda: up.stats.disconnects, what="replica hears the cut")
                await wait_until(
                    lambda: gw.relay.requests_in_flight == 0, what="no request in flight"
                )
                assert all(r.in_flight == 0 for r in gw.fleet.replicas())
                assert stalls._value.get() == 1
                assert up.stats.bytes_written < 20000 * 1000  # cut, not finished
            finally:
                sock.close()

            # A client that reads is not cut, and the gateway still serves.
            async with httpx.AsyncClient(timeout=30) as client:
                async with client.stream(
                    "POST", url + "/v1/chat/completions",
                    json={**CHAT, "stream": True, "max_tokens": 2000, "fake_token_bytes": 1000,
                          "fake_interval_ms": 0},
                ) as resp:  # fmt: skip
                    text = "".join([t async for t in resp.aiter_text()])
            assert text.rstrip().endswith("data: [DONE]")
            assert stalls._value.get() == 1
