"""The admin API over a real socket: auth rules, replica rows, operator moves, reload."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import httpx
import pytest
from starlette.applications import Starlette

from proxy.config import Policy
from proxy.edge.admin import Forbidden, admin_routes, check_auth, epoch_row
from proxy.errors import Unauthorized
from proxy.fleet.fleet import Fleet, Replica
from proxy.observe.metrics import Metrics
from proxy.policyfile import PolicyError, build_policy

from .servers import serve_app

A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"


@dataclass
class FakeGateway:
    policy: Policy
    environ: Mapping[str, str]
    fleet: Fleet = field(init=False)
    metrics: Metrics = field(default_factory=Metrics)
    version: int = 1
    next_problems: list[str] | None = None
    needs_restart: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.fleet = Fleet(self.policy, self.environ, metrics=self.metrics)
        for r in self.fleet.replicas():
            r.models = {"m": {"id": "m"}}

    async def reload(self) -> int:
        if self.next_problems:
            raise PolicyError(self.next_problems)
        self.version += 1
        return self.version

    def in_flight(self, replica: Replica) -> int:
        return replica.in_flight


def make_gateway(environ: Mapping[str, str] | None = None) -> FakeGateway:
    policy = build_policy(
        {
            "pools": {
                "fast": {"replicas": [{"url": A}, {"url": B}]},
                "bulk": {"replicas": [{"url": B}]},  # B is in two pools
            },
            "lanes": [{"name": "all", "pool": "fast"}],
        }
    )
    return FakeGateway(policy, environ or {})


@pytest.fixture
async def admin() -> AsyncIterator[tuple[httpx.AsyncClient, FakeGateway]]:
    gw = make_gateway()
    async with serve_app(Starlette(routes=admin_routes(gw))) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            yield client, gw


def assert_openai_error(resp: httpx.Response, status: int) -> None:
    assert resp.status_code == status
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


# ---------------------------------------------------------------------------- auth


@pytest.mark.parametrize(
    ("authorization", "host", "token", "error"),
    [
        (None, "127.0.0.1", None, None),
        (None, "::1", None, None),
        (None, "127.8.9.10", None, None),
        (None, "10.1.2.3", None, Forbidden),
        (None, None, None, Forbidden),
        ("Bearer s3cret", "10.1.2.3", "s3cret", None),
        ("bearer s3cret", "10.1.2.3", "s3cret", None),
        ("Bearer wrong", "127.0.0.1", "s3cret", Unauthorized),  # a token overrides loopback
        (None, "127.0.0.1", "s3cret", Unauthorized),
        ("Basic s3cret", "127.0.0.1", "s3cret", Unauthorized),
    ],
)
def test_check_auth_token_or_loopback(authorization, host, token, error) -> None:
    if error is None:
        check_auth(authorization, host, token)
    else:
        with pytest.raises(error):
            check_auth(authorization, host, token)


async def test_admin_without_token_refuses_forwarded_remote_client(admin) -> None:
    client, _ = admin
    # serve_app keeps uvicorn's default proxy_headers, which trusts X-Forwarded-For from a
    # loopback peer: the way to be a non-loopback client over a loopback socket.
    resp = await client.get("/admin/replicas", headers={"x-forwarded-for": "203.0.113.7"})
    assert_openai_error(resp, 403)
    assert (await client.get("/admin/replicas")).status_code == 200


async def test_admin_with_token_requires_bearer() -> None:
    gw = make_gateway({"TOKENLANE_ADMIN_TOKEN": "s3cret"})
    async with serve_app(Starlette(routes=admin_routes(gw))) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            assert_openai_error(await client.get("/admin/replicas"), 401)
            bad = {"authorization": "Bearer nope"}
            assert_openai_error(await client.post("/admin/reload", headers=bad), 401)
            good = {"authorization": "Bearer s3cret", "x-forwarded-for": "203.0.113.7"}
            assert (await client.get("/admin/replicas", headers=good)).status_code == 200


# ---------------------------------------------------------------------------- replicas


async def test_admin_replicas_lists_every_replica_row(admin) -> None:
    client, _ = admin
    rows = (await client.get("/admin/replicas")).json()["replicas"]
    assert [(r["pool"], r["url"]) for r in rows] == [("fast", A), ("fast", B), ("bulk", B)]
    row = rows[0]
    assert set(row) == {
        "pool",
        "name",
        "url",
        "state",
        "reason",
        "in_flight",
        "ejections",
        "models",
        "stats",
    }
    assert (row["state"], row["reason"], row["models"]) == ("probing", None, ["m"])


async def test_admin_eject_readmit_drain_move_replica(admin) -> None:
    client, gw = admin
    resp = await client.post("/admin/replicas/eject", json={"url": A})
    assert resp.status_code == 200
    assert (resp.json()["state"], resp.json()["reason"], resp.json()["ejections"]) == (
        "ejected",
        "operator",
        1,
    )
    assert (
        gw.metrics.registry.get_sample_value(
            "tokenlane_ejections_total",
            {"pool": "fast", "replica": "10.0.0.1:8000", "reason": "operator"},
        )
        == 1
    )
    resp = await client.post("/admin/replicas/readmit", json={"url": A})
    assert resp.json()["state"] == "probing"
    resp = await client.post("/admin/replicas/readmit", json={"url": A + "/", "force": True})
    assert (resp.json()["state"], resp.json()["reason"]) == ("healthy", None)
    resp = await client.post("/admin/replicas/drain", json={"url": A})
    assert resp.json()["state"] == "draining"
    assert gw.fleet.find(A)[0].state.value == "draining"


async def test_admin_action_on_url_in_two_pools_needs_pool(admin) -> None:
    client, gw = admin
    assert_openai_error(await client.post("/admin/replicas/drain", json={"url": B}), 400)
    resp = await client.post("/admin/replicas/drain", json={"url": B, "pool": "bulk"})
    assert (resp.status_code, resp.json()["pool"], resp.json()["state"]) == (
        200,
        "bulk",
        "draining",
    )
    assert gw.fleet.find(B, "fast")[0].state.value == "probing"


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/admin/replicas/eject", {"url": "http://nowhere:1"}, 404),
        ("/admin/replicas/eject", {"url": A, "pool": "bulk"}, 404),
        ("/admin/replicas/eject", {}, 400),
        ("/admin/replicas/eject", {"url": 5}, 400),
        ("/admin/replicas/eject", {"url": A, "force": True}, 400),  # force is for readmit
        ("/admin/replicas/readmit", {"url": A, "force": "yes"}, 400),
        ("/admin/replicas/drain", {"url": A, "pol": "fast"}, 400),  # a typo must not pass
    ],
)
async def test_admin_action_rejects_unknown_or_malformed(admin, path, body, status) -> None:
    client, gw = admin
    assert_openai_error(await client.post(path, json=body), status)
    assert all(r.state.value == "probing" for r in gw.fleet.replicas())


async def test_admin_action_rejects_non_json_body(admin) -> None:
    client, _ = admin
    assert_openai_error(await client.post("/admin/replicas/eject", content=b"url=x"), 400)


# ---------------------------------------------------------------------------- reload


async def test_admin_reload_returns_new_version(admin) -> None:
    client, _ = admin
    resp = await client.post("/admin/reload")
    assert (resp.status_code, resp.json()) == (200, {"version": 2, "needs_restart": []})


async def test_admin_reload_invalid_policy_is_422_with_problems(admin) -> None:
    client, gw = admin
    gw.next_problems = ["lanes[0].pool: unknown pool 'bluk'"]
    resp = await client.post("/admin/reload")
    assert resp.status_code == 422
    body = resp.json()
    assert body["problems"] == ["lanes[0].pool: unknown pool 'bluk'"]
    assert body["error"]["message"] and gw.version == 1


# ---------------------------------------------------------------------------- by name, one clock


async def test_admin_actions_take_the_replica_name(admin) -> None:
    client, gw = admin
    resp = await client.post("/admin/replicas/eject", json={"name": "10.0.0.1:8000"})
    assert (resp.status_code, resp.json()["url"], resp.json()["state"]) == (200, A, "ejected")
    # The name of B is in two pools, like its URL: the pool decides.
    assert_openai_error(
        await client.post("/admin/replicas/drain", json={"name": "10.0.0.2:8000"}), 400
    )
    resp = await client.post(
        "/admin/replicas/drain", json={"name": "10.0.0.2:8000", "pool": "bulk"}
    )
    assert (resp.json()["pool"], resp.json()["state"]) == ("bulk", "draining")
    assert gw.fleet.find(B, "fast")[0].state.value == "probing"


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"name": "nobody"}, 404),
        ({"name": "10.0.0.1:8000", "pool": "bulk"}, 404),
        ({"name": "10.0.0.1:8000", "url": A}, 400),  # one or the other
        ({"name": ""}, 400),
        ({"name": 3}, 400),
    ],
)
async def test_admin_action_by_name_rejects_unknown_or_malformed(admin, body, status) -> None:
    client, gw = admin
    assert_openai_error(await client.post("/admin/replicas/eject", json=body), status)
    assert all(r.state.value == "probing" for r in gw.fleet.replicas())


@pytest.mark.parametrize(
    ("scraped_at", "fleet_now", "epoch_now", "expected"),
    [
        (None, 500.0, 1_700_000_000.0, None),
        (498.5, 500.0, 1_700_000_000.0, 1_699_999_998.5),
        (500.0, 500.0, 1_700_000_000.25, 1_700_000_000.25),
    ],
)
def test_epoch_row_puts_scrape_times_on_the_wall_clock(
    scraped_at: float | None, fleet_now: float, epoch_now: float, expected: float | None
) -> None:
    row = {"name": "r", "stats": {"scraped_at": scraped_at, "state_changed_at": 1.0}}
    out = epoch_row(row, fleet_now, epoch_now)
    assert out["stats"]["scraped_at"] == expected
    assert out["stats"]["state_changed_at"] == 1.0
    assert row["stats"]["scraped_at"] == scraped_at  # the input is not changed


async def test_admin_row_times_are_epoch_seconds(admin) -> None:
    client, gw = admin
    replica = gw.fleet.find(A)[0]
    replica.stats.at = gw.fleet.clock() - 2.0  # scraped two seconds ago, on the fleet clock
    gw.fleet.operator_eject(replica)
    before = time.time()
    row = (await client.get("/admin/replicas")).json()["replicas"][0]
    after = time.time()
    assert before - 3.0 <= row["stats"]["scraped_at"] <= after - 1.0
    assert before - 60 <= row["stats"]["state_changed_at"] <= after
