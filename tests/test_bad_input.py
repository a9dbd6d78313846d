"""Bad input gets a 4xx in OpenAI's error shape, never a 500 or a hang, and the gateway keeps
serving after each."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from loadtest.fake_upstream import FakeUpstream, running

from .gateway import policy_for, running_gateway

CHAT = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "messages": [{"role": "user", "content": "hi"}]}
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[str, FakeUpstream]]:
    async with running(tokens=3) as up:
        policy = policy_for({"p": [up.url]}, server={"max_body_bytes": 64 * 1024})
        async with running_gateway(policy) as (url, _):
            yield url, up


BAD_BODIES = [
    pytest.param(b"{not json", "not valid JSON", id="not-json"),
    pytest.param(b"[1, 2]", "JSON object", id="not-an-object"),
    pytest.param(b'"text"', "JSON object", id="a-string"),
    pytest.param(b'{"messages": "\xff\xfe"}', "UTF-8", id="invalid-utf8"),
    pytest.param(b"[" * 5_000 + b"]" * 5_000, "nested", id="nested-too-deep"),
    pytest.param(json.dumps({"model": "m"}).encode(), "messages", id="messages-missing"),
    pytest.param(
        json.dumps({"messages": {"role": "user"}}).encode(), "messages", id="messages-not-list"
    ),
    pytest.param(
        json.dumps({**CHAT, "max_tokens": -1}).encode(), "max_tokens", id="max-tokens-negative"
    ),
    pytest.param(
        json.dumps({**CHAT, "max_tokens": "ten"}).encode(), "max_tokens", id="max-tokens-string"
    ),
    pytest.param(
        json.dumps({**CHAT, "max_tokens": 1.5}).encode(), "max_tokens", id="max-tokens-float"
    ),
    pytest.param(json.dumps({**CHAT, "stream": "yes"}).encode(), "stream", id="stream-not-bool"),
    pytest.param(json.dumps({**CHAT, "n": 0}).encode(), "n", id="n-zero"),
    pytest.param(b"", "not valid JSON", id="empty"),
]


@pytest.mark.parametrize(("raw", "mentions"), BAD_BODIES)
async def test_bad_chat_body_gets_400_in_openai_shape(
    gateway: tuple[str, FakeUpstream], raw: bytes, mentions: str
) -> None:
    url, up = gateway
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(
            url + "/v1/chat/completions",
            content=raw,
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == ERROR_KEYS
        assert mentions in error["message"]
        # ... and the gateway keeps serving.
        ok = await client.post(url + "/v1/chat/completions", json=CHAT)
        assert ok.status_code == 200
    assert len([b for b in up.stats.bodies if "messages" in b and b == CHAT]) == 1


async def test_completion_without_prompt_gets_400(gateway: tuple[str, FakeUpstream]) -> None:
    url, _ = gateway
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(url + "/v1/completions", json={"model": "m"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt"


async def test_body_over_the_limit_gets_413_while_being_read(
    gateway: tuple[str, FakeUpstream],
) -> None:
    url, _ = gateway
    sent = 0

    async def body() -> AsyncIterator[bytes]:
        # Chunked, so no content-length tells the gateway in advance: it must stop reading.
        nonlocal sent
        for _ in range(1000):
            sent += 16 * 1024
            yield b" " * (16 * 1024)
            await asyncio.sleep(0)

    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(url + "/v1/chat/completions", content=body())
        assert r.status_code == 413
        assert set(r.json()["error"]) == ERROR_KEYS
        declared = await client.post(
            url + "/v1/chat/completions",
            content=b"x" * (65 * 1024),
            headers={"content-type": "application/json"},
        )
        assert declared.status_code == 413
        ok = await client.post(url + "/v1/chat/completions", json=CHAT)
        assert ok.status_code == 200


async def test_body_over_the_limit_gets_413_when_it_came_whole_without_a_length() -> None:
    # Chunked, small and in one write: the body is all in when the relay looks (taken from
    # the server, not received), and nothing announced its size.
    def chat(chars: int) -> bytes:
        body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * chars}]})
        return body.encode()

    def chunked(body: bytes) -> bytes:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n"
        half = len(body) // 2
        parts = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in (body[:half], body[half:]))
        return head + b"content-type: application/json\r\n\r\n" + parts + b"0\r\n\r\n"

    over, under = chat(1500), chat(500)
    async with running(tokens=3) as up:
        policy = policy_for({"p": [up.url]}, server={"max_body_bytes": 1024})
        async with running_gateway(policy) as (url, _):
            host, port = url.removeprefix("http://").split(":")
            async with asyncio.timeout(30):
                statuses = []
                for body in (over, under):
                    reader, writer = await asyncio.open_connection(host, int(port))
                    writer.write(chunked(body))
                    statuses.append(await reader.readline())
                    writer.close()
    assert statuses[0].startswith(b"HTTP/1.1 413 ")
    assert statuses[1].startswith(b"HTTP/1.1 200 ")
    relayed = [b for b in up.stats.bodies if "messages" in b]
    assert [len(b["messages"][0]["content"]) for b in relayed] == [500]


async def test_wrong_method_gets_405_and_unknown_path_404(
    gateway: tuple[str, FakeUpstream],
) -> None:
    url, _ = gateway
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.get(url + "/v1/chat/completions")
        assert r.status_code == 405
        assert set(r.json()["error"]) == ERROR_KEYS
        r = await client.delete(url + "/v1/models")
        assert r.status_code == 405
        assert set(r.json()["error"]) == ERROR_KEYS
        r = await client.post(url + "/v1/assistants", json={})
        assert r.status_code == 404
        assert set(r.json()["error"]) == ERROR_KEYS


async def test_unknown_model_gets_vllms_404_body(gateway: tuple[str, FakeUpstream]) -> None:
    url, up = gateway
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(url + "/v1/chat/completions", json={**CHAT, "model": "gpt-4o"})
        assert r.status_code == 404
        assert r.json() == json.loads(
            (
                __import__("pathlib").Path(__file__).parent / "fixtures/vllm_error_404_model.json"
            ).read_text()
        )
        r = await client.get(url + "/v1/models/gpt-4o")
        assert r.status_code == 404
    assert not [b for b in up.stats.bodies if b.get("model") == "gpt-4o"]


async def test_a_client_leaving_mid_body_is_not_logged_as_a_server_error(
    gateway: tuple[str, FakeUpstream], caplog: pytest.LogCaptureFixture
) -> None:
    url, _ = gateway
    host, port = url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b'content-length: 1000\r\n\r\n{"messages": ['
    )
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.close()
    await asyncio.sleep(0.3)
    # Leaving is the client's right: no "Exception in ASGI application" traceback.
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
