"""The Prometheus metric objects (docs/operations.md). Names and labels are a contract with
dashboards and alert rules in ``deploy/``; change them only on purpose.

Each gateway builds its own ``Metrics`` on its own registry, so several gateways can live in one
test process and ``/metrics`` shows only this gateway's series.

Length: one job: every metric family is declared here with the label sets it creates at 0, so the
contract with the dashboards and alerts reads in one file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proxy.config import LaneConfig, package_version
from proxy.errors import RetryReason

# 5 ms to 60 s: TTFT of a warm short request is tens of ms; a queued bulk request can take a
# minute. Roughly ×2 steps, finer where SLOs usually sit (100 ms – 2 s).
LATENCY_BUCKETS: Final = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    45.0,
    60.0,
)
# Gateway overhead is sub-millisecond when healthy; resolve 50 µs to 60 s.
OVERHEAD_BUCKETS: Final = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    60.0,
)

REPLICA_STATES: Final = ("probing", "healthy", "ejected", "draining")
REJECTION_REASONS = ("queue_full", "queue_timeout", "no_replica", "rate_limited", "unauthorized")
EJECTION_REASONS: Final = (
    "stall",
    "silent_stream",
    "first_token_timeout",
    "health_check",
    "consecutive_failures",
    "canary_failed",
    "operator",
)
RETRY_REASONS: Final = tuple(RetryReason)
# Rejections recorded against a lane; `unauthorized` comes before any lane is known and is
# recorded under NO_LANE (proxy/edge/auth.py).
LANE_REJECTION_REASONS: Final = ("queue_full", "queue_timeout", "no_replica", "rate_limited")
# proxy/relay/continuation.py's Trigger and Refusal values (observe imports nothing of relay).
CONTINUATION_TRIGGERS: Final = ("eof", "reset", "error_event", "abort", "stall")
CONTINUATION_REFUSALS: Final = (
    "disabled", "n", "tools", "structured", "logprobs", "stop", "content", "seeded",
    "usage_stats", "reasoning", "seq_len", "no_ids", "limit", "no_target", "busy",
    "client_error", "malformed", "api",
)  # fmt: skip
CACHE_AWARE_REASONS: Final = ("longest_match", "new_prefix", "replicated")  # cache_aware.Verdict
NO_LANE: Final = "none"
# The relayed APIs, as ``Call.kind`` names them (``other``: every pass-through path).
APIS: Final = ("chat", "completion", "messages", "responses", "realtime", "other")
GATEWAY_STATUSES: Final = ("429", "503")  # the gateway's own refusals (rejections, no replica)
# Per-replica TTFT: coarser than LATENCY_BUCKETS on purpose. Each replica costs
# len(REPLICA_TTFT_BUCKETS) + 3 series (the buckets, +Inf, _sum, _count): 15 per replica, so a
# fleet of 100 replicas adds 1,500 series per gateway instance. Enough to tell a replica whose
# p50 is 80 ms from one at 2 s; the per-lane histogram keeps the fine resolution.
REPLICA_TTFT_BUCKETS: Final = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)

LabelSets = dict[str, set[tuple[str, ...]]]


def replica_address(url: str) -> str:
    """``host:port`` of a replica URL: what Prometheus calls the vLLM target's ``instance``
    when it scrapes that replica at the address the gateway uses, so the two sides join."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"{host}:{port}"


def known_label_sets(
    lanes: Iterable[LaneConfig],
    replicas: Iterable[tuple[str, str, str]],
    cache_aware_pools: Iterable[str] = (),
    continuing_lanes: Iterable[str] = (),
) -> LabelSets:
    """Every label set the policy makes possible for the counters, by metric attribute.

    Created at 0 when the policy loads, so ``rate()`` and ``increase()`` see the first event:
    a series born at 1 has no earlier sample, and Prometheus counts its first increment as
    nothing. ``replicas`` are (pool, name, url); ``cache_aware_pools`` get their routing
    series (and lose them when a reload gives the pool another balance);
    ``continuing_lanes`` (continuation on, and the lane's switch) get the continuation series,
    and every other lane the one refusal its cut streams can have, ``disabled``."""
    sets: LabelSets = {
        "requests": set(),
        "api_requests": set(),
        "ejections": set(),
        "retries": set(),
        "rejections": {(NO_LANE, "unauthorized")},
        "spills": set(),
        "replica_ttft": set(),
        "replica_info": set(),
        # The lane histograms, per pool a lane can be served by: a histogram born with its
        # first observations shows rate() nothing of them either.
        "ttft": set(),
        "inter_token": set(),
        "duration": set(),
        "overhead": set(),
        "prompt_tokens_estimated": set(),
        "prompt_tokens_reported": set(),
        "prefix_match": set(),
        "cache_aware_picks": set(),
        "prefix_index_blocks": set(),
        "prefix_index_bytes": set(),
        "replica_prefix_hits": set(),
        "replica_prefix_queries": set(),
        "continuations": set(),
        "continuation_refusals": set(),
        "continuation_gap": set(),
        "continuation_replayed": set(),
    }
    continuing = set(continuing_lanes)
    cached = set(cache_aware_pools)
    for pool in cached:
        sets["prefix_match"].add((pool,))
        sets["cache_aware_picks"].update((pool, r) for r in CACHE_AWARE_REASONS)
        sets["prefix_index_bytes"].add((pool,))
    replicas = list(replicas)
    for lane in lanes:
        # Answers a lane can get: 200 from each replica of its pools, and the gateway's own
        # refusals (no replica behind them). Other statuses are rarer and still start at 1.
        pools = {lane.pool, lane.spill_to}
        sets["requests"].update((lane.name, p, n, "200") for p, n, _ in replicas if p in pools)
        sets["requests"].update((lane.name, "", "", s) for s in GATEWAY_STATUSES)
        sets["api_requests"].update((lane.name, api) for api in APIS)
        sets["retries"].update((lane.name, r) for r in RETRY_REASONS)
        sets["rejections"].update((lane.name, r) for r in LANE_REJECTION_REASONS)
        if lane.spill_to:
            sets["spills"].add((lane.name, lane.pool, lane.spill_to))
        for attr in ("ttft", "inter_token", "duration"):
            sets[attr].update((lane.name, p) for p in pools if p is not None)
        sets["overhead"].add((lane.name,))
        if lane.name in continuing:
            sets["continuations"].update(
                (lane.name, t, o) for t in CONTINUATION_TRIGGERS for o in ("ok", "failed")
            )
            sets["continuation_refusals"].update((lane.name, r) for r in CONTINUATION_REFUSALS)
            sets["continuation_gap"].add((lane.name,))
            sets["continuation_replayed"].add((lane.name,))
        else:
            sets["continuation_refusals"].add((lane.name, "disabled"))
    for pool, name, url in replicas:
        sets["prompt_tokens_estimated"].add((pool,))
        sets["prompt_tokens_reported"].add((pool,))
        sets["ejections"].update((pool, name, r) for r in EJECTION_REASONS)
        sets["replica_ttft"].add((pool, name))
        sets["replica_info"].add((pool, name, url, replica_address(url)))
        if pool in cached:
            for attr in ("prefix_index_blocks", "replica_prefix_hits", "replica_prefix_queries"):
                sets[attr].add((pool, name))
    return sets


def diff_label_sets(old: LabelSets, new: LabelSets) -> tuple[LabelSets, LabelSets]:
    """(to create, to remove): label sets that stay are left alone, so a reload keeps counts."""
    keys = set(old) | set(new)
    add = {k: new.get(k, set()) - old.get(k, set()) for k in keys}
    gone = {k: old.get(k, set()) - new.get(k, set()) for k in keys}
    return add, gone


def replica_ttft_s(ttft_s: float | None, queue_wait_s: float, retries: int) -> float | None:
    """The serving replica's share of a request's TTFT: dispatch to first chunk. None for a
    request with no first chunk or one that was retried (its time is spread over several
    replicas; the failed ones show in ejections and retries instead)."""
    if ttft_s is None or retries:
        return None
    return max(0.0, ttft_s - queue_wait_s)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.build_info = Gauge(
            "tokenlane_build_info",
            "Always 1; the running version in the label (join on it to see a rollout).",
            ["version"],
            registry=r,
        )
        self.build_info.labels(package_version()).set(1)
        self._series: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self.requests = Counter(
            "tokenlane_requests",
            "Requests answered, by lane, pool, replica and HTTP status.",
            ["lane", "pool", "replica", "status"],
            registry=r,
        )
        self.api_requests = Counter(
            "tokenlane_api_requests",
            "Requests answered, by lane and API (chat, completion, messages, responses, "
            "realtime, other).",
            ["lane", "api"],
            registry=r,
        )
        self.ttft = Histogram(
            "tokenlane_ttft_seconds",
            "Request received to first content chunk sent to the client.",
            ["lane", "pool"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "tokenlane_inter_token_seconds",
            "Gap between content chunks sent to the client.",
            ["lane", "pool"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "tokenlane_request_duration_seconds",
            "Request received to response complete.",
            ["lane", "pool"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "tokenlane_queue_depth",
            "Requests waiting for dispatch, by lane.",
            ["lane"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "tokenlane_queue_wait_seconds",
            "Time spent waiting for dispatch.",
            ["lane"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rejections = Counter(
            "tokenlane_rejections",
            "Requests refused by the gateway, by lane and reason.",
            ["lane", "reason"],
            registry=r,
        )
        self.replica_state = Gauge(
            "tokenlane_replica_state",
            "1 for the replica's current state, 0 for the others.",
            ["pool", "replica", "state"],
            registry=r,
        )
        self.replica_in_flight = Gauge(
            "tokenlane_replica_in_flight",
            "Requests this gateway has in flight to the replica.",
            ["pool", "replica"],
            registry=r,
        )
        self.ejections = Counter(
            "tokenlane_ejections",
            "Replica ejections, by reason.",
            ["pool", "replica", "reason"],
            registry=r,
        )
        self.retries = Counter(
            "tokenlane_retries",
            "Attempts retried on another replica, by reason.",
            ["lane", "reason"],
            registry=r,
        )
        self.stale_resends = Counter(
            "tokenlane_stale_connection_resends",
            "Requests sent again because the pooled connection they went out on was closed "
            "under them before any answer (the replica never read them).",
            registry=r,
        )
        self.continuations = Counter(
            "tokenlane_continuations",
            "Streams continued on another replica after theirs failed mid-answer, by what "
            "ended the upstream and how the continuation ended (ok, failed).",
            ["lane", "trigger", "outcome"],
            registry=r,
        )
        self.continuation_refusals = Counter(
            "tokenlane_continuation_refusals",
            "Streams whose replica failed mid-answer and that were not continued, by reason.",
            ["lane", "reason"],
            registry=r,
        )
        self.continuation_gap = Histogram(
            "tokenlane_continuation_gap_seconds",
            "Client-visible gap of a continuation: last chunk before the failure to the "
            "continuation's first chunk.",
            ["lane"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120),
            registry=r,
        )
        self.continuation_replayed = Counter(
            "tokenlane_continuation_replayed_tokens",
            "Prompt and generated tokens prefilled again by continuations.",
            ["lane"],
            registry=r,
        )
        self.spills = Counter(
            "tokenlane_spills",
            "Requests sent to a lane's spill_to pool.",
            ["lane", "from_pool", "to_pool"],
            registry=r,
        )
        self.panic = Gauge(
            "tokenlane_panic",
            "1 while the pool serves from ejected replicas because too many are out.",
            ["pool"],
            registry=r,
        )
        # Both prompt-token counters count the same requests (those whose usage reported the
        # prompt tokens), so their ratio compares like with like.
        self.prompt_tokens_estimated = Counter(
            "tokenlane_prompt_tokens_estimated",
            "Prompt tokens as the gateway estimated them, for requests whose usage reported them.",
            ["pool"],
            registry=r,
        )
        self.prompt_tokens_reported = Counter(
            "tokenlane_prompt_tokens_reported",
            "Prompt tokens as replicas reported them in usage.",
            ["pool"],
            registry=r,
        )
        self.overhead = Histogram(
            "tokenlane_overhead_seconds",
            "Request received to upstream request sent.",
            ["lane"],
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.replica_ttft = Histogram(
            "tokenlane_replica_ttft_seconds",
            "Dispatch to first content chunk, by the replica that served it (requests not "
            "retried). 15 series per replica.",
            ["pool", "replica"],
            buckets=REPLICA_TTFT_BUCKETS,
            registry=r,
        )
        self.replica_info = Gauge(
            "tokenlane_replica_info",
            "1 per replica of the policy: its name, pool, URL and the host:port Prometheus "
            "scrapes it at (join vLLM's series on instance = address).",
            ["pool", "replica", "url", "address"],
            registry=r,
        )
        self._known: LabelSets = {}
        self.shared_state_up = Gauge(
            "tokenlane_shared_state_up",
            "1 while shared state (Redis) is reachable or not configured; 0 on local fallback.",
            registry=r,
        )
        self.shared_state_up.set(1)
        # The policy's own bounds as series, so alert rules and dashboards compare against
        # what is configured now instead of copies that go stale on reload.
        self.lane_ttft_slo = Gauge(
            "tokenlane_lane_ttft_slo_seconds",
            "The lane's ttft_slo_s (lanes that set one).",
            ["lane"],
            registry=r,
        )
        self.lane_max_queue = Gauge(
            "tokenlane_lane_max_queue",
            "The lane's max_queue.",
            ["lane"],
            registry=r,
        )
        self.reloads = Counter(
            "tokenlane_policy_reloads",
            "Policy reloads by result (ok, invalid).",
            ["result"],
            registry=r,
        )
        for result in ("ok", "invalid"):  # both series exist from the start, at 0
            self.reloads.labels(result)
        # -- cache_aware pools (proxy/routing/cache_aware.py) --
        self.prefix_match = Histogram(
            "tokenlane_prefix_match_tokens",
            "cache_aware picks: prompt tokens the chosen replica was judged to hold cached.",
            ["pool"],
            buckets=(0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
            registry=r,
        )
        self.cache_aware_picks = Counter(
            "tokenlane_cache_aware_picks",
            "cache_aware picks by reason (longest_match, new_prefix, replicated).",
            ["pool", "reason"],
            registry=r,
        )
        self.prefix_index_blocks = Gauge(
            "tokenlane_prefix_index_blocks",
            "Blocks in a replica's prefix index (cache_aware pools).",
            ["pool", "replica"],
            registry=r,
        )
        self.kv_events_up = Gauge(
            "tokenlane_kv_events_up",
            "1 while a replica's KV cache events are flowing and cache_aware routes it on its "
            "real blocks; 0 while it falls back to the approximate index.",
            ["pool", "replica"],
            registry=r,
        )
        self.kv_event_batches = Counter(
            "tokenlane_kv_event_batches",
            "KV cache event batches applied per replica (precise cache_aware mode).",
            ["pool", "replica"],
            registry=r,
        )
        self.kv_event_gaps = Counter(
            "tokenlane_kv_event_gaps",
            "Gaps in a replica's KV event sequence: replayed (filled from its replay socket) or "
            "lost (its block set restarted).",
            ["pool", "replica", "outcome"],
            registry=r,
        )
        self.prefix_index_bytes = Gauge(
            "tokenlane_prefix_index_bytes",
            "Approximate memory of a pool's prefix indexes.",
            ["pool"],
            registry=r,
        )
        # The replicas' own vllm:prefix_cache_{hits,queries}_total as last scraped (cache_aware
        # pools, refreshed at each pick): the hit rate per pool is the ratio of their rates.
        self.replica_prefix_hits = Gauge(
            "tokenlane_replica_prefix_cache_hits_tokens",
            "The replica's vllm:prefix_cache_hits_total, as last scraped.",
            ["pool", "replica"],
            registry=r,
        )
        self.replica_prefix_queries = Gauge(
            "tokenlane_replica_prefix_cache_queries_tokens",
            "The replica's vllm:prefix_cache_queries_total, as last scraped.",
            ["pool", "replica"],
            registry=r,
        )

    def series(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, remembered: the request path records a handful of series
        per request, and prometheus_client's ``labels()`` takes a lock and builds a key each
        time."""
        key = (metric, labels)
        child = self._series.get(key)
        if child is None:
            child = self._series[key] = metric.labels(*labels)
        return child

    def set_lane_bounds(self, lanes: Iterable[LaneConfig]) -> None:
        """Export each lane's SLO and queue bound; forget lanes (and SLOs) no longer there."""
        self.lane_ttft_slo.clear()
        self.lane_max_queue.clear()
        for lane in lanes:
            self.lane_max_queue.labels(lane.name).set(lane.max_queue)
            if lane.ttft_slo_s is not None:
                self.lane_ttft_slo.labels(lane.name).set(lane.ttft_slo_s)

    def sync(
        self,
        lanes: Iterable[LaneConfig],
        replicas: Iterable[Any],
        cache_aware_pools: Iterable[str] = (),
        continuing_lanes: Iterable[str] = (),
    ) -> None:
        """Make the series match the policy just loaded: every known label set exists (at 0
        when new), the lanes' bounds are current, and label sets of lanes and replicas that
        left are removed. ``replicas`` are the fleet's (``pool``, ``name``, ``url``)."""
        lanes = list(lanes)
        self.set_lane_bounds(lanes)
        new = known_label_sets(
            lanes,
            [(r.pool, r.name, r.url) for r in replicas],
            cache_aware_pools,
            continuing_lanes,
        )
        add, gone = diff_label_sets(self._known, new)
        self._apply(add, gone)
        self._known = new

    def _apply(self, add: Mapping[str, set[tuple[str, ...]]], gone: LabelSets) -> None:
        for attr, label_sets in gone.items():
            metric = getattr(self, attr)
            for labels in label_sets:
                self._remove(metric, labels)
        for attr, label_sets in add.items():
            metric = getattr(self, attr)
            for labels in label_sets:
                child = self.series(metric, *labels)
                if attr == "replica_info":
                    child.set(1)

    def forget_kv_events(self, pool: str, replica: str) -> None:
        """A replica's KV event series, gone with its feed."""
        self._remove(self.kv_events_up, (pool, replica))
        self._remove(self.kv_event_batches, (pool, replica))
        for outcome in ("replayed", "lost"):
            self._remove(self.kv_event_gaps, (pool, replica, outcome))

    def _remove(self, metric: Any, labels: tuple[str, ...]) -> None:
        self._series.pop((metric, labels), None)
        try:
            metric.remove(*labels)
        except KeyError:  # never created
            pass

    def observe_replica_ttft(self, pool: str, replica: str, seconds: float | None) -> None:
        if seconds is not None:
            self.series(self.replica_ttft, pool, replica).observe(seconds)

    def set_replica_state(self, pool: str, replica: str, state: str) -> None:
        for s in REPLICA_STATES:
            self.replica_state.labels(pool, replica, s).set(1 if s == state else 0)

    def forget_replica(self, pool: str, replica: str) -> None:
        """Drop a replica's gauges once it left the fleet (or was renamed): a gauge left behind
        would show a replica that no longer exists as healthy (or ejected) forever. Its
        ejection counters, TTFT and info series go too: they were created for it at 0 and
        would otherwise pile up with every renamed or rediscovered replica."""
        for s in REPLICA_STATES:
            self._remove(self.replica_state, (pool, replica, s))
        self._remove(self.replica_in_flight, (pool, replica))
        gone: LabelSets = {
            "ejections": {(pool, replica, r) for r in EJECTION_REASONS},
            "replica_ttft": {(pool, replica)},
            "replica_info": {
                k for k in self._known.get("replica_info", set()) if k[:2] == (pool, replica)
            },
            "requests": {
                k for k in self._known.get("requests", set()) if k[1:3] == (pool, replica)
            },
        }
        self._apply({}, gone)
        for attr, label_sets in gone.items():
            self._known.get(attr, set()).difference_update(label_sets)
