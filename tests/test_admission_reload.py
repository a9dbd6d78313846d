"""Admission across a reload: requests queued or in flight keep the lane they started with,
even when the reload removes that lane's pool; they get an honest answer, never a 500."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import yaml

from loadtest.fake_upstream import running
from proxy.edge.connection import GatewayProtocol
from proxy.gateway import create_app
from proxy.policyfile import load_policy

from .gateway import policy_for, wait_ready
from .servers import serve_app
from .waiting import wait_until

CHAT = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "messages": [{"role": "user", "content": "hi"}]}


async def test_a_request_queued_for_a_pool_that_a_reload_removes_gets_503_not_500(
    tmp_path: Path,
) -> None:
    async with running(tokens=300, interval_s=0.01) as a, running(tokens=5) as b:
        before = policy_for({"a": [a.url], "b": [b.url]}, lanes=[{"name": "all", "pool": "a"}])
        before["pools"]["a"]["replicas"][0]["max_in_flight"] = 1
        path = tmp_path / "policy.yaml"
        path.write_text(yaml.safe_dump(before))
        app = create_app(load_policy(path, environ={}), environ={}, policy_path=str(path))
        gw = app.gateway
        async with serve_app(app, http=GatewayProtocol) as url:
            await wait_ready(url)
            async with httpx.AsyncClient(timeout=10) as client:
                async with client.stream(
                    "POST", url + "/v1/chat/completions", json={**CHAT, "stream": True}
                ) as holder:
                    assert holder.status_code == 200
                    queued = asyncio.create_task(
                        client.post(url + "/v1/chat/completions", json=CHAT)
                    )
                    await wait_until(lambda: gw.admission.waiting, what="a request queued")
                    assert gw.admission.waiting == 1
                    after = policy_for({"b": [b.url]}, lanes=[{"name": "all", "pool": "b"}])
                    path.write_text(yaml.safe_dump(after))
                    await gw.reload()
                    resp = await asyncio.wait_for(queued, 10)
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["type"] == "ServiceUnavailableError"
    assert int(resp.headers["retry-after"]) >= 1


async def test_a_body_still_arriving_during_a_reload_is_laned_by_the_new_policy(
    tmp_path: Path,
) -> None:
    async with running(tokens=5) as up:
        lanes_v1 = [{"name": "all", "pool": "p", "max_in_flight": 1, "max_queue": 0}]
        path = tmp_path / "policy.yaml"
        path.write_text(yaml.safe_dump(policy_for({"p": [up.url]}, lanes=lanes_v1)))
        app = create_app(load_policy(path, environ={}), environ={}, policy_path=str(path))
        gw = app.gateway
        async with serve_app(app, http=GatewayProtocol) as url:
            await wait_ready(url)
            port = int(url.rsplit(":", 1)[1])
            body = json.dumps(CHAT).encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body[:10])
            )
            await writer.drain()
            await asyncio.sleep(0.2)  # the gateway is reading the body
            lanes_v2 = [{"name": "all", "pool": "p", "max_in_flight": 5, "max_queue": 0}]
            path.write_text(yaml.safe_dump(policy_for({"p": [up.url]}, lanes=lanes_v2)))
            await gw.reload()
            writer.write(body[10:])
            await writer.drain()
            status_line = await asyncio.wait_for(reader.readline(), 10)
            writer.close()
    assert b" 200 " in status_line
    # The request that straddled the reload must not put the old lane limits back.
    assert gw.admission.lanes["all"].config.max_in_flight == 5
