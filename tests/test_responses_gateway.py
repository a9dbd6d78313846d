"""The OpenAI Responses API through the gateway to two simulated vLLM replicas, with the official
`openai` SDK: plain and streamed answers, conversations that go on with
``previous_response_id`` (each turn on the replica holding the last one, however the pool
balances), retrieve, background and cancel by id, vLLM's 404 for an id nobody holds, a stream
retried before its first token, and the access line of a stream (TTFT, usage, api)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loadtest.sim.server import run_sim

from .gateway import policy_for, running_gateway
from .servers import FAST_SIM
from .waiting import wait_until

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
FIXTURES = Path(__file__).parent / "fixtures"


class Fleet:
    def __init__(self, url: str, sims: list[Any]) -> None:
        self.url = url
        self.sims = sims


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    async with run_sim(FAST_SIM, name="a") as a, run_sim(FAST_SIM, name="b") as b:
        # Round robin over both: without pinning, every other turn would meet the replica
        # that never saw the conversation.
        async with running_gateway(policy_for({"p": [a.url, b.url]})) as (url, _):
            yield Fleet(url, [a, b])


@pytest.fixture
async def client(fleet: Fleet) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def replica_of(raw: Any) -> str:
    return str(raw.headers["x-tokenlane-replica"])


async def test_conversations_go_on_on_the_replica_holding_them(
    client: openai.AsyncOpenAI,
) -> None:
    for conversation in range(4):
        raw = await client.responses.with_raw_response.create(
            model=MODEL, input=f"Conversation {conversation}: hello", max_output_tokens=4
        )
        first = raw.parse()
        home = replica_of(raw)
        previous, tokens = first.id, first.usage.input_tokens  # type: ignore[union-attr]
        for turn in range(3):
            raw = await client.responses.with_raw_response.create(
                model=MODEL,
                input=f"turn {turn}",
                previous_response_id=previous,
                max_output_tokens=4,
            )
            answer = raw.parse()
            assert replica_of(raw) == home
            assert answer.usage is not None and answer.usage.input_tokens > tokens
            previous, tokens = answer.id, answer.usage.input_tokens
        got = await client.responses.retrieve(previous)
        assert got.id == previous and got.status in ("completed", "incomplete")


async def test_a_streamed_response_is_relayed_event_by_event_and_logged(
    client: openai.AsyncOpenAI, access_lines: list[dict[str, Any]]
) -> None:
    kinds: list[str] = []
    created = None
    async with client.responses.stream(
        model=MODEL, input="Stream to me", max_output_tokens=8
    ) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.created":
                created = event.response.id
        final = await stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",)
    assert "response.output_text.delta" in kinds
    assert created == final.id
    await wait_until(lambda: any(r["api"] == "responses" for r in access_lines), what="line")
    [line] = [r for r in access_lines if r["api"] == "responses"]
    assert line["status"] == 200 and line["stream"] is True
    assert line["ttft_ms"] is not None
    assert final.usage is not None
    assert line["prompt_tokens"] == final.usage.input_tokens
    assert line["output_tokens"] == final.usage.output_tokens
    # The stored response was learned from the stream: it can be continued.
    more = await client.responses.create(
        model=MODEL, input="and then?", previous_response_id=final.id, max_output_tokens=3
    )
    assert more.usage is not None and more.usage.input_tokens > final.usage.input_tokens


async def test_background_responses_are_retrieved_and_cancelled_where_they_live(
    client: openai.AsyncOpenAI,
) -> None:
    made = await client.responses.create(
        model=MODEL, input="Take your time", max_output_tokens=6, background=True
    )
    assert made.status in ("queued", "in_progress", "completed")

    async def done() -> bool:
        got = await client.responses.retrieve(made.id)
        return got.status in ("completed", "incomplete")

    await wait_until(done, what="the background response completed")
    # vLLM refuses to cancel a finished response: its own 400 comes back through the gateway.
    with pytest.raises(openai.BadRequestError):
        await client.responses.cancel(made.id)


async def responses_asked(http: httpx.AsyncClient, fleet: Fleet) -> int:
    """Requests under /v1/responses the replicas saw (health probes apart)."""
    seen = 0
    for sim in fleet.sims:
        log = (await http.get(sim.url + "/sim/requests")).json()["requests"]
        seen += sum(1 for r in log if str(r["path"]).startswith("/v1/responses"))
    return seen


async def test_an_id_nobody_holds_is_vllms_404_without_asking_a_replica(fleet: Fleet) -> None:
    fixture = json.loads((FIXTURES / "vllm_responses_error_404.json").read_text())
    async with httpx.AsyncClient(timeout=10) as http:
        before = await responses_asked(http, fleet)
        for method, path, body in [
            ("GET", "/v1/responses/resp_nobody", None),
            ("POST", "/v1/responses/resp_nobody/cancel", None),
            ("POST", "/v1/responses", {"model": MODEL, "input": "x", "previous_response_id": "resp_nobody"}),
        ]:  # fmt: skip
            resp = await http.request(method, fleet.url + path, json=body)
            assert resp.status_code == 404
            got = resp.json()["error"]
            want = fixture["error"]
            assert {k: got[k] for k in ("type", "param", "code")} == {
                k: want[k] for k in ("type", "param", "code")
            }
            assert got["message"] == "Response with id 'resp_nobody' not found."
        assert await responses_asked(http, fleet) == before


async def test_a_stream_whose_replica_is_busy_is_retried_before_its_first_token(
    fleet: Fleet, client: openai.AsyncOpenAI, access_lines: list[dict[str, Any]]
) -> None:
    await fleet.sims[0].set_fault({"fault": "error_rate", "rate": 1.0, "status": 503})
    for i in range(2):  # round robin: one of the two meets the busy replica first
        async with client.responses.stream(
            model=MODEL, input=f"retry me {i}", max_output_tokens=4
        ) as stream:
            final = await stream.get_final_response()
        assert final.status in ("completed", "incomplete")
    await wait_until(
        lambda: sum(1 for r in access_lines if r["api"] == "responses") == 2, what="lines"
    )
    lines = [r for r in access_lines if r["api"] == "responses"]
    assert sorted(r["retries"] for r in lines) == [0, 1]
    assert all(r["status"] == 200 for r in lines)
    assert len({r["replica"] for r in lines}) == 1  # both answered by the healthy replica
