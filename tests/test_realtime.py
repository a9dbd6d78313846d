"""The realtime WebSocket relay: its pure parts (close codes, the headers a replica gets), then
over real sockets against a WebSocket replica: both directions, close codes passed on each
way, the client's key checked and never relayed, a 503 with Retry-After without replicas, and
one access line per session."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import websockets
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from loadtest.fake_upstream import _MODELS, MODEL, FakeUpstream, _plain
from proxy.edge.realtime import close_code_for, upstream_headers
from proxy.fleet.health import CANARY_PATH

from .gateway import policy_for, running_gateway
from .servers import serve_app
from .waiting import wait_until


@pytest.mark.parametrize(
    ("code", "sent"),
    [(1000, 1000), (1001, 1001), (4000, 4000), (1005, 1011), (1006, 1011), (None, 1011)],
)
def test_a_close_without_a_code_is_passed_on_as_a_failure(code: int | None, sent: int) -> None:
    assert close_code_for(code) == sent


def test_the_replica_gets_the_clients_headers_without_its_connection_or_credentials() -> None:
    headers = [
        (b"host", b"gw:8080"),
        (b"upgrade", b"websocket"),
        (b"connection", b"Upgrade"),
        (b"sec-websocket-key", b"abc"),
        (b"sec-websocket-version", b"13"),
        (b"authorization", b"Bearer sk-client"),
        (b"x-api-key", b"sk-client"),
        (b"openai-beta", b"realtime=v1"),
        (b"traceparent", b"00-1-2-01"),
    ]
    out = upstream_headers(headers, "rid-1", "sk-replica")
    assert out == [
        (b"openai-beta", b"realtime=v1"),
        (b"traceparent", b"00-1-2-01"),
        (b"x-request-id", b"rid-1"),
        (b"authorization", b"Bearer sk-replica"),
    ]
    assert (b"authorization", b"Bearer sk-replica") not in upstream_headers(headers, "r", None)


# -- over real sockets: a WebSocket replica behind the gateway ----------------------------


class EchoReplica:
    """A replica with vLLM's health, models and metrics routes and a ``/v1/realtime`` that
    answers each message with ``echo:<message>``; a message ``close:<code>`` makes it close
    with that code. It records what reached it."""

    def __init__(self) -> None:
        self.sessions: list[dict[str, Any]] = []
        self.closed = asyncio.Event()

    def app(self) -> Starlette:
        async def health(request: Request) -> Response:
            return Response(status_code=200)

        async def models(request: Request) -> Response:
            return Response(_MODELS, media_type="application/json")

        async def metrics(request: Request) -> Response:
            return Response(FakeUpstream()._metrics(), media_type="text/plain")

        async def completion(request: Request) -> Response:  # the health canary's
            return Response(_plain(1), media_type="application/json")

        async def realtime(ws: WebSocket) -> None:
            session: dict[str, Any] = {
                "headers": dict(ws.headers),
                "query": str(ws.url.query),
                "got": [],
                "close_code": None,
            }
            self.sessions.append(session)
            await ws.accept(subprotocol=(ws.scope.get("subprotocols") or [None])[0])
            try:
                while True:
                    message = await ws.receive()
                    if message["type"] == "websocket.disconnect":
                        session["close_code"] = message.get("code")
                        return
                    text = message.get("text")
                    if text is None:
                        session["got"].append(message.get("bytes"))
                        await ws.send_bytes(b"echo:" + (message.get("bytes") or b""))
                        continue
                    session["got"].append(text)
                    if text.startswith("close:"):
                        await ws.close(code=int(text[len("close:") :]))
                        return
                    await ws.send_text("echo:" + text)
            finally:
                self.closed.set()

        return Starlette(
            routes=[
                Route("/health", health),
                Route("/v1/models", models),
                Route("/metrics", metrics),
                Route(CANARY_PATH, completion, methods=["POST"]),
                WebSocketRoute("/v1/realtime", realtime),
            ]
        )


@contextlib.asynccontextmanager
async def realtime_gateway(
    **env: str,
) -> AsyncIterator[tuple[str, EchoReplica, Any]]:
    replica = EchoReplica()
    async with serve_app(replica.app()) as up:
        async with running_gateway(policy_for({"p": [up]}), environ=env) as (url, app):
            yield "ws" + url[4:], replica, app


async def test_a_session_is_relayed_both_ways_and_a_client_close_reaches_the_replica(
    access_lines: list[dict[str, Any]],
) -> None:
    async with realtime_gateway() as (url, replica, _):
        async with websockets.connect(
            url + "/v1/realtime?model=Qwen%2FQwen2.5-0.5B-Instruct",
            subprotocols=[websockets.Subprotocol("realtime")],
            additional_headers={"x-request-id": "rt-1", "openai-beta": "realtime=v1"},
        ) as ws:
            assert ws.subprotocol == "realtime"
            await ws.send("hello")
            assert await ws.recv() == "echo:hello"
            await ws.send(b"\x00\x01")
            assert await ws.recv() == b"echo:\x00\x01"
            await ws.close(code=4001)
        await asyncio.wait_for(replica.closed.wait(), 30)
    [session] = replica.sessions
    assert session["got"] == ["hello", b"\x00\x01"]
    assert session["close_code"] == 4001  # the client's own code, passed on
    assert session["query"] == "model=Qwen%2FQwen2.5-0.5B-Instruct"
    assert session["headers"]["x-request-id"] == "rt-1"
    assert session["headers"]["openai-beta"] == "realtime=v1"
    await wait_until(lambda: access_lines, what="the session's access line")
    [line] = access_lines
    assert line["api"] == "realtime" and line["status"] == 101
    assert line["model"] == MODEL and line["content_chunks"] == 2
    assert line["ttft_ms"] is not None and line["error"] is None


async def test_a_replica_close_reaches_the_client_with_its_code() -> None:
    async with realtime_gateway() as (url, _, _):
        async with websockets.connect(url + "/v1/realtime") as ws:
            await ws.send("close:4002")
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4002


async def test_a_session_needs_a_client_key_and_gets_a_503_without_replicas() -> None:
    async with realtime_gateway(TOKENLANE_API_KEYS="sk-rt") as (url, replica, app):
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(url + "/v1/realtime"):
                pass
        assert refused.value.response.status_code == 401
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(
                url + "/v1/realtime?model=nope", additional_headers={"x-api-key": "sk-rt"}
            ):
                pass
        assert refused.value.response.status_code == 404  # vLLM's own for an unknown model
        async with websockets.connect(
            url + "/v1/realtime", additional_headers={"authorization": "Bearer sk-rt"}
        ) as ws:
            await ws.send("hi")
            assert await ws.recv() == "echo:hi"
        assert "authorization" not in replica.sessions[0]["headers"]
        for r in app.gateway.fleet.replicas():
            app.gateway.fleet.operator_eject(r)
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(
                url + "/v1/realtime", additional_headers={"x-api-key": "sk-rt"}
            ):
                pass
        assert refused.value.response.status_code == 503
        assert int(refused.value.response.headers["retry-after"]) >= 1
