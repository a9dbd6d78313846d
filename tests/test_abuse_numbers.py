"""Client-chosen numbers the gateway does arithmetic with: ``max_tokens: 10**400`` (or a huge
``n``) must not overflow a rate limiter into a 500. A cost beyond a whole minute's budget is
refused as too large (429 in OpenAI's shape, as for any request over the limit), whatever its
size; with no limits the body is vLLM's to judge and is forwarded."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from loadtest.fake_upstream import running
from proxy.config import RateLimitsConfig
from proxy.routing.ratelimit import LocalRateLimiter, RateLimiter
from proxy.state.leases import Lease, LeasedRateLimiter

from .gateway import policy_for, running_gateway

KEY = "sk-alpha-0123456789"
CHAT = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "messages": [{"role": "user", "content": "hi"}]}
HUGE = (10**400, 10**4000, 2**1024, 2**1023 * 3)  # beyond a float, or at its edge


class _Holder:
    """A lease holder that is up (no Redis behind it)."""

    instances = 1
    up = True

    def clock(self) -> float:
        return 0.0

    def wake_leases(self) -> None:
        pass


def _local(cfg: RateLimitsConfig) -> RateLimiter:
    return LocalRateLimiter(lambda: cfg, clock=lambda: 0.0)


def _leased(cfg: RateLimitsConfig) -> RateLimiter:
    lim = LeasedRateLimiter(_Holder(), lambda: cfg)
    lim.leases[("tokens", "k")] = Lease(stock=1000.0, left=0.0)
    lim.leases[("requests", "k")] = Lease(stock=1000.0, left=0.0)
    return lim


@pytest.mark.parametrize("make", [_local, _leased], ids=["local", "leased"])
@pytest.mark.parametrize("tokens", HUGE, ids=["1e400", "1e4000", "2^1024", "3*2^1023"])
def test_a_cost_beyond_any_float_is_too_large_not_an_overflow(make: Any, tokens: int) -> None:
    lim = make(RateLimitsConfig(requests_per_min=100, tokens_per_min=1000))
    verdict = lim.check("k", tokens)
    assert not verdict.allowed and verdict.too_large and verdict.retry_after_s == 60.0
    # Nothing was spent: a request that fits still passes, and the budget is intact.
    ok = lim.check("k", 10)
    assert ok.allowed and ok.tokens is not None and ok.tokens.remaining == 990


@pytest.mark.parametrize("make", [_local, _leased], ids=["local", "leased"])
def test_a_cost_just_within_the_budget_still_passes(make: Any) -> None:
    lim = make(RateLimitsConfig(tokens_per_min=1000))
    assert lim.check("k", 1000).allowed
    assert lim.check("k", 1001).too_large


@pytest.mark.parametrize(
    "extra",
    [
        {"max_tokens": 10**400},
        {"max_completion_tokens": 10**400},
        {"n": 10**400, "max_tokens": 16},
        {"n": 10**300, "max_tokens": 10**300},  # each fits a float, their product does not
    ],
    ids=["max_tokens", "max_completion_tokens", "n", "product"],
)
async def test_a_huge_number_is_a_429_too_large_over_a_real_socket(extra: dict[str, int]) -> None:
    async with running(tokens=3) as up:
        policy = policy_for({"p": [up.url]}, rate_limits={"tokens_per_min": 1000})
        env = {"TOKENLANE_API_KEYS": KEY}
        async with running_gateway(policy, environ=env) as (url, _):
            headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
            async with httpx.AsyncClient(base_url=url, headers=headers, timeout=10) as client:
                huge = await client.post("/v1/chat/completions", content=json.dumps(CHAT | extra))
                after = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8})
    assert huge.status_code == 429, huge.text
    error = huge.json()["error"]
    assert error["type"] == "RateLimitError" and "too large" in error["message"]
    assert huge.headers["retry-after"] == "60"
    assert after.status_code == 200  # the refused request spent nothing, the gateway serves on
