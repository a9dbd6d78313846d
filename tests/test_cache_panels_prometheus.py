"""The Replicas dashboard's ``cache_aware`` panels, checked through a real Prometheus: a gateway
with a ``cache_aware`` pool over two simulated replicas serves groups of prompts that share a
system prompt, Prometheus scrapes it, and each panel's expression is evaluated through the HTTP
API and compared with the truth (the simulators' own prefix-cache counters, the gateway's own
indexes). The incident test routes one replica's pool ``cache_aware``; here two replicas share
the groups, so the panels show a pool whose picks choose between replicas.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.sim.server import run_sim
from proxy.routing import cache_aware

from .gateway import policy_for, running_gateway, wait_healthy
from .prometheus_server import running_prometheus
from .test_incident_prometheus import DASHBOARDS, MODEL, as_promql, sim_counter, until, values

GROUPS, QUESTIONS = 3, 4


def cache_panels() -> dict[str, list[tuple[str, str]]]:
    """title -> [(refId, expr)] of the Replicas dashboard's cache_aware panels."""
    (path,) = [p for p in DASHBOARDS if p.stem == "tokenlane-replicas"]
    out: dict[str, list[tuple[str, str]]] = {}
    for panel in json.loads(path.read_text())["panels"]:
        if panel["title"].startswith("cache_aware:"):
            out[panel["title"]] = [(t["refId"], t["expr"]) for t in panel["targets"]]
    return out


def body(group: int, question: int) -> dict[str, Any]:
    system = " ".join(f"group {group} rule {i}: answer in one short line." for i in range(60))
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"question {question}"},
    ]
    return {"model": MODEL, "messages": messages, "max_tokens": 2}


async def hits_and_queries(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for u in urls:
        hits += await sim_counter(u, "vllm:prefix_cache_hits_total")
        queries += await sim_counter(u, "vllm:prefix_cache_queries_total")
    return hits, queries


async def test_cache_aware_panels_show_the_pools_routing(tmp_path: Path) -> None:
    panels = cache_panels()
    assert len(panels) == 4, sorted(panels)
    async with run_sim(name="a") as a, run_sim(name="b") as b:
        urls = [a.url, b.url]
        policy = policy_for({"cached": urls}, balance="cache_aware")
        async with running_gateway(policy, ready=False) as (url, app):
            await wait_healthy(app, 2)
            jobs = {"tokenlane": [url.removeprefix("http://")]}
            prom_cm = running_prometheus(tmp_path, jobs)
            prom = await asyncio.to_thread(prom_cm.__enter__)
            try:

                async def scraped_after(t: float) -> bool:
                    return await asyncio.to_thread(prom.last_scrape) > t

                t0 = time.time()
                await until(lambda: scraped_after(t0 + 1), 120, "scrapes before the traffic")
                started = time.time()
                before = await hits_and_queries(urls)
                async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                    for q in range(QUESTIONS):
                        for g in range(GROUPS):
                            r = await client.post("/v1/chat/completions", json=body(g, q))
                            assert r.status_code == 200, r.text
                after = await hits_and_queries(urls)
                sims_done = time.time()

                # The gateway's health loop reads the replicas' counters after the last
                # request (fleet clock), then Prometheus scrapes the gateway.
                fleet = app.gateway.fleet
                read_at = fleet.clock()

                async def read_after_traffic() -> bool:
                    return all((r.stats.at or 0) > read_at for r in fleet.replicas())

                await until(read_after_traffic, 60, "a health round after the traffic")
                settled = max(time.time(), sims_done) + 1
                await until(lambda: scraped_after(settled), 60, "a scrape after the traffic")
                at = await asyncio.to_thread(prom.last_scrape)
                window = f"{math.ceil(at - started) + 2}s"
                results = {
                    (title, ref): await asyncio.to_thread(prom.query, as_promql(expr, window), at)
                    for title, targets in panels.items()
                    for ref, expr in targets
                }
            finally:
                await asyncio.to_thread(prom_cm.__exit__, None, None, None)
            router = cache_aware.routers(app.gateway.fleet)["cached"]
            blocks = {name: len(ix) for name, ix in router.indexes.items()}
            nbytes = sum(ix.nbytes for ix in router.indexes.values())

    def one(title: str, ref: str = "A", *labels: str) -> dict[tuple[str, ...], float]:
        return values(results[(title, ref)], *labels)

    p50 = one("cache_aware: prefix matched per pick, p50 / p99", "A", "pool")
    p99 = one("cache_aware: prefix matched per pick, p50 / p99", "B", "pool")
    # 12 picks, 9 of them a group's later question: the median pick matched its prefix.
    assert set(p50) == {("cached",)} and 64 < p50[("cached",)] <= p99[("cached",)], (p50, p99)

    true_rate = (after[0] - before[0]) / (after[1] - before[1])
    assert 0 < true_rate < 1
    rate = one("cache_aware: prefix-cache hit rate per pool", "A", "pool")
    assert set(rate) == {("cached",)}, rate
    assert abs(rate[("cached",)] - true_rate) < 0.02, (rate, true_rate)

    shown = one("cache_aware: prefix index blocks per replica", "A", "replica")
    assert {k[0]: v for k, v in shown.items() if v} == {n: b for n, b in blocks.items() if b}
    assert sum(shown.values()) > 0
    memory = one("cache_aware: prefix index memory per pool", "A", "pool")
    assert memory == {("cached",): float(nbytes)}
