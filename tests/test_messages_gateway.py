"""The Anthropic Messages API through the gateway to two simulated vLLM replicas, with the
official `anthropic` SDK: plain and streamed answers (TTFT, usage and api on the access line),
``x-api-key`` as the client key, the gateway's 503 in Anthropic's shape honoured by the SDK's
own retry, a stream retried before its first token, and a stream cut mid-answer ending with
Anthropic's error event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import pytest

from loadtest.sim.server import run_sim

from .gateway import policy_for, running_gateway
from .servers import FAST_SIM
from .waiting import wait_until

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
KEY = "sk-anthropic-client"
HELLO = [{"role": "user", "content": "Say hello to the gateway"}]


class Fleet:
    def __init__(self, url: str, sims: list[Any], app: Any) -> None:
        self.url = url
        self.sims = sims
        self.app = app


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    async with run_sim(FAST_SIM, name="a") as a, run_sim(FAST_SIM, name="b") as b:
        env = {"TOKENLANE_API_KEYS": KEY}
        async with running_gateway(policy_for({"p": [a.url, b.url]}), environ=env) as (url, app):
            yield Fleet(url, [a, b], app)


@pytest.fixture
async def client(fleet: Fleet) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=fleet.url, api_key=KEY, max_retries=0) as c:
        yield c


def lines_of(access_lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in access_lines if r["api"] == "messages"]


async def test_a_plain_answer_and_a_stream_through_the_sdk(
    client: anthropic.AsyncAnthropic, access_lines: list[dict[str, Any]]
) -> None:
    message = await client.messages.create(
        model=MODEL,
        max_tokens=8,
        system="Be brief.",
        messages=HELLO,  # type: ignore[arg-type]
    )
    assert message.content and message.content[0].type == "text"
    assert message.usage.output_tokens > 0
    texts: list[str] = []
    async with client.messages.stream(
        model=MODEL,
        max_tokens=8,
        messages=HELLO,  # type: ignore[arg-type]
    ) as stream:
        async for text in stream.text_stream:
            texts.append(text)
        final = await stream.get_final_message()
    assert "".join(texts) == "".join(b.text for b in final.content if b.type == "text")
    await wait_until(lambda: len(lines_of(access_lines)) == 2, what="two access lines")
    plain, streamed = lines_of(access_lines)
    assert plain["status"] == streamed["status"] == 200
    assert plain["output_tokens"] == message.usage.output_tokens
    assert plain["prompt_tokens"] == message.usage.input_tokens
    assert streamed["stream"] is True and streamed["ttft_ms"] is not None
    assert streamed["output_tokens"] == final.usage.output_tokens
    assert streamed["prompt_tokens"] is not None


async def test_a_wrong_key_is_anthropics_authentication_error(fleet: Fleet) -> None:
    async with anthropic.AsyncAnthropic(base_url=fleet.url, api_key="sk-wrong", max_retries=0) as c:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            await c.messages.create(model=MODEL, max_tokens=4, messages=HELLO)  # type: ignore[arg-type]
    assert caught.value.status_code == 401
    body: Any = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"


async def test_the_gateways_503_is_retried_by_the_sdk_after_its_retry_after(
    fleet: Fleet, access_lines: list[dict[str, Any]]
) -> None:
    for replica in fleet.app.gateway.fleet.replicas():
        fleet.app.gateway.fleet.operator_eject(replica)
    async with anthropic.AsyncAnthropic(base_url=fleet.url, api_key=KEY, max_retries=1) as c:
        with pytest.raises(anthropic.APIStatusError) as caught:
            await c.messages.create(model=MODEL, max_tokens=4, messages=HELLO)  # type: ignore[arg-type]
    assert caught.value.status_code == 503
    body: Any = caught.value.body
    assert body["error"]["type"] == "overloaded_error"
    assert int(caught.value.response.headers["retry-after"]) >= 1
    # The SDK tried twice (its own retry), each a refusal with its own access line.
    await wait_until(lambda: len(lines_of(access_lines)) == 2, what="two refusals logged")
    assert [r["status"] for r in lines_of(access_lines)] == [503, 503]


async def test_a_stream_whose_replica_is_busy_is_retried_before_its_first_token(
    fleet: Fleet, client: anthropic.AsyncAnthropic, access_lines: list[dict[str, Any]]
) -> None:
    await fleet.sims[0].set_fault({"fault": "error_rate", "rate": 1.0, "status": 503})
    for _ in range(2):  # round robin: one of the two meets the busy replica first
        async with client.messages.stream(
            model=MODEL,
            max_tokens=4,
            messages=HELLO,  # type: ignore[arg-type]
        ) as stream:
            final = await stream.get_final_message()
        assert final.content
    await wait_until(lambda: len(lines_of(access_lines)) == 2, what="two access lines")
    lines = lines_of(access_lines)
    assert sorted(r["retries"] for r in lines) == [0, 1]
    assert all(r["status"] == 200 for r in lines)


async def test_a_stream_cut_mid_answer_ends_with_anthropics_error_event(fleet: Fleet) -> None:
    for sim in fleet.sims:
        await sim.set_fault({"fault": "cut_close", "after_tokens": 3})
    body = {"model": MODEL, "max_tokens": 16, "stream": True, "messages": HELLO}
    async with httpx.AsyncClient(timeout=30) as http:
        resp = await http.post(fleet.url + "/v1/messages", json=body, headers={"x-api-key": KEY})
    assert resp.status_code == 200
    events = [block for block in resp.text.split("\n\n") if block.strip()]
    names = [block.split("\n", 1)[0] for block in events]
    assert "event: content_block_delta" in names  # the answer had started
    assert names[-1] == "event: error"
    last = json.loads(events[-1].split("\n", 1)[1][len("data: ") :])
    assert last["type"] == "error" and last["error"]["type"] == "overloaded_error"
    assert "[DONE]" not in resp.text
