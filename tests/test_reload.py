"""Hot reload (file change, SIGHUP, POST /admin/reload) and DNS discovery."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loadtest.fake_upstream import running
from proxy import gateway as gateway_module
from proxy.edge.serve import GatewayServer, uvicorn_config
from proxy.fleet.discovery import Discovery, expand, expand_replica
from proxy.gateway import create_app
from proxy.policyfile import build_policy, load_policy

from .gateway import policy_for, wait_ready
from .servers import bound_socket
from .waiting import wait_until

CHAT = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "messages": [{"role": "user", "content": "hi"}]}


def write_atomically(path: Path, data: dict[str, Any]) -> None:
    """As editors save: a new file renamed over the old one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data))
    os.replace(tmp, path)


def two_pool_policy(a: str, b: str, lane_pool: str) -> dict[str, Any]:
    return policy_for({"a": [a], "b": [b]}, lanes=[{"name": "all", "pool": lane_pool}])


@contextlib.asynccontextmanager
async def gateway_with_file(path: Path, *, sighup: bool = False) -> AsyncIterator[tuple[str, Any]]:
    """A gateway serving the policy at ``path`` the way `tokenlane serve` does."""
    app = create_app(load_policy(path, environ={}), environ={}, policy_path=str(path))
    sock = bound_socket()
    port = sock.getsockname()[1]
    server = GatewayServer(uvicorn_config(app, "127.0.0.1", port), app.gateway)
    if not sighup:
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(url)
        yield url, app
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def replica_of_next_request(url: str) -> str:
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
        return r.headers["x-tokenlane-replica"]


async def test_editing_the_file_reloads_and_keeps_replica_state(tmp_path: Path) -> None:
    async with running(tokens=2) as a, running(tokens=2) as b:
        path = tmp_path / "policy.yaml"
        write_atomically(path, two_pool_policy(a.url, b.url, "a"))
        async with gateway_with_file(path) as (url, app):
            assert await replica_of_next_request(url) == a.url.removeprefix("http://")
            replica_a = app.gateway.fleet.find(a.url)[0]
            served = replica_a.requests_total
            write_atomically(path, two_pool_policy(a.url, b.url, "b"))

            async def switched() -> bool:
                return app.gateway.version == 2

            await wait_until(switched, what="switched")
            assert await replica_of_next_request(url) == b.url.removeprefix("http://")
            # The replica that stayed is the same object, with its health and counters.
            assert app.gateway.fleet.find(a.url)[0] is replica_a
            assert replica_a.requests_total == served
            assert replica_a.state.value == "healthy"


async def test_an_invalid_edit_keeps_the_old_policy_and_says_why(tmp_path: Path) -> None:
    async with running(tokens=2) as a, running(tokens=2) as b:
        path = tmp_path / "policy.yaml"
        write_atomically(path, two_pool_policy(a.url, b.url, "a"))
        async with gateway_with_file(path) as (url, app):
            write_atomically(path, two_pool_policy(a.url, b.url, "nope"))
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(url + "/admin/reload")
                assert r.status_code == 422
                assert "lanes[0].pool: unknown pool 'nope'" in r.text
                await asyncio.sleep(1.5)  # the watcher sees the same bad file
                assert app.gateway.version == 1
                scrape = (await client.get(url + "/metrics")).text
            assert 'tokenlane_policy_reloads_total{result="invalid"}' in scrape
            assert await replica_of_next_request(url) == a.url.removeprefix("http://")


async def test_admin_reload_answers_the_new_version(tmp_path: Path) -> None:
    async with running(tokens=2) as a, running(tokens=2) as b:
        path = tmp_path / "policy.yaml"
        write_atomically(path, two_pool_policy(a.url, b.url, "a"))
        async with gateway_with_file(path) as (url, _):
            data = two_pool_policy(a.url, b.url, "b")
            data["server"] = {"port": 1234}  # restart-only: reported, not applied
            write_atomically(path, data)
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(url + "/admin/reload")
            assert r.status_code == 200, r.text
            assert r.json()["version"] >= 2
            assert await replica_of_next_request(url) == b.url.removeprefix("http://")


async def test_restart_only_keys_are_reported_and_kept(tmp_path: Path) -> None:
    async with running(tokens=2) as a, running(tokens=2) as b:
        path = tmp_path / "policy.yaml"
        write_atomically(path, two_pool_policy(a.url, b.url, "a"))
        async with gateway_with_file(path) as (_, app):
            data = two_pool_policy(a.url, b.url, "a")
            data["server"] = {"port": 1234, "max_body_bytes": 10}
            data["retry"] = {"max_attempts": 7}
            write_atomically(path, data)
            await app.gateway.reload()
            gw = app.gateway
            assert set(gw.needs_restart) == {"server.port", "server.max_body_bytes"}
            assert gw.policy.server.max_body_bytes == 16 * 1024 * 1024
            assert gw.policy.retry.max_attempts == 7


async def test_sighup_reloads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway_module, "POLICY_POLL_S", 3600.0)  # only the signal can do it
    async with running(tokens=2) as a, running(tokens=2) as b:
        path = tmp_path / "policy.yaml"
        write_atomically(path, two_pool_policy(a.url, b.url, "a"))
        async with gateway_with_file(path, sighup=True) as (url, app):
            write_atomically(path, two_pool_policy(a.url, b.url, "b"))
            await asyncio.sleep(0.2)
            assert app.gateway.version == 1
            os.kill(os.getpid(), signal.SIGHUP)

            async def reloaded() -> bool:
                return app.gateway.version == 2

            await wait_until(reloaded, what="reloaded")
            assert await replica_of_next_request(url) == b.url.removeprefix("http://")
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)


# ---------------------------------------------------------------------------- discovery


def test_a_dns_replica_expands_to_one_replica_per_address() -> None:
    policy = build_policy(policy_for({"p": ["http://vllm-bulk:8000"]}))
    dns = policy.pools["p"].replicas[0].model_copy(update={"dns": True, "max_in_flight": 7})
    replicas = expand_replica(dns, ["10.0.0.7", "fd00::2"])
    assert [r.url for r in replicas] == ["http://10.0.0.7:8000", "http://[fd00::2]:8000"]
    assert [r.name for r in replicas] == ["vllm-bulk@10.0.0.7", "vllm-bulk@fd00::2"]
    assert all(r.max_in_flight == 7 and not r.dns for r in replicas)


def test_a_host_that_never_resolved_has_no_replicas_yet() -> None:
    data = policy_for({"p": ["http://vllm-bulk:8000", "http://fixed:8000"]})
    data["pools"]["p"]["replicas"][0]["dns"] = True
    policy = build_policy(data)
    assert [r.url for r in expand(policy, {}).pools["p"].replicas] == ["http://fixed:8000"]


async def test_discovery_keeps_the_last_addresses_when_a_lookup_fails() -> None:
    answers: list[Any] = [["10.0.0.1", "10.0.0.2"], OSError("no DNS"), ["10.0.0.2"]]

    async def resolver(host: str) -> list[str]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    d = Discovery(resolver)
    assert await d.refresh({"h"}) is True
    assert await d.refresh({"h"}) is False
    assert d.addresses["h"] == ["10.0.0.1", "10.0.0.2"]
    assert await d.refresh({"h"}) is True
    assert d.addresses["h"] == ["10.0.0.2"]


async def test_scaled_service_adds_probing_replicas_and_drops_vanished_ones() -> None:
    async with running(tokens=2) as up:
        port = int(up.url.rsplit(":", 1)[1])
        data = policy_for({"p": [f"http://scaled.test:{port}"]})
        data["pools"]["p"]["replicas"][0]["dns"] = True
        answers = [["127.0.0.1"], ["127.0.0.1", "127.0.0.2"], ["127.0.0.2"]]

        async def resolver(host: str) -> list[str]:
            assert host == "scaled.test"
            return answers[0]

        app = create_app(build_policy(data), environ={})
        gw = app.gateway
        gw.discovery = Discovery(resolver)
        await gw.start()
        try:
            assert [r.name for r in gw.fleet.replicas()] == ["scaled.test@127.0.0.1"]
            first = next(gw.fleet.replicas())
            answers.pop(0)
            assert await gw.discovery.refresh({"scaled.test"})
            gw._swap(gw.declared)
            names = {r.name: r for r in gw.fleet.replicas()}
            assert set(names) == {"scaled.test@127.0.0.1", "scaled.test@127.0.0.2"}
            assert names["scaled.test@127.0.0.1"] is first  # kept, with its state
            assert names["scaled.test@127.0.0.2"].state.value == "probing"
            answers.pop(0)
            assert await gw.discovery.refresh({"scaled.test"})
            gw._swap(gw.declared)
            assert "scaled.test@127.0.0.2" in {r.name for r in gw.fleet.replicas()}
            gone = [r for r in gw.fleet.replicas() if r.name == "scaled.test@127.0.0.1"]
            assert not gone or gone[0].state.value == "draining"
        finally:
            await gw.stop()


async def test_a_removed_replica_drains_and_its_stream_finishes(tmp_path: Path) -> None:
    async with running(tokens=40, interval_s=0.05) as a, running(tokens=2) as b:
        path = tmp_path / "policy.yaml"
        write_atomically(path, policy_for({"p": [a.url, b.url]}))
        async with gateway_with_file(path) as (url, app):
            async with httpx.AsyncClient(timeout=20) as client:
                body = {**CHAT, "stream": True}
                async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    served_by = r.headers["x-tokenlane-replica"]
                    removed = a if served_by == a.url.removeprefix("http://") else b
                    kept = b if removed is a else a
                    write_atomically(path, policy_for({"p": [kept.url]}))
                    await app.gateway.reload()
                    rows = (await client.get(url + "/admin/replicas")).json()["replicas"]
                    states = {row["url"]: row["state"] for row in rows}
                    assert states[removed.url] == "draining"
                    text = "".join([chunk async for chunk in r.aiter_text()])
                assert text.rstrip().endswith("data: [DONE]")  # finished where it started
                rows = (await client.get(url + "/admin/replicas")).json()["replicas"]
                assert [row["url"] for row in rows] == [kept.url]
