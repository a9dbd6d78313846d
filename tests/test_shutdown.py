"""Graceful shutdown (RELIABILITY T13): on SIGTERM `/ready` fails at once, new requests get 503
with Retry-After, streams shorter than the grace finish, longer ones are cut at its end with
the OpenAI-shaped error event and `data: [DONE]` (no traceback in the log), and the process
exits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.fake_upstream import running

from .gateway import policy_for, wait_ready
from .servers import free_port, run_process
from .waiting import WaitTimeout, wait_until

CHAT = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "messages": [{"role": "user", "content": "hi"}]}


@contextlib.asynccontextmanager
async def gateway_with_log(
    policy: dict[str, Any], tmp: Path
) -> AsyncIterator[tuple[str, int, list[str]]]:
    """``python -m proxy serve`` as `make run` does; yields its URL, pid, and a list that
    holds its stderr once the block ends (after the process has exited)."""
    port = free_port()
    path = tmp / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    argv = [sys.executable, "-m", "proxy", "serve", "--config", str(path),
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    stderr: list[str] = []
    with run_process(argv) as proc:
        try:
            await wait_ready(url, timeout_s=120)  # a backstop: a loaded host starts slowly
        except WaitTimeout:
            proc.kill()
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"gateway did not start:\n{err[-3000:]}") from None
        yield url, proc.pid, stderr
        await asyncio.to_thread(proc.wait, 30)
        assert proc.stderr is not None
        stderr.append(proc.stderr.read().decode(errors="replace"))


async def test_sigterm_drains_then_exits(tmp_path: Path) -> None:
    grace = 3.0
    async with running(tokens=20, interval_s=0.05, record=False) as up:
        policy = policy_for({"p": [up.url]}, server={"shutdown_grace_s": grace})
        async with gateway_with_log(policy, tmp_path) as (url, pid, stderr):
            async with httpx.AsyncClient(timeout=30) as client:

                async def stream(tokens: int) -> str:
                    body = {**CHAT, "stream": True, "max_tokens": tokens}
                    text = ""
                    try:
                        async with client.stream(
                            "POST", url + "/v1/chat/completions", json=body
                        ) as resp:
                            async for chunk in resp.aiter_text():
                                text += chunk
                    except httpx.HTTPError:
                        pass  # a cut stream may end with a protocol error
                    return text

                short = [asyncio.create_task(stream(20)) for _ in range(4)]  # ~1 s each
                long = [asyncio.create_task(stream(400)) for _ in range(2)]  # ~20 s each
                # All six are at the replica before the signal (a loaded host is slow to send).
                await wait_until(lambda: up.stats.requests >= 6, what="six streams upstream")
                os.kill(pid, signal.SIGTERM)
                signalled = time.monotonic()

                ready = await client.get(url + "/ready")
                assert ready.status_code == 503
                late = await client.post(url + "/v1/chat/completions", json=CHAT)
                assert late.status_code == 503
                assert int(late.headers["retry-after"]) >= 1
                assert set(late.json()["error"]) == {"message", "type", "param", "code"}

                for text in await asyncio.gather(*short):
                    assert text.rstrip().endswith("data: [DONE]")
                for text in await asyncio.gather(*long):
                    assert "tok1" in text  # they were streaming when cut
                    # ...and ended with the error event, then [DONE]
                    events = [e for e in text.split("\n\n") if e.strip()]
                    assert events[-1] == "data: [DONE]"
                    error = json.loads(events[-2].removeprefix("data: "))["error"]
                    assert set(error) == {"message", "type", "param", "code"}
                    assert error["code"] == 503
                    assert "shutting down" in error["message"]

                while time.monotonic() - signalled < grace + 5:
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:
                        break
                    if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                        break
                    await asyncio.sleep(0.05)
                exited_after = time.monotonic() - signalled
    assert exited_after <= grace + 2.0
    log = stderr[0]
    assert "grace period over: cutting" in log
    assert "Traceback" not in log
