"""Wiring: the gateway's state, its HTTP routes, and the request handler.

The relayed endpoints are plain ASGI handlers dispatched by path before Starlette: every chunk of
every stream passes through them, and each middleware layer would add a wrapped ``send`` per
chunk. Starlette serves everything else (models, health, metrics, admin) and the lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import hashlib
import itertools
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from proxy.config import Policy, PolicyError, keep_restart_keys, load_policy, restart_changes
from proxy.edge import validate
from proxy.edge.asgi_ext import CLIENT_GONE, START_WITH_BODY
from proxy.edge.auth import ClientKeys, Guard
from proxy.errors import (
    GatewayError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    Rejected,
    error_body,
)
from proxy.fleet.discovery import Discovery, dns_hosts, expand
from proxy.fleet.fleet import Fleet
from proxy.fleet.health import HealthMonitor
from proxy.observe.accesslog import logger as access_log
from proxy.observe.accesslog import write_line
from proxy.observe.metrics import Metrics, replica_ttft_s
from proxy.observe.outcomes import Outcomes
from proxy.relay.call import Call
from proxy.relay.relay import DROP_UPSTREAM, Relay, make_client
from proxy.routing.admission import Admission
from proxy.routing.estimate import Estimator
from proxy.routing.lanes import match_lane
from proxy.routing.profile import profile_request
from proxy.state.shared import FleetView, shared_state_for

log = logging.getLogger("tokenlane")

now = time.perf_counter

# Relayed unchanged through the last lane (DESIGN 4.3).
PASSTHROUGH_PATHS = (
    "/v1/embeddings",
    "/v1/rerank",
    "/v1/score",
    "/tokenize",
    "/detokenize",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
)
POLICY_POLL_S = 1.0


def _file_hash(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).digest()
    except OSError:
        return None


_ID_PREFIX = os.urandom(7).hex()
_id_counter = itertools.count(int.from_bytes(os.urandom(4), "big"))
_REQUEST_ID_OK = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")


class Gateway:
    """Everything one gateway process holds; shared by the handlers, health and admin."""

    def __init__(
        self,
        policy: Policy,
        *,
        environ: Mapping[str, str] | None = None,
        policy_path: str | None = None,
    ) -> None:
        self.declared = policy  # as written; `policy` is it with DNS replicas expanded
        self.policy = policy
        self.version = 1
        self.policy_path = policy_path
        self.needs_restart: list[str] = []
        self.discovery = Discovery()
        self._reload_lock = asyncio.Lock()
        self._policy_hash: bytes | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.environ: Mapping[str, str] = os.environ if environ is None else environ
        self.metrics = Metrics()
        self.fleet = Fleet(policy, self.environ, metrics=self.metrics)
        self.estimator = Estimator.from_config(policy.estimate)
        self.outcomes = Outcomes(self._record)
        self.admission = Admission(self.fleet, self.metrics, policy.lanes)
        # In-process unless redis.url is set: then ejections, load and rate limits are shared
        # with the other instances (issue 7).
        self.shared = shared_state_for(lambda: self.policy.redis, self.metrics)
        self.guard = Guard(
            ClientKeys.from_env(self.environ, policy.server.api_keys_env),
            self.shared.rate_limiter(lambda: self.policy.rate_limits),
            self.metrics,
        )
        self.max_prefix_chars = max(p.prefix_chars for p in policy.pools.values())
        self.client = make_client(policy)
        self.health_client = make_client(policy)
        self.relay = Relay(
            self.client,
            admission=self.admission,
            fleet=self.fleet,
            metrics=self.metrics,
            policy=lambda: self.policy,
        )
        self.health = HealthMonitor(
            self.fleet, lambda: self.policy, self.health_client, self.metrics
        )
        self.active_requests = 0  # relayed requests being handled, queued ones included
        self.shutting_down = False
        for replica in self.fleet.replicas():
            self.metrics.set_replica_state(replica.pool, replica.name, replica.state.value)
        self.metrics.sync(policy.lanes, self.fleet.replicas())
        for pool in policy.pools:
            self.metrics.panic.labels(pool).set(0)

    # -- policy changes: reload and discovery -----------------------------------------------

    async def reload(self) -> int:
        """Read the policy file again and swap it in whole, or keep the old one and raise
        ``PolicyError`` saying why. Requests in flight finish with the policy they started
        with; replicas that stay keep their health state and counters."""
        async with self._reload_lock:
            if self.policy_path is None:
                raise PolicyError(["no policy file: this gateway was started from data"])
            try:
                new = load_policy(self.policy_path, environ=self.environ)
            except PolicyError as exc:
                self.metrics.reloads.labels("invalid").inc()
                log.warning(
                    "policy reload refused, keeping version %d: %s",
                    self.version,
                    "; ".join(exc.problems),
                )
                raise
            self.needs_restart = restart_changes(self.declared, new)
            self._swap(keep_restart_keys(self.declared, new))
            self.version += 1
            self._policy_hash = _file_hash(self.policy_path)
            self.metrics.reloads.labels("ok").inc()
            log.info(
                "policy reloaded: version %d%s",
                self.version,
                f" (restart needed for {', '.join(self.needs_restart)})"
                if self.needs_restart
                else "",
            )
            return self.version

    def _swap(self, declared: Policy) -> None:
        self.declared = declared
        effective = expand(declared, self.discovery.addresses)
        self.policy = effective
        if self.fleet.apply(effective):
            self.health.replicas_changed()
        self.estimator.configure(declared.estimate)
        self.admission.set_lanes(declared.lanes)
        self.admission.kick()  # new replicas or looser limits may serve waiters now
        self.max_prefix_chars = max(p.prefix_chars for p in declared.pools.values())
        self.metrics.sync(declared.lanes, self.fleet.replicas())
        for pool in declared.pools:
            self.metrics.series(self.metrics.panic, pool)

    async def _watch_policy_file(self) -> None:
        """Reload when the file's content changes. Polling the content (not mtime or inotify)
        also catches editors that save by writing a new file and renaming it over the old."""
        assert self.policy_path is not None
        while True:
            await asyncio.sleep(POLICY_POLL_S)
            digest = _file_hash(self.policy_path)
            if digest is None or digest == self._policy_hash:
                continue
            self._policy_hash = digest
            with contextlib.suppress(PolicyError):
                await self.reload()

    async def _discover(self) -> None:
        while True:
            hosts = dns_hosts(self.declared)
            if hosts and await self.discovery.refresh(hosts):
                async with self._reload_lock:
                    self._swap(self.declared)
            await asyncio.sleep(self.policy.health.interval_s * 10)

    async def reload_logged(self) -> None:
        """A reload whose refusal is only logged (SIGHUP has no one to answer)."""
        with contextlib.suppress(PolicyError):
            await self.reload()

    async def start(self) -> None:
        if dns_hosts(self.declared):
            await self.discovery.refresh(dns_hosts(self.declared))
            self._swap(self.declared)
        # Before the first health round, so this instance starts from the shared states
        # (bounded by redis.timeout_ms per call: a missing Redis delays nothing).
        await self.shared.start(FleetView(self.fleet, self.shared))
        await self.health.start()
        self._tasks = [asyncio.create_task(self._discover())]
        if self.policy_path is not None:
            self._policy_hash = _file_hash(self.policy_path)
            self._tasks.append(asyncio.create_task(self._watch_policy_file()))

    async def stop(self) -> None:
        try:
            for task in self._tasks:
                task.cancel()
            await self.admission.close()
            await self.health.stop()
            await self.shared.stop()
            await self.client.aclose()
            await self.health_client.aclose()
        finally:
            self.outcomes.close()

    def begin_shutdown(self) -> None:
        """From now on ``/ready`` fails and new requests get 503: a drain has started."""
        self.shutting_down = True

    def ready(self) -> tuple[bool, list[str]]:
        """Every lane has a healthy replica in its pool or its ``spill_to`` pool."""
        if self.shutting_down:
            return False, ["(shutting down)"]
        missing = []
        for lane in self.policy.lanes:
            pools = [lane.pool] + ([lane.spill_to] if lane.spill_to else [])
            if not any(self.fleet.pools[p].has_healthy() for p in pools):
                missing.append(lane.name)
        return not missing, missing

    # -- the one place a request's outcome is observed ------------------------------------

    def observe(self, call: Call) -> None:
        """``call`` is over: its outcome is recorded off this path (``outcomes``)."""
        self.outcomes.add(call, now() - call.received_at)

    def _record(self, call: Call, duration: float, ts: float) -> None:
        m = self.metrics
        lane = call.lane.name
        pool = call.pool or ""
        replica = call.replica.name if call.replica is not None else ""
        m.series(m.requests, lane, pool, replica, str(call.status)).inc()
        if call.overhead_s is not None:
            m.series(m.overhead, lane).observe(call.overhead_s)
        if call.pool:
            m.series(m.duration, lane, pool).observe(duration)
            if call.ttft_s is not None:
                m.series(m.ttft, lane, pool).observe(call.ttft_s)
            if call.replica is not None:
                m.observe_replica_ttft(
                    pool, replica, replica_ttft_s(call.ttft_s, call.queue_wait_s, call.retries)
                )
        usage = call.usage
        reported = usage.get("prompt_tokens") if usage else None
        profile = call.profile
        if profile is not None and call.pool:
            if isinstance(reported, int) and reported > 0:
                m.series(m.prompt_tokens_estimated, pool).inc(profile.prompt_tokens_est)
                m.series(m.prompt_tokens_reported, pool).inc(reported)
                self.estimator.observe(profile, reported)
        write_line(call, duration, ts)  # the one line per request


# ---------------------------------------------------------------------------- helpers


class ShuttingDown(Rejected):
    """A request that arrived after SIGTERM: not a rejection by admission, so not counted as
    one; the client should go to another instance."""


class ClientGone(Exception):
    """The client disconnected before its request was whole: nobody to answer, nothing to
    log as a server error (a CancelledError out of the app would be, by uvicorn)."""


async def read_body(receive: Receive, limit: int, content_length: int | None) -> bytes:
    """The whole request body, refused with 413 as soon as it passes ``limit``."""
    if content_length is not None and content_length > limit:
        raise PayloadTooLarge(f"request body is over the {limit}-byte limit")
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone("client disconnected while sending the body")
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body is over the {limit}-byte limit")
            parts.append(chunk)
        if not message.get("more_body", False):
            break
    return parts[0] if len(parts) == 1 else b"".join(parts)


def request_id_from(value: bytes | None) -> str:
    """The client's ``X-Request-Id`` when it is sane, else a new one: 24 hex digits, a random
    prefix drawn once per process and a counter (no system call per request)."""
    if value and len(value) <= 128 and all(c in _REQUEST_ID_OK for c in value):
        return value.decode()
    return f"{_ID_PREFIX}{next(_id_counter) & 0xFFFFFFFFFF:010x}"


async def send_error(
    send: Send,
    err: GatewayError,
    request_id: str | None = None,
    extra: list[tuple[bytes, bytes]] | tuple[()] = (),
) -> None:
    """The gateway's own error answer; ``extra`` is the request's ``Call.extra_headers``."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    for k, v in err.headers.items():
        headers.append((k.encode(), v.encode()))
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    headers += extra
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _client_gone(call: Call) -> None:
    """The client left: cancel the request's task, which closes the upstream connection (vLLM
    frees the KV blocks) and frees the replica's slot, or takes it out of its queue."""
    if not call.finished and call.task is not None:
        call.disconnected = True
        call.task.cancel("client disconnected")


async def _listen_for_disconnect(receive: Receive, call: Call) -> None:
    # Under a server without the CLIENT_GONE extension: its send() silently does nothing once
    # the client is gone, so the only way to learn of it is receive().
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            _client_gone(call)
            return


# ---------------------------------------------------------------------------- relayed endpoints


class RelayEndpoint:
    """POST handler for one relayed path: parse, check, classify, relay, observe."""

    def __init__(self, gateway: Gateway, path: str, kind: str) -> None:
        self.gw = gateway
        self.path = path
        self.kind = kind
        self.check = {
            "chat": validate.check_chat,
            "completion": validate.check_completion,
        }.get(kind)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        received_at = now()
        gw = self.gw
        gw.active_requests += 1
        request_id: str | None = None
        call: Call | None = None
        listener: asyncio.Task[None] | None = None
        hook = None
        try:
            headers: list[tuple[bytes, bytes]] = []
            content_length = None
            rid = None
            for k, v in scope["headers"]:
                if k == b"x-request-id":
                    rid = v
                elif k == b"content-length":
                    with contextlib.suppress(ValueError):
                        content_length = int(v)
                if k not in DROP_UPSTREAM:
                    headers.append((k, v))
            request_id = request_id_from(rid)
            if gw.shutting_down:
                raise ShuttingDown(
                    "the gateway is shutting down; retry on another instance",
                    status=503,
                    reason="shutdown",
                    retry_after_s=1.0,
                )
            if scope["method"] != "POST":
                raise MethodNotAllowed(f"method {scope['method']} is not allowed on {self.path}")
            key = gw.guard.authenticate(scope["headers"]) if gw.guard.enabled else None
            raw = await read_body(receive, gw.policy.server.max_body_bytes, content_length)
            # Taken after the body's awaits: a lane from a policy reloaded meanwhile would put
            # its old limits back into admission.
            policy = gw.policy
            call = self._make_call(policy, raw, headers, request_id, received_at)
            call.query = scope.get("query_string", b"")
            if key is not None:
                gw.guard.charge(key, call, policy.estimate.chars_per_token)
            call.task = asyncio.current_task()
            ext = scope.get("extensions")
            hook = ext.get(CLIENT_GONE) if ext is not None else None
            if hook is not None:
                call.start_with_body = START_WITH_BODY in ext
                hook.callback = functools.partial(_client_gone, call)
            else:
                listener = asyncio.create_task(_listen_for_disconnect(receive, call))
            try:
                await gw.relay.run(call, send)
            finally:
                call.finished = True
        except GatewayError as err:
            if call is not None:
                call.status = err.status
                call.error = err.message
            if call is None:
                await send_error(send, err, request_id)
            elif not call.started:  # admitted, then failed: the key's limits still apply
                await send_error(send, err, request_id, call.extra_headers)
        except ClientGone:
            pass
        except asyncio.CancelledError:
            if call is not None and call.disconnected:
                call.status = 499  # nginx's "client closed request", for logs and metrics
            else:
                raise
        except Exception:
            log.exception("unexpected error in %s", self.path)
            if call is not None:
                call.status = 500
            if call is None or not call.started:
                await send_error(
                    send,
                    GatewayError("internal error in the gateway; see its log"),
                    request_id,
                    call.extra_headers if call is not None else (),
                )
        finally:
            gw.active_requests -= 1
            if listener is not None:
                listener.cancel()
            if hook is not None:
                hook.callback = None  # the connection outlives the request: keep no Call alive
            if call is not None:
                gw.observe(call)

    def _make_call(
        self,
        policy: Policy,
        raw: bytes,
        headers: list[tuple[bytes, bytes]],
        request_id: str,
        received_at: float,
    ) -> Call:
        gw = self.gw
        profile = None
        model = None
        stream = False
        wants_usage = False
        if self.check is not None:
            body = validate.parse_json_object(raw)
            self.check(body)
            model = body.get("model")
            stream = validate.wants_stream(body)
            wants_usage = stream and validate.wants_usage(body)
            profile = profile_request(body, self.kind, gw.estimator, gw.max_prefix_chars)
            lane = match_lane(profile, policy.lanes).lane
        else:
            lane = policy.lanes[-1]
            if raw and validate.is_json_body(headers):
                with contextlib.suppress(Exception):
                    body = validate.parse_json_object(raw)
                    m = body.get("model")
                    model = m if isinstance(m, str) else None
        # Until some replica has told its models, nobody can say a model is unknown: such a
        # request waits for a replica like any other (and gets 503 when there is none).
        fleet = gw.fleet
        if (
            model is not None
            and not fleet.serves_model(model)
            and any(r.models for r in fleet.replicas())
        ):
            raise NotFound(f"The model `{model}` does not exist.", param="model", code=404)
        return Call(
            request_id=request_id,
            kind=self.kind,
            path=self.path,
            body=raw,
            headers=headers,
            stream=stream,
            model=model,
            lane=lane,
            profile=profile,
            wants_usage=wants_usage,
            received_at=received_at,
        )


# ---------------------------------------------------------------------------- other routes


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(data, status_code=status, headers=headers)


def build_routes(gw: Gateway) -> list[Route]:
    async def models(request: Request) -> Response:
        return _json({"object": "list", "data": list(gw.fleet.models().values())})

    async def model(request: Request) -> Response:
        model_id = request.path_params["model_id"]
        card = gw.fleet.models().get(model_id)
        if card is None:
            err = NotFound(f"The model `{model_id}` does not exist.", param="model", code=404)
            return _json(err.body(), 404)
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
        gw.outcomes.flush()  # every request that ended before the scrape is in it
        m = gw.metrics
        for replica in gw.fleet.replicas():
            m.replica_in_flight.labels(replica.pool, replica.name).set(replica.in_flight)
            m.set_replica_state(replica.pool, replica.name, replica.state.value)
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/ready/gateway", ready_gateway, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    try:
        from proxy.edge.admin import admin_routes
    except ImportError:  # the admin API lands with issue 4
        pass
    else:
        routes.extend(admin_routes(gw))
    return routes


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err: GatewayError = NotFound(f"no route for {request.method} {request.url.path}")
    elif exc.status_code == 405:
        err = MethodNotAllowed(f"method {request.method} is not allowed on {request.url.path}")
    else:
        err = GatewayError(str(exc.detail))
        err.status = exc.status_code
    return _json(err.body(), err.status, err.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error in %s", request.url.path, exc_info=exc)
    return _json(
        error_body("internal error in the gateway; see its log", "InternalServerError"), 500
    )


class GatewayApp:
    """The ASGI application: relayed paths first, Starlette for the rest."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.fast: dict[str, Callable[[Scope, Receive, Send], Awaitable[None]]] = {
            "/v1/chat/completions": RelayEndpoint(gateway, "/v1/chat/completions", "chat"),
            "/v1/completions": RelayEndpoint(gateway, "/v1/completions", "completion"),
        }
        for path in PASSTHROUGH_PATHS:
            self.fast[path] = RelayEndpoint(gateway, path, "other")

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
        if scope["type"] == "http":
            handler = self.fast.get(scope["path"])
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


def create_app(
    policy: Policy,
    *,
    environ: Mapping[str, str] | None = None,
    policy_path: str | None = None,
) -> GatewayApp:
    return GatewayApp(Gateway(policy, environ=environ, policy_path=policy_path))


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
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access_log.addHandler(handler)
    access_log.propagate = False
    other = logging.StreamHandler(sys.stderr)
    other.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(other)
