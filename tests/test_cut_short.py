"""A stream the replica ends early (its connection closed cleanly, without the API's end event)
reaches the client with the API's error event, never looking whole: chat and completions end
with the error chunk and ``[DONE]``, Messages with Anthropic's ``event: error``, Responses with
its ``error`` event. Continuation is off (the default): nothing is spliced."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from loadtest.sim.server import run_sim

from .gateway import policy_for, running_gateway
from .servers import FAST_SIM
from .waiting import wait_until

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
HELLO = [{"role": "user", "content": "Say hello to the gateway"}]


def last_event(text: str) -> tuple[str | None, Any]:
    """(event name or None, data) of a stream's last event."""
    blocks = [b for b in text.split("\n\n") if b.strip()]
    name = None
    data: Any = None
    for line in blocks[-1].split("\n"):
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            raw = line[len("data: ") :]
            data = raw if raw == "[DONE]" else json.loads(raw)
    return name, data


@pytest.mark.parametrize(
    ("path", "body", "check"),
    [
        ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 16}, "openai"),
        ("/v1/completions", {"prompt": "Once upon", "max_tokens": 16}, "openai"),
        ("/v1/messages", {"messages": HELLO, "max_tokens": 16}, "anthropic"),
        ("/v1/responses", {"input": "Say hello", "max_output_tokens": 16}, "responses"),
    ],
)
async def test_a_stream_closed_early_ends_with_the_apis_error_event(
    path: str, body: dict[str, Any], check: str, access_lines: list[dict[str, Any]]
) -> None:
    async with run_sim(FAST_SIM, name="a", fault={"fault": "cut_close", "after_tokens": 3}) as a:
        async with running_gateway(policy_for({"p": [a.url]})) as (url, _):
            async with httpx.AsyncClient(timeout=30) as http:
                resp = await http.post(url + path, json={"model": MODEL, "stream": True, **body})
    assert resp.status_code == 200
    name, data = last_event(resp.text)
    if check == "openai":
        assert data == "[DONE]"
        blocks = [b for b in resp.text.split("\n\n") if b.strip()]
        error = json.loads(blocks[-2][len("data: ") :])
        # Eligible, but the pool has no other replica: "closed the stream early; not continued"
        assert "stream early" in error["error"]["message"]
    elif check == "anthropic":
        assert name == "error" and data["error"]["type"] == "overloaded_error"
        assert "ended the stream early" in data["error"]["message"]
    else:
        assert name == "error" and data["type"] == "error"
        assert "ended the stream early" in data["message"]
    await wait_until(lambda: access_lines, what="the access line")
    assert access_lines[-1]["error"] is not None and access_lines[-1]["error_origin"] == "replica"
