"""``GET /metrics`` as vLLM V1 exports it: names, help texts, types, labels and buckets copied
from ``tests/fixtures/vllm_metrics_v1.txt`` (labels ``engine="0"`` and ``model_name`` = the
first served model).

Each simulator has its own registry, so several in one test process do not mix. Everything is
updated once per engine step or per finished request, and the gauges are read from the engine
when scraped, so a stalled engine shows its frozen state exactly as #37729 describes.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from .scheduler import EngineRequest, StepPlan, StepResult
from .settings import SimSettings

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_TIME_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
LABELS = ["model_name", "engine"]


class SimMetrics:
    """The vLLM metric objects of one simulator, fed by its engine (an ``EngineObserver``)."""

    def __init__(self, settings: SimSettings) -> None:
        r = self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=r)
        lv = (settings.models[0], "0")
        self._lv = lv
        self.steps = 0  # engine steps seen, and requests finished: a scrape cache key
        self.finished = 0

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*LABELS, *extra], registry=r)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r)

        self.g_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.g_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.g_waiting_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            [*LABELS, "reason"], registry=r,
        )  # fmt: skip
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
            "level 2.",
            [*LABELS, "sleep_state"], registry=r,
        )  # fmt: skip
        for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
            sleep.labels(*lv, state).set(value)
        self.g_kv = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.c_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        ).labels(*lv)
        self.c_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ).labels(*lv)
        counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in "
            "terms of number of queried tokens.",
        ).labels(*lv)
        counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in "
            "terms of number of cached tokens.",
        ).labels(*lv)
        self.c_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        ).labels(*lv)
        self.c_prompt = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(
            *lv
        )
        by_source = counter(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", ("source",)
        )
        self.c_prompt_computed = by_source.labels(*lv, "local_compute")
        self.c_prompt_hit = by_source.labels(*lv, "local_cache_hit")
        by_source.labels(*lv, "external_kv_transfer")
        self.c_prompt_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        ).labels(*lv)
        self.c_generation = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        ).labels(*lv)
        success = counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ("finished_reason",),
        )
        self.c_success = {reason: success.labels(*lv, reason) for reason in FINISH_REASONS}
        self.h_prompt = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS
        ).labels(*lv)
        self.h_generation = hist(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            TOKEN_BUCKETS,
        ).labels(*lv)
        self.h_iteration = hist(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_BUCKETS,
        ).labels(*lv)
        self.h_max_gen = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            TOKEN_BUCKETS,
        ).labels(*lv)
        self.h_n = hist(
            "vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS
        ).labels(*lv)
        self.h_max_tokens = hist(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            TOKEN_BUCKETS,
        ).labels(*lv)
        self.h_ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        ).labels(*lv)
        self.h_itl = hist(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        ).labels(*lv)
        self.h_tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        ).labels(*lv)

        def phase(name: str, doc: str) -> Histogram:
            return hist(name, doc, REQUEST_TIME_BUCKETS).labels(*lv)

        self.h_e2e = phase(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."
        )
        self.h_queue = phase(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
        )
        self.h_inference = phase(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
        )
        self.h_prefill = phase(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
        )
        self.h_decode = phase(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
        )
        self.h_kv_computed = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            TOKEN_BUCKETS,
        ).labels(*lv)
        info = {
            "block_size": str(settings.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(settings.enable_prefix_caching),
            "gpu_memory_utilization": "0.9",
            "num_gpu_blocks": str(settings.num_gpu_blocks),
            "prefix_caching_hash_algo": "sha256",
        }
        Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            sorted([*info, "engine"]), registry=r,
        ).labels(engine="0", **info).set(1)  # fmt: skip

    def bind(
        self,
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_usage: Callable[[], float],
    ) -> None:
        """Read the gauges from the engine at scrape time."""
        self.g_running.labels(*self._lv).set_function(running)
        self.g_waiting.labels(*self._lv).set_function(waiting)
        self.g_waiting_reason.labels(*self._lv, "capacity").set_function(waiting)
        self.g_waiting_reason.labels(*self._lv, "deferred").set(0)
        self.g_kv.labels(*self._lv).set_function(kv_usage)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- EngineObserver -------------------------------------------------------------------------

    def on_step(self, plan: StepPlan, result: StepResult, now: float) -> None:
        self.steps += 1
        self.h_iteration.observe(plan.num_tokens)
        if plan.preempted:
            self.c_preemptions.inc(plan.preempted)
        if plan.cache_queries:
            self.c_cache_queries.inc(plan.cache_queries)
            self.c_cache_hits.inc(plan.cache_hits)
        if result.produced:
            self.c_generation.inc(len(result.produced))
        first = set(result.first)
        for req in result.first:
            # vLLM counts a prompt when its first token comes out, cached part included.
            cached = req.num_cached_tokens or 0
            self.c_prompt.inc(req.num_prompt)
            self.c_prompt_computed.inc(req.num_prompt - cached)
            self.c_prompt_hit.inc(cached)
            self.c_prompt_cached.inc(cached)
            self.h_ttft.observe(now - req.arrival)
        itl = self.h_itl.observe
        for req in result.produced:
            if req not in first:
                itl(req.last_itl)

    def on_finished(self, req: EngineRequest, now: float) -> None:
        self.finished += 1
        reason = req.finish_reason or "abort"
        self.c_success[reason if reason in self.c_success else "abort"].inc()
        if reason not in ("stop", "length") or req.first_token_at is None:
            return
        scheduled = req.scheduled_at if req.scheduled_at is not None else req.arrival
        self.h_e2e.observe(now - req.arrival)
        self.h_queue.observe(scheduled - req.arrival)
        self.h_inference.observe(now - scheduled)
        self.h_prefill.observe(req.first_token_at - scheduled)
        self.h_decode.observe(now - req.first_token_at)
        if req.num_output > 1:
            self.h_tpot.observe((now - req.first_token_at) / (req.num_output - 1))
        self.h_prompt.observe(req.num_prompt)
        self.h_generation.observe(req.num_output)
        self.h_max_gen.observe(req.max_tokens)
        self.h_max_tokens.observe(req.max_tokens)
        self.h_n.observe(req.params_n)
        self.h_kv_computed.observe(req.num_prompt - (req.num_cached_tokens or 0))
