"""The cache_aware balance: the prefix index, the pure decision, and the router's bookkeeping.

Each table row is a property a uniform or least-loaded picker fails: a cached prefix attracts its
prompts, a new prefix goes where there is room, a hot prefix grows onto an idle replica."""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from proxy.config import CacheAwareConfig, PoolConfig, ReplicaConfig
from proxy.fleet.fleet import Fleet, Replica
from proxy.fleet.vllm import EngineSample
from proxy.observe.metrics import Metrics
from proxy.policyfile import build_policy
from proxy.routing import cache_aware
from proxy.routing.cache_aware import CacheAwareRouter, View, decide
from proxy.routing.prefix_index import ENTRY_BYTES, PrefixIndex, text_block_hashes

CFG = CacheAwareConfig()  # miss_weight 1.5, request_tokens 64

# ------------------------------------------------------------------------- block hashes


def test_hashes_are_chained_over_full_blocks_only() -> None:
    a = text_block_hashes("abcdefgh" * 4 + "xyz", 8)
    assert len(a) == 4  # the 3-char tail is no full block
    # Equal blocks at different positions hash differently: the parent is part of the hash.
    assert len(set(a)) == 4
    b = text_block_hashes("abcdefgh" * 2 + "ZZZZZZZZ" + "abcdefgh", 8)
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]


def test_hashes_agree_for_ascii_and_unicode_paths_and_across_calls() -> None:
    text = "héllo wörld " * 20
    assert text_block_hashes(text, 16) == text_block_hashes(text, 16)
    assert text_block_hashes("a" * 64, 16, max_blocks=2) == text_block_hashes("a" * 64, 16)[:2]


# ------------------------------------------------------------------------- the index


def test_index_matches_the_longest_prefix() -> None:
    ix = PrefixIndex(100)
    ix.touch([1, 2, 3, 4])
    assert ix.match([1, 2, 3, 4, 5]) == 4
    assert ix.match([1, 2, 9]) == 2
    assert ix.match([9, 2, 3]) == 0
    assert ix.match([]) == 0


def test_index_evicts_least_recent_tail_first() -> None:
    ix = PrefixIndex(6)
    ix.touch([1, 2, 3, 4])  # a prefix of four blocks
    ix.touch([10, 11])
    ix.touch([20])  # one over: the oldest prompt's tail goes, its head stays
    assert len(ix) == 6 and ix.evictions == 1
    assert ix.match([1, 2, 3, 4]) == 3
    ix.touch([1, 2, 30, 31])  # the shared head becomes most recent again; two must go:
    assert ix.match([1, 2, 30, 31]) == 4
    assert ix.match([1, 2, 3]) == 2  # the old tail block 3 (least recent) ...
    assert ix.match([10, 11]) == 1  # ... and the other prompt's tail, 11 (touched before 10)


def test_index_resize_evicts_at_once() -> None:
    ix = PrefixIndex(10)
    ix.touch(list(range(10)))
    ix.resize(4)
    assert len(ix) == 4 and ix.match([0, 1, 2, 3]) == 4
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_index_memory_is_bounded_and_as_measured() -> None:
    """The index never holds more than its capacity, and ENTRY_BYTES is what an entry costs."""
    rng = random.Random(1)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        ix = PrefixIndex(20_000)
        for _ in range(500):
            ix.touch([rng.getrandbits(64) for _ in range(100)])
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    assert len(ix) == 20_000
    used = sum(s.size_diff for s in after.compare_to(before, "filename"))
    per_entry = used / len(ix)
    assert 0.6 * ENTRY_BYTES < per_entry < 1.4 * ENTRY_BYTES, per_entry
    assert ix.nbytes == ENTRY_BYTES * 20_000


# ------------------------------------------------------------------------- the decision


def v(name: str, matched: float = 0, queued: float = 0, requests: float = 0, headroom: int = 100):
    return View(name, matched, queued, requests, headroom)


# (views, prompt tokens, expected winner, expected reason)
CASES = [
    # The replica holding the prefix wins while idle elsewhere too.
    ([v("a"), v("b", matched=1536), v("c")], 1664, "b", "longest_match"),
    # Longer match beats shorter one at equal load.
    ([v("a", matched=512), v("b", matched=1536)], 1664, "b", "longest_match"),
    # Nobody holds it: the least loaded takes it ...
    ([v("a", requests=3), v("b", requests=1), v("c", requests=2)], 1664, "b", "new_prefix"),
    # ... and among equally loaded ones the one with the most free index room.
    ([v("a", headroom=10), v("b", headroom=500), v("c", headroom=50)], 1664, "b", "new_prefix"),
    # Queued prefill tokens count, not only request counts: one long queued prompt outweighs
    # two short ones.
    ([v("a", queued=8000, requests=1), v("b", queued=200, requests=2)], 1664, "b", "new_prefix"),
    # A hot prefix stays home while its queue is shorter than the prefill it saves ...
    ([v("a", matched=1536, queued=1000, requests=4), v("b")], 1664, "a", "longest_match"),
    # ... and grows onto an idle replica once the queue outweighs a full prefill there.
    ([v("a", matched=1536, queued=3000, requests=6), v("b")], 1664, "b", "replicated"),
    # Once copied, the copy and the home share the load.
    (
        [v("a", matched=1536, queued=900, requests=5), v("b", matched=1536)],
        1664,
        "b",
        "longest_match",
    ),
    # A match longer than the prompt estimate is capped by it (no negative cost).
    ([v("a", matched=5000), v("b")], 1000, "a", "longest_match"),
]


@pytest.mark.parametrize(("views", "prompt", "winner", "reason"), CASES)
def test_decide(views: list[View], prompt: float, winner: str, reason: str) -> None:
    verdict = decide(views, prompt, CFG, random.Random(0))
    assert views[verdict.index].name == winner
    assert verdict.reason == reason
    assert winner in verdict.describe()
    assert [r.name for r in verdict.rows] == [x.name for x in views]


def test_miss_weight_sets_how_sticky_a_prefix_is() -> None:
    views = [v("a", matched=1536, queued=2000), v("b")]
    sticky = CacheAwareConfig(miss_weight=2.0)
    loose = CacheAwareConfig(miss_weight=1.0)
    assert views[decide(views, 1664, sticky, random.Random(0)).index].name == "a"
    assert views[decide(views, 1664, loose, random.Random(0)).index].name == "b"


def test_exact_ties_are_broken_by_the_rng_not_by_position() -> None:
    views = [v("a"), v("b"), v("c")]
    won = {views[decide(views, 100, CFG, random.Random(s)).index].name for s in range(50)}
    assert won == {"a", "b", "c"}


# ------------------------------------------------------------------------- the router


@dataclass
class FakeProfile:
    prompt_head: str
    prompt_chars: int
    prompt_tokens_est: int


@dataclass(eq=False)
class FakeCall:
    request_id: str
    profile: FakeProfile
    ttft_s: float | None = None
    finished: bool = False
    prefix_match_tokens: int | None = None
    prompt_token_ids: list[int] | None = None


def replica(name: str) -> Replica:
    r = Replica(
        pool="p", config=ReplicaConfig(url=f"http://{name}"), name=name, url=f"http://{name}"
    )
    r.stats.stale = False
    return r


def prompt(group: int, question: int) -> FakeProfile:
    system = f"system prompt of group {group:03d} " * 200  # ~5.6 K characters
    text = system + f"question {question} " * 20
    return FakeProfile(text, len(text), len(text) // 4)


def test_router_groups_stay_home_and_spread_over_the_pool() -> None:
    router = CacheAwareRouter()
    reps = [replica(f"r{i}") for i in range(4)]
    rng = random.Random(0)
    homes: dict[int, set[str]] = {}
    n = 0
    for q in range(4):
        for g in range(8):
            n += 1
            call = FakeCall(f"c{n}", prompt(g, q))
            chosen, verdict = router.pick(reps, call, CFG, 4.0, rng)  # type: ignore[arg-type,misc]
            call.ttft_s = 0.1  # answered before the next one arrives: no queue builds up
            homes.setdefault(g, set()).add(chosen.name)
            if q > 0:
                assert verdict.reason == "longest_match"
                assert call.prefix_match_tokens and call.prefix_match_tokens > 1000
    assert all(len(h) == 1 for h in homes.values())  # each group kept its replica
    assert len({next(iter(h)) for h in homes.values()}) == 4  # and the groups used all four


def test_router_counts_unanswered_prefill_and_replicates_a_hot_prefix() -> None:
    router = CacheAwareRouter()
    reps = [replica("r0"), replica("r1")]
    rng = random.Random(0)
    chosen = []
    calls = []
    for q in range(12):  # one group, nobody answered yet: the home's queue grows
        call = FakeCall(f"c{q}", prompt(0, q))
        calls.append(call)
        r, _ = router.pick(reps, call, CFG, 4.0, rng)  # type: ignore[arg-type,misc]
        r.in_flight += 1
        chosen.append(r.name)
    assert len(set(chosen)) == 2, chosen  # the prefix grew onto the second replica
    queued = router.queued_by_replica()
    assert sum(queued.values()) > 0
    for call in calls:
        call.finished = True
    assert router.queued_by_replica() == {}  # answered calls leave the ledger


def test_router_sizes_the_index_from_the_replica_kv_capacity() -> None:
    router = CacheAwareRouter()
    r = replica("r0")
    assert router.capacity_blocks(r, CFG) == int(1_000_000 * 0.9) // 64  # policy default
    r.stats.sample = EngineSample(num_gpu_blocks=2200, block_size=16)
    assert router.capacity_blocks(r, CFG) == int(2200 * 16 * 0.9) // 64
    ix = router.index(r, CFG)
    assert ix.capacity == 495


# ------------------------------------------------------------------------- the policy


def test_cache_aware_pools_see_a_long_prompt_head_by_default() -> None:
    reps = [{"url": "http://a"}]
    assert PoolConfig(balance="cache_aware", replicas=reps).prefix_chars == 65_536
    assert PoolConfig(balance="cache_aware", prefix_chars=999, replicas=reps).prefix_chars == 999
    assert PoolConfig(balance="least_loaded", replicas=reps).prefix_chars == 1024
    with pytest.raises(ValueError):
        PoolConfig(balance="cache_aware", replicas=reps, cache_aware={"block_tokenz": 3})


def test_the_scrape_reads_the_kv_capacity_from_cache_config_info() -> None:
    from pathlib import Path

    from proxy.fleet.vllm import parse_metrics

    fixture = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "vllm_metrics_v1.txt"
    base = (
        "vllm:num_requests_running 0\nvllm:prompt_tokens_total 1\nvllm:generation_tokens_total 1\n"
    )
    # hash_block_size must not be read as block_size, whatever the label order.
    info = 'vllm:cache_config_info{hash_block_size="64",num_gpu_blocks="2200",block_size="16"} 1\n'
    sample = parse_metrics(base + info)
    assert (sample.num_gpu_blocks, sample.block_size) == (2200, 16)
    assert parse_metrics(base).num_gpu_blocks == 0
    if fixture.exists():
        assert parse_metrics(fixture.read_text()).num_gpu_blocks == 383_948


def test_explain_shows_the_match_per_candidate_and_why(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    import yaml

    from proxy.cli import main

    policy = {
        "pools": {
            "p": {
                "balance": "cache_aware",
                "replicas": [
                    {"url": "http://a:1", "name": "a"},
                    {"url": "http://b:1", "name": "b"},
                ],
            }
        },
        "lanes": [{"name": "all", "pool": "p"}],
    }
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(yaml.safe_dump(policy))
    system = {"role": "system", "content": "You answer questions about the sea. " * 80}
    first = tmp_path / "first.json"
    first.write_text(json.dumps({"messages": [system, {"role": "user", "content": "why?"}]}))
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"messages": [system, {"role": "user", "content": "how?"}]}))
    assert main(["explain", "--config", str(cfg), str(req), "--after", str(first), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (ca,) = out["cache_aware"]
    matched = {c["name"]: c["matched_tokens"] for c in ca["candidates"]}
    # The earlier request's replica holds the shared system prompt; the other holds nothing.
    assert sorted(matched.values())[0] == 0 and sorted(matched.values())[1] > 500
    assert ca["winner"] == max(matched, key=matched.__getitem__)
    assert ca["reason"] == "longest_match" and ca["winner"] in ca["why"]


# ------------------------------------------------------------- placements made elsewhere


def cache_aware_fleet() -> Fleet:
    policy = build_policy(
        {
            "pools": {
                "p": {
                    "balance": "cache_aware",
                    "replicas": [{"url": "http://r0"}, {"url": "http://r1"}, {"url": "http://r2"}],
                },
                "q": {"replicas": [{"url": "http://r0"}]},
            },
            "lanes": [{"name": "all", "pool": "p"}],
        }
    )
    fleet = Fleet(policy, {}, metrics=Metrics())
    for r in fleet.replicas():
        r.stats.stale = False
    return fleet


def test_a_placement_shared_by_one_gateway_is_matched_by_another() -> None:
    """What one process picks, another learns (``share`` → ``learn``), and its own pick then
    matches the prefix on the same replica instead of treating it as new."""
    a, b = cache_aware_fleet(), cache_aware_fleet()
    shared: list[tuple[str, str, list[int]]] = []

    def share(pool: str, url: str, hashes: Sequence[int]) -> None:
        shared.append((pool, url, list(hashes)))
        cache_aware.learn(b, pool, url, hashes)

    first = FakeCall("c1", prompt(7, 0))
    home = cache_aware.pick(a, Metrics(), 4.0, "p", a.pools["p"].replicas, first, random.Random(0), share)  # type: ignore[arg-type]  # fmt: skip
    assert home is not None and [(p, u) for p, u, _ in shared] == [("p", home.url)]
    assert shared[0][2] and all(isinstance(h, int) for h in shared[0][2])
    again = FakeCall("c2", prompt(7, 1))
    picked = cache_aware.router_for(b, "p").pick(b.pools["p"].replicas, again, CFG, 4.0, random.Random(1))  # type: ignore[arg-type]  # fmt: skip
    assert picked is not None
    chosen, verdict = picked
    assert (chosen.url, verdict.reason) == (home.url, "longest_match")
    assert again.prefix_match_tokens and again.prefix_match_tokens > 1000


def test_a_placement_for_a_pool_or_replica_this_gateway_lacks_is_ignored() -> None:
    fleet = cache_aware_fleet()
    cache_aware.learn(fleet, "gone", "http://r0", [1, 2])  # no such pool (not reloaded yet)
    cache_aware.learn(fleet, "q", "http://r0", [1, 2])  # not a cache_aware pool
    cache_aware.learn(fleet, "p", "http://elsewhere", [1, 2])  # no such replica
    assert cache_aware.snapshot(fleet) == {}
    cache_aware.learn(fleet, "p", "http://r1", [1, 2])
    assert cache_aware.snapshot(fleet) == {"p": {"http://r1": [2, 1]}}  # head most recent


def test_a_starting_worker_takes_over_the_indexes_in_their_order() -> None:
    old, new = cache_aware_fleet(), cache_aware_fleet()
    for blocks in ([1, 2, 3], [4, 5], [1, 9]):
        cache_aware.learn(old, "p", "http://r2", blocks)
    cache_aware.learn(old, "p", "http://r0", [6])
    taken = cache_aware.snapshot(old)
    assert taken["p"]["http://r2"] == [3, 2, 5, 4, 9, 1]  # least recent first
    cache_aware.adopt(new, taken)
    assert cache_aware.snapshot(new) == taken
