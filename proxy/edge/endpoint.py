"""The relayed endpoints: read, check and classify a request, hand it to the relay, observe it.

They are plain ASGI handlers dispatched by path before Starlette (``routes.GatewayApp``): every
chunk of every stream passes through them, and each middleware layer would add a wrapped
``send`` per chunk. An endpoint gets the parts it uses through ``EndpointParts``, looked up per
request (a reload swaps ``policy`` and ``max_prefix_chars``), and the client-key ``Guard``.

Length: one job, an endpoint's path (read, check, classify, relay, observe); every chunk of every
stream passes through it, so it stays flat rather than layered.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import os
import time
from typing import Any, Final, Protocol

from starlette.types import Receive, Scope, Send

from proxy.config import Policy
from proxy.edge import validate
from proxy.edge.asgi_ext import CLIENT_GONE, DIRECT_BODY, START_WITH_BODY, ClientGoneHook
from proxy.edge.auth import Guard
from proxy.errors import (
    ClientGone,
    GatewayError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    ShuttingDown,
    dialect_of,
    internal_error,
    send_error,
)
from proxy.fleet.fleet import Fleet
from proxy.observe import accessline
from proxy.observe.outcomes import Outcomes
from proxy.observe.tracing import Tracer
from proxy.relay.call import Call
from proxy.relay.relay import DROP_UPSTREAM, Relay
from proxy.relay.sse import contains
from proxy.routing.estimate import Estimator
from proxy.routing.lanes import match_lane
from proxy.routing.profile import profile_request

log: Final = logging.getLogger("tokenlane")

now: Final = time.monotonic

# Relayed unchanged through the last lane.
PASSTHROUGH_PATHS = (
    "/v1/embeddings",
    "/v1/rerank",
    "/v1/score",
    "/tokenize",
    "/detokenize",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    # The rest of what vLLM's api_server serves (pooling, scoring, rendering, SageMaker).
    "/score",
    "/rerank",
    "/v2/rerank",
    "/v2/embed",
    "/classify",
    "/pooling",
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/chat/completions/batch",
    "/invocations",
    "/v1/messages/count_tokens",
)
# Pass-through paths vLLM serves to GET (``/ping`` also to POST, as SageMaker calls it).
PASSTHROUGH_GET_PATHS = {
    "/ping": ("GET", "POST"),
    "/version": ("GET",),
    "/tokenizer_info": ("GET",),
}
# Stored responses, by id (``/v1/responses/{id}``, ``.../cancel``, ``.../input_items``):
# answered only by the replica holding the response (``relay.homes``).
RESPONSES_BY_ID: Final = "/v1/responses/"

_ID_PREFIX: Final = os.urandom(7).hex()


class _Count:
    """The new request ids' counter, from a random start. A compiled object's int, formatted
    by ``hex``: ``f"{next(count) & mask:010x}"`` (``next`` on ``itertools.count``, a format
    spec parsed per call) cost 3x as much (``timeit``, compiled)."""

    def __init__(self, start: int) -> None:
        self.value = start


_ids: Final = _Count(int.from_bytes(os.urandom(4), "big"))
_partial: Final = functools.partial  # a Final: compiled, not a module lookup per request
_NO_EXTENSIONS: Final[dict[str, Any]] = {}  # a server that advertises none (never written to)
_REQUEST_ID_OK: Final = frozenset(
    b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:"
)


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def without_connection_named(
    headers: list[tuple[bytes, bytes]], connection: bytes
) -> list[tuple[bytes, bytes]]:
    """``headers`` without those the client's ``Connection:`` names: hop-by-hop by its say
    (RFC 9110 7.6.1), about its connection to the gateway, never relayed."""
    named = {t.strip().lower() for t in connection.split(b",")}
    named.discard(b"")
    if not named:
        return headers
    return [(k, v) for k, v in headers if k not in named]


def networks_of(cidrs: list[str]) -> list[IPNetwork]:
    return [ipaddress.ip_network(c, strict=False) for c in cidrs]


def peer_in(peer: str, networks: list[IPNetwork]) -> bool:
    try:
        addr = ipaddress.ip_address(peer)
    except ValueError:
        return False  # a Unix socket's peer, say: not an address a proxy list can name
    return any(addr in net for net in networks)


def forwarding_headers(
    peer: str | None, chain: list[bytes], forwarded: list[bytes], trusted: bool
) -> list[tuple[bytes, bytes]]:
    """The ``X-Forwarded-For`` and ``Forwarded`` to send upstream: the incoming ones (only
    from a trusted proxy, else they are the client's own claims and dropped), with the peer's
    address appended."""
    out: list[tuple[bytes, bytes]] = []
    xff = b", ".join(chain) if trusted else b""
    fwd = b", ".join(forwarded) if trusted else b""
    if peer is not None:
        addr = peer.encode()
        xff = xff + b", " + addr if xff else addr
        node = b'"[' + addr + b']"' if contains(addr, b":") else addr  # RFC 7239 6: IPv6 quoted
        fwd = fwd + b", for=" + node if fwd else b"for=" + node
    if xff:
        out.append((b"x-forwarded-for", xff))
    if fwd:
        out.append((b"forwarded", fwd))
    return out


class EndpointParts(Protocol):
    """What a relayed endpoint reads of the gateway (``proxy.gateway.Gateway`` has it all).

    ``fleet``, ``estimator``, ``relay``, ``outcomes`` and ``tracer`` are the gateway's for its
    life: an endpoint takes them once, when made (each read of the gateway, an interpreted
    object, is a generic attribute lookup: a request made about fifteen). The rest is read per
    request: a reload swaps ``policy`` and ``max_prefix_chars``."""

    policy: Policy
    max_prefix_chars: int
    shutting_down: bool
    active_requests: int  # the endpoint counts itself in and out (the drain waits on it)

    # Read-only here, and ``Final`` on the gateway: the type checker refuses any code that
    # would put a new one in place of what the endpoints took.
    @property
    def fleet(self) -> Fleet: ...
    @property
    def estimator(self) -> Estimator: ...
    @property
    def relay(self) -> Relay: ...
    @property
    def outcomes(self) -> Outcomes: ...
    # None: tracing off (the OTEL_EXPORTER_OTLP_* variables unset).
    @property
    def tracer(self) -> Tracer | None: ...


def check_body_size(size: int, limit: int, content_length: int | None) -> None:
    """413 for a body over ``limit``, or announced over it."""
    if size > limit or (content_length is not None and content_length > limit):
        raise PayloadTooLarge(f"request body is over the {limit}-byte limit")


async def read_body(receive: Receive, limit: int, content_length: int | None) -> bytes:
    """The whole request body, refused with 413 as soon as it passes ``limit``."""
    check_body_size(0, limit, content_length)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone("client disconnected while sending the body")
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            check_body_size(size, limit, None)
            parts.append(chunk)
        if not message.get("more_body", False):
            break
    return parts[0] if len(parts) == 1 else b"".join(parts)


_USAGE_ALWAYS: Final = frozenset({"messages", "responses"})


def refuse_unknown_model(fleet: Fleet, model: str | None) -> None:
    """vLLM's 404 for a model no replica serves. Until some replica has told its models,
    nobody can say a model is unknown: such a request waits for a replica like any other (and
    gets 503 when there is none)."""
    if (
        model is not None
        and not fleet.serves_model(model)
        and any(r.models for r in fleet.replicas())
    ):
        raise NotFound(f"The model `{model}` does not exist.", param="model", code=404)


def stored_response_id(path: str) -> str:
    """The response id in ``/v1/responses/{id}[/cancel|/input_items]``."""
    return path[len(RESPONSES_BY_ID) :].split("/", 1)[0]


def unknown_response(response_id: str) -> NotFound:
    """vLLM's own 404 for a response id it does not hold (tests/fixtures/
    vllm_responses_error_404.json)."""
    err = NotFound(f"Response with id '{response_id}' not found.", param="response_id", code=404)
    err.type = "invalid_request_error"
    return err


def request_id_from(value: bytes | None) -> str:
    """The client's ``X-Request-Id`` when it is sane, else a new one: 24 hex digits, a random
    prefix drawn once per process and a counter (no system call per request)."""
    if value and len(value) <= 128 and all(c in _REQUEST_ID_OK for c in value):
        return value.decode()
    _ids.value += 1
    digits = hex(_ids.value & 0xFFFFFFFFFF)  # "0x" and one to ten of them
    return _ID_PREFIX + "0" * (12 - len(digits)) + digits[2:]


def _client_gone(call: Call, hook: ClientGoneHook | None = None) -> None:
    """The client left (or the server cut it, ``hook.reason``): cancel the request's task,
    which closes the upstream connection (vLLM frees the KV blocks) and frees the replica's
    slot, or takes it out of its queue."""
    if not call.finished and call.task is not None:
        call.disconnected = True
        if hook is not None and hook.reason is not None:
            call.error = hook.reason
            call.error_origin = "gateway"
        call.task.cancel("client disconnected")


async def _listen_for_disconnect(receive: Receive, call: Call) -> None:
    # Under a server without the CLIENT_GONE extension: its send() silently does nothing once
    # the client is gone, so the only way to learn of it is receive().
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            _client_gone(call)
            return


class RelayEndpoint:
    """POST handler for one relayed path: parse, check, classify, relay, observe."""

    def __init__(
        self,
        parts: EndpointParts,
        guard: Guard,
        path: str,
        kind: str,
        methods: tuple[str, ...] = ("POST",),
    ) -> None:
        """``path`` is the relayed path, or ``RESPONSES_BY_ID`` for every path under it."""
        self.gw = parts
        self.fleet = parts.fleet
        self.estimator = parts.estimator
        self.relay = parts.relay
        self.outcomes = parts.outcomes
        self.tracer = parts.tracer
        self.guard = guard
        self.path = path
        self.kind = kind
        self.methods = methods
        self.dialect = dialect_of(path)
        self.check = {
            "chat": validate.check_chat,
            "completion": validate.check_completion,
            "messages": validate.check_messages,
            "responses": validate.check_responses,
        }.get(kind)
        self._networks: tuple[list[str], list[IPNetwork]] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        received_at = now()
        # A dict, as every ASGI server passes it: typed so, its reads are the dict's own, not
        # method calls by name.
        if type(scope) is not dict:
            scope = dict(scope)
        sc: dict[str, Any] = scope
        gw = self.gw
        gw.active_requests += 1
        request_id: str | None = None
        call: Call | None = None
        listener: asyncio.Task[None] | None = None
        hook: ClientGoneHook | None = None  # typed: its reads and writes are native
        try:
            headers: list[tuple[bytes, bytes]] = []
            content_length = None
            rid = None
            connection = None
            chain: list[bytes] = []  # incoming X-Forwarded-For, then Forwarded, values
            forwarded: list[bytes] = []
            for k, v in sc["headers"]:
                if k == b"x-request-id":
                    rid = v
                elif k == b"content-length":
                    try:  # not contextlib.suppress: an interpreted context manager per request
                        content_length = int(v)
                    except ValueError:
                        pass
                elif k == b"connection":
                    connection = v if connection is None else connection + b"," + v
                elif k == b"x-forwarded-for":
                    chain.append(v)
                    continue
                elif k == b"forwarded":
                    forwarded.append(v)
                    continue
                if k not in DROP_UPSTREAM:
                    headers.append((k, v))
            if connection is not None:
                headers = without_connection_named(headers, connection)
            client = sc.get("client")
            peer = client[0] if client else None
            server = gw.policy.server
            trusted = self._trusted(server.trusted_proxies, peer)
            headers += forwarding_headers(peer, chain, forwarded, trusted)
            request_id = request_id_from(rid)
            if gw.shutting_down:
                raise ShuttingDown()
            if sc["method"] not in self.methods:
                raise MethodNotAllowed(f"method {sc['method']} is not allowed on {self.path}")
            guard = self.guard
            key = guard.authenticate(sc["headers"]) if guard.enabled else None
            limit = server.max_body_bytes
            given = sc.get("extensions") or _NO_EXTENSIONS
            ext: dict[str, Any] = given if type(given) is dict else dict(given)
            writer = ext.get(DIRECT_BODY)
            raw = writer.take_body() if writer is not None else None
            if raw is None:
                raw = await read_body(receive, limit, content_length)
            else:
                check_body_size(len(raw), limit, content_length)
            # Taken after the body's awaits: a lane from a policy reloaded meanwhile would put
            # its old limits back into admission.
            policy = gw.policy
            call = self._make_call(policy, raw, headers, request_id, received_at)
            call.query = sc.get("query_string", b"")
            call.method = sc["method"]
            if self.path == RESPONSES_BY_ID:
                call.path = sc["path"]
                await self._pin(call, stored_response_id(sc["path"]))
            elif call.fields is not None and self.kind == "responses":
                previous = call.fields.get("previous_response_id")
                if previous is not None:
                    await self._pin(call, previous)
            tracer = self.tracer
            if tracer is not None:
                tracer.request_started(call)
            if key is not None:
                guard.charge(key, call, policy.estimate.chars_per_token)
            hook = ext.get(CLIENT_GONE)
            if hook is not None:
                # The server names the request's task (asyncio's ``current_task`` is
                # interpreted in Python 3.11); the app runs in it, no middleware between here.
                call.task = hook.task
                call.start_with_body = START_WITH_BODY in ext
                call.body_writer = writer
                hook.callback = _partial(_client_gone, call, hook)
            else:
                call.task = asyncio.current_task()
                listener = asyncio.create_task(_listen_for_disconnect(receive, call))
            try:
                await self.relay.run(call, send)
            finally:
                call.finished = True
                call.body_writer = None  # the cycle (and its connection) not held by the record
        except GatewayError as err:
            if call is not None:
                call.status = err.status
                call.error = err.message
                call.error_origin = "gateway"
            if call is None:
                # Refused before it was a call: its own access line (a Call gets one below).
                accessline.write_refusal(
                    self.path, err.status, request_id, err.message, now() - received_at, time.time()
                )
                await send_error(send, err, request_id, dialect=self.dialect)
            elif not call.started:  # admitted, then failed: the key's limits still apply
                await send_error(send, err, request_id, call.extra_headers, self.dialect)
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
                call.error_origin = "gateway"
            else:
                accessline.write_refusal(
                    self.path, 500, request_id, "internal error", now() - received_at, time.time()
                )
            if call is None or not call.started:
                await send_error(
                    send,
                    internal_error(),
                    request_id,
                    call.extra_headers if call is not None else (),
                    self.dialect,
                )
        finally:
            gw.active_requests -= 1
            if listener is not None:
                listener.cancel()
            if hook is not None:
                hook.callback = None  # the connection outlives the request: keep no Call alive
            if call is not None:
                if call.trace is not None and self.tracer is not None:
                    self.tracer.request_finished(call)
                # Recorded off this path, in a batch (``Outcomes``).
                self.outcomes.add(call, now() - call.received_at)

    def _trusted(self, cidrs: list[str], peer: str | None) -> bool:
        """Whether ``peer`` is one of ``server.trusted_proxies`` (parsed once per policy)."""
        if not cidrs or peer is None:
            return False
        cached = self._networks
        if cached is None or cached[0] is not cidrs:
            cached = self._networks = (cidrs, networks_of(cidrs))
        return peer_in(peer, cached[1])

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
        fields = None
        if self.check is not None:
            body = fields = validate.parse_json_object(raw)
            self.check(body)
            model = body.get("model")
            stream = validate.wants_stream(body)
            # Messages and Responses streams always carry their usage.
            wants_usage = stream and (self.kind in _USAGE_ALWAYS or validate.wants_usage(body))
            profile = profile_request(body, self.kind, self.estimator, gw.max_prefix_chars)
            lane = match_lane(profile, policy.lanes).lane
        else:
            lane = policy.lanes[-1]
            if raw and validate.is_json_body(headers):
                with contextlib.suppress(Exception):
                    body = validate.parse_json_object(raw)
                    m = body.get("model")
                    model = m if isinstance(m, str) else None
        refuse_unknown_model(self.fleet, model)
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
            fields=fields,
            dialect=self.dialect,
        )

    async def _pin(self, call: Call, response_id: str) -> None:
        """Send ``call`` to the one replica holding ``response_id``; an id the gateway does not
        know, or whose replica left the fleet, gets the 404 vLLM gives for an unknown id (any
        other replica would answer without the conversation, or with that same 404)."""
        url = await self.relay.homes.lookup(response_id)
        if url is None or not any(r.url == url for r in self.fleet.replicas()):
            raise unknown_response(response_id)
        call.pinned = url


__all__ = [
    "PASSTHROUGH_GET_PATHS",
    "PASSTHROUGH_PATHS",
    "RESPONSES_BY_ID",
    "EndpointParts",
    "RelayEndpoint",
    "forwarding_headers",
    "read_body",
    "refuse_unknown_model",
    "request_id_from",
    "without_connection_named",
]
