"""Each fault of the simulator (and ``engine_dead``) over real sockets: what it does, and that it
lifts."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import pytest

from loadtest.sim.server import run_sim
from loadtest.sim.settings import SimSettings

from .waiting import wait_until

SETTINGS = SimSettings(step_fixed_s=0.005, decode_per_seq_s=0.0, prefill_per_token_s=0.000001,
                       request_overhead_s=0.0)  # fmt: skip
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
LONG = {**CHAT, "max_tokens": 100_000 // 8, "stream": True}


class Reader:
    """Reads a stream in the background, keeping every SSE event as it arrives."""

    def __init__(self, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
        self.events: list[Any] = []
        self.raw = ""
        self.status: int | None = None
        self.error: Exception | None = None
        self.task = asyncio.create_task(self._run(client, url, body))

    async def _run(self, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
        try:
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
                self.status = resp.status_code
                buf = ""
                async for text in resp.aiter_text():
                    self.raw += text
                    buf += text
                    while "\n\n" in buf:
                        block, buf = buf.split("\n\n", 1)
                        data = block.removeprefix("data: ")
                        self.events.append(data if data == "[DONE]" else json.loads(data))
        except httpx.HTTPError as exc:
            self.error = exc

    async def wait_events(self, n: int) -> None:
        await wait_until(lambda: len(self.events) >= n, what=f"{n} events", poll=0.005)


def _gauge(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M).group(1))


async def _reachable(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=1) as c:
            return (await c.get(url + "/health")).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=60) as c:
        yield c


async def test_stall_freezes_streams_and_counters_but_not_health_until_lifted(client):
    async with run_sim(SETTINGS) as s:
        stream = Reader(client, s.url, {**CHAT, "max_tokens": 80, "stream": True})
        await stream.wait_events(5)
        await s.set_fault({"fault": "stall"})
        await asyncio.sleep(0.05)  # chunks already on the wire arrive
        seen = len(stream.events)
        before = (await client.get(s.url + "/metrics")).text
        late = asyncio.create_task(client.post(s.url + "/v1/chat/completions", json=CHAT))
        await asyncio.sleep(0.3)
        after = (await client.get(s.url + "/metrics")).text
        assert len(stream.events) == seen  # even the step under way keeps its tokens
        assert _gauge(after, "vllm:num_requests_running") == 1
        assert _gauge(after, "vllm:num_requests_waiting") == 0  # the engine never saw it
        for counter in ("vllm:generation_tokens_total", "vllm:prompt_tokens_total"):
            assert _gauge(after, counter) == _gauge(before, counter)
        assert (await client.get(s.url + "/health")).status_code == 200
        assert not late.done()
        await s.set_fault(None)
        # Generous bounds: a loaded machine streams 80 tokens slowly; only a hang fails.
        assert (await asyncio.wait_for(late, 30)).status_code == 200
        await asyncio.wait_for(stream.task, 30)
    assert stream.events[-1] == "[DONE]" and stream.status == 200


async def test_slow_multiplies_every_step(client):
    async def duration(s) -> float:
        t0 = time.perf_counter()
        resp = await client.post(s.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 20})
        assert resp.status_code == 200
        return time.perf_counter() - t0

    async with run_sim(SETTINGS) as s:
        # The fastest of three: a pause of the machine can only lengthen a run.
        normal = min([await duration(s) for _ in range(3)])
        await s.set_fault({"fault": "slow", "factor": 6})
        slow = await duration(s)
    assert slow > 2.5 * normal


async def test_error_rate_fails_that_share_of_new_requests_in_vllms_shape(client):
    async with run_sim(SETTINGS) as s:
        await s.set_fault({"fault": "error_rate", "rate": 1.0, "status": 503})
        resp = await client.post(s.url + "/v1/chat/completions", json=CHAT)
        assert resp.status_code == 503
        error = resp.json()["error"]
        assert (error["type"], error["code"]) == ("ServiceUnavailableError", 503)
        assert (await client.get(s.url + "/v1/models")).status_code == 200
        await s.set_fault({"fault": "error_rate", "rate": 0.5})
        statuses = [
            (await client.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}))
            .status_code for _ in range(40)
        ]  # fmt: skip
        await s.set_fault(None)
        assert (await client.post(s.url + "/v1/chat/completions", json=CHAT)).status_code == 200
    assert set(statuses) == {200, 500}
    assert 5 <= statuses.count(500) <= 35


async def test_health_fail_answers_its_status_while_serving(client):
    async with run_sim(SETTINGS, fault={"fault": "health_fail", "status": 500}) as s:
        health = await client.get(s.url + "/health")
        served = await client.post(s.url + "/v1/chat/completions", json=CHAT)
        await s.set_fault(None)
        healed = await client.get(s.url + "/health")
    assert (health.status_code, health.content) == (500, b"")
    assert served.status_code == 200 and healed.status_code == 200


async def test_refuse_closes_the_port_until_duration_passes(client):
    async with run_sim(SETTINGS) as s:
        resp = await client.post(s.url + "/sim/fault", json={"fault": "refuse", "duration_s": 0.6})
        assert resp.json()["fault"] == "refuse"
        await wait_until(lambda: _refused(s.url), what="the port refuses", poll=0.02)
        t0 = time.monotonic()
        await wait_until(lambda: _reachable(s.url), what="the port answers again", poll=0.02)
        assert time.monotonic() - t0 < 10  # lifted by its timer, wide for a paused VM
        assert (await client.get(s.url + "/sim/fault")).json() == {"fault": None}


async def _refused(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=1) as c:
            await c.get(url + "/health")
    except httpx.ConnectError:
        return True
    return False


async def test_refuse_lifted_in_process_listens_again():
    async with run_sim(SETTINGS) as s:
        await s.set_fault({"fault": "refuse"})
        assert await _refused(s.url)
        await s.set_fault(None)
        assert await _reachable(s.url)


async def test_hang_accept_connects_but_never_answers_until_lifted():
    async with run_sim(SETTINGS) as s:
        await s.set_fault({"fault": "hang_accept", "duration_s": 30})
        async with httpx.AsyncClient(timeout=httpx.Timeout(0.3, connect=2)) as c:
            with pytest.raises(httpx.ReadTimeout):  # connected, then silence
                await c.get(s.url + "/health")
        assert s.describe_fault()["remaining_s"] > 25
        await s.set_fault(None)
        assert await _reachable(s.url)


async def test_engine_dead_ends_streams_with_the_error_event_and_health_503(client):
    async with run_sim(SETTINGS) as s:
        stream = Reader(client, s.url, LONG)
        await stream.wait_events(4)
        resp = await client.post(s.url + "/sim/fault", json={"fault": "engine_dead"})
        assert resp.status_code == 200
        await asyncio.wait_for(stream.task, 5)
        new = await client.post(s.url + "/v1/chat/completions", json=CHAT)
        health = await client.get(s.url + "/health")
        await client.post(s.url + "/sim/fault", json={"fault": None})
        healed = await client.get(s.url + "/health")
        served = await client.post(s.url + "/v1/chat/completions", json=CHAT)
    assert stream.status == 200 and stream.events[-1] == "[DONE]"
    error = stream.events[-2]["error"]
    assert (error["type"], error["code"], error["param"]) == ("InternalServerError", 500, None)
    assert 'data: {"error": {"message": ' in stream.raw  # spaced JSON, as vLLM writes it
    assert (new.status_code, health.status_code, health.content) == (500, 503, b"")
    assert healed.status_code == 200 and served.status_code == 200


async def test_crash_in_process_cuts_connections_then_returns_fresh(client):
    async with run_sim(SETTINGS) as s:
        await client.post(s.url + "/v1/chat/completions", json=CHAT)
        stream = Reader(client, s.url, LONG)
        await stream.wait_events(3)
        await s.set_fault({"fault": "crash", "duration_s": 0.5})
        await asyncio.wait_for(stream.task, 5)
        assert stream.error is not None  # cut mid-stream, no [DONE]
        assert await _refused(s.url)
        await wait_until(lambda: _reachable(s.url), what="the port answers again", poll=0.02)
        text = (await client.get(s.url + "/metrics")).text
        stats = s.stats()
    assert _gauge(text, "vllm:generation_tokens_total") == 0  # a new engine, new counters
    assert stats["requests_received"] >= 3  # observability survives the emulated crash


async def test_fault_endpoint_validates_describes_and_lifts(client):
    async with run_sim(SETTINGS) as s:
        url = s.url + "/sim/fault"
        assert (await client.get(url)).json() == {"fault": None}
        for bad in ({"fault": "melt"}, {"fault": "refuse"}, {"fault": "slow"},
                    {"fault": "slow", "factor": 2, "speed": 1}, {"nofault": 1}):  # fmt: skip
            resp = await client.post(url, json=bad)
            assert resp.status_code == 400 and "message" in resp.json()["error"], bad
        resp = await client.post(url, json={"fault": "slow", "factor": 2, "duration_s": 60})
        got = (await client.get(url)).json()
        assert resp.status_code == 200
        assert {k: got[k] for k in ("fault", "factor", "duration_s")} == {
            "fault": "slow", "factor": 2.0, "duration_s": 60.0}  # fmt: skip
        assert 0 < got["remaining_s"] <= 60
        assert (await client.post(url, json={"fault": None})).json() == {"fault": None}
        assert s.engine.slow_factor == 1.0


async def test_duration_lifts_a_fault_by_itself(client):
    async with run_sim(SETTINGS) as s:
        await s.set_fault({"fault": "stall", "duration_s": 0.2})
        resp = await asyncio.wait_for(
            client.post(s.url + "/v1/chat/completions", json=CHAT), 5
        )  # answered once the stall lifts
        assert resp.status_code == 200 and s.fault is None
