"""Summaries of load-test results: percentiles, goodput, per-class tables; hand-made results."""

from __future__ import annotations

import pytest

from loadtest.bench_overhead import turn
from loadtest.bench_workers import RateResult, arrived_by, start_delay, windowed
from loadtest.stats import (
    CONNECT_ERROR,
    HTTP_ERROR,
    OK,
    STREAM_ERROR,
    RequestResult,
    format_summary,
    goodput,
    lateness,
    percentile,
    summarize,
)


def res(cls="light", *, outcome=OK, status=200, ttft=0.05, slo=None, itl=(), e2e=0.2, i=0, **kw):
    return RequestResult(
        index=i,
        cls=cls,
        stream=True,
        prompt_tokens=128,
        max_tokens=32,
        scheduled_s=kw.pop("scheduled_s", 0.0),
        ttft_slo_s=slo,
        outcome=outcome,
        status=status,
        ttft_s=ttft,
        itl_s=list(itl),
        e2e_s=e2e,
        **kw,
    )


def test_percentile_interpolates_between_ranks_like_numpy():
    values = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(values, 0) == 1 and percentile(values, 100) == 10
    assert percentile(reversed(values), 50) == pytest.approx(5.5)  # order does not matter
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_goodput_counts_completed_requests_within_their_slo():
    results = [
        res(ttft=0.05, slo=0.1),  # met
        res(ttft=0.1, slo=0.1),  # met: the objective is inclusive
        res(ttft=0.2, slo=0.1),  # too slow
        res(outcome=HTTP_ERROR, status=429, ttft=None, slo=0.1),  # failed
        res(ttft=5.0, slo=None),  # no objective: completing is enough
        res(outcome=STREAM_ERROR, ttft=0.01, slo=None),  # failed mid-stream
    ]
    assert goodput(results) == pytest.approx(3 / 6)
    assert goodput([]) is None


def test_summary_is_per_class_with_status_counts_and_latencies_of_completed_only():
    results = [
        res("light", ttft=0.010, itl=[0.005, 0.007], e2e=0.1, slo=0.05),
        res("light", ttft=0.030, itl=[0.006], e2e=0.2, slo=0.05),
        res("light", outcome=HTTP_ERROR, status=503, ttft=None, e2e=0.001, slo=0.05),
        res("heavy", ttft=1.0, itl=[0.02] * 3, e2e=3.0, usage_completion_tokens=256),
        res("heavy", outcome=CONNECT_ERROR, status=0, ttft=None, e2e=None),
    ]
    s = summarize(results, duration_s=2.0)
    assert list(s["classes"]) == ["light", "heavy"]
    light = s["classes"]["light"]
    assert (light["n"], light["ok"], light["met_slo"]) == (3, 2, 2)
    assert light["statuses"] == {"200": 2, "503": 1}
    assert light["ttft_s"]["p50"] == pytest.approx(0.020)
    assert light["ttft_s"]["n"] == 2  # the 503 has no TTFT to count
    assert light["itl_s"]["n"] == 3 and light["itl_s"]["max"] == pytest.approx(0.007)
    assert light["goodput"] == pytest.approx(2 / 3)
    assert light["goodput_rps"] == pytest.approx(1.0)
    assert light["ttft_slo_s"] == 0.05
    heavy = s["classes"]["heavy"]
    assert heavy["statuses"] == {"200": 1, "connect_error": 1}
    assert heavy["output_tokens"] == 256 and heavy["output_tokens_per_s"] == pytest.approx(128)
    assert s["all"]["n"] == 5 and s["all"]["goodput"] == pytest.approx(3 / 5)


def test_output_tokens_prefer_reported_usage_over_counted_chunks():
    assert res(content_chunks=7).output_tokens == 7
    assert res(content_chunks=7, usage_completion_tokens=9).output_tokens == 9


def test_lateness_measures_the_generator_behind_schedule():
    results = [res(scheduled_s=1.0, start_s=1.001), res(scheduled_s=2.0, start_s=2.5)]
    assert lateness(results)["max_s"] == pytest.approx(0.5)


def test_format_summary_has_a_row_per_class_and_the_statuses():
    results = [
        res("light", slo=0.1),
        res("heavy", ttft=2.0),
        res("heavy", outcome=HTTP_ERROR, status=429),
    ]
    text = format_summary(summarize(results))
    lines = text.splitlines()
    assert lines[0].startswith("class")
    assert lines[1].split()[:3] == ["light", "1", "1"]
    assert lines[2].split()[:3] == ["heavy", "2", "1"]
    assert lines[3].split()[:3] == ["all", "3", "2"]
    assert "2000/2000/2000" in lines[2]  # TTFT in ms
    assert lines[-1] == "status: 200 x2, 429 x1"


def test_result_json_row_summarises_inter_token_gaps():
    row = res(itl=[0.01, 0.03, 0.02], headers={"x-tokenlane-lane": "short"}).to_json()
    assert row["class"] == "light" and row["headers"] == {"x-tokenlane-lane": "short"}
    assert row["itl"]["n"] == 3 and row["itl"]["p50_s"] == pytest.approx(0.02)
    assert row["itl"]["max_s"] == pytest.approx(0.03)
    assert row["met_slo"] is True


def test_the_scaling_benchmark_counts_the_chunks_that_came_within_the_window() -> None:
    """``bench_workers``' delivered rate counts chunks by when they arrived, not the whole
    streams begun while the load was offered (which made it step with how many streams each
    client fitted in the window)."""
    assert arrived_by([], 1.0) == 0
    assert arrived_by([0.5, 1.0, 1.5, 2.0], 1.0) == 2  # one at the deadline counts
    assert arrived_by([0.5, 0.9], 1.0) == 2 and arrived_by([1.1], 1.0) == 0
    r = RateResult(chunks=400, in_window=300, window_s=10.0, seconds=13.0)
    assert r.summary()["chunks_per_s"] == 30.0


def test_the_scaling_benchmark_measures_from_when_every_client_has_begun() -> None:
    """``bench_workers`` spreads its clients' first streams over a stream's life and opens its
    window when the last has begun: chunks and gaps before it are not the steady load's."""
    assert [start_delay(i, 4, 3.2) for i in range(4)] == pytest.approx([0.0, 0.8, 1.6, 2.4])
    # A stream that began before the window, ended after its deadline.
    chunks, in_window, gaps = windowed([0.5, 1.0, 1.5, 2.0, 2.5], begin=1.2, deadline=2.0)
    assert (chunks, in_window) == (3, 2)  # 1.5, 2.0, 2.5 from the window on; 2.5 after it
    assert gaps == pytest.approx([500.0, 500.0, 500.0])  # the gap spanning the opening counts
    assert windowed([0.1, 0.2], begin=1.0, deadline=2.0) == (0, 0, [])  # over before it opened
    chunks, in_window, gaps = windowed([1.0, 1.1], begin=0.5, deadline=2.0)
    assert (chunks, in_window) == (2, 2) and gaps == pytest.approx([100.0])  # first: no gap


def test_the_peers_are_measured_in_turns() -> None:
    """``bench_overhead --peer`` measures every gateway once a round, each round's order turned
    by one: over as many rounds as gateways, each is measured in every place once."""
    names = ["direct", "nginx", "router", "tokenlane"]
    rounds = [turn(names, r) for r in range(4)]
    assert rounds[0] == names and rounds[1] == ["nginx", "router", "tokenlane", "direct"]
    for place in range(4):
        assert sorted(r[place] for r in rounds) == sorted(names)
    assert all(sorted(r) == sorted(names) for r in rounds)
    assert turn(names, 5) == rounds[1] and turn([], 3) == []
