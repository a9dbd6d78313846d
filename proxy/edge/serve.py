"""Running the gateway process: uvicorn on uvloop and httptools, with our signal handling."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import time
from types import FrameType

import uvicorn
from starlette.types import Message
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from proxy.config import Policy
from proxy.edge.asgi_ext import (
    CLIENT_GONE,
    START_BODY,
    START_MORE_BODY,
    START_WITH_BODY,
    ClientGoneHook,
)
from proxy.edge.routes import configure_logging
from proxy.gateway import Gateway, create_app

log = logging.getLogger("tokenlane")
_NO_OPTIONS: dict[str, object] = {}  # an extension's (empty) options, shared


def tune_gc() -> None:
    """Fewer, cheaper collections: a relay allocates short-lived objects per chunk, and the
    default gen-0 threshold (700) runs a collection every few hundred chunks."""
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, 50_000), gen1, gen2)


class _Capture:
    """Stands in for the connection's transport while one message's writes are collected;
    ``flush`` sends them in one vectored write. A close (``Connection: close``) flushes and
    closes at once, as uvicorn expects before it looks for the next request."""

    __slots__ = ("closed", "parts", "transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.parts: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def flush(self) -> None:
        if self.parts:
            self.transport.writelines(self.parts)  # one write, no joined copy
            self.parts = []

    def close(self) -> None:
        self.flush()
        self.transport.close()
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed or self.transport.is_closing()


class CoalescingCycle(RequestResponseCycle):
    """uvicorn's request/response cycle that also takes the ``START_WITH_BODY`` extension: a
    response start carrying its first body, written to the socket in one write.

    Under plain ASGI the status line and headers leave in one write and the first chunk in
    another: two TCP segments, and on a busy host two wake-ups of the client before it sees
    any content. Relayed responses always have their first chunk in hand when they start."""

    async def send(self, message: Message) -> None:
        body = message.get(START_BODY)
        if body is None:
            await super().send(message)
            return
        transport = self.transport
        capture = _Capture(transport)
        self.transport = capture  # type: ignore[assignment]
        try:
            await super().send(message)
            more = bool(message.get(START_MORE_BODY, False))
            await super().send({"type": "http.response.body", "body": body, "more_body": more})
        finally:
            self.transport = transport
        if not self.disconnected:
            capture.flush()


class NoDelayHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with TCP_NODELAY on every accepted connection (neither
    asyncio nor uvicorn sets it, and Nagle's algorithm would hold back a small SSE chunk
    until the previous one is acknowledged), serving the ``START_WITH_BODY`` extension."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)
        self._hooks: list[tuple[RequestResponseCycle, ClientGoneHook]] = []

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        # The request's cycle exists now and its app task has not run yet (a pipelined one
        # starts later). The extensions are advertised only when the cycle really is ours: a
        # uvicorn that built its cycle another way gets plain ASGI from the relay, never a
        # start whose body the server would drop.
        cycle = self.cycle
        if cycle is None or cycle.scope is not self.scope:
            return  # an upgrade, or nothing new
        if type(cycle) is RequestResponseCycle:
            cycle.__class__ = CoalescingCycle
        if type(cycle) is CoalescingCycle:
            hook = ClientGoneHook()
            ours = {START_WITH_BODY: _NO_OPTIONS, CLIENT_GONE: hook}
            theirs = self.scope.get("extensions")
            self.scope["extensions"] = {**theirs, **ours} if theirs else ours
            # Every request of the connection not answered yet: with pipelining, the one
            # running is no longer ``self.cycle`` (the last one parsed) when the client leaves.
            live = [(c, h) for c, h in self._hooks if not c.response_complete]
            live.append((cycle, hook))
            self._hooks = live

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        for cycle, hook in self._hooks:
            if not cycle.response_complete:
                hook.fire()
        self._hooks = []


def uvicorn_config(app: object, host: str, port: int, **kw: object) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=NoDelayHttpToolsProtocol,
        lifespan="on",
        access_log=False,  # the gateway writes its own JSON access log
        proxy_headers=False,  # one ASGI layer less per chunk; client IPs are the peers
        log_level="warning",
        timeout_keep_alive=30,
        server_header=False,  # the answer is the replica's: no "server: uvicorn" added
        backlog=4096,
        **kw,  # type: ignore[arg-type]
    )


class GatewayServer(uvicorn.Server):
    """uvicorn with a drain in front of its shutdown (RELIABILITY 4).

    uvicorn closes its listeners on the first SIGTERM, which a load balancer sees as refused
    connections. Here the first SIGTERM (or Ctrl-C) only starts a drain: ``/ready`` fails at
    once, new requests get 503 with ``Retry-After``, and requests in flight get
    ``server.shutdown_grace_s``. When they are done, or the grace is over, uvicorn's own
    shutdown runs and cancels what is left (closing those upstreams). A second Ctrl-C quits
    at once."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.drain_deadline: float | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # SIGHUP reloads the policy file (as nginx and HAProxy do).
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(
            signal.SIGHUP, lambda: loop.create_task(self.gateway.reload_logged())
        )

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_deadline is None:
            grace = self.gateway.policy.server.shutdown_grace_s
            self.drain_deadline = time.monotonic() + grace
            self.gateway.begin_shutdown()
            log.info(
                "signal %s: draining %d request(s) for up to %gs",
                signal.Signals(sig).name,
                self.gateway.active_requests,
                grace,
            )
            return
        super().handle_exit(sig, frame)
        if sig == signal.SIGINT:
            self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            if self.gateway.active_requests == 0 or time.monotonic() >= self.drain_deadline:
                left = self.gateway.active_requests
                if left:
                    log.warning("grace period over: cutting %d request(s)", left)
                self.should_exit = True
        return await super().on_tick(counter)


def serve(policy: Policy, *, policy_path: str | None = None, log_level: str = "info") -> int:
    configure_logging(log_level)
    tune_gc()
    app = create_app(policy, policy_path=policy_path)
    # The drain happened before uvicorn's shutdown starts: what is left gets one more second.
    config = uvicorn_config(
        app, policy.server.host, policy.server.port, timeout_graceful_shutdown=1.0
    )
    server = GatewayServer(config, app.gateway)
    log.info(
        "tokenlane listening on http://%s:%d (%d pools, %d lanes)",
        policy.server.host,
        policy.server.port,
        len(policy.pools),
        len(policy.lanes),
    )
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0


__all__ = [
    "CoalescingCycle",
    "GatewayServer",
    "NoDelayHttpToolsProtocol",
    "serve",
    "tune_gc",
    "uvicorn_config",
]
