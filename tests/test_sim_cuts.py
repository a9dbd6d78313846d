"""Faults that end a stream after k tokens (close, reset, in-band error, abort, stall), the
``stall`` deadlock of vLLM #37729 (aborts not processed, counters and gauges frozen, ``/health``
200), and vLLM's 400 where bad input used to give a 500; over real sockets."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from loadtest.sim.server import run_sim
from loadtest.sim.settings import SimSettings

SETTINGS = SimSettings(step_fixed_s=0.002, decode_per_seq_s=0.0, prefill_per_token_s=0.0,
                       request_overhead_s=0.0)  # fmt: skip
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 60, "stream": True}


class Stream:
    """A stream read in the background: its SSE events as they arrive, and how it ended."""

    def __init__(self, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
        self.events: list[Any] = []
        self.error: Exception | None = None
        self.ended = asyncio.Event()
        self.changed = asyncio.Event()
        self.task = asyncio.create_task(self._run(client, url, body))

    async def _run(self, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
        try:
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
                buf = ""
                async for text in resp.aiter_text():
                    buf += text
                    while "\n\n" in buf:
                        block, buf = buf.split("\n\n", 1)
                        data = block.removeprefix("data: ")
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.changed.set()
        except httpx.HTTPError as exc:
            self.error = exc
        finally:
            self.ended.set()
            self.changed.set()

    def tokens(self) -> int:
        return sum(
            1
            for e in self.events
            if e != "[DONE]" and e.get("choices") and "role" not in e["choices"][0]["delta"]
            and e["choices"][0]["finish_reason"] != "abort"
        )  # fmt: skip

    async def until(self, check: Callable[[], bool], timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not check():
                self.changed.clear()
                await self.changed.wait()


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    """Wait for a condition another task or process brings about, polling what it exposes."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def _metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=30) as c:
        yield c


@pytest.mark.parametrize("k", [0, 7])
async def test_cut_close_ends_the_response_after_k_tokens_without_done(client, k):
    async with run_sim(SETTINGS, fault={"fault": "cut_close", "after_tokens": k}) as s:
        stream = Stream(client, s.url, CHAT)
        await asyncio.wait_for(stream.ended.wait(), 10)
        assert stream.error is None  # a complete HTTP response, but not a complete stream
        assert stream.tokens() == k and "[DONE]" not in stream.events
        await until(lambda: _ready(s, lambda st: st["running"] == 0 and st["aborted"] == 1))


async def test_cut_reset_resets_the_connection_after_k_tokens(client):
    async with run_sim(SETTINGS, fault={"fault": "cut_reset", "after_tokens": 5}) as s:
        stream = Stream(client, s.url, CHAT)
        await asyncio.wait_for(stream.ended.wait(), 10)
        # Not a clean end of the body (cut_close's): the read itself fails.
        assert isinstance(stream.error, httpx.ReadError)
        assert stream.tokens() == 5 and "[DONE]" not in stream.events


async def test_cut_error_sends_vllms_in_band_error_event_then_done(client):
    fault = {"fault": "cut_error", "after_tokens": 3, "status": 503}
    async with run_sim(SETTINGS, fault=fault) as s:
        stream = Stream(client, s.url, CHAT)
        await asyncio.wait_for(stream.ended.wait(), 10)
    *_, error, done = stream.events
    assert done == "[DONE]" and stream.tokens() == 3
    assert set(error) == {"error"}
    assert error["error"]["code"] == 503 and error["error"]["type"] == "ServiceUnavailableError"
    assert set(error["error"]) == {"message", "type", "param", "code"}


async def test_cut_abort_finishes_with_abort_and_usage(client):
    body = {**CHAT, "stream_options": {"include_usage": True}, "return_token_ids": True}
    async with run_sim(SETTINGS, fault={"fault": "cut_abort", "after_tokens": 4}) as s:
        stream = Stream(client, s.url, body)
        await asyncio.wait_for(stream.ended.wait(), 10)
    *_, last, usage, done = stream.events
    assert done == "[DONE]" and stream.tokens() == 4
    choice = last["choices"][0]
    assert (choice["finish_reason"], choice["delta"]["content"], choice["token_ids"]) == (
        "abort", "", []
    )  # fmt: skip
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4


async def _ready(s, check) -> bool:
    return check(s.stats())


async def test_stall_after_k_tokens_freezes_the_engine_there_and_resumes_when_lifted(client):
    async with run_sim(SETTINGS, fault={"fault": "stall", "after_tokens": 6}) as s:
        stream = Stream(client, s.url, CHAT)
        await until(lambda: _ready(s, lambda st: st["running"] == 1))
        await until(lambda: _ready(s, lambda _: s.engine.stalled))
        await stream.until(lambda: stream.tokens() == 6)
        assert s.engine.scheduler.running[0].num_output == 6  # the engine holds token 7 back
        await s.set_fault(None)
        await asyncio.wait_for(stream.ended.wait(), 10)
    assert stream.tokens() == 60 and stream.events[-1] == "[DONE]"


async def test_a_stalled_engine_processes_no_aborts_until_the_stall_lifts(client):
    async with run_sim(SETTINGS) as s:
        stream = Stream(client, s.url, CHAT)
        await stream.until(lambda: stream.tokens() >= 3)
        await s.set_fault({"fault": "stall"})
        before = (await client.get(s.url + "/metrics")).text
        stream.task.cancel()  # the client leaves mid-stall (the gateway rescuing its request)
        await until(lambda: _ready(s, lambda st: st["disconnects"] == 1))
        stats = s.stats()
        assert (stats["running"], stats["aborted"]) == (1, 0)
        after = (await client.get(s.url + "/metrics")).text
        for name in ("vllm:num_requests_running", "vllm:generation_tokens_total",
                     "vllm:request_success_total"):  # fmt: skip
            assert _metric(after, name) == _metric(before, name), name
        assert _metric(after, "vllm:num_requests_running") == 1
        assert (await client.get(s.url + "/health")).status_code == 200
        await s.set_fault(None)
        await until(lambda: _ready(s, lambda st: (st["running"], st["aborted"]) == (0, 1)))
        lifted = (await client.get(s.url + "/metrics")).text
        assert _metric(lifted, "vllm:num_requests_running") == 0


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions",
         {"messages": [{"role": "assistant", "content": "x", "tool_calls": "nope"}]},
         "body.messages.0.tool_calls"),
        ("/v1/chat/completions",
         {"messages": [{"role": "assistant", "content": "x", "tool_calls": {"id": 1}}]},
         "body.messages.0.tool_calls"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
         None),
        ("/v1/chat/completions", '{"messages": [{"role": "user\\udfff", "content": "a"}]}',
         None),
        ("/v1/completions", '{"prompt": "\\ud800"}', None),
        ("/v1/completions", '{"prompt": ["ok", "\\udbff"]}', None),
        ("/tokenize", '{"prompt": "\\ud800"}', None),
        ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}', None),
        ("/v1/chat/completions", '{"model": "\\ud800", "messages": []}', "model"),
    ],
)  # fmt: skip
async def test_bad_input_gets_vllms_400_not_a_500(client, path, body, param):
    async with run_sim(SETTINGS) as s:
        raw = body if isinstance(body, str) else json.dumps(body)
        resp = await client.post(
            s.url + path, content=raw, headers={"content-type": "application/json"}
        )
        log = (await client.get(s.url + "/sim/requests")).json()  # the log still renders
    assert resp.status_code in (400, 404), resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == resp.status_code and error["param"] == param
    if param is None:
        assert "surrogates not allowed" in error["message"]
        assert error["type"] == "BadRequestError"
    assert log["requests"]
