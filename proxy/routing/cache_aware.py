"""The ``cache_aware`` balance: send a prompt where its prefix is cached, unless waiting there
costs more than prefilling it elsewhere.

Every candidate is priced in prefill tokens, the unit that decides time to first token::

    cost = miss_weight * uncached + queued + request_tokens * requests

- ``uncached``: the prompt tokens this replica would have to prefill, i.e. the prompt minus the
  longest prefix the replica's index holds (``prefix_index.py``);
- ``queued``: prefill tokens this gateway sent to the replica that have not produced a first
  token yet (known at once, unlike a scrape);
- ``requests``: the replica's ``load`` (in flight from every gateway plus its scraped waiting
  queue), each request costing ``request_tokens`` (its decode steps slow everyone's batch).

The cheapest candidate wins; ties go to the longer match, then to the replica whose index has the
most headroom, then to the RNG. What follows from the one formula:

- a new prefix (no match anywhere) goes to the least busy replica, and among idle ones to the one
  with the most room, so groups spread over the pool instead of evicting each other;
- a known prefix stays where it is cached while that replica's queue is shorter than the
  prefill it saves (``miss_weight`` > 1 makes it stickier: a replica that prefills a stranger's
  prefix also evicts someone else's);
- a hot prefix grows onto another replica once its home's queue outweighs a full prefill there:
  the copy is indexed on the new replica, and from then on both match and share the load.

``decide`` is the pure part (table-tested); ``CacheAwareRouter`` holds the per-replica indexes and
the queued-token ledger of one pool and is what the relay calls.

Placements are shared: every pick is handed to shared state (``SharedState.share_placement``),
which tells the serve's other workers and, with Redis, the other instances; they ``learn`` it
into their own indexes. So each index holds what the whole gateway sent, not one process's
share of it. The queued-token ledger stays per process: it covers only the instants between a
pick and its first token, and the replicas' ``load`` (shared) carries the rest.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from proxy.config import CacheAwareConfig
from proxy.routing.kv_blocks import KvBlockSet, token_block_keys
from proxy.routing.prefix_index import PrefixIndex, text_block_hashes

if TYPE_CHECKING:
    from proxy.fleet.fleet import Fleet, Replica
    from proxy.observe.metrics import Metrics
    from proxy.relay.call import Call

__all__ = [
    "CacheAwareRouter",
    "PreciseFeed",
    "PreciseFeeds",
    "Row",
    "Verdict",
    "View",
    "decide",
    "learn",
    "router_for",
]

DEFAULT_BLOCK_SIZE = 16  # vLLM's --block-size, until a replica's events say otherwise


class PreciseFeed(Protocol):
    """A replica's real block set, from its KV events (``proxy.fleet.kv_events``)."""

    blocks: KvBlockSet

    def live(self, now: float, stale_s: float) -> bool: ...

    def sent(self, now: float) -> None: ...


class PreciseFeeds(Protocol):
    def feed(self, replica: Replica) -> PreciseFeed | None: ...


@dataclass(frozen=True, slots=True)
class View:
    """What the decision sees of one candidate."""

    name: str
    matched_tokens: float  # the longest cached prefix of this prompt, in tokens
    queued_tokens: float  # prefill tokens sent here and not yet answered
    requests: float  # in flight + waiting (the replica's ``load``)
    headroom: int  # free index blocks: room for a new prefix without evicting


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    matched_tokens: int
    cost: float


@dataclass(frozen=True, slots=True)
class Verdict:
    index: int  # into the views
    # longest_match: the chosen replica holds the longest prefix and is the cheapest;
    # new_prefix: nobody holds any of it, the cheapest (then roomiest) takes it;
    # replicated: a replica with a longer match was busier by more than the prefill saved.
    reason: str
    rows: tuple[Row, ...]

    def describe(self) -> str:
        won = self.rows[self.index]
        best = max(self.rows, key=lambda r: r.matched_tokens)
        if self.reason == "replicated":
            return (
                f"{won.name}: {best.name} holds {best.matched_tokens} tokens but costs "
                f"{best.cost:.0f} against {won.cost:.0f} here (matched {won.matched_tokens})"
            )
        if self.reason == "new_prefix":
            return f"{won.name}: no replica holds this prefix; cheapest ({won.cost:.0f}), most room"
        return f"{won.name}: longest match ({won.matched_tokens} tokens), cost {won.cost:.0f}"


def decide(
    views: Sequence[View], prompt_tokens: float, cfg: CacheAwareConfig, rng: random.Random
) -> Verdict:
    """The cheapest candidate by the module's cost formula. ``views`` is not empty."""
    rows = []
    best_i = -1
    best_key: tuple[float, float, int, float] | None = None
    for i, v in enumerate(views):
        matched = min(v.matched_tokens, prompt_tokens)
        cost = (
            cfg.miss_weight * (prompt_tokens - matched)
            + v.queued_tokens
            + cfg.request_tokens * v.requests
        )
        rows.append(Row(v.name, int(matched), cost))
        # Lower is better in every position; the RNG draw only separates exact ties.
        key = (cost, -matched, -v.headroom, rng.random())
        if best_key is None or key < best_key:
            best_key, best_i = key, i
    longest = max(r.matched_tokens for r in rows)
    if longest == 0:
        reason = "new_prefix"
    elif rows[best_i].matched_tokens >= longest:
        reason = "longest_match"
    else:
        reason = "replicated"
    return Verdict(best_i, reason, tuple(rows))


class CacheAwareRouter:
    """One pool's indexes (one per replica, by name) and its ledger of queued prefill tokens."""

    def __init__(self) -> None:
        self.indexes: dict[str, PrefixIndex] = {}
        # request id -> (call, replica name, prefill tokens): answered or finished calls are
        # dropped at the next pick, so the ledger holds at most the pool's requests in flight.
        self._queued: dict[str, tuple[Call, str, float]] = {}

    def capacity_blocks(self, replica: Replica, cfg: CacheAwareConfig) -> int:
        """The replica's KV capacity in index blocks: from its /metrics, else the policy's."""
        sample = replica.stats.sample
        kv_tokens = sample.num_gpu_blocks * sample.block_size or cfg.kv_tokens
        return max(1, int(kv_tokens * cfg.kv_fraction) // cfg.block_tokens)

    def index(self, replica: Replica, cfg: CacheAwareConfig) -> PrefixIndex:
        cap = self.capacity_blocks(replica, cfg)
        ix = self.indexes.get(replica.name)
        if ix is None:
            ix = self.indexes[replica.name] = PrefixIndex(cap)
        elif ix.capacity != cap:
            ix.resize(cap)
        return ix

    def queued_by_replica(self) -> dict[str, float]:
        out: dict[str, float] = {}
        done = []
        for rid, (call, name, tokens) in self._queued.items():
            if call.ttft_s is not None or call.finished:
                done.append(rid)
            else:
                out[name] = out.get(name, 0.0) + tokens
        for rid in done:
            del self._queued[rid]
        return out

    def learn(self, replica: Replica, cfg: CacheAwareConfig, hashes: Sequence[int]) -> None:
        """Another process sent a prompt with these blocks to ``replica``."""
        self.index(replica, cfg).touch(hashes)

    def pick(
        self,
        candidates: Sequence[Replica],
        call: Call,
        cfg: CacheAwareConfig,
        chars_per_token: float,
        rng: random.Random,
        placed: Callable[[Replica, list[int]], None] | None = None,
        feeds: PreciseFeeds | None = None,
    ) -> tuple[Replica, Verdict] | None:
        """The cheapest candidate. A replica whose KV events are live (``feeds``) is matched
        exactly on the prompt's token ids when the call has them; the others, and every replica
        without them, on the approximate index, which every pick keeps up to date."""
        if not candidates:
            return None
        profile = call.profile
        head = profile.prompt_head if profile is not None else ""
        prompt_chars = max(profile.prompt_chars, len(head)) if profile is not None else 0
        prompt_tokens = float(profile.prompt_tokens_est) if profile is not None else 0.0
        token_ids = call.prompt_token_ids
        if token_ids is not None:
            prompt_tokens = float(len(token_ids))
        block_chars = max(1, round(cfg.block_tokens * chars_per_token))
        hashes = text_block_hashes(head, block_chars)
        queued = self.queued_by_replica()
        now = time.monotonic()
        keys_by_size: dict[int, list[bytes]] = {}
        precise: list[tuple[PreciseFeed, list[bytes]] | None] = []
        views = []
        indexes = []
        for r in candidates:
            ix = self.index(r, cfg)
            indexes.append(ix)
            feed = feeds.feed(r) if feeds is not None else None
            keys: list[bytes] | None = None
            if feed is not None and token_ids is not None:
                size = feed.blocks.block_size or DEFAULT_BLOCK_SIZE
                keys = keys_by_size.get(size)
                if keys is None:
                    keys = keys_by_size[size] = token_block_keys(token_ids, size)
            precise.append((feed, keys) if feed is not None and keys is not None else None)
            if feed is not None and keys is not None and feed.live(now, cfg.events_stale_s):
                matched = float(feed.blocks.match(keys, now) * size)
            else:
                matched_chars = ix.match(hashes) * block_chars
                # In the prompt's own token count, so a learned chars/token ratio carries over.
                matched = prompt_tokens * matched_chars / prompt_chars if prompt_chars else 0.0
            views.append(
                View(
                    r.name,
                    matched,
                    queued.get(r.name, 0.0),
                    r.load,
                    ix.capacity - len(ix),
                )
            )
        verdict = decide(views, prompt_tokens, cfg, rng)
        chosen = candidates[verdict.index]
        indexes[verdict.index].touch(hashes)
        if placed is not None and hashes:
            placed(chosen, hashes)
        chosen_feed = precise[verdict.index]
        if chosen_feed is not None:
            feed, keys = chosen_feed
            feed.sent(now)
            feed.blocks.speculate(keys, now, cfg.speculative_s)
        elif feeds is not None and (feed := feeds.feed(chosen)) is not None:
            feed.sent(now)  # no token ids, but its events should follow all the same
        matched_tokens = verdict.rows[verdict.index].matched_tokens
        uncached = max(0.0, prompt_tokens - matched_tokens)
        self._queued[call.request_id] = (call, chosen.name, uncached)
        call.prefix_match_tokens = matched_tokens
        return chosen, verdict

    def stats(self) -> dict[str, Any]:
        """Blocks and bytes per replica index, for metrics and the admin view."""
        return {
            name: {"blocks": len(ix), "capacity": ix.capacity, "bytes": ix.nbytes}
            for name, ix in self.indexes.items()
        }


# One router per (fleet, pool), held by the fleet (``Fleet.cache_routers``): the fleet outlives
# policy reloads, so a reload keeps what the indexes learnt; a fleet that goes away takes its
# routers with it.


def router_for(fleet: Fleet, pool: str) -> CacheAwareRouter:
    pools = fleet.cache_routers
    router = pools.get(pool)
    if router is None:
        router = pools[pool] = CacheAwareRouter()
    assert isinstance(router, CacheAwareRouter)
    return router


def routers(fleet: Fleet) -> dict[str, CacheAwareRouter]:
    return fleet.cache_routers


def learn(fleet: Fleet, pool: str, url: str, hashes: Sequence[int]) -> None:
    """A placement made elsewhere (another worker or instance), into this fleet's index of the
    replica at ``url``; ignored when this fleet has no such ``cache_aware`` pool or replica
    (a reload not applied here yet)."""
    cfg = fleet.pools.get(pool)
    if cfg is None or cfg.config.balance != "cache_aware":
        return
    for replica in fleet.find(url, pool):
        router_for(fleet, pool).learn(replica, cfg.config.cache_aware, hashes)


def snapshot(fleet: Fleet) -> dict[str, dict[str, list[int]]]:
    """pool → replica URL → its index's blocks, least recent first: what a starting worker
    takes over."""
    out: dict[str, dict[str, list[int]]] = {}
    for pool_name, router in routers(fleet).items():
        pool = fleet.pools.get(pool_name)
        if pool is None:
            continue
        urls = {r.name: r.url for r in pool.replicas}
        out[pool_name] = {
            urls[name]: ix.blocks() for name, ix in router.indexes.items() if name in urls
        }
    return out


def adopt(fleet: Fleet, taken: Mapping[str, Mapping[str, Sequence[int]]]) -> None:
    """A peer's ``snapshot``, into this fleet's (empty) indexes, keeping their order."""
    for pool, by_url in taken.items():
        for url, blocks in by_url.items():
            # ``touch`` makes its first block the most recent, so least recent goes last.
            learn(fleet, pool, url, list(reversed(blocks)))


def pick(
    fleet: Fleet,
    metrics: Metrics,
    chars_per_token: float,
    pool: str,
    candidates: Sequence[Replica],
    call: Call,
    rng: random.Random,
    share: Callable[[str, str, Sequence[int]], None] | None = None,
    feeds: PreciseFeeds | None = None,
) -> Replica | None:
    """The relay's entry point: route ``call`` within ``pool``, record the pick in metrics and
    hand the placement to ``share`` (``SharedState.share_placement``)."""
    cfg = fleet.pools[pool].config.cache_aware
    router = router_for(fleet, pool)
    placed = None
    if share is not None:
        placed = lambda replica, hashes: share(pool, replica.url, hashes)  # noqa: E731
    picked = router.pick(candidates, call, cfg, chars_per_token, rng, placed, feeds)
    if picked is None:
        return None
    chosen, verdict = picked
    m = metrics
    # The gauges (index sizes, the replicas' hit counters) are read at each scrape instead
    # (``export_gauges``): they also move between picks.
    m.series(m.prefix_match, pool).observe(verdict.rows[verdict.index].matched_tokens)
    m.series(m.cache_aware_picks, pool, verdict.reason).inc()
    return chosen


def export_gauges(fleet: Fleet, metrics: Metrics) -> None:
    """Every ``cache_aware`` pool's gauges, as of now (called at each scrape): index blocks
    and bytes, which also grow by placements made in other workers and instances, and the
    replicas' own prefix-cache counters, which move after the last pick."""
    m = metrics
    by_pool = routers(fleet)
    for name, pool in fleet.pools.items():
        if pool.config.balance != "cache_aware":
            continue
        router = by_pool.get(name)
        indexes = router.indexes if router is not None else {}
        for replica in pool.replicas:
            sample = replica.stats.sample
            m.series(m.replica_prefix_hits, name, replica.name).set(sample.prefix_cache_hits_total)
            m.series(m.replica_prefix_queries, name, replica.name).set(
                sample.prefix_cache_queries_total
            )
            ix = indexes.get(replica.name)
            m.series(m.prefix_index_blocks, name, replica.name).set(len(ix) if ix else 0)
        m.series(m.prefix_index_bytes, name).set(sum(i.nbytes for i in indexes.values()))


# ---------------------------------------------------------------------------- explain


@dataclass(eq=False)
class _Probe:
    """The part of a ``Call`` the router reads, for ``tokenlane explain``."""

    request_id: str
    profile: Any
    ttft_s: float | None = None
    finished: bool = False
    prefix_match_tokens: int | None = None
    prompt_token_ids: list[int] | None = None


def explain(
    policy: Any,
    pool: str,
    body: dict[str, Any],
    kind: str,
    earlier: Sequence[dict[str, Any]] = (),
    chars_per_token: float | None = None,
) -> dict[str, Any]:
    """How a ``cache_aware`` pool would place ``body`` once ``earlier`` requests were placed.

    No network: every replica idle, indexes sized from the policy, the earlier requests routed
    (and answered) first, so the match lengths show what the pool would have learnt from them.
    """
    from proxy.fleet.fleet import Replica
    from proxy.routing.estimate import Estimator
    from proxy.routing.profile import max_prefix_chars, profile_request

    ratio = policy.estimate.chars_per_token if chars_per_token is None else chars_per_token
    estimator = Estimator(ratio, policy.estimate.image_tokens)
    head = max_prefix_chars(policy)
    cfg = policy.pools[pool]
    replicas = []
    for rc in cfg.replicas:
        r = Replica(pool=pool, config=rc, name=rc.label, url=rc.url)
        r.stats.stale = False
        replicas.append(r)
    router = CacheAwareRouter()
    rng = random.Random(0)
    for i, b in enumerate(earlier):
        probe = _Probe(f"earlier-{i}", profile_request(b, kind, estimator, head))
        router.pick(replicas, probe, cfg.cache_aware, ratio, rng)  # type: ignore[arg-type]
        probe.finished = True
    probe = _Probe("request", profile_request(body, kind, estimator, head))
    picked = router.pick(replicas, probe, cfg.cache_aware, ratio, rng)  # type: ignore[arg-type]
    assert picked is not None  # a pool has at least one replica
    chosen, verdict = picked
    return {
        "pool": pool,
        "winner": chosen.name,
        "reason": verdict.reason,
        "why": verdict.describe(),
        "candidates": [
            {"name": r.name, "matched_tokens": r.matched_tokens, "cost": round(r.cost, 1)}
            for r in verdict.rows
        ],
    }
