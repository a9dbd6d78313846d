"""The admin API (docs/operations.md): see the fleet, move replicas by hand, reload the policy.

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
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

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
    metrics: Metrics
    policy: Policy
    environ: Mapping[str, str]
    needs_restart: list[str]

    @property
    def fleet(self) -> Fleet: ...  # the gateway's for its life

    async def reload(self) -> int: ...

    def in_flight(self, replica: Replica) -> int:
        """The gateway's requests in flight to ``replica`` (all workers' when it has several)."""
        ...


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
    "eject": {"url", "name", "pool"},
    "drain": {"url", "name", "pool"},
    "readmit": {"url", "name", "pool", "force"},
}


@dataclass(frozen=True)
class Target:
    """The replica an admin action means: by ``url`` or by ``name`` (the label every log,
    metric and admin row uses), optionally narrowed to a pool."""

    url: str | None
    name: str | None
    pool: str | None
    force: bool


def parse_target(action: str, raw: bytes) -> Target:
    """The body of eject / readmit / drain; ``BadRequest`` when malformed."""
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        raise BadRequest("body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest('body must be a JSON object such as {"name": "bulk-0"}')
    unknown = sorted(set(body) - ACTION_KEYS[action])
    if unknown:
        raise BadRequest(f"unknown key(s) for {action}: {', '.join(unknown)}", param=unknown[0])
    url, name = body.get("url"), body.get("name")
    pool, force = body.get("pool"), body.get("force", False)
    if (url is None) == (name is None):
        raise BadRequest("give exactly one of `url` and `name`", param="url")
    for key, value in (("url", url), ("name", name)):
        if value is not None and (not isinstance(value, str) or not value):
            raise BadRequest(f"`{key}` must be a non-empty string", param=key)
    if pool is not None and not isinstance(pool, str):
        raise BadRequest("`pool` must be a string", param="pool")
    if not isinstance(force, bool):
        raise BadRequest("`force` must be true or false", param="force")
    return Target(url, name, pool, force)


def find_target(fleet: Fleet, target: Target) -> Replica:
    """The one replica ``target`` means; ``NotFound`` or ``BadRequest`` (ambiguous)."""
    if target.url is not None:
        try:
            return fleet.one(target.url, target.pool)
        except UnknownReplica as exc:
            raise NotFound(str(exc), param="url") from None
        except AmbiguousReplica as exc:
            raise BadRequest(str(exc), param="pool") from None
    found = [
        r
        for r in fleet.replicas()
        if r.name == target.name and (target.pool is None or r.pool == target.pool)
    ]
    where = f" in pool {target.pool!r}" if target.pool is not None else ""
    if not found:
        raise NotFound(f"no replica named {target.name!r}{where}", param="name")
    if len(found) > 1:
        pools = ", ".join(sorted(r.pool for r in found))
        raise BadRequest(
            f"{target.name!r} is in several pools ({pools}); name the pool", param="pool"
        )
    return found[0]


def epoch_row(row: dict[str, Any], fleet_now: float, epoch_now: float) -> dict[str, Any]:
    """A replica row with every time in epoch seconds: the fleet stamps scrapes with its own
    (monotonic) clock, state changes with the wall clock; an operator compares them only on
    one clock."""
    stats = dict(row["stats"])
    at = stats.get("scraped_at")
    if at is not None:
        stats["scraped_at"] = round(epoch_now - (fleet_now - at), 3)
    return {**row, "stats": stats}


def parse_action(action: str, raw: bytes) -> tuple[str, str | None, bool]:
    """The body of eject / readmit / drain by URL → (url, pool, force); ``BadRequest`` when
    malformed. (``parse_target`` also takes a replica's name.)"""
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

    def row(replica: Replica) -> dict[str, Any]:
        shown = replica.row()
        shown["in_flight"] = gateway.in_flight(replica)
        return epoch_row(shown, gateway.fleet.clock(), time.time())

    async def replicas(request: Request) -> Response:
        return JSONResponse({"replicas": [row(r) for r in gateway.fleet.replicas()]})

    def action(name: str, apply: Callable[[Replica, bool], None]) -> Handler:
        async def endpoint(request: Request) -> Response:
            target = parse_target(name, await request.body())
            replica = find_target(gateway.fleet, target)
            apply(replica, target.force)
            return JSONResponse(row(replica))

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
