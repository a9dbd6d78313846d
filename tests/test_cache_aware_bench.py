"""bench_cache's virtual-time mode: the gateway's decision code over the simulator's scheduler.

A small workload, so the test is quick; the property is the one the benchmark is for: keeping a
group on the replica that caches its prefix turns repeat prompts into cache hits."""

from __future__ import annotations

from loadtest.bench_cache import Workload, requests_for, run_virtual

SMALL = Workload(groups=4, per_group=4, system_tokens=256, question_tokens=32, output_tokens=4)


def test_requests_share_the_group_prefix_and_differ_after_it() -> None:
    reqs = requests_for(SMALL, "salt", 1)
    assert len(reqs) == 16
    systems = {r[0]["content"] for r in reqs}
    assert len(systems) == 4  # one system prompt per group
    assert len({r[1]["content"] for r in reqs}) == 16  # every question its own


def test_cache_aware_hits_more_than_round_robin_and_loses_nothing() -> None:
    rr = run_virtual("round_robin", SMALL, 1)
    ca = run_virtual("cache_aware", SMALL, 1)
    for row in (rr, ca):
        assert row["errors"] == 0
        assert sum(row["per_replica"]) == 16
    assert ca["hit_rate"] > rr["hit_rate"]
    assert ca["ttft_mean_ms"] <= rr["ttft_mean_ms"]
