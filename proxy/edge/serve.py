"""Running the gateway process: uvicorn's server on uvloop (each connection served by the
gateway's own protocol, ``proxy.edge.connection``), with our signal handling and the drain
before shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import resource
import signal
import socket
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any, cast

import uvicorn

from proxy import compiled
from proxy.config import Policy
from proxy.edge.bounds import KEEP_ALIVE_S
from proxy.edge.connection import GatewayProtocol
from proxy.edge.routes import configure_logging
from proxy.gateway import Gateway, create_app
from proxy.workers import kept
from proxy.workers.link import WorkerLink, WorkerPlace
from proxy.workers.supervisor import supervise, workers_for

log = logging.getLogger("tokenlane")
_NO_OPTIONS: dict[str, object] = {}  # an extension's (empty) options, shared


def tune_gc() -> None:
    """Fewer, cheaper collections: a relay allocates short-lived objects per chunk, and the
    default gen-0 threshold (700) runs a collection every few hundred chunks."""
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, 50_000), gen1, gen2)


def uvicorn_config(app: Any, host: str, port: int, **kw: Any) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        # uvicorn types its protocol class as an ``asyncio.Protocol``; the compiled one has the
        # interface without the base (a native class cannot subclass an interpreted one).
        http=cast("type[asyncio.Protocol]", GatewayProtocol),
        lifespan="on",
        access_log=False,  # the gateway writes its own JSON access log
        proxy_headers=False,  # one ASGI layer less per chunk; client IPs are the peers
        log_level="warning",
        timeout_keep_alive=KEEP_ALIVE_S,
        server_header=False,  # the answer is the replica's: no "server: uvicorn" added
        backlog=4096,
        **kw,
    )


class GatewayServer(uvicorn.Server):
    """uvicorn with a drain in front of its shutdown (docs/http.md, "Shutdown").

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
                    # Cut here, each with its error event (or 503), before uvicorn's shutdown
                    # would cancel them bare (a traceback each, streams without an end).
                    cut = self.gateway.relay.cut_all(
                        "the gateway is shutting down; the request was cut at the end of its "
                        "shutdown grace period"
                    )
                    log.warning("grace period over: cutting %d request(s) (%d relayed)", left, cut)
                self.should_exit = True
        return await super().on_tick(counter)


def _check_fd_limit(max_connections: int) -> None:
    """Raise the soft fd limit to what the connection cap needs (a client fd and an upstream
    one per stream, and some to spare), as far as the hard limit allows; warn if short."""
    need = 2 * max_connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning(
            "open-file limit %d is below the %d that server.max_connections=%d needs",
            soft,
            need,
            max_connections,
        )


def serve(
    policy: Policy,
    *,
    policy_path: str | None = None,
    log_level: str = "info",
    worker_args: Sequence[str] = (),
) -> int:
    """One process serving the policy's port, or, with ``server.workers`` above 1, a
    supervisor of that many worker processes (``worker_args``: their other command-line
    options)."""
    configure_logging(log_level)
    count = workers_for(policy.server.workers)
    if count > 1:
        if policy_path is None:
            raise ValueError("workers need a policy file: each worker reads it")
        args = ["--config", policy_path, "--log-level", log_level, *worker_args]
        return supervise(policy, count, args)
    tune_gc()
    app = create_app(policy, policy_path=policy_path)
    # The drain happened before uvicorn's shutdown starts: what is left gets one more second.
    config = uvicorn_config(
        app, policy.server.host, policy.server.port, timeout_graceful_shutdown=1.0
    )
    server = GatewayServer(config, cast(Gateway, app.gateway))  # create_app built a Gateway
    _check_fd_limit(policy.server.max_connections)
    log.info(
        "tokenlane listening on http://%s:%d (%d pools, %d lanes; request path %s)",
        policy.server.host,
        policy.server.port,
        len(policy.pools),
        len(policy.lanes),
        compiled.status,
    )
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0


def serve_worker(
    policy: Policy,
    *,
    policy_path: str,
    place: WorkerPlace,
    sock: socket.socket,
    log_level: str = "info",
) -> int:
    """One worker of a serve: the gateway on the supervisor's socket, linked to the others."""
    configure_logging(log_level)
    tune_gc()
    # Before any metric exists: a restarted worker counts on from where its slot stopped.
    kept.install(place.rundir, place.index)
    app = create_app(policy, policy_path=policy_path, link=WorkerLink(place))
    config = uvicorn_config(
        app, policy.server.host, policy.server.port, timeout_graceful_shutdown=1.0
    )
    server = GatewayServer(config, cast(Gateway, app.gateway))
    _check_fd_limit(policy.server.max_connections)
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[sock])
    return 0


__all__ = [
    "GatewayServer",
    "serve",
    "serve_worker",
    "tune_gc",
    "uvicorn_config",
]
