"""The realtime WebSocket (``/v1/realtime``, vLLM's streaming transcription): one client session
relayed to one healthy replica, both directions as they come.

A session is admitted like a request of the last lane (the lane's and the replica's
``max_in_flight`` count it for as long as it is open; it may wait in the lane's queue for its
handshake), then holds its replica until either side closes; the other side is then closed
with the same code. It is not retried: once the handshake is done the session is the
replica's. Refusals before the handshake (no key, no replica, the replica refused the upgrade)
are HTTP answers in OpenAI's shape where the server can send one, else a close before accept
(which the client sees as 403). One access line per session, status 101, ``ttft_ms`` the first
message from the replica, ``content_chunks`` the messages it sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol
from urllib.parse import parse_qs

from starlette.types import Receive, Scope, Send

from proxy.edge.auth import Guard
from proxy.edge.endpoint import EndpointParts, refuse_unknown_model, request_id_from
from proxy.errors import (
    GatewayError,
    ShuttingDown,
    UpstreamError,
    UpstreamFailed,
    error_messages,
)
from proxy.relay.call import Call
from proxy.relay.upstream import (
    CONNECT_TIMEOUT_S,
    UpstreamClient,
    UpstreamWebSocket,
    open_websocket,
)

now = time.monotonic
PATH = "/v1/realtime"
# The client's handshake headers that are about its own connection to the gateway: the
# upstream handshake makes its own.
_HANDSHAKE_HEADERS = frozenset(
    {
        b"host",
        b"connection",
        b"upgrade",
        b"sec-websocket-key",
        b"sec-websocket-version",
        b"sec-websocket-extensions",
        b"sec-websocket-protocol",
        b"authorization",
        b"x-api-key",
        b"api-key",
        b"cookie",
        b"x-request-id",
        b"content-length",
    }
)
_HTTP_RESPONSE = "websocket.http.response"  # the ASGI extension for an HTTP answer instead


class RealtimeParts(EndpointParts, Protocol):
    """What the realtime endpoint reads of the gateway, beyond a relayed endpoint's parts: the
    upstream client, whose session opens the replica's WebSocket."""

    client: UpstreamClient


def close_code_for(code: int | None) -> int:
    """A close code one side may send on: 1005 / 1006 say no code was received, and are never
    sent; a side that went without one is told 1011 (the other end failed)."""
    if code is None or code in (1005, 1006):
        return 1011
    return code


def upstream_headers(
    headers: list[tuple[bytes, bytes]], request_id: str, api_key: str | None
) -> list[tuple[bytes, bytes]]:
    """The client's handshake headers as the replica gets them: its own connection's and its
    credentials dropped, the request id and the replica's key added."""
    out = [(k, v) for k, v in headers if k not in _HANDSHAKE_HEADERS]
    out.append((b"x-request-id", request_id.encode()))
    if api_key:
        out.append((b"authorization", b"Bearer " + api_key.encode()))
    return out


class RealtimeEndpoint:
    """ASGI handler for ``/v1/realtime`` WebSocket scopes."""

    def __init__(self, parts: RealtimeParts, guard: Guard) -> None:
        self.gw = parts
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        gw = self.gw
        received_at = now()
        headers: list[tuple[bytes, bytes]] = list(scope["headers"])
        rid = next((v for k, v in headers if k == b"x-request-id"), None)
        request_id = request_id_from(rid)
        query = scope.get("query_string", b"")
        model = _query_model(query)
        policy = gw.policy
        call = Call(
            request_id=request_id,
            kind="realtime",
            path=PATH,
            body=b"",
            headers=[],
            stream=True,
            model=model,
            lane=policy.lanes[-1],
            profile=None,
            wants_usage=False,
            received_at=received_at,
            query=query,
            method="GET",
        )
        call.task = asyncio.current_task()
        gw.active_requests += 1
        relay = gw.relay
        relay.live.add(call)  # a shutdown past its grace cuts it (``Relay.cut_all``)
        try:
            await self._session(call, scope, receive, send, headers)
        except asyncio.CancelledError:
            if call.cut is None:
                raise
            call.error, call.error_origin = call.cut, "gateway"
            with contextlib.suppress(Exception):
                await send({"type": "websocket.close", "code": 1001})  # going away
        finally:
            relay.live.discard(call)
            gw.active_requests -= 1
            gw.outcomes.add(call, now() - received_at)

    async def _session(
        self,
        call: Call,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        gw = self.gw
        relay = gw.relay
        admission = relay.admission
        try:
            if gw.shutting_down:
                raise ShuttingDown()
            key = self.guard.authenticate(headers) if self.guard.enabled else None
            refuse_unknown_model(gw.fleet, call.model)
            if key is not None:
                self.guard.charge(key, call, gw.policy.estimate.chars_per_token)
            replica = await admission.admit(
                call.lane, lambda: relay.try_pick(call), lambda: relay.any_serving(call)
            )
        except GatewayError as err:
            await self._refuse(call, scope, send, err)
            return
        gw.fleet.attempt_started(replica)
        call.replica, call.pool = replica, replica.pool
        call.queue_wait_s = now() - call.received_at
        try:
            query = b"?" + call.query if call.query else b""
            try:
                upstream = await open_websocket(
                    gw.client,
                    replica.url + PATH + query.decode("latin-1"),
                    headers=upstream_headers(headers, call.request_id, replica.api_key),
                    protocols=list(scope.get("subprotocols") or ()),
                    timeout_s=CONNECT_TIMEOUT_S,
                )
            except UpstreamError as exc:
                refused = UpstreamFailed(f"{replica.name} refused the WebSocket: {exc.why}")
                await self._refuse(call, scope, send, refused, origin="replica")
                return
            await send({"type": "websocket.accept", "subprotocol": upstream.protocol})
            call.started, call.status = True, 101
            await self._pump(call, upstream, receive, send)
        finally:
            gw.fleet.attempt_finished(replica, None)
            admission.released(replica)
            admission.finished(call.lane)

    async def _pump(
        self, call: Call, upstream: UpstreamWebSocket, receive: Receive, send: Send
    ) -> None:
        """Both directions until one side closes; then the other is closed with its code."""

        async def from_client() -> int:
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    return int(message.get("code", 1000))
                data = message.get("text")
                await upstream.send(data if data is not None else message.get("bytes") or b"")

        async def from_replica() -> int:
            while True:
                kind, data = await upstream.receive()
                if kind == "close":
                    return int(data)
                if call.ttft_s is None:
                    call.ttft_s = now() - call.received_at
                call.content_chunks += 1
                key = "text" if kind == "text" else "bytes"
                await send({"type": "websocket.send", key: data})

        client_side = asyncio.create_task(from_client())
        replica_side = asyncio.create_task(from_replica())
        try:
            done, _ = await asyncio.wait(
                (client_side, replica_side), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for task in (client_side, replica_side):
                task.cancel()
            await asyncio.gather(client_side, replica_side, return_exceptions=True)
        if client_side in done and not client_side.cancelled():
            exc = client_side.exception()
            if exc is None:
                await upstream.close(close_code_for(client_side.result()))
                return
            call.error, call.error_origin = f"sending to the replica: {exc}", "replica"
            await upstream.close(1011)
            with contextlib.suppress(Exception):
                await send({"type": "websocket.close", "code": 1011})
            return
        exc = replica_side.exception() if not replica_side.cancelled() else None
        if exc is not None:
            name = call.replica.name if call.replica is not None else "replica"
            call.error, call.error_origin = f"{name}: {exc}", "replica"
            code = 1011
        else:
            code = close_code_for(replica_side.result())
        await upstream.close(code)
        with contextlib.suppress(Exception):
            await send({"type": "websocket.close", "code": code})

    async def _refuse(
        self, call: Call, scope: Scope, send: Send, err: GatewayError, origin: str = "gateway"
    ) -> None:
        call.status, call.error, call.error_origin = err.status, err.message, origin
        if _HTTP_RESPONSE in (scope.get("extensions") or {}):
            start, body = error_messages(err, call.request_id, call.extra_headers)
            await send({**start, "type": "websocket.http.response.start"})
            await send({**body, "type": "websocket.http.response.body"})
        else:
            await send({"type": "websocket.close", "code": 1008})


def _query_model(query: bytes) -> str | None:
    """``model`` from the query string, as vLLM's realtime route takes it."""
    values = parse_qs(query.decode("latin-1")).get("model")
    return values[0] if values else None


__all__ = ["PATH", "RealtimeEndpoint", "RealtimeParts", "close_code_for", "upstream_headers"]
