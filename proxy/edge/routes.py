"""The ASGI application: the relayed paths first, Starlette for the rest, and logging.

``GatewayApp`` sends the relayed paths (``endpoint.RelayEndpoint``) straight to their handler
and everything else (models, health, ready, metrics, admin, the lifespan) to Starlette. It reads
the gateway through ``AppGateway``; ``proxy.gateway.create_app`` builds both.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from proxy.edge.admin import AdminGateway, admin_routes
from proxy.edge.auth import Guard
from proxy.edge.endpoint import (
    PASSTHROUGH_GET_PATHS,
    PASSTHROUGH_PATHS,
    RESPONSES_BY_ID,
    RelayEndpoint,
    request_id_from,
)
from proxy.edge.realtime import PATH as REALTIME_PATH
from proxy.edge.realtime import RealtimeEndpoint, RealtimeParts
from proxy.errors import (
    GatewayError,
    MethodNotAllowed,
    NotFound,
    error_response,
    internal_error,
    send_error,
)
from proxy.observe.accessline import write_refusal
from proxy.observe.accesslog import BatchedLines
from proxy.observe.accesslog import logger as access_log
from proxy.observe.metrics import Metrics
from proxy.observe.outcomes import Outcomes

log = logging.getLogger("tokenlane")


class AppGateway(RealtimeParts, AdminGateway, Protocol):
    """What the app reads of the gateway (``proxy.gateway.Gateway`` has it all): the parts of
    the relayed endpoints and of the admin API, the door, and the lifecycle."""

    guard: Guard
    metrics: Metrics
    shutting_down: bool
    version: int

    @property
    def outcomes(self) -> Outcomes: ...

    def ready(self) -> tuple[bool, list[str]]: ...

    async def scrape(self) -> bytes:
        """The gateway's metrics in Prometheus' text format (all workers' when it has several)."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def _json(data: Any, status: int = 200) -> Response:
    return JSONResponse(data, status_code=status)


def build_routes(gw: AppGateway) -> list[Route]:
    async def models(request: Request) -> Response:
        return _json({"object": "list", "data": list(gw.fleet.models().values())})

    async def model(request: Request) -> Response:
        model_id = request.path_params["model_id"]
        card = gw.fleet.models().get(model_id)
        if card is None:
            return error_response(
                NotFound(f"The model `{model_id}` does not exist.", param="model", code=404)
            )
        return _json(card)

    async def health(request: Request) -> Response:
        return _json({"status": "ok"})

    async def ready(request: Request) -> Response:
        ok, missing = gw.ready()
        if ok:
            return _json({"status": "ready"})
        return _json({"status": "not ready", "lanes_without_replica": missing}, 503)

    async def ready_gateway(request: Request) -> Response:
        # For an orchestrator's readiness probe: this instance can answer (a policy is loaded:
        # it is built from one) and is not draining. Replica health is left out on purpose: a
        # fleet outage then gives clients the gateway's 503 with a reason, not a refused
        # connection because every gateway left the Service. `/ready` keeps its meaning.
        if gw.shutting_down:
            return _json({"status": "draining"}, 503)
        return _json({"status": "ready", "policy_version": gw.version})

    async def metrics(request: Request) -> Response:
        return Response(await gw.scrape(), media_type=CONTENT_TYPE_LATEST)

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/ready/gateway", ready_gateway, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *admin_routes(gw),
    ]


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err: GatewayError = NotFound(f"no route for {request.method} {request.url.path}")
    elif exc.status_code == 405:
        err = MethodNotAllowed(f"method {request.method} is not allowed on {request.url.path}")
    else:
        err = GatewayError(str(exc.detail))
        err.status = exc.status_code
    # A refusal leaves its access line, as the relayed paths' do (no duration measured here).
    write_refusal(request.url.path, err.status, None, err.message, 0.0, time.time())
    return error_response(err)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error in %s", request.url.path, exc_info=exc)
    return error_response(internal_error(code=None))


class GatewayApp:
    """The ASGI application: relayed paths first, Starlette for the rest."""

    def __init__(self, gateway: AppGateway) -> None:
        self.gateway = gateway
        guard = gateway.guard
        self.fast: dict[str, Callable[[Scope, Receive, Send], Awaitable[None]]] = {
            "/v1/chat/completions": RelayEndpoint(gateway, guard, "/v1/chat/completions", "chat"),
            "/v1/completions": RelayEndpoint(gateway, guard, "/v1/completions", "completion"),
            "/v1/messages": RelayEndpoint(gateway, guard, "/v1/messages", "messages"),
            "/v1/responses": RelayEndpoint(gateway, guard, "/v1/responses", "responses"),
        }
        for path in PASSTHROUGH_PATHS:
            self.fast[path] = RelayEndpoint(gateway, guard, path, "other")
        for path, methods in PASSTHROUGH_GET_PATHS.items():
            self.fast[path] = RelayEndpoint(gateway, guard, path, "other", methods)
        self.by_response_id = RelayEndpoint(
            gateway, guard, RESPONSES_BY_ID, "other", ("GET", "POST")
        )
        self._cors: tuple[list[str], CORSMiddleware] | None = None
        self.realtime = RealtimeEndpoint(gateway, guard)

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            await gateway.start()
            # Everything allocated so far lives as long as the process: keep the collector
            # from walking it on every full pass (a long pass stalls every stream at once).
            gc.collect()
            gc.freeze()
            try:
                yield
            finally:
                await gateway.stop()

        self.starlette = Starlette(
            routes=build_routes(gateway),
            lifespan=lifespan,
            exception_handlers={HTTPException: _http_error, Exception: _server_error},
        )
        # No redirect to the path with(out) a slash: Starlette builds it from the client's Host
        # header, an open redirect before authentication. An unknown path is a plain 404.
        self.starlette.router.redirect_slashes = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.serve_direct(scope, receive, send)

    def serve_direct(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        """``__call__``'s work as a plain function that returns the request's coroutine: a
        relayed path's handler is called here and its coroutine returned, for the server to
        await with no frame of this module between. The gateway's server takes it in place of
        ``__call__`` (``asgi_ext.DIRECT_APP``): as coroutines, ``__call__`` and ``_dispatch``
        were two interpreted frames resumed every time the request's task was."""
        if scope["type"] == "http" and not self.gateway.policy.server.cors_allowed_origins:
            handler = self.fast.get(scope["path"])
            if handler is not None:
                return handler(scope, receive, send)
        return self._routed(scope, receive, send)

    async def _routed(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            origins = self.gateway.policy.server.cors_allowed_origins
            if origins:
                await self._cors_for(origins)(scope, receive, send)
                return
        await self._dispatch(scope, receive, send)

    def _cors_for(self, origins: list[str]) -> CORSMiddleware:
        """Starlette's CORS middleware, as vLLM's api_server configures it (any method and
        header, no credentials), for the current policy's origins (rebuilt after a reload
        changes them)."""
        cached = self._cors
        if cached is None or cached[0] is not origins:
            cors = CORSMiddleware(
                self._dispatch, allow_origins=origins, allow_methods=["*"], allow_headers=["*"]
            )
            cached = self._cors = (origins, cors)
        return cached[1]

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and scope["path"] == REALTIME_PATH:
            await self.realtime(scope, receive, send)
            return
        if scope["type"] == "http":
            path = scope["path"]
            handler = self.fast.get(path)
            if handler is None and path.startswith(RESPONSES_BY_ID):
                handler = self.by_response_id
            if handler is not None:
                await handler(scope, receive, send)
                return
            # Everything else is answered here or by Starlette; it carries the request id
            # too (kept from the client or made), as relayed answers do.
            rid = None
            for k, v in scope["headers"]:
                if k == b"x-request-id":
                    rid = v
                    break
            request_id = request_id_from(rid)
            guard = self.gateway.guard
            if guard.enabled and scope["path"].startswith("/v1/"):
                try:
                    guard.authenticate(scope["headers"])
                except GatewayError as err:
                    await send_error(send, err, request_id)
                    return
            await self.starlette(scope, receive, _with_request_id(send, request_id))
            return
        await self.starlette(scope, receive, send)


def _with_request_id(send: Send, request_id: str) -> Send:
    header = (b"x-request-id", request_id.encode())

    async def sender(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), header]}
        await send(message)

    return sender


def configure_logging(level: str = "info") -> None:
    """Access log lines are JSON written as they are; everything else gets a short prefix."""
    root = logging.getLogger("tokenlane")
    if root.handlers:
        return
    root.setLevel(level.upper())
    # One process, one thread: not worth a lookup on every log line (the access log's).
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = BatchedLines(sys.stdout)  # the message as it is
    access_log.addHandler(handler)
    access_log.propagate = False
    other = logging.StreamHandler(sys.stderr)
    other.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(other)


__all__ = ["AppGateway", "GatewayApp", "build_routes", "configure_logging"]
