"""The admin API (DESIGN 4.3): see the fleet, move replicas by hand, reload the policy.

Auth: when the environment variable named by ``server.admin_token_env`` is set, every call needs
``Authorization: Bearer <token>`` (compared in constant time); when it is unset, only loopback
clients are served. The client address is the one the ASGI server reports: ``tokenlane serve``
runs uvicorn without proxy headers, so it is the TCP peer. Behind a reverse proxy on the same
host every client looks local: set a token there.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.config import Policy
from proxy.errors import (
    AmbiguousReplica,
    BadRequest,
    Forbidden,
    GatewayError,
    NotFound,
    PolicyError,
    PolicyRefused,
    Unauthorized,
    UnknownReplica,
    error_response,
)
from proxy.fleet.fleet import Fleet, Replica
from proxy.observe.metrics import Metrics


class AdminGateway(Protocol):
    fleet: Fleet
    metrics: Metrics
    policy: Policy
    environ: Mapping[str, str]
    needs_restart: list[str]

    async def reload(self) -> int: ...


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return host == "localhost"


def check_auth(authorization: str | None, client_host: str | None, token: str | None) -> None:
    """Raise ``Unauthorized`` / ``Forbidden`` unless the caller may use the admin API."""
    if token:
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), token.encode()
        ):
            raise Unauthorized("admin API: missing or wrong bearer token")
        return
    if not is_loopback(client_host):
        raise Forbidden("admin API: no admin token is set, so only loopback clients are served")


ACTION_KEYS = {
    "eject": {"url", "pool"},
    "drain": {"url", "pool"},
    "readmit": {"url", "pool", "force"},
}


def parse_action(action: str, raw: bytes) -> tuple[str, str | None, bool]:
    """The body of eject / readmit / drain → (url, pool, force); ``BadRequest`` when malformed."""
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        raise BadRequest("body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest('body must be a JSON object such as {"url": "http://host:8000"}')
    unknown = sorted(set(body) - ACTION_KEYS[action])
    if unknown:
        raise BadRequest(f"unknown key(s) for {action}: {', '.join(unknown)}", param=unknown[0])
    url, pool, force = body.get("url"), body.get("pool"), body.get("force", False)
    if not isinstance(url, str) or not url:
        raise BadRequest("`url` is required and must be a string", param="url")
    if pool is not None and not isinstance(pool, str):
        raise BadRequest("`pool` must be a string", param="pool")
    if not isinstance(force, bool):
        raise BadRequest("`force` must be true or false", param="force")
    return url, pool, force


Handler = Callable[[Request], Awaitable[Response]]


def admin_routes(gateway: AdminGateway) -> list[Route]:
    def guarded(handler: Handler) -> Handler:
        async def endpoint(request: Request) -> Response:
            token = gateway.environ.get(gateway.policy.server.admin_token_env)
            client = request.client.host if request.client else None
            try:
                check_auth(request.headers.get("authorization"), client, token)
                return await handler(request)
            except GatewayError as err:
                return error_response(err)

        return endpoint

    async def replicas(request: Request) -> Response:
        return JSONResponse({"replicas": [r.row() for r in gateway.fleet.replicas()]})

    def action(name: str, apply: Callable[[Replica, bool], None]) -> Handler:
        async def endpoint(request: Request) -> Response:
            url, pool, force = parse_action(name, await request.body())
            try:
                replica = gateway.fleet.one(url, pool)
            except UnknownReplica as exc:
                raise NotFound(str(exc), param="url") from None
            except AmbiguousReplica as exc:
                raise BadRequest(str(exc), param="pool") from None
            apply(replica, force)
            return JSONResponse(replica.row())

        return endpoint

    async def reload(request: Request) -> Response:
        try:
            version = await gateway.reload()
        except PolicyError as exc:
            raise PolicyRefused(exc.problems) from None
        return JSONResponse({"version": version, "needs_restart": list(gateway.needs_restart)})

    # gateway.fleet is looked up per call: a reload may replace it.
    return [
        Route("/admin/replicas", guarded(replicas), methods=["GET"]),
        Route(
            "/admin/replicas/eject",
            guarded(action("eject", lambda r, _: gateway.fleet.operator_eject(r))),
            methods=["POST"],
        ),
        Route(
            "/admin/replicas/readmit",
            guarded(action("readmit", lambda r, force: gateway.fleet.operator_readmit(r, force))),
            methods=["POST"],
        ),
        Route(
            "/admin/replicas/drain",
            guarded(action("drain", lambda r, _: gateway.fleet.operator_drain(r))),
            methods=["POST"],
        ),
        Route("/admin/reload", guarded(reload), methods=["POST"]),
    ]


__all__ = ["AdminGateway", "Forbidden", "admin_routes", "check_auth", "is_loopback", "parse_action"]
