"""Counters exist at 0 from the moment the policy loads (so the first event counts in rate()),
stay across reloads and go with their replica or lane; the replica info series; per-replica
TTFT; the estimated/reported prompt-token ratio over the same requests."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtest.fake_upstream import running
from proxy.observe.metrics import (
    CONTINUATION_REFUSALS,
    CONTINUATION_TRIGGERS,
    EJECTION_REASONS,
    RETRY_REASONS,
    Metrics,
    diff_label_sets,
    known_label_sets,
    replica_address,
    replica_ttft_s,
)
from proxy.policyfile import build_policy
from proxy.relay.continuation import Refusal, Trigger

from .gateway import policy_for, running_gateway
from .test_reload import gateway_with_file, write_atomically

CHAT = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("http://vllm-fast-0:8000", "vllm-fast-0:8000"),
        ("http://127.0.0.1:8101/", "127.0.0.1:8101"),
        ("http://10.0.0.7", "10.0.0.7:80"),
        ("https://vllm.example", "vllm.example:443"),
        ("http://[::1]:8000", "[::1]:8000"),
    ],
)
def test_replica_address_is_what_prometheus_calls_the_instance(url: str, address: str) -> None:
    assert replica_address(url) == address


@pytest.mark.parametrize(
    ("ttft", "wait", "retries", "expected"),
    [
        (0.5, 0.2, 0, 0.3),
        (0.5, 0.0, 0, 0.5),
        (None, 0.0, 0, None),  # no first chunk
        (0.5, 0.1, 1, None),  # retried: spread over replicas
        (0.1, 0.2, 0, 0.0),  # clocks never give a negative
    ],
)
def test_replica_ttft_is_dispatch_to_first_chunk(
    ttft: float | None, wait: float, retries: int, expected: float | None
) -> None:
    got = replica_ttft_s(ttft, wait, retries)
    assert got == (pytest.approx(expected) if expected is not None else None)


def lanes_of(data: dict) -> list:
    return build_policy(data).lanes


def test_known_label_sets_cover_every_lane_and_replica() -> None:
    lanes = lanes_of(
        policy_for(
            {"i": ["http://a:1"], "b": ["http://b:1"]},
            lanes=[
                {"name": "short", "pool": "i", "spill_to": "b", "when": {"stream": True}},
                {"name": "long", "pool": "b"},
            ],
        )
    )
    sets = known_label_sets(lanes, [("i", "a", "http://a:1"), ("b", "bee", "http://b:1")])
    assert sets["ejections"] == {
        (p, n, r) for p, n in (("i", "a"), ("b", "bee")) for r in EJECTION_REASONS
    }
    assert sets["retries"] == {(lane, r) for lane in ("short", "long") for r in RETRY_REASONS}
    assert ("short", "queue_full") in sets["rejections"] and ("none", "unauthorized") in sets[
        "rejections"
    ]
    assert ("long", "unauthorized") not in sets["rejections"]
    assert sets["spills"] == {("short", "i", "b")}
    # 200 from each replica of the lane's pools, and the gateway's own refusals
    assert sets["requests"] == {
        ("short", "i", "a", "200"), ("short", "b", "bee", "200"), ("long", "b", "bee", "200"),
        ("short", "", "", "429"), ("short", "", "", "503"),
        ("long", "", "", "429"), ("long", "", "", "503"),
    }  # fmt: skip
    assert sets["replica_info"] == {
        ("i", "a", "http://a:1", "a:1"),
        ("b", "bee", "http://b:1", "b:1"),
    }


def test_continuation_series_exist_for_the_lanes_that_continue() -> None:
    lanes = lanes_of(
        policy_for(
            {"i": ["http://a:1"]},
            lanes=[
                {"name": "on", "pool": "i", "when": {"stream": True}},
                {"name": "off", "pool": "i"},
            ],
        )
    )
    sets = known_label_sets(lanes, [("i", "a", "http://a:1")], continuing_lanes=["on"])
    assert sets["continuations"] == {
        ("on", t, o) for t in CONTINUATION_TRIGGERS for o in ("ok", "failed")
    }
    # A lane that cannot continue can only refuse a cut stream as `disabled`.
    assert sets["continuation_refusals"] == {("on", r) for r in CONTINUATION_REFUSALS} | {
        ("off", "disabled")
    }
    assert sets["continuation_gap"] == sets["continuation_replayed"] == {("on",)}


def test_the_continuation_label_values_are_the_relays_own() -> None:
    # observe may not import relay (tests/test_layers.py), so the values are written twice.
    assert set(CONTINUATION_TRIGGERS) == {t.value for t in Trigger}
    assert set(CONTINUATION_REFUSALS) == {r.value for r in Refusal}


def test_diff_keeps_what_stays() -> None:
    old = {"retries": {("a", "connect"), ("b", "connect")}}
    new = {"retries": {("b", "connect"), ("c", "connect")}, "spills": {("c", "p", "q")}}
    add, gone = diff_label_sets(old, new)
    assert add == {"retries": {("c", "connect")}, "spills": {("c", "p", "q")}}
    assert gone == {"retries": {("a", "connect")}, "spills": set()}


def samples(text: str, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    for f in text_string_to_metric_families(text):
        if f.name == family:
            return {
                tuple(sorted(s.labels.items())): s.value
                for s in f.samples
                if not s.name.endswith("_created")
            }
    return {}


class _R:
    def __init__(self, pool: str, name: str, url: str) -> None:
        self.pool, self.name, self.url = pool, name, url


def test_sync_creates_at_zero_keeps_counts_and_removes_what_left() -> None:
    from prometheus_client import generate_latest

    m = Metrics()
    one = lanes_of(policy_for({"p": ["http://a:1"]}, lanes=[{"name": "x", "pool": "p"}]))
    m.sync(one, [_R("p", "a", "http://a:1")])
    text = generate_latest(m.registry).decode()
    ej = samples(text, "tokenlane_ejections")
    assert len(ej) == len(EJECTION_REASONS) and set(ej.values()) == {0.0}
    m.ejections.labels("p", "a", "stall").inc()
    m.series(m.retries, "x", "connect").inc()
    two = lanes_of(
        policy_for(
            {"p": ["http://a:1"], "q": ["http://b:1"]},
            lanes=[
                {"name": "y", "pool": "q", "when": {"stream": True}},
                {"name": "x", "pool": "p"},
            ],
        )
    )
    m.sync(two, [_R("p", "a", "http://a:1"), _R("q", "b", "http://b:1")])
    text = generate_latest(m.registry).decode()
    ej = samples(text, "tokenlane_ejections")
    assert ej[(("pool", "p"), ("reason", "stall"), ("replica", "a"))] == 1.0  # kept
    assert ej[(("pool", "q"), ("reason", "stall"), ("replica", "b"))] == 0.0  # new, at 0
    assert samples(text, "tokenlane_retries")[(("lane", "x"), ("reason", "connect"))] == 1.0
    # lane x and replica a leave
    three = lanes_of(policy_for({"q": ["http://b:1"]}, lanes=[{"name": "y", "pool": "q"}]))
    m.forget_replica("p", "a")  # what the fleet does when a replica leaves
    m.sync(three, [_R("q", "b", "http://b:1")])
    text = generate_latest(m.registry).decode()
    assert not any(dict(k)["replica"] == "a" for k in samples(text, "tokenlane_ejections"))
    assert not any(dict(k)["lane"] == "x" for k in samples(text, "tokenlane_retries"))
    assert not any(dict(k)["replica"] == "a" for k in samples(text, "tokenlane_replica_info"))
    # A cached child of a removed series is not reused: a lane that comes back starts at 0.
    m.sync(one, [_R("p", "a", "http://a:1")])
    text = generate_latest(m.registry).decode()
    assert samples(text, "tokenlane_retries")[(("lane", "x"), ("reason", "connect"))] == 0.0
    m.series(m.retries, "x", "connect").inc()
    text = generate_latest(m.registry).decode()
    assert samples(text, "tokenlane_retries")[(("lane", "x"), ("reason", "connect"))] == 1.0


async def test_gateway_scrape_has_every_counter_at_zero_and_follows_reload(tmp_path: Path) -> None:
    async with running(tokens=3) as a, running(tokens=3) as b:
        path = tmp_path / "policy.yaml"
        first = policy_for(
            {"p": [a.url]}, lanes=[{"name": "x", "pool": "p"}], health={"interval_s": 60}
        )
        path.write_text(yaml.safe_dump(first))
        async with gateway_with_file(path) as (url, app):
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                text = (await client.get("/metrics")).text
                name = app.gateway.fleet.pools["p"].replicas[0].name
                ej = samples(text, "tokenlane_ejections")
                assert ej[(("pool", "p"), ("reason", "operator"), ("replica", name))] == 0.0
                info = samples(text, "tokenlane_replica_info")
                addr = a.url.removeprefix("http://")
                assert info == {
                    (("address", addr), ("pool", "p"), ("replica", name), ("url", a.url)): 1.0
                }
                assert (
                    await client.post("/admin/replicas/eject", json={"url": a.url})
                ).status_code == 200
                second = policy_for(
                    {"p": [a.url], "q": [b.url]},
                    lanes=[
                        {"name": "y", "pool": "q", "when": {"stream": True}},
                        {"name": "x", "pool": "p"},
                    ],
                    health={"interval_s": 60},
                )
                write_atomically(path, second)
                assert (await client.post("/admin/reload")).status_code == 200
                text = (await client.get("/metrics")).text
                ej = samples(text, "tokenlane_ejections")
                assert ej[(("pool", "p"), ("reason", "operator"), ("replica", name))] == 1.0
                rej = samples(text, "tokenlane_rejections")
                assert rej[(("lane", "y"), ("reason", "queue_full"))] == 0.0
                third = policy_for(
                    {"q": [b.url]}, lanes=[{"name": "y", "pool": "q"}], health={"interval_s": 60}
                )
                write_atomically(path, third)
                assert (await client.post("/admin/reload")).status_code == 200
                text = (await client.get("/metrics")).text
                assert not any(
                    dict(k)["replica"] == name for k in samples(text, "tokenlane_ejections")
                )
                assert not any(
                    dict(k)["lane"] == "x" for k in samples(text, "tokenlane_rejections")
                )


async def test_replica_ttft_and_prompt_tokens_over_the_same_requests() -> None:
    async with running(tokens=3) as up:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, app):
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                # With usage (non-streaming answers carry it) and without (a stream without
                # include_usage): only the first counts in both prompt-token counters.
                assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
                r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
                assert r.status_code == 200
                app.gateway.outcomes.flush()
                text = (await client.get("/metrics")).text
    est = samples(text, "tokenlane_prompt_tokens_estimated")
    rep = samples(text, "tokenlane_prompt_tokens_reported")
    assert est and rep
    est_v = next(iter(est.values()))
    rep_v = next(iter(rep.values()))
    # the fake upstream reports a prompt size near the estimate: one request's worth each
    assert 0.2 < est_v / rep_v < 5, (est_v, rep_v)
    counts = {
        k: v
        for k, v in samples(text, "tokenlane_replica_ttft_seconds").items()
        if ("le", "+Inf") in k
    }
    assert sum(counts.values()) == 2
