"""Per-key token buckets without sockets: continuous refill, both limits or neither, OpenAI's
x-ratelimit-* headers and Go durations, reloads, and requests bigger than a minute's budget."""

from __future__ import annotations

import pytest

from proxy.config import RateLimitsConfig
from proxy.routing.ratelimit import LocalRateLimiter, TokenBucket, go_duration


def limiter(clock: list[float], **limits: int) -> LocalRateLimiter:
    cfg = [RateLimitsConfig(**limits)]
    lim = LocalRateLimiter(lambda: cfg[0], clock=lambda: clock[0])
    lim.cfg = cfg  # type: ignore[attr-defined]  # the test swaps it to mimic a reload
    return lim


def test_bucket_refills_continuously_up_to_its_capacity() -> None:
    b = TokenBucket.per_minute(60, now=0.0)
    b.level = 0.0
    b.refill(0.5)
    assert b.level == pytest.approx(0.5)
    b.refill(1000.0)
    assert b.level == 60.0


def test_bucket_wait_is_time_to_the_missing_tokens_and_inf_beyond_capacity() -> None:
    b = TokenBucket.per_minute(600, now=0.0)  # 10/s
    b.level = 5.0
    assert b.wait_s(5) == 0.0
    assert b.wait_s(25) == pytest.approx(2.0)
    assert b.wait_s(601) == float("inf")


def test_requests_per_min_allows_a_burst_then_refuses_until_refilled() -> None:
    clock = [0.0]
    lim = limiter(clock, requests_per_min=3)
    assert [lim.check("k", 0).allowed for _ in range(4)] == [True, True, True, False]
    refused = lim.check("k", 0)
    assert refused.retry_after_s == pytest.approx(20.0)  # one request every 20 s
    clock[0] = 20.0
    assert lim.check("k", 0).allowed


def test_keys_have_separate_budgets() -> None:
    lim = limiter([0.0], requests_per_min=1)
    assert lim.check("a", 0).allowed
    assert not lim.check("a", 0).allowed
    assert lim.check("b", 0).allowed


def test_a_request_refused_for_tokens_spends_no_request() -> None:
    lim = limiter([0.0], requests_per_min=2, tokens_per_min=100)
    assert lim.check("k", 90).allowed
    v = lim.check("k", 50)
    assert not v.allowed
    assert v.requests is not None and v.requests.remaining == 1
    assert v.tokens is not None and v.tokens.remaining == 10
    assert lim.check("k", 10).allowed


def test_refusal_headers_are_openai_shaped() -> None:
    clock = [0.0]
    lim = limiter(clock, requests_per_min=60, tokens_per_min=1000)
    lim.check("k", 400)
    clock[0] = 0.5
    v = lim.check("k", 700)
    assert not v.allowed
    assert v.headers() == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "500ms",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "608",
        "x-ratelimit-reset-tokens": "23.5s",
    }
    # 608.3 tokens left after 0.5 s of refill; 91.7 missing at 1000/60 per second
    assert v.retry_after_s == pytest.approx(5.5, rel=1e-3)


def test_only_configured_limits_have_headers() -> None:
    lim = limiter([0.0], tokens_per_min=10)
    assert set(lim.check("k", 1).headers()) == {
        "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens",
    }  # fmt: skip


def test_request_over_a_whole_minute_of_tokens_is_too_large() -> None:
    lim = limiter([0.0], tokens_per_min=100)
    v = lim.check("k", 101)
    assert not v.allowed and v.too_large and v.retry_after_s == 60.0
    assert lim.check("k", 100).allowed  # and it spent nothing


def test_reloaded_limit_resizes_buckets_keeping_what_is_left() -> None:
    clock = [0.0]
    lim = limiter(clock, requests_per_min=10)
    for _ in range(4):
        lim.check("k", 0)
    lim.cfg[0] = RateLimitsConfig(requests_per_min=3)  # type: ignore[attr-defined]
    v = lim.check("k", 0)
    assert v.allowed and v.requests is not None
    assert (v.requests.limit, v.requests.remaining) == (3, 2)
    lim.cfg[0] = RateLimitsConfig()  # type: ignore[attr-defined]
    assert not lim.enabled


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.0004, "1ms"), (0.12, "120ms"), (1, "1s"), (1.5, "1.5s"), (8.64, "8.64s"),
     (59.9999, "1m0s"), (360, "6m0s"), (3723, "1h2m3s")],
)  # fmt: skip
def test_go_duration_matches_openai_header_format(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text
