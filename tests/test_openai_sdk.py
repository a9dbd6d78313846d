"""The official `openai` SDK, sync and async, through the gateway to simulated vLLM replicas."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import openai
import pytest

from loadtest.sim.server import run_sim

from .gateway import policy_for, running_gateway

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
MESSAGES = [{"role": "user", "content": "Say hello to the gateway"}]


@pytest.fixture
async def base_url() -> AsyncIterator[str]:
    async with run_sim(name="a") as a, run_sim(name="b") as b:
        policy = policy_for(
            {"interactive": [a.url], "bulk": [b.url]},
            lanes=[
                {"name": "short", "pool": "interactive", "when": {"stream": True}},
                {"name": "long", "pool": "bulk"},
            ],
        )
        async with running_gateway(policy) as (url, _):
            yield url + "/v1"


def sync_calls(base: str) -> dict[str, object]:
    """Every kind of call with the blocking client (run in a thread: the gateway shares our
    event loop)."""
    client = openai.OpenAI(base_url=base, api_key="client-key", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    completion = client.completions.create(model=MODEL, prompt="Once upon a", max_tokens=4)
    cstream = list(
        client.completions.create(model=MODEL, prompt="Once upon a", max_tokens=4, stream=True)
    )
    models = client.models.list()
    return {
        "chat": chat,
        "chunks": chunks,
        "completion": completion,
        "cstream": cstream,
        "models": models,
    }


async def test_sync_client_chat_and_completions_stream_and_not(base_url: str) -> None:
    got = await asyncio.to_thread(sync_calls, base_url)
    chat = got["chat"]
    assert chat.choices[0].message.content  # type: ignore[attr-defined]
    assert chat.usage.completion_tokens == 5  # type: ignore[attr-defined]
    chunks = got["chunks"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # type: ignore[attr-defined]
    assert text
    assert chunks[-1].usage.completion_tokens == 5  # type: ignore[index]
    assert got["completion"].choices[0].text  # type: ignore[attr-defined]
    assert "".join(c.choices[0].text for c in got["cstream"])  # type: ignore[attr-defined]
    assert [m.id for m in got["models"].data] == [MODEL]  # type: ignore[attr-defined]


async def test_async_client_chat_and_completions_stream_and_not(base_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="client-key", max_retries=0)
    chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6)
    assert chat.usage is not None and chat.usage.completion_tokens == 6
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, stream=True
    )
    assert raw.headers["x-tokenlane-lane"] == "short"
    text = ""
    async for chunk in raw.parse():  # type: ignore[attr-defined]
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert text
    plain = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=3
    )
    assert plain.headers["x-tokenlane-lane"] == "long"
    completion = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert completion.choices[0].text
    stream = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True)
    assert "".join([c.choices[0].text async for c in stream])


async def test_upstream_400_reaches_the_sdk_as_bad_request(base_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        # Over the simulated model's 32k context: vLLM's own 400, relayed unchanged.
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40_000)
    assert "maximum context length" in str(info.value)


async def test_unknown_model_reaches_the_sdk_as_not_found(base_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=3)


async def test_sixteen_concurrent_streams(base_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0)

    async def one(i: int) -> str:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"stream number {i}"}],
            max_tokens=12,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    texts = await asyncio.gather(*(one(i) for i in range(16)))
    assert all(texts)
