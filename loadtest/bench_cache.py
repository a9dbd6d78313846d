"""Routing for the prefix cache, side by side: Tokenlane's balances and vllm-router's.

Four simulated replicas with a small KV pool (``--num-gpu-blocks 2200``, 35,200 tokens each) and
a prefill cost of a mid-size model (0.2 ms per prompt token, so a 1,664-token miss takes ~0.33 s
and a hit ~0.03 s), so that where a prompt lands decides its time to first token. Workloads, in
the shape of inference-perf's ``shared_prefix`` (groups x prompts, system and question lengths):

- ``shared_prefix``: 32 groups x 8 prompts, 1,536-token system prompts, 128-token questions,
  64 tokens out, Poisson 8 req/s. The distinct prompt tokens (with outputs) fill ~70 % of the
  four replicas' KV and ~2.8x one replica's: a balance must keep groups apart to hit;
- ``one_group``: the same with one group for everything (256 prompts): every replica can hold
  the prefix, and piling all of it on one replica is the failure to avoid;
- ``small_groups``: 64 groups x 4 prompts with 128-token system prompts and 384-token
  questions: little to gain from affinity, and it must cost nothing against least_loaded.

- ``saturating``: 96 groups x 3 prompts: the distinct system prompts outgrow the four replicas'
  KV, so blocks are evicted all the time and an index blind to evictions guesses wrong.

Configurations: Tokenlane ``round_robin``, ``least_loaded``, ``prefix_affinity`` (defaults),
``cache_aware``, ``cache_aware+precise`` (routed on the replicas' KV cache events, which every
simulated replica publishes as vLLM with ``--kv-events-config`` does; the prompt's token ids
from a replica's render route), ``cache_aware+2workers`` (``--workers 2``) and
``cache_aware+2instances`` (two ``tokenlane serve`` sharing a Redis of their own, requests
alternating between them; before the load it measures how long a placement made by one instance
takes to reach the other's index); vllm-router
(PyPI, installed by ``loadtest/peers.py`` into its own virtualenv) ``cache_aware`` and
``round_robin``, or a line saying why not. The replicas start afresh for every run, from an
empty cache, and every configuration of a repetition gets the same prompts, so the
configurations differ in nothing but their routing. Hit rate comes from the replicas' own
``vllm:prefix_cache_hits_total / queries_total``, deltas over the run.

    python -m loadtest.bench_cache [--quick] [--workloads shared_prefix,...] [--reps 2]
        [--json out.json] [--plot docs/cache_routing.png]

Length: one benchmark: the workloads, the two modes (HTTP and virtual time) over the same routing
code and the one table they print.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import yaml

from loadtest import peers
from loadtest.procs import free_port, process, wait_http, wait_port
from loadtest.prompts import words

if TYPE_CHECKING:
    from proxy.routing.profile import Profile

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
REPLICAS = 4
SIM_ARGS = ["--num-gpu-blocks", "2200", "--prefill-per-token-s", "0.0002"]


@dataclass(frozen=True)
class Workload:
    groups: int
    per_group: int
    system_tokens: int
    question_tokens: int
    output_tokens: int = 64
    rate: float = 8.0


WORKLOADS = {
    "shared_prefix": Workload(32, 8, 1536, 128),
    "one_group": Workload(1, 256, 1536, 128),
    "small_groups": Workload(64, 4, 128, 384),
    # The distinct system prompts (147 K tokens) outgrow the four replicas' KV (141 K): blocks
    # are evicted all the time, and an index that does not see evictions guesses wrong.
    "saturating": Workload(96, 3, 1536, 128),
}
CONFIGS = [
    ("tokenlane", "round_robin"),
    ("tokenlane", "least_loaded"),
    ("tokenlane", "prefix_affinity"),
    ("tokenlane", "cache_aware"),
    ("tokenlane", "cache_aware+precise"),
    ("tokenlane", "cache_aware+2workers"),
    ("tokenlane", "cache_aware+2instances"),
    ("vllm-router", "cache_aware"),
    ("vllm-router", "round_robin"),
]


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    errors: int = 0
    output_tokens: int = 0


def requests_for(w: Workload, salt: str, seed: int) -> list[list[dict[str, str]]]:
    """Chat messages of every request, in a random order (groups interleave, as users do)."""
    out = []
    for g in range(w.groups):
        system = f"[{salt}/{g}] " + " ".join(words(w.system_tokens, random.Random(f"{seed}:{g}")))
        for q in range(w.per_group):
            rng = random.Random(f"{seed}:{g}:{q}")
            out.append(
                [
                    {"role": "system", "content": system},
                    {"role": "user", "content": " ".join(words(w.question_tokens, rng))},
                ]
            )
    random.Random(seed).shuffle(out)
    return out


async def one(
    http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], w: Workload, r: Result
) -> None:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": w.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = None
    try:
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                r.errors += 1
                await resp.read()
                return
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if first is None and any(
                    (c.get("delta") or {}).get("content") for c in chunk.get("choices") or []
                ):
                    first = time.perf_counter() - t0
                usage = chunk.get("usage")
                if usage:
                    r.output_tokens += usage.get("completion_tokens", 0)
    except (TimeoutError, aiohttp.ClientError, ValueError):
        r.errors += 1
        return
    if first is None:
        r.errors += 1
    else:
        r.ttft.append(first)


async def render_cost(port: int, w: Workload, n: int = 200) -> dict[str, float]:
    """What precise mode adds to a request: one render call to a replica (its token ids), here
    through the gateway's own client code, sequential on an idle replica: latency p50/p99."""
    from types import SimpleNamespace

    from proxy.config import ReplicaConfig
    from proxy.fleet.kv_events import render_token_ids
    from proxy.fleet.replica import Replica
    from proxy.policyfile import build_policy
    from proxy.relay.upstream import make_client

    url = f"http://127.0.0.1:{port}"
    policy = build_policy({"pools": {"p": {"replicas": [{"url": url}]}},
                           "lanes": [{"name": "all", "pool": "p"}]})  # fmt: skip
    client = make_client(policy)
    replica = Replica(pool="p", config=ReplicaConfig(url=url), name="r", url=url)
    times = []
    try:
        for messages in requests_for(w, "render", 7)[:n]:
            body = {"model": MODEL, "messages": messages, "max_tokens": w.output_tokens}
            call = SimpleNamespace(kind="chat", fields=body, body=b"")
            t0 = time.perf_counter()
            ids = await render_token_ids(client, replica, call, 5.0)  # type: ignore[arg-type]
            times.append(time.perf_counter() - t0)
            assert ids, "the replica rendered nothing"
    finally:
        await client.aclose()
    times.sort()
    return {
        "render_p50_ms": times[len(times) // 2] * 1000,
        "render_p99_ms": times[min(len(times) - 1, int(0.99 * len(times)))] * 1000,
        "prompt_tokens": float(w.system_tokens + w.question_tokens),
        **local_tokenize_cost(w, n),
    }


def local_tokenize_cost(w: Workload, n: int = 200) -> dict[str, float]:
    """The other source of token ids the issue names, ``estimate.tokenizer_file``: the same
    prompts encoded in-process by the ``tokenizers`` library (as ``proxy.routing.tokens``
    does for counts), with a byte-level BPE trained here on the workload's texts (no model's
    tokenizer can be downloaded on this machine; a real one's vocabulary is larger, its
    per-token cost of the same order). Only the encode: a chat would also need the model's
    chat template. Per request, p50/p99, on this process's core."""
    from tokenizers import Tokenizer

    from loadtest import hf_tokenizer

    reqs = requests_for(w, "render", 7)[:n]
    texts = [m["content"] for messages in reqs for m in messages]
    with tempfile.TemporaryDirectory() as d:
        tokenizer = Tokenizer.from_file(str(hf_tokenizer.build(Path(d), texts) / "tokenizer.json"))
    encode = tokenizer.encode
    times, tokens = [], 0
    for messages in reqs:
        t0 = time.perf_counter()
        ids = [i for m in messages for i in encode(m["content"], add_special_tokens=False).ids]
        times.append(time.perf_counter() - t0)
        tokens += len(ids)
    times.sort()
    return {
        "local_encode_p50_ms": times[len(times) // 2] * 1000,
        "local_encode_p99_ms": times[min(len(times) - 1, int(0.99 * len(times)))] * 1000,
        "local_encode_tokens": tokens / len(reqs),
    }


async def drive(urls: list[str], w: Workload, reqs: list[list[dict[str, str]]], seed: int) -> tuple:
    """The workload's requests, Poisson arrivals, alternating over ``urls`` (gateway
    instances)."""
    rng = random.Random(seed)
    r = Result()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        t0 = time.perf_counter()
        tasks = []
        for i, messages in enumerate(reqs):  # exponential gaps at the workload's rate
            url = urls[i % len(urls)]
            tasks.append(asyncio.create_task(one(http, url, messages, w, r)))
            await asyncio.sleep(rng.expovariate(w.rate))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return r, wall


async def placement_delay(urls: list[str], n: int = 30) -> dict[str, float]:
    """How long a ``cache_aware`` placement made through the first instance takes to reach the
    second's index: from sending a request with a prompt nobody sent before to the first
    instance, until the second instance's ``tokenlane_prefix_index_blocks`` grows (its
    ``/metrics`` polled back to back). Idle gateways, one probe at a time; p50/p99/max in ms."""
    first, second = urls[0], urls[1]
    delays: list[float] = []
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def blocks() -> float:
            async with http.get(second + "/metrics") as resp:
                text = await resp.text()
            return sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("tokenlane_prefix_index_blocks{")
            )

        for i in range(n):
            before = await blocks()
            system = f"[placement {i} {time.time_ns()}] " + " ".join(words(256, random.Random(i)))
            body = {
                "model": MODEL,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": "hi"}],
                "max_tokens": 1,
            }  # fmt: skip
            t0 = time.perf_counter()
            sent = asyncio.create_task(http.post(first + "/v1/chat/completions", json=body))
            while await blocks() <= before:
                if time.perf_counter() - t0 > 10:
                    raise RuntimeError("a placement did not reach the other instance in 10 s")
            delays.append(time.perf_counter() - t0)
            resp = await sent
            await resp.read()
            resp.release()
    delays.sort()
    return {
        "placement_p50_ms": delays[len(delays) // 2] * 1000,
        "placement_p99_ms": delays[min(len(delays) - 1, int(0.99 * len(delays)))] * 1000,
        "placement_max_ms": delays[-1] * 1000,
    }


def metric_sums(url: str, want: dict[str, str]) -> dict[str, float]:
    """key -> the sum of every sample of metric ``want[key]`` in ``url``'s /metrics."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(want, 0.0)
    for line in text.splitlines():
        for key, name in want.items():
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def scrape(port: int) -> dict[str, float]:
    """A replica's prefix-cache counters and finished requests."""
    return metric_sums(
        f"http://127.0.0.1:{port}",
        {
            "hits": "vllm:prefix_cache_hits_total",
            "queries": "vllm:prefix_cache_queries_total",
            "requests": "vllm:request_success_total",
        },
    )


# Each replica's KV cache events (PUB, replay) by its HTTP port: every replica publishes them,
# as vLLM started with --kv-events-config does, whichever configuration runs; only the
# precise one subscribes.
KV_EVENTS: dict[int, tuple[str, str]] = {}


@contextlib.contextmanager
def replicas(tmp: Path) -> Iterator[list[int]]:
    # Three ports a replica, all distinct: free_port() may hand out a port twice before any
    # child binds it, and a replica whose HTTP port went to a peer's ZMQ socket never answers.
    distinct: set[int] = set()
    while len(distinct) < 3 * REPLICAS:
        distinct.add(free_port())
    pool = sorted(distinct, key=lambda _: random.random())
    ports = pool[:REPLICAS]
    with contextlib.ExitStack() as stack:
        for i, p in enumerate(ports):
            events = f"tcp://127.0.0.1:{pool[REPLICAS + 2 * i]}"
            replay = f"tcp://127.0.0.1:{pool[REPLICAS + 2 * i + 1]}"
            KV_EVENTS[p] = (events, replay)
            config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
                      "replay_endpoint": replay}  # fmt: skip
            argv = [sys.executable, "-m", "loadtest.sim", "--port", str(p), "--name", f"sim{i}"]
            argv += ["--kv-events-config", json.dumps(config)]
            stack.enter_context(process(argv + SIM_ARGS, log=tmp / f"sim{i}.log"))
        for p in ports:
            wait_http(f"http://127.0.0.1:{p}/health")
        yield ports


@contextlib.contextmanager
def gateway(kind: str, balance: str, ports: list[int], tmp: Path) -> Iterator[list[str]]:
    """The configuration's gateway processes; yields their URLs (two for ``+2instances``)."""
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    if kind != "tokenlane":
        port = free_port()
        exe = peers.ensure("vllm-router")
        argv = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--policy", balance]
        argv += ["--worker-urls", *urls, "--prometheus-port", str(free_port())]
        argv += ["--log-level", "warning"]
        with process(argv, log=tmp / f"{kind}-{balance}.log"):
            wait_http(f"http://127.0.0.1:{port}/health", timeout_s=60)
            yield [f"http://127.0.0.1:{port}"]
        return
    # "cache_aware+precise": routed on the replicas' KV events; "+2workers": two workers;
    # "+2instances": two instances sharing a Redis.
    balance, _, variant = balance.partition("+")
    reps: list[dict[str, Any]] = [{"url": u, "max_in_flight": 256} for u in urls]
    if variant == "precise":
        for rc, p in zip(reps, ports, strict=True):
            rc["kv_events"], rc["kv_events_replay"] = KV_EVENTS[p]
    policy: dict[str, Any] = {
        "pools": {"p": {"balance": balance, "replicas": reps}},
        "lanes": [{"name": "all", "pool": "p"}],
    }
    with contextlib.ExitStack() as stack:
        instances = 1
        if variant == "2instances":
            instances = 2
            redis_port = free_port()
            argv = ["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"]
            stack.enter_context(process(argv, log=tmp / "redis.log"))
            wait_port(redis_port)
            policy["redis"] = {"url": f"redis://127.0.0.1:{redis_port}/0"}
        gateway_ports = [free_port() for _ in range(instances)]
        for i, port in enumerate(gateway_ports):
            policy["server"] = {"host": "127.0.0.1", "port": port}
            path = tmp / f"policy-{balance}-{variant}-{i}.yaml"
            path.write_text(yaml.safe_dump(policy))
            argv = [sys.executable, "-m", "proxy", "serve", "--config", str(path)]
            if variant == "2workers":
                argv += ["--workers", "2"]
            stack.enter_context(process(argv, log=tmp / f"{kind}-{balance}-{variant}-{i}.log"))
        for port in gateway_ports:
            wait_http(f"http://127.0.0.1:{port}/ready", timeout_s=60)
            # /ready once one replica is healthy: wait for all four to pass their canaries.
            _wait_all_healthy(port)
        yield [f"http://127.0.0.1:{port}" for port in gateway_ports]


def _wait_all_healthy(port: int, timeout_s: float = 60.0) -> None:
    """Until the gateway's own metrics show every replica healthy (canaries passed)."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                text = r.read().decode()
            healthy = sum(
                1
                for line in text.splitlines()
                if line.startswith("tokenlane_replica_state{")
                and 'state="healthy"' in line
                and line.endswith(" 1.0")
            )
            if healthy >= REPLICAS:
                return
        time.sleep(0.2)
    raise TimeoutError(f"gateway :{port}: not all {REPLICAS} replicas healthy in {timeout_s:g}s")


def run_one(
    kind: str, balance: str, ports: list[int], w: Workload, salt: str, seed: int, tmp: Path
) -> dict[str, Any]:
    with gateway(kind, balance, ports, tmp) as urls:
        # Counted from here, once the gateway is up: Tokenlane's startup canaries (a one-token
        # "ping" per replica) are prefills the workload did not ask for, and would lower its
        # hit rate by 4 query tokens that vllm-router, which sends none, does not pay.
        before = [scrape(p) for p in ports]
        r, wall = asyncio.run(drive(urls, w, requests_for(w, salt, seed), seed))
        # Proof that a precise run saw events: batches applied, replicas on their events now.
        kv = gateway_kv(urls[0]) if kind == "tokenlane" else {"batches": 0.0, "up": 0.0}
        after = [scrape(p) for p in ports]
        # After the load (and its counters): the probes' prompts must not change its cache.
        shared = asyncio.run(placement_delay(urls)) if len(urls) > 1 else {}
    d = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    hits, queries = sum(x["hits"] for x in d), sum(x["queries"] for x in d)
    per = [int(x["requests"]) for x in d]
    t = sorted(r.ttft)

    def q(p: float) -> float:
        return t[min(len(t) - 1, int(p * len(t)))] * 1000 if t else float("nan")

    return {
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_p50_ms": q(0.50),
        "ttft_p99_ms": q(0.99),
        "ttft_mean_ms": statistics.fmean(t) * 1000 if t else float("nan"),
        "output_tok_s": r.output_tokens / wall,
        "per_replica": per,
        "spread": max(per) / (sum(per) / len(per)) if sum(per) else 0.0,
        "errors": r.errors,
        "kv_event_batches": kv["batches"],
        "kv_events_up": kv["up"],
        **shared,
    }


def gateway_kv(url: str) -> dict[str, float]:
    """A gateway's KV event batches applied, and how many replicas are on their events now."""
    return metric_sums(
        url, {"batches": "tokenlane_kv_event_batches_total", "up": "tokenlane_kv_events_up"}
    )


def mean_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in rows[0].items():
        if isinstance(v, list):
            out[k] = [round(statistics.fmean(r[k][i] for r in rows), 1) for i in range(len(v))]
        else:
            out[k] = statistics.fmean(r[k] for r in rows)
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = []
    for wl, rows in results.items():
        lines.append(f"\n### {wl}\n")
        lines.append(
            "| configuration | hit rate | TTFT p50 / p99 / mean (ms) | output tok/s "
            "| requests per replica (max/mean) | errors |"
        )
        lines.append("|---|---|---|---|---|---|")
        for name, m in rows.items():
            if "skipped" in m:
                lines.append(f"| {name} | not run: {m['skipped']} | | | | |")
                continue
            lines.append(
                f"| {name} | {m['hit_rate'] * 100:.0f} % | {m['ttft_p50_ms']:.0f} / "
                f"{m['ttft_p99_ms']:.0f} / {m['ttft_mean_ms']:.0f} | {m['output_tok_s']:.0f} | "
                f"{m['per_replica']} ({m['spread']:.2f}) | {m['errors']:.0f} |"
            )
        for name, m in rows.items():
            if "placement_p50_ms" in m:
                lines.append(
                    f"\n{name}: a placement reached the other instance's index in "
                    f"{m['placement_p50_ms']:.1f} / {m['placement_p99_ms']:.1f} / "
                    f"{m['placement_max_ms']:.1f} ms (p50 / p99 / max, idle, from the request's "
                    "send)"
                )
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (wl, rows) in zip(axes[0], results.items(), strict=True):
        names = [n for n, m in rows.items() if "skipped" not in m]
        for n in names:
            m = rows[n]
            ax.scatter(m["hit_rate"] * 100, m["ttft_mean_ms"], label=n)
        ax.set_title(wl)
        ax.set_xlabel("prefix-cache hit rate (%)")
        ax.set_ylabel("TTFT mean (ms)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


# ---------------------------------------------------------------------- virtual time

VIRTUAL_BALANCES = ("round_robin", "least_loaded", "prefix_affinity", "cache_aware")


@dataclass(eq=False)
class _VCall:
    request_id: str
    profile: Profile
    ttft_s: float | None = None
    finished: bool = False
    prefix_match_tokens: int | None = None
    prompt_token_ids: list[int] | None = None


def run_virtual(balance: str, w: Workload, seed: int) -> dict[str, Any]:
    """The gateway's own decision code over four simulator schedulers, in virtual time.

    No processes and no wall clock: the figures depend on the routing alone, not on how busy
    the machine is. The replicas' waiting queues are "scraped" once a virtual second, as the
    health loop does; in-flight counts are exact, as in the gateway.
    """
    from loadtest.sim.generate import Output
    from loadtest.sim.scheduler import EngineRequest, Scheduler
    from loadtest.sim.settings import SimSettings
    from loadtest.sim.tokenizer import encode, render_chat
    from proxy.config import CacheAwareConfig, ReplicaConfig
    from proxy.fleet.fleet import Replica
    from proxy.fleet.vllm import EngineSample
    from proxy.routing import balance as bal
    from proxy.routing.cache_aware import CacheAwareRouter
    from proxy.routing.profile import Profile, affinity_key

    settings = SimSettings(num_gpu_blocks=2200, prefill_per_token_s=0.0002)
    scheds = [Scheduler(settings) for _ in range(REPLICAS)]
    reps = []
    for i in range(REPLICAS):
        r = Replica(pool="p", config=ReplicaConfig(url=f"http://sim{i}"), name=f"sim{i}", url="")
        r.stats.stale = False
        reps.append(r)
    router = CacheAwareRouter()
    cfg = CacheAwareConfig()
    rng = random.Random(seed)
    arr_rng = random.Random(seed + 1)
    reqs = requests_for(w, "virtual", seed)
    t = 0.0
    arrivals = []
    for messages in reqs:
        arrivals.append((t, messages))
        t += arr_rng.expovariate(w.rate)
    step_end: list[float | None] = [None] * REPLICAS
    plans: list[Any] = [None] * REPLICAS
    live: list[list[tuple[EngineRequest, _VCall]]] = [[] for _ in range(REPLICAS)]
    done: list[EngineRequest] = []
    per = [0] * REPLICAS
    hits = queries = 0
    next_scrape = 0.0
    rr = 0
    ai = 0

    def start_step(i: int, now: float) -> None:
        nonlocal hits, queries
        if scheds[i].has_work():
            plan = scheds[i].schedule(now)
            hits += plan.cache_hits
            queries += plan.cache_queries
            plans[i] = plan
            step_end[i] = now + scheds[i].step_time(plan)
        else:
            step_end[i] = None

    while ai < len(arrivals) or any(e is not None for e in step_end):
        t_arr = arrivals[ai][0] if ai < len(arrivals) else float("inf")
        ends = [(e, i) for i, e in enumerate(step_end) if e is not None]
        t_step, i_step = min(ends) if ends else (float("inf"), -1)
        now = min(t_arr, t_step)
        while next_scrape <= now:
            for r, s in zip(reps, scheds, strict=True):
                r.stats.sample = EngineSample(waiting=len(s.waiting), running=len(s.running))
            next_scrape += 1.0
        if t_step <= t_arr:
            i = i_step
            scheds[i].complete(plans[i], now)
            still = []
            for req, call in live[i]:
                if req.first_token_at is not None and call.ttft_s is None:
                    call.ttft_s = req.first_token_at - req.arrival
                if req.done:
                    call.finished = True
                    reps[i].in_flight -= 1
                    done.append(req)
                else:
                    still.append((req, call))
            live[i] = still
            start_step(i, now)
            continue
        messages = arrivals[ai][1]
        ai += 1
        text, _ = render_chat(messages)
        # A real Profile: the routing code may be compiled (``proxy/compiled.py``).
        profile = Profile("chat", None, True, len(text), len(text) // 4, None, 1, 0, text)
        call = _VCall(f"v{ai}", profile)
        if balance == "cache_aware":
            picked = router.pick(reps, call, cfg, 4.0, rng)  # type: ignore[arg-type]
            chosen = picked[0] if picked is not None else None
        else:
            key = affinity_key(call.profile, 1024)
            chosen = bal.pick(balance, reps, key=key, rng=rng, rr_index=rr, bounded_load=1.25)
            rr += 1
        assert chosen is not None  # reps is never empty
        i = reps.index(chosen)
        per[i] += 1
        chosen.in_flight += 1
        req = EngineRequest(
            id=call.request_id,
            prompt=encode(text),
            output=Output(ai, max_tokens=w.output_tokens),
            arrival=now,
        )
        scheds[i].add(req)
        live[i].append((req, call))
        if step_end[i] is None:
            start_step(i, now)
    # A finished request has both timestamps; the scheduler sets them as it goes.
    ttft = sorted(r.first_token_at - r.arrival for r in done if r.first_token_at is not None)
    wall = max(r.finished_at for r in done if r.finished_at is not None)
    out_tokens = sum(r.num_output for r in done)

    def q(p: float) -> float:
        return ttft[min(len(ttft) - 1, int(p * len(ttft)))] * 1000

    return {
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_p50_ms": q(0.50),
        "ttft_p99_ms": q(0.99),
        "ttft_mean_ms": statistics.fmean(ttft) * 1000,
        "output_tok_s": out_tokens / wall,
        "per_replica": per,
        "spread": max(per) / (sum(per) / len(per)),
        "errors": len(reqs) - len(done),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--configs", default=",".join(f"{k}:{b}" for k, b in CONFIGS))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one repetition, half the prompts")
    ap.add_argument(
        "--virtual",
        action="store_true",
        help="Tokenlane's balances over the simulator's scheduler in virtual time (no processes)",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)
    reps = 1 if args.quick else args.reps
    configs = [tuple(c.split(":", 1)) for c in args.configs.split(",")]
    peer_problem = None
    if any(k == "vllm-router" for k, _ in configs):
        try:
            peers.ensure("vllm-router")
        except peers.PeerUnavailable as exc:
            peer_problem = str(exc).splitlines()[0]
            print(f"vllm-router: not run ({peer_problem})", file=sys.stderr)
    results: dict[str, dict[str, Any]] = {}
    if args.virtual:
        for wl in args.workloads.split(","):
            results[wl] = {}
            for b in VIRTUAL_BALANCES:
                rows = [run_virtual(b, WORKLOADS[wl], 1000 + rep) for rep in range(reps)]
                results[wl][f"tokenlane {b}"] = mean_rows(rows)
                print(f"{wl} {b}: {json.dumps(results[wl][f'tokenlane {b}'])}", file=sys.stderr)
        return report(results, reps, args, "virtual time, the simulator's scheduler")
    with tempfile.TemporaryDirectory() as tmpname:
        tmp = Path(tmpname)
        for wl in args.workloads.split(","):
            w = WORKLOADS[wl]
            if args.quick:
                w = Workload(
                    w.groups,
                    max(1, w.per_group // 2),
                    w.system_tokens,
                    w.question_tokens,
                    w.output_tokens,
                    w.rate,
                )
            results[wl] = {}
            if wl == "shared_prefix":
                with replicas(tmp) as ports:
                    cost = asyncio.run(render_cost(ports[0], w))
                print(f"render cost (precise mode), one replica idle: {json.dumps(cost)}")
            runs: dict[str, list[dict[str, Any]]] = {}
            for rep in range(reps):
                # The same prompts (salt and seed) for every configuration of a repetition.
                salt = hashlib.blake2b(f"{wl}-{rep}".encode(), digest_size=4).hexdigest()
                for kind, balance in configs:
                    name = f"{kind} {balance}"
                    if kind == "vllm-router" and peer_problem:
                        results[wl][name] = {"skipped": peer_problem}
                        continue
                    with replicas(tmp) as ports:  # started afresh: every run from an empty cache
                        row = run_one(kind, balance, ports, w, salt, 1000 + rep, tmp)
                    runs.setdefault(name, []).append(row)
                    print(f"{wl} rep {rep} {name}: {json.dumps(row)}", file=sys.stderr)
            for name, rows in runs.items():
                results[wl][name] = mean_rows(rows)
    return report(results, reps, args, "4 simulator processes over HTTP")


def report(
    results: dict[str, dict[str, Any]], reps: int, args: argparse.Namespace, how: str
) -> int:
    stamp = time.strftime("%Y-%m-%d", time.gmtime())
    print(f"bench_cache {stamp}, {reps} repetition(s), {how} ({' '.join(SIM_ARGS)})")
    print(table(results))
    if args.json:
        args.json.write_text(
            json.dumps({"date": stamp, "reps": reps, "results": results}, indent=1)
        )
    if args.plot and not plot(results, args.plot):
        print("no matplotlib: no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
