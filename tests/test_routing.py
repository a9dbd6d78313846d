"""Requests reach the right pool and only replicas that serve their model, against simulated
vLLM replicas over real sockets."""

from __future__ import annotations

import asyncio

import httpx

from loadtest.sim.server import run_sim

from .gateway import policy_for, running_gateway

QWEN = "Qwen/Qwen2.5-0.5B-Instruct"
LLAMA = "meta-llama/Llama-3.2-1B-Instruct"

LANES = [
    {
        "name": "short",
        "pool": "interactive",
        "when": {"stream": True, "prompt_tokens_max": 256, "output_tokens_max": 64},
        "default_output_tokens": 32,
    },
    {"name": "long", "pool": "bulk"},
]


def label(sim: object) -> str:
    """The gateway's name for a replica given by URL alone: host:port."""
    return str(sim.url).removeprefix("http://")  # type: ignore[attr-defined]


def chat(content: str, **kw: object) -> dict[str, object]:
    return {"model": QWEN, "messages": [{"role": "user", "content": content}], **kw}


async def test_short_streams_go_to_interactive_and_the_rest_to_bulk() -> None:
    async with run_sim(name="fast") as fast, run_sim(name="bulk") as bulk:
        policy = policy_for({"interactive": [fast.url], "bulk": [bulk.url]}, lanes=LANES)
        async with running_gateway(policy) as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=20) as client:
                cases = [
                    (chat("hi", stream=True, max_tokens=16), "short"),
                    (chat("hi", stream=True), "short"),  # no max: the lane's default (32)
                    (chat("hi", stream=True, max_tokens=500), "long"),
                    (chat("word " * 2000, stream=True, max_tokens=16), "long"),
                    (chat("hi", max_tokens=16), "long"),  # not streaming
                ]
                for body, lane in cases:
                    r = await client.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    assert r.headers["x-tokenlane-lane"] == lane
                    expected = fast if lane == "short" else bulk
                    assert r.headers["x-tokenlane-replica"] == label(expected)
    chats = [r for r in fast.requests() if r["path"] == "/v1/chat/completions"]
    assert len(chats) == 2


async def test_a_request_goes_only_to_replicas_serving_its_model() -> None:
    async with run_sim(name="q", model=QWEN) as q, run_sim(name="l", model=LLAMA) as ll:
        policy = policy_for({"p": [q.url, ll.url]}, balance="least_loaded")
        async with running_gateway(policy) as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=20) as client:
                models = (await client.get("/v1/models")).json()
                assert sorted(m["id"] for m in models["data"]) == sorted([QWEN, LLAMA])
                one = (await client.get(f"/v1/models/{LLAMA}")).json()
                assert one["id"] == LLAMA and one["object"] == "model"
                for _ in range(6):
                    r = await client.post(
                        "/v1/chat/completions", json={**chat("hi", max_tokens=2), "model": LLAMA}
                    )
                    assert r.status_code == 200
                    assert r.headers["x-tokenlane-replica"] == label(ll)
                    assert r.json()["model"] == LLAMA


async def test_models_still_answer_while_a_replica_is_down() -> None:
    async with run_sim(name="q", model=QWEN) as q, run_sim(name="l", model=LLAMA) as ll:
        policy = policy_for({"p": [q.url, ll.url]})
        async with running_gateway(policy) as (url, app):
            await ll.set_fault({"fault": "refuse"})
            async with httpx.AsyncClient(base_url=url, timeout=20) as client:
                for _ in range(50):  # let the health loop see it
                    replica = next(r for r in app.gateway.fleet.replicas() if r.name == label(ll))
                    if replica.state.value != "healthy":
                        break
                    await asyncio.sleep(0.1)
                models = (await client.get("/v1/models")).json()
                assert sorted(m["id"] for m in models["data"]) == sorted([QWEN, LLAMA])
                r = await client.post(
                    "/v1/chat/completions", json={**chat("hi", max_tokens=2), "model": LLAMA}
                )
                # Known but unavailable: 503 with Retry-After, not vLLM's 404.
                assert r.status_code == 503
                assert "retry-after" in r.headers
            await ll.set_fault(None)


async def test_passthrough_endpoints_are_relayed_unchanged() -> None:
    async with run_sim(name="s") as sim:
        policy = policy_for({"p": [sim.url]})
        async with running_gateway(policy) as (url, _):
            async with httpx.AsyncClient(timeout=20) as client:
                body = {"model": QWEN, "prompt": "Hello tokenizer world"}
                via = await client.post(url + "/tokenize", json=body)
                direct = await client.post(sim.url + "/tokenize", json=body)
                assert via.status_code == 200
                assert via.json() == direct.json()
                assert via.headers["x-tokenlane-lane"] == "all"
                missing = await client.post(
                    url + "/v1/embeddings", json={"model": QWEN, "input": "x"}
                )
                # The simulator has no embeddings route: its 404 comes back as it is.
                assert missing.status_code == direct_status(
                    await client.post(
                        sim.url + "/v1/embeddings", json={"model": QWEN, "input": "x"}
                    )
                )


def direct_status(resp: httpx.Response) -> int:
    return resp.status_code


async def test_answers_the_gateway_makes_itself_carry_the_request_id() -> None:
    async with run_sim(name="s") as sim:
        async with running_gateway(policy_for({"p": [sim.url]})) as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=20) as client:
                for path in ("/v1/models", "/health", "/ready", "/nope"):
                    kept = await client.get(path, headers={"x-request-id": "abc-123"})
                    assert kept.headers["x-request-id"] == "abc-123", path
                    made = await client.get(path)
                    assert len(made.headers["x-request-id"]) >= 16, path
