"""Micro-benchmark of the per-request decisions: profile + lane match, and each pick strategy.

Run: ``.venv/bin/python -m loadtest.bench_decisions`` (about ten seconds). Prints the median of
several repeats in µs per call. The whole gateway's budget is ~600 µs of CPU per request; these
decisions should stay a small fraction of it.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from proxy.config import Policy, ReplicaConfig
from proxy.fleet.fleet import Replica, ReplicaState
from proxy.fleet.vllm import EngineSample
from proxy.policyfile import build_policy
from proxy.routing.balance import pick
from proxy.routing.estimate import Estimator
from proxy.routing.lanes import match_lane
from proxy.routing.profile import profile_request

REPEATS = 5


def per_call_us(fn: Callable[[], Any], target_s: float = 0.1) -> float:
    """Median µs per call over REPEATS runs of a batch sized to take about ``target_s``."""
    n = 1
    while True:  # calibrate the batch size
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t0 > target_s / 4:
            break
        n *= 2
    n = max(1, int(n * target_s / max(time.perf_counter() - t0, 1e-9)))
    runs = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def policy() -> Policy:
    return build_policy(
        {
            "pools": {
                "fast": {"replicas": [{"url": "http://fast-0:8000"}]},
                "bulk": {"balance": "prefix_affinity", "replicas": [{"url": "http://b-0:8000"}]},
            },
            "lanes": [
                {
                    "name": "short",
                    "pool": "fast",
                    "when": {"stream": True, "prompt_tokens_max": 1024, "output_tokens_max": 256},
                    "spill_to": "bulk",
                },
                {"name": "qwen", "pool": "bulk", "when": {"model": "Qwen/*"}},
                {"name": "long", "pool": "bulk"},
            ],
        }
    )


SYSTEM = "You are a helpful assistant. Answer briefly and cite sources. " * 20  # ~1.2k chars
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": "Look something up in the knowledge base and return the top hits.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
                "required": ["query"],
            },
        },
    }
    for i in range(8)
]

BODIES: list[tuple[str, str, dict[str, Any]]] = [
    (
        "chat short (2 msgs)",
        "chat",
        {
            "model": "Qwen/Qwen2.5-0.5B-Instruct",
            "stream": True,
            "max_tokens": 64,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"},
            ],
        },
    ),
    (
        "chat 20 turns, 1.2k system",
        "chat",
        {
            "model": "Qwen/Qwen2.5-0.5B-Instruct",
            "stream": True,
            "max_completion_tokens": 256,
            "messages": [{"role": "system", "content": SYSTEM}]
            + [
                {"role": "user" if i % 2 else "assistant", "content": "Tell me more. " * 30}
                for i in range(20)
            ],
        },
    ),
    (
        "chat parts+image, 8 tools",
        "chat",
        {
            "model": "Qwen/Qwen2.5-VL-7B-Instruct",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in this picture?"},
                        {"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
                    ],
                }
            ],
            "tools": TOOLS,
        },
    ),
    (
        "completion 2k ids",
        "completion",
        {"model": "m", "prompt": list(range(2000)), "max_tokens": 16},
    ),
    (
        "completion 8-prompt batch",
        "completion",
        {"model": "m", "prompt": ["Once upon a time " * 20] * 8, "max_tokens": 32},
    ),
]


def replicas(n: int, rng: random.Random) -> list[Replica]:
    out = []
    for i in range(n):
        cfg = ReplicaConfig(url=f"http://replica-{i}:8000")
        r = Replica(pool="bulk", config=cfg, name=cfg.label, url=cfg.url)
        r.state = ReplicaState.HEALTHY
        r.in_flight = rng.randrange(0, 32)
        r.stats.sample = EngineSample(waiting=float(rng.randrange(0, 4)))
        r.stats.stale = False
        out.append(r)
    return out


def main() -> None:
    pol = policy()
    est = Estimator.from_config(pol.estimate)
    lanes = pol.lanes
    print(f"profile_request + match_lane (median of {REPEATS}, µs per call)")
    for label, kind, body in BODIES:

        def decide(body: dict[str, Any] = body, kind: str = kind) -> None:
            match_lane(profile_request(body, kind, est, 1024), lanes)

        prof = profile_request(body, kind, est, 1024)
        print(
            f"  {label:30s} {per_call_us(decide):7.2f}"
            f"   (prompt_tokens_est {prof.prompt_tokens_est}, lane "
            f"{match_lane(prof, lanes).lane.name})"
        )

    rng = random.Random(1)
    key = SYSTEM[:1024]
    print(f"pick (median of {REPEATS}, µs per call; fleet.Replica candidates)")
    print(f"  {'strategy':18s} {'2':>8s} {'8':>8s} {'32':>8s}")
    for strategy in ("round_robin", "least_loaded", "prefix_affinity"):
        cells = []
        for n in (2, 8, 32):
            cands = replicas(n, rng)
            counter = iter(range(1 << 62))

            def one(
                cands: list[Replica] = cands, strategy: str = strategy, counter: Any = counter
            ) -> None:
                pick(
                    strategy,
                    cands,
                    key=key,
                    rng=rng,
                    rr_index=next(counter),
                    bounded_load=1.25,
                )

            cells.append(per_call_us(one))
        print(f"  {strategy:18s} " + " ".join(f"{c:8.2f}" for c in cells))


if __name__ == "__main__":
    main()
