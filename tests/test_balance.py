"""Picking strategies, table-driven. Each property here is one a uniform random picker fails:
lighter replicas win, a hot prefix respects the load bound, keys stay put when the set changes."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

import pytest

from proxy.config import ReplicaConfig
from proxy.fleet.fleet import Replica, ReplicaState
from proxy.routing.balance import STRATEGIES, key_hash, pick, rendezvous_order


@dataclass(frozen=True)
class Cand:
    name: str
    load: float = 0.0


def cands(loads: list[float]) -> list[Cand]:
    return [Cand(f"r{i}", load) for i, load in enumerate(loads)]


def pick_affinity(candidates: list[Cand], key: str | None, bounded_load: float = 1.25) -> Cand:
    chosen = pick(
        "prefix_affinity",
        candidates,
        key=key,
        rng=random.Random(0),
        rr_index=0,
        bounded_load=bounded_load,
    )
    assert chosen is not None
    return chosen


# ------------------------------------------------------------------------- common


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pick_without_candidates_is_none(strategy: str) -> None:
    rng = random.Random(0)
    assert pick(strategy, [], key="k", rng=rng, rr_index=3, bounded_load=1.25) is None


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pick_single_candidate_is_that_candidate(strategy: str) -> None:
    only = Cand("only", 1000.0)
    rng = random.Random(0)
    assert pick(strategy, [only], key="k", rng=rng, rr_index=7, bounded_load=1.0) is only


def test_pick_unknown_strategy_raises() -> None:
    with pytest.raises(ValueError, match="unknown balance strategy 'fastest'"):
        pick("fastest", cands([0]), key=None, rng=random.Random(0), rr_index=0, bounded_load=1)


def test_pick_accepts_fleet_replicas() -> None:
    """fleet.Replica satisfies Candidate: its ``load`` (in-flight + scraped waiting) decides."""
    replicas = []
    for i, in_flight in enumerate((9, 2)):
        cfg = ReplicaConfig(url=f"http://r{i}:8000")
        r = Replica(pool="p", config=cfg, name=cfg.label, url=cfg.url, in_flight=in_flight)
        r.state = ReplicaState.HEALTHY
        replicas.append(r)
    rng = random.Random(0)
    for _ in range(50):
        chosen = pick("least_loaded", replicas, key=None, rng=rng, rr_index=0, bounded_load=1.25)
        assert chosen is replicas[1]


# ------------------------------------------------------------------------- round robin


def test_round_robin_cycles_through_candidates_in_order() -> None:
    cs = cands([5, 0, 9])
    rng = random.Random(0)
    got = [
        pick("round_robin", cs, key=None, rng=rng, rr_index=i, bounded_load=1).name  # type: ignore[union-attr]
        for i in range(7)
    ]
    assert got == ["r0", "r1", "r2", "r0", "r1", "r2", "r0"]


# ------------------------------------------------------------------------- least loaded

P2C_PICKS = 4000


@pytest.mark.parametrize(
    "loads",
    [
        pytest.param([0, 10], id="two: the lighter always"),
        pytest.param([5, 1, 9], id="three distinct"),
        pytest.param([0, 10, 10, 10, 10, 10, 10, 10], id="one idle among eight busy"),
        pytest.param([3, 1, 4, 1.5, 9, 2, 6, 5], id="eight distinct"),
        pytest.param(
            [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55], id="16 close"
        ),
    ],
)
def test_least_loaded_prefers_lighter_and_never_picks_heaviest(loads: list[float]) -> None:
    cs = cands(loads)
    rng = random.Random(42)
    counts = Counter(
        pick("least_loaded", cs, key=None, rng=rng, rr_index=0, bounded_load=1).name  # type: ignore[union-attr]
        for _ in range(P2C_PICKS)
    )
    n = len(cs)
    lightest = min(cs, key=lambda c: c.load).name
    heaviest = max(cs, key=lambda c: c.load)
    # Power of two choices: the lightest wins whenever it is drawn, P = 2/n (1 for n = 2);
    # a uniform picker gives it 1/n. A strictly heaviest one loses every comparison.
    expected = 1.0 if n == 2 else 2 / n
    assert counts[lightest] / P2C_PICKS > 0.85 * expected
    assert counts[lightest] / P2C_PICKS > 1.5 / n
    if sum(c.load == heaviest.load for c in cs) == 1:
        assert counts[heaviest.name] == 0


def test_least_loaded_ties_are_broken_by_the_rng() -> None:
    cs = cands([3, 3])
    picks = [
        pick("least_loaded", cs, key=None, rng=random.Random(7), rr_index=0, bounded_load=1)
        for _ in range(3)
    ]
    assert picks[0] is picks[1] is picks[2]  # same seed, same choice: the RNG decides
    rng = random.Random(7)
    counts = Counter(
        pick("least_loaded", cs, key=None, rng=rng, rr_index=0, bounded_load=1).name  # type: ignore[union-attr]
        for _ in range(2000)
    )
    assert 850 < counts["r0"] < 1150


def test_least_loaded_draws_two_distinct_candidates() -> None:
    # Loads all equal except one lighter: if the two draws could coincide, the lighter would
    # sometimes be "compared with itself" and its share would drop below 2/n - 1/n^2.
    cs = cands([1, 0, 1, 1])
    rng = random.Random(3)
    wins = sum(
        pick("least_loaded", cs, key=None, rng=rng, rr_index=0, bounded_load=1) is cs[1]
        for _ in range(20_000)
    )
    assert abs(wins / 20_000 - 0.5) < 0.02  # P(drawn among 2 distinct of 4) = 1/2 exactly


# ------------------------------------------------------------------------- prefix affinity


def test_prefix_affinity_same_key_same_replica() -> None:
    cs = cands([0] * 8)
    first = pick_affinity(cs, "system\nYou are a pirate.\n")
    for _ in range(20):
        assert pick_affinity(cs, "system\nYou are a pirate.\n") is first


def test_prefix_affinity_spreads_keys_uniformly() -> None:
    cs = cands([0] * 8)
    counts = Counter(pick_affinity(cs, f"key-{i}").name for i in range(10_000))
    assert set(counts) == {c.name for c in cs}
    for name, count in counts.items():
        assert 1250 * 0.85 < count < 1250 * 1.15, (name, count)


def test_prefix_affinity_removing_a_replica_moves_only_its_keys() -> None:
    before_set = [Cand(f"vllm-{i}:8000") for i in range(8)]
    removed = before_set[3]
    after_set = [c for c in before_set if c is not removed]
    keys = [f"user-{i}: hello there" for i in range(10_000)]
    moved_other = 0
    held_by_removed = 0
    for key in keys:
        before = pick_affinity(before_set, key).name
        after = pick_affinity(after_set, key).name
        if before == removed.name:
            held_by_removed += 1
        elif before != after:
            moved_other += 1
    assert moved_other == 0
    assert 0.8 / 8 < held_by_removed / len(keys) < 1.2 / 8


def test_prefix_affinity_adding_a_replica_moves_about_one_in_n_keys_to_it() -> None:
    old = [Cand(f"vllm-{i}:8000") for i in range(8)]
    new = [*old, Cand("vllm-8:8000")]
    moved = Counter()
    for i in range(10_000):
        key = f"conversation {i}"
        before = pick_affinity(old, key).name
        after = pick_affinity(new, key).name
        if before != after:
            moved[after] += 1
    assert set(moved) == {"vllm-8:8000"}  # every moved key went to the newcomer
    assert 0.8 / 9 < moved["vllm-8:8000"] / 10_000 < 1.2 / 9


def test_prefix_affinity_is_independent_of_candidate_order() -> None:
    cs = cands([0] * 6)
    for i in range(200):
        key = f"k{i}"
        shuffled = cs[:]
        random.Random(i).shuffle(shuffled)
        assert pick_affinity(cs, key) is pick_affinity(shuffled, key)


@pytest.mark.parametrize("n", [2, 5, 8])
@pytest.mark.parametrize("bounded_load", [1.0, 1.25, 2.0])
def test_prefix_affinity_hot_prefix_stays_within_bound(n: int, bounded_load: float) -> None:
    """One prefix sent 1,000 times, each pick adding one request to the chosen replica: no
    replica ever holds more than ceil(bounded_load x mean load), the bound balance.py states."""
    loads = [0] * n
    names = [f"replica-{i}" for i in range(n)]
    c = Fraction(bounded_load)
    for _ in range(1000):
        chosen = pick_affinity(
            [Cand(names[i], loads[i]) for i in range(n)], "system\nhot prompt", bounded_load
        )
        loads[names.index(chosen.name)] += 1
        total = sum(loads)
        assert max(loads) <= math.ceil(c * Fraction(total, n)), loads


def test_prefix_affinity_hot_prefix_keeps_its_home_while_within_bound() -> None:
    """Affinity is not least-loaded: the key's own replica keeps it while it fits the bound."""
    names = [f"replica-{i}" for i in range(4)]
    key = "system\nshared system prompt"
    home = rendezvous_order(key, names)[0]
    loads = {name: 10 for name in names}
    # cap = ceil(1.25 * (40 + 1) / 4) = 13: home takes requests while its load + 1 <= 13.
    for expected_load in (10, 11, 12):
        loads[home] = expected_load
        chosen = pick_affinity([Cand(n, loads[n]) for n in names], key)
        assert chosen.name == home


def test_prefix_affinity_overflow_goes_to_next_in_hash_order_not_the_lightest() -> None:
    names = ["a", "b", "c"]
    key = next(k for k in (f"key{i}" for i in range(1000)) if rendezvous_order(k, names) == names)
    # total 13, cap = ceil(1.25 * 14 / 3) = 6: a (10) is over, b (3) fits, c (0) is lighter.
    chosen = pick_affinity([Cand("a", 10), Cand("b", 3), Cand("c", 0)], key)
    assert chosen.name == "b"


def test_prefix_affinity_fractional_loads_fall_back_to_lightest() -> None:
    # total 1, cap = ceil(1.0 * 2 / 2) = 1; neither 0.25 + 1 nor 0.75 + 1 fits.
    cs = [Cand("x", 0.75), Cand("y", 0.25)]
    assert pick_affinity(cs, "any key", bounded_load=1.0).name == "y"


def test_prefix_affinity_without_key_falls_back_to_least_loaded() -> None:
    cs = cands([50, 0])
    rng = random.Random(0)
    for _ in range(50):
        assert (
            pick("prefix_affinity", cs, key=None, rng=rng, rr_index=0, bounded_load=1.25) is cs[1]
        )


def test_prefix_affinity_accepts_lone_surrogates_in_key() -> None:
    # json.loads('"\\ud800"') yields a lone surrogate; strict UTF-8 encoding would raise.
    assert pick_affinity(cands([0, 0]), "user\n\ud800 broken emoji") is not None


def test_rendezvous_hashing_is_stable_across_processes() -> None:
    """No dependence on PYTHONHASHSEED: two gateway instances place a key alike."""
    names = [f"vllm-{i}:8000" for i in range(6)]
    keys = ["", "system\nYou are helpful.\n", "ключ", "x" * 2000]
    script = (
        "import json, sys\n"
        "from proxy.routing.balance import key_hash, rendezvous_order\n"
        "names, keys = json.loads(sys.argv[1])\n"
        "print(json.dumps([[key_hash(k), rendezvous_order(k, names)] for k in keys]))\n"
    )
    here = [[key_hash(k), rendezvous_order(k, names)] for k in keys]
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", script, json.dumps([names, keys])],
            capture_output=True,
            text=True,
            env=env,
            check=True,
            timeout=60,
        )
        assert json.loads(out.stdout) == here
