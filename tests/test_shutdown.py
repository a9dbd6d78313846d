"""Graceful shutdown (docs/http.md, "Shutdown"): on SIGTERM `/ready` fails at once, new requests get 503
with Retry-After, streams shorter than the grace finish, longer ones are cut at its end with
the OpenAI-shaped error event and `data: [DONE]` (no traceback in the log), and the process
exits."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx

from loadtest.fake_upstream import running

from .gateway import gateway_process, policy_for
from .waiting import wait_until

CHAT = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "messages": [{"role": "user", "content": "hi"}]}


async def test_sigterm_drains_then_exits(tmp_path: Path) -> None:
    # Short streams (~0.5 s) must end inside the grace and long ones (~20 s) must not: the grace
    # sits far from both, so a paused machine cannot move a stream to the other side.
    grace = 5.0
    async with running(tokens=10, interval_s=0.05, record=False) as up:
        policy = policy_for({"p": [up.url]}, server={"shutdown_grace_s": grace})
        stderr: list[str] = []
        async with gateway_process(policy, tmp_path, stderr=stderr) as (url, pid):
            async with httpx.AsyncClient(timeout=30) as client:
                streaming = 0  # streams whose first token reached the client

                async def stream(tokens: int) -> str:
                    nonlocal streaming
                    body = {**CHAT, "stream": True, "max_tokens": tokens}
                    text = ""
                    try:
                        async with client.stream(
                            "POST", url + "/v1/chat/completions", json=body
                        ) as resp:
                            async for chunk in resp.aiter_text():
                                if "tok0" not in text and "tok0" in text + chunk:
                                    streaming += 1
                                text += chunk
                    except httpx.HTTPError:
                        pass  # a cut stream may end with a protocol error
                    return text

                short = [asyncio.create_task(stream(10)) for _ in range(4)]  # ~0.5 s each
                long = [asyncio.create_task(stream(400)) for _ in range(2)]  # ~20 s each
                await wait_until(lambda: streaming == 6, what="all six streams streaming")
                os.kill(pid, signal.SIGTERM)
                signalled = time.monotonic()

                # The signal reaches the gateway's loop a moment later: /ready fails from
                # then on, well before the drain ends.
                async def not_ready() -> bool:
                    return (await client.get(url + "/ready")).status_code == 503

                await wait_until(not_ready, what="/ready answers 503", timeout=grace)
                late = await client.post(url + "/v1/chat/completions", json=CHAT)
                assert late.status_code == 503
                assert int(late.headers["retry-after"]) >= 1
                assert set(late.json()["error"]) == {"message", "type", "param", "code"}

                for text in await asyncio.gather(*short):
                    assert text.rstrip().endswith("data: [DONE]"), text[-300:]
                for text in await asyncio.gather(*long):
                    assert "tok1" in text  # they were streaming when cut
                    # ...and ended with the error event, then [DONE]
                    events = [e for e in text.split("\n\n") if e.strip()]
                    assert events[-1] == "data: [DONE]"
                    error = json.loads(events[-2].removeprefix("data: "))["error"]
                    assert set(error) == {"message", "type", "param", "code"}
                    assert error["code"] == 503
                    assert "shutting down" in error["message"]

                while time.monotonic() - signalled < grace + 10:
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:
                        break
                    if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                        break
                    await asyncio.sleep(0.05)
                exited_after = time.monotonic() - signalled
    assert exited_after <= grace + 4.0
    log = stderr[0]
    assert "grace period over: cutting" in log
    assert "Traceback" not in log
