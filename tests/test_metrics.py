"""Every metric of the contract (docs/operations.md, "Metrics") is emitted with its labels after real traffic (every lane, a
retry, a spill, a rejection, an ejection), and `promtool check metrics` accepts the scrape."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.fake_upstream import running

from .gateway import policy_for, running_gateway, wait_healthy
from .servers import free_port
from .waiting import wait_until

CHAT = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "messages": [{"role": "user", "content": "hi"}]}

# The metrics contract: name -> label names (counters without their _total suffix, as parsed).
CONTRACT = {
    "tokenlane_requests": {"lane", "pool", "replica", "status"},
    "tokenlane_ttft_seconds": {"lane", "pool"},
    "tokenlane_inter_token_seconds": {"lane", "pool"},
    "tokenlane_request_duration_seconds": {"lane", "pool"},
    "tokenlane_queue_depth": {"lane"},
    "tokenlane_queue_wait_seconds": {"lane"},
    "tokenlane_rejections": {"lane", "reason"},
    "tokenlane_replica_state": {"pool", "replica", "state"},
    "tokenlane_replica_in_flight": {"pool", "replica"},
    "tokenlane_ejections": {"pool", "replica", "reason"},
    "tokenlane_retries": {"lane", "reason"},
    "tokenlane_spills": {"lane", "from_pool", "to_pool"},
    "tokenlane_panic": {"pool"},
    "tokenlane_prompt_tokens_estimated": {"pool"},
    "tokenlane_prompt_tokens_reported": {"pool"},
    "tokenlane_overhead_seconds": {"lane"},
    "tokenlane_shared_state_up": set(),
}
TYPES = {
    "tokenlane_queue_depth": "gauge",
    "tokenlane_replica_state": "gauge",
    "tokenlane_replica_in_flight": "gauge",
    "tokenlane_panic": "gauge",
    "tokenlane_shared_state_up": "gauge",
}


async def scrape_after_traffic() -> AsyncIterator[str]:
    """A gateway scrape after traffic through every lane, a retry, a spill, a rejection and
    an operator ejection."""
    async with (
        running(tokens=5) as fast,
        running(tokens=5) as bulk_a,
        running(tokens=5) as bulk_b,
    ):
        dead = f"http://127.0.0.1:{free_port()}"
        policy = policy_for(
            {"interactive": [fast.url], "bulk": [bulk_a.url, bulk_b.url], "nowhere": [dead]},
            lanes=[
                {"name": "huge", "pool": "nowhere", "when": {"prompt_tokens_min": 3000}},
                {
                    "name": "short",
                    "pool": "interactive",
                    "when": {"stream": True},
                    "spill_to": "bulk",
                    "ttft_slo_s": 0.5,
                },
                {"name": "long", "pool": "bulk"},
            ],
            health={"interval_s": 60},
        )
        async with running_gateway(policy, ready=False) as (url, app):
            await wait_healthy(app, 3)
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                post = client.post
                assert (
                    await post(
                        "/v1/chat/completions",
                        json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
                    )
                ).status_code == 200
                assert (await post("/v1/chat/completions", json=CHAT)).status_code == 200
                bulk_a.fail_status = 503  # the next bulk requests are retried on bulk_b
                for _ in range(2):
                    assert (await post("/v1/chat/completions", json=CHAT)).status_code == 200
                bulk_a.fail_status = None
                huge = {**CHAT, "messages": [{"role": "user", "content": "word " * 20000}]}
                assert (await post("/v1/chat/completions", json=huge)).status_code == 503
                r = await post("/admin/replicas/eject", json={"url": fast.url})
                assert r.status_code == 200, r.text
                spilled = await post("/v1/chat/completions", json={**CHAT, "stream": True})
                assert spilled.headers["x-tokenlane-lane"] == "short"
                assert spilled.headers["x-tokenlane-replica"] != fast.url.removeprefix("http://")
                yield (await client.get("/metrics")).text


@pytest.fixture
async def scrape() -> AsyncIterator[str]:
    async for text in scrape_after_traffic():
        yield text


async def test_every_contract_metric_is_emitted_with_its_labels(scrape: str) -> None:
    families = {f.name: f for f in text_string_to_metric_families(scrape)}
    for name, labels in CONTRACT.items():
        assert name in families, f"{name} missing"
        family = families[name]
        assert family.samples, f"{name} has no series"
        for sample in family.samples:
            assert labels <= set(sample.labels) | {"le"}, (name, sample.labels)
        if name in TYPES:
            assert family.type == TYPES[name]
    reasons = {
        (s.labels["lane"], s.labels["reason"])
        for s in families["tokenlane_retries"].samples
        if s.value
    }
    assert ("long", "upstream_5xx") in reasons
    rejected = {s.labels["reason"] for s in families["tokenlane_rejections"].samples if s.value}
    assert "no_replica" in rejected
    ejected = {s.labels["reason"] for s in families["tokenlane_ejections"].samples if s.value}
    assert "operator" in ejected
    spills = [s.labels for s in families["tokenlane_spills"].samples if s.value]
    assert {"lane": "short", "from_pool": "interactive", "to_pool": "bulk"} in spills


async def test_promtool_accepts_the_scrape(scrape: str) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: make test installs Debian's prometheus package"
    result = subprocess.run(
        [promtool, "check", "metrics"], input=scrape, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_histograms_resolve_5ms_to_60s() -> None:
    from proxy.observe.metrics import LATENCY_BUCKETS

    assert LATENCY_BUCKETS[0] <= 0.005 and LATENCY_BUCKETS[-1] >= 60


def has_access_line(caplog: pytest.LogCaptureFixture) -> bool:
    return any(rec.name == "tokenlane.access" for rec in caplog.records)


async def test_access_log_is_one_json_line_per_request_without_secrets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with running(tokens=3) as up:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, _):
            with caplog.at_level("INFO", logger="tokenlane.access"):
                async with httpx.AsyncClient(timeout=10) as client:
                    r = await client.post(
                        url + "/v1/chat/completions",
                        json={**CHAT, "stream": True},
                        headers={"authorization": "Bearer sk-secret-key", "x-request-id": "r-1"},
                    )
                    assert r.status_code == 200
                # Lines are written within FLUSH_S, off the request's path.
                await wait_until(
                    lambda: has_access_line(caplog), what="the access line", poll=0.005
                )
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "tokenlane.access"]
    assert len(lines) == 1
    record = json.loads(lines[0])
    for key in (
        "request_id",
        "lane",
        "pool",
        "replica",
        "status",
        "prompt_tokens_est",
        "output_tokens",
        "queue_wait_ms",
        "ttft_ms",
        "duration_ms",
        "retries",
    ):
        assert key in record, key
    assert record["request_id"] == "r-1" and record["status"] == 200 and record["lane"] == "all"
    assert record["ttft_ms"] > 0
    assert "sk-secret-key" not in lines[0]
