"""Which failures are retried and for how long (docs/architecture.md "Retries", docs/http.md): one
deadline for all attempts, and a reset after the request was sent retried only on opt-in,
once. Over real sockets against the wire-level fake."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from loadtest.fake_upstream import FakeUpstream, running
from proxy.config import restart_changes
from proxy.policyfile import PolicyError, build_policy, policy_from_text
from proxy.relay import upstream

from .gateway import policy_for, running_gateway

CHAT = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "messages": [{"role": "user", "content": "hi"}]}
POLICY = """
pools:
  p:
    replicas: [{url: "http://r0:8000"}]
lanes:
  - name: all
    pool: p
"""


def chats(up: FakeUpstream) -> int:
    """Chat requests a fake received (canaries and probes apart)."""
    return sum("messages" in b for b in up.stats.bodies)


def first_then_spill(first: list[str], spill: list[str], **sections: Any) -> dict[str, Any]:
    """A lane that tries the replicas of ``first``, then those of ``spill``: a fixed order."""
    return policy_for(
        {"first": first, "spill": spill},
        lanes=[{"name": "all", "pool": "first", "spill_to": "spill"}],
        health={"interval_s": 60},
        **sections,
    )


class _SlowHeadersUpstream(FakeUpstream):
    """A replica that answers client requests only after ``delay_s`` (status line included)."""

    delay_s = 0.0

    async def _respond(
        self, method: str, path: str, headers: dict[str, str], raw: bytes, w: asyncio.StreamWriter
    ) -> None:
        if path == "/v1/chat/completions" and "x-tokenlane-canary" not in headers:
            await asyncio.sleep(self.delay_s)
        await super()._respond(method, path, headers, raw, w)


# -- retry.deadline_s ----------------------------------------------------------------------


def test_deadline_defaults_to_60s_must_be_positive_and_reloads_without_restart() -> None:
    policy = policy_from_text(POLICY, environ={})
    assert policy.retry.deadline_s == 60.0
    for bad in ("0", "-1", "soon"):
        with pytest.raises(PolicyError) as info:
            policy_from_text(POLICY + f"retry:\n  deadline_s: {bad}\n", environ={})
        assert [p.split(":")[0] for p in info.value.problems] == ["retry.deadline_s"]
    changed = policy_from_text(POLICY + "retry:\n  deadline_s: 2.5\n", environ={})
    assert changed.retry.deadline_s == 2.5
    assert restart_changes(policy, changed) == []


async def test_silent_replicas_fail_a_stream_at_the_deadline_not_after_every_attempt() -> None:
    async with running(tokens=3) as a, running(tokens=3) as b, running(tokens=3) as c:
        # The first attempt times out at 3 s; the second starts after that, so its own timeout
        # would come at 6 s or later, and the deadline at 5 s cuts it first (9 s without the
        # deadline: max_attempts stays 3). The 2 s between the first timeout and the deadline
        # let a paused machine still start the second attempt.
        policy = policy_for(
            {"p": [a.url, b.url, c.url]},
            lanes=[{"name": "all", "pool": "p", "first_token_timeout_s": 3.0}],
            health={"interval_s": 60},
            retry={"deadline_s": 5.0},
        )
        async with running_gateway(policy) as (url, app):
            for up in (a, b, c):
                up.first_token_delay_s = 60.0
            async with httpx.AsyncClient(timeout=60) as client:
                started = time.monotonic()
                r = await client.post(url + "/v1/chat/completions", json={**CHAT, "stream": True})
                elapsed = time.monotonic() - started
            assert r.status_code == 502
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert "deadline" in r.json()["error"]["message"], r.json()
            # Ended by the deadline, not before it; that no third attempt ran is counted below
            # (a paused machine stretches the time, never the count).
            assert elapsed > 4.9, elapsed
            assert chats(a) + chats(b) + chats(c) == 2
            retries = app.gateway.metrics.retries.labels("all", "first_token_timeout")
            assert retries._value.get() == 1


async def test_a_plain_attempt_outlives_the_deadline_but_no_retry_starts_after_it() -> None:
    slow = _SlowHeadersUpstream(tokens=3)
    await slow.start()
    try:
        async with running(tokens=3) as good:
            policy = first_then_spill([slow.url], [good.url], retry={"deadline_s": 0.3})
            async with running_gateway(policy) as (url, _):
                slow.delay_s = 0.6
                async with httpx.AsyncClient(timeout=10) as client:
                    # Not cut: a plain response arrives whole at the end of generation.
                    r = await client.post(url + "/v1/chat/completions", json=CHAT)
                    assert r.status_code == 200
                    assert r.headers["x-tokenlane-replica"] == slow.url.removeprefix("http://")
                    # Busy, but only after the deadline: answered as it is, not retried.
                    slow.fail_status = 503
                    r = await client.post(url + "/v1/chat/completions", json=CHAT)
                    assert r.status_code == 503
            assert chats(good) == 0
    finally:
        await slow.stop()


# -- resets ----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["close", "reset"])
async def test_a_reset_after_the_request_was_sent_is_not_retried_by_default(how: str) -> None:
    async with running(tokens=3) as closer, running(tokens=3) as good:
        async with running_gateway(first_then_spill([closer.url], [good.url])) as (url, app):
            closer.close_after_request = how
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(url + "/v1/chat/completions", json=CHAT)
            assert r.status_code == 502
            assert r.json()["error"]["type"] == "BadGatewayError"
            assert "closed the connection" in r.json()["error"]["message"]
            assert (chats(closer), chats(good)) == (1, 0)
            # Still a failure of the replica, towards health.consecutive_failures.
            assert app.gateway.fleet.find(closer.url)[0].failures_in_row == 1


async def test_a_reset_is_retried_once_elsewhere_with_on_5xx_after_send() -> None:
    async with running(tokens=3) as closer, running(tokens=3) as good:
        policy = first_then_spill([closer.url], [good.url], retry={"on_5xx_after_send": True})
        async with running_gateway(policy) as (url, app):
            closer.close_after_request = "reset"
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(url + "/v1/chat/completions", json=CHAT)
            assert r.status_code == 200
            assert r.headers["x-tokenlane-replica"] == good.url.removeprefix("http://")
            assert app.gateway.metrics.retries.labels("all", "upstream_5xx")._value.get() == 1
            assert app.gateway.metrics.retries.labels("all", "connect")._value.get() == 0


async def test_a_reset_after_send_is_retried_at_most_once() -> None:
    async with (
        running(tokens=3) as c1,
        running(tokens=3) as c2,
        running(tokens=3) as good,
    ):
        policy = first_then_spill(
            [c1.url, c2.url], [good.url], retry={"on_5xx_after_send": True, "max_attempts": 3}
        )
        async with running_gateway(policy) as (url, _):
            c1.close_after_request = c2.close_after_request = "close"
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(url + "/v1/chat/completions", json=CHAT)
            assert r.status_code == 502
            assert (chats(c1) + chats(c2), chats(good)) == (2, 0)


async def stream_cut_before_its_first_token(**sections: Any) -> tuple[httpx.Response, int, int]:
    """A stream whose first replica sends the status line and the role chunk, then drops the
    connection, under a policy of ``sections``: the client's answer, and the chat requests
    the cut replica and the spill replica received."""
    async with running(tokens=3) as cut, running(tokens=3) as good:
        async with running_gateway(first_then_spill([cut.url], [good.url], **sections)) as (
            url,
            _,
        ):
            cut.cut_after = 0
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(url + "/v1/chat/completions", json={**CHAT, "stream": True})
        return r, chats(cut), chats(good)


@pytest.mark.parametrize("opt_in", [False, True])
async def test_a_stream_cut_before_its_first_token_is_retried_only_on_opt_in(opt_in: bool) -> None:
    # Continuation off: the stream is not one it would carry (see the next test).
    r, _, good = await stream_cut_before_its_first_token(
        retry={"on_5xx_after_send": opt_in}, continuation={"enabled": False}
    )
    if opt_in:
        assert r.status_code == 200
        assert r.text.rstrip().endswith("data: [DONE]")
        assert good == 1
    else:
        assert r.status_code == 502
        assert good == 0


@pytest.mark.parametrize("attempts", [1, 0])
async def test_a_stream_continuation_would_carry_is_retried_once_after_a_reset_before_its_first_token(
    attempts: int,
) -> None:
    """One token later the reset would have been continued on another replica, so at token
    zero it is retried there, once, without the opt-in (docs/http.md); not when the policy
    allows no continuation (``max_attempts: 0``)."""
    r, cut, good = await stream_cut_before_its_first_token(
        continuation={"enabled": True, "max_attempts": attempts}
    )
    if attempts:
        assert r.status_code == 200
        assert r.text.rstrip().endswith("data: [DONE]")
        assert (cut, good) == (1, 1)
    else:
        assert r.status_code == 502
        assert (cut, good) == (1, 0)


async def test_an_idle_pooled_connection_is_not_reused_past_the_keepalive_expiry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM's uvicorn closes idle connections after 5 s; the gateway must give them up first.
    assert upstream.KEEPALIVE_EXPIRY_S < 5.0
    # Long enough that a pause of the machine between two requests cannot expire it.
    monkeypatch.setattr(upstream, "KEEPALIVE_EXPIRY_S", 2.0)
    client = upstream.make_client(build_policy(policy_for({"p": ["http://127.0.0.1:1"]})))
    try:
        async with running(tokens=2) as up:

            async def post() -> None:
                request = httpx.Request(
                    "POST", up.url + "/v1/chat/completions", json=CHAT, extensions={"timeout": {}}
                )
                response = await client.transport.handle_async_request(request)
                await response.aread()
                await response.aclose()

            await post()
            await post()
            assert up.stats.connections == 1  # reused while fresh
            await asyncio.sleep(2.5)  # past the expiry (a pause only makes it longer)
            await post()
            assert up.stats.connections == 2  # expired: a new connection
    finally:
        await client.aclose()
