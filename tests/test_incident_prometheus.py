"""From events to panels, checked: a real Prometheus scrapes a gateway and three simulated
vLLM replicas during a scripted incident (a retry, a rejection, an operator ejection, a
deadlock that ejects a replica with two streams on it, one continued on the spill pool and one
refused, a rescue, spills, a ``cache_aware`` pool, and the stall alert pending), then every
expression of every dashboard and every alert rule is evaluated through Prometheus' HTTP API
and compared with what the script caused. No panel may be empty.

Counts come from the script (what it sent, what each response said) and from the simulators'
own counters, never from the gateway's metrics. Counters over the whole incident are read with
the range set to the incident's length, so `rate() × range` and `increase()` are counts; they
are compared after rounding (Prometheus extrapolates by up to one scrape interval)."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loadtest.sim.server import run_sim
from proxy.routing import cache_aware

from .gateway import policy_for, running_gateway, wait_healthy
from .prometheus_server import Prometheus, running_prometheus
from .servers import free_port

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
# The rules that read `up` alone: they say whether Prometheus reached a target, not what happened.
UP_ALERTS = ("TokenlaneGatewayDown", "TokenlaneReplicaScrapeFailing")
ALERTS = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
NAMES = {"fast-0": "interactive", "bulk-0": "bulk", "bulk-1": "bulk"}
SHORT_RATE_S = 5  # the rate window of the "now" checks (stall signature)
# A continued stream is counted under the replica that finished it: fast-0 froze, and the
# bulk pool's one replica left in service took the rest of the answer.
FINISHED_ON = {"continued": "bulk-0"}
PREFIX_COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
# The long lane's prompt: a few hundred characters, so its estimate is mostly text. A two-word
# message is dominated by the model's template (Qwen2.5 adds its default system prompt, ~26
# tokens the gateway cannot know of), and its estimated/reported ratio says nothing of the
# estimator.
PROMPT = " ".join(
    f"Line {i}: summarise the quarterly report for the northern region in plain words."
    for i in range(6)
)


def chat(content: str = PROMPT, *, stream: bool = False, max_tokens: int = 8) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
    return body


@dataclass
class Incident:
    """What the script caused and what Prometheus answered."""

    responses: list[tuple[str, int, str]] = field(default_factory=list)  # lane, status, replica
    window_s: int = 0
    results: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # expr -> result
    now_results: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    sim_tokens: dict[str, dict[str, float]] = field(default_factory=dict)
    admin: list[dict[str, Any]] = field(default_factory=list)
    sim_preemptions: dict[str, float] = field(default_factory=dict)
    continued: list[Any] = field(default_factory=list)  # the continued stream's events
    refused: list[Any] = field(default_factory=list)  # the stream that could not be
    replayed_tokens: int = 0  # the continuation's token-id prompt, as bulk-0 received it
    cache_blocks: dict[str, int] = field(default_factory=dict)  # the gateway's own index
    cache_bytes: int = 0
    fast_prefix: tuple[float, float] = (0.0, 0.0)  # fast-0's prefix-cache hits, queries
    # A simulator's name by its address: vLLM's own series carry only the address (`instance`)
    # in this Prometheus, as a scrape config without relabelling gives them.
    names: dict[str, str] = field(default_factory=dict)

    def subject(self, labels: dict[str, str]) -> str:
        """Whom an alert is about: its replica, its lane, or the replica at its address."""
        return (
            labels.get("replica")
            or labels.get("lane")
            or self.names.get(labels.get("instance", ""), "")
        )

    def count(self, pred: Callable[[str, int, str], bool]) -> int:
        return sum(1 for r in self.responses if pred(*r))


# -- the dashboards' expressions as Prometheus gets them ---------------------------------------

_VAR = re.compile(r"\$\{?([A-Za-z_]\w*)\}?")


def as_promql(expr: str, window: str) -> str:
    durations = {"__rate_interval": window, "__range": window, "__interval": "1s"}
    return _VAR.sub(lambda m: durations.get(m.group(1), ".*"), expr)


def dashboard_targets() -> list[tuple[str, str, str, str]]:
    """(dashboard stem, panel title, refId, expr) of every target."""
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for t in panel.get("targets", []):
                out.append((path.stem, panel["title"], t["refId"], t["expr"]))
    return out


def alert_exprs() -> dict[str, str]:
    return {r["alert"]: r["expr"] for g in ALERTS["groups"] for r in g["rules"] if "alert" in r}


# -- the script --------------------------------------------------------------------------------


async def sim_counter(url: str, name: str) -> float:
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(url + "/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


async def until(predicate: Callable[[], Any], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        await asyncio.sleep(0.1)


async def run_incident(tmp: Path) -> Incident:
    inc = Incident()
    async with (
        run_sim(name="fast-0") as fast,
        run_sim(name="bulk-0") as bulk0,
        run_sim(name="bulk-1") as bulk1,
    ):
        sims = {"fast-0": fast, "bulk-0": bulk0, "bulk-1": bulk1}
        inc.names = {s.url.removeprefix("http://"): n for n, s in sims.items()}
        dead = f"http://127.0.0.1:{free_port()}"
        policy = policy_for(
            {"interactive": [fast.url], "bulk": [bulk0.url, bulk1.url], "nowhere": [dead]},
            lanes=[
                {"name": "huge", "pool": "nowhere", "when": {"prompt_tokens_min": 3000}},
                {
                    "name": "short",
                    "pool": "interactive",
                    "when": {"stream": True},
                    "spill_to": "bulk",
                    "ttft_slo_s": 5,
                    "first_token_timeout_s": 60,
                },
                {"name": "long", "pool": "bulk", "ttft_slo_s": 10, "max_queue": 64},
            ],
            # A probe's timeout and the stall span far above a loaded machine's pauses (the
            # simulators share the gateway's loop): only fast-0's deadlock ejects anything.
            health={
                "interval_s": 0.25,
                "timeout_s": 5,
                "stall_after_s": 3,
                "eject_base_s": 300,
            },
        )
        # The interactive pool routes for the prefix cache (the bulk pool keeps round robin:
        # step 2 needs its order), and the short lane's streams continue across a failure.
        policy["pools"]["interactive"]["balance"] = "cache_aware"
        policy["continuation"] = {"enabled": True}
        for pool in policy["pools"].values():
            for replica in pool["replicas"]:
                replica["name"] = next(
                    (n for n, s in sims.items() if s.url == replica["url"]), "dead-0"
                )
        async with running_gateway(policy, ready=False) as (url, app):
            await wait_healthy(app, 3)
            gw = url.removeprefix("http://")
            jobs = {
                "tokenlane": [gw],
                "vllm": [s.url.removeprefix("http://") for s in sims.values()],
            }
            # Started off the loop: waiting for Prometheus must not hold back the gateway's
            # health checks (a blocked loop times them out and ejects healthy replicas).
            prom_cm = running_prometheus(tmp, jobs)
            prom = await asyncio.to_thread(prom_cm.__enter__)
            try:
                await _script(inc, prom, url, app, sims)
            finally:
                await asyncio.to_thread(prom_cm.__exit__, None, None, None)
    return inc


async def _q(prom: Prometheus, expr: str, at: float | None = None) -> list[dict[str, Any]]:
    return await asyncio.to_thread(prom.query, expr, at)


async def _script(inc: Incident, prom: Prometheus, url: str, app: Any, sims: dict) -> None:
    started = time.time()

    async def scraped_after(t: float) -> bool:
        return await asyncio.to_thread(prom.last_scrape) > t

    # Every target scraped a few times before the first event: the zeros are recorded.
    async def all_up() -> bool:
        up = await asyncio.to_thread(prom.targets_up)
        return len(up) == 4 and all(v == 1 for v in up.values())

    await until(all_up, 120, "every target up")
    t0 = time.time()
    await until(lambda: scraped_after(t0 + 2), 120, "scrapes before the incident")
    prefix_before = [await sim_counter(sims["fast-0"].url, n) for n in PREFIX_COUNTERS]

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def send(lane: str, body: dict[str, Any]) -> httpx.Response:
            r = await client.post("/v1/chat/completions", json=body)
            inc.responses.append((lane, r.status_code, r.headers.get("x-tokenlane-replica", "")))
            return r

        # 1. ordinary traffic on both lanes
        for _ in range(4):
            for lane, body in (("short", chat(stream=True)), ("long", chat())):
                r = await send(lane, body)
                assert r.status_code == 200, (lane, r.status_code, r.text)
        # 2. one retry: bulk-1 answers 503 to everything, round robin sends it one of two
        await sims["bulk-1"].set_fault({"fault": "error_rate", "rate": 1.0, "status": 503})
        for _ in range(2):
            r = await send("long", chat())
            assert r.status_code == 200 and r.headers["x-tokenlane-replica"] == "bulk-0"
        await sims["bulk-1"].set_fault(None)
        # 3. two rejections: the huge lane's pool has no replica
        for _ in range(2):
            assert (await send("huge", chat("word " * 4000))).status_code == 503
        # 4. an operator ejection, then bulk-0 takes the long lane alone
        r = await client.post("/admin/replicas/eject", json={"url": sims["bulk-1"].url})
        assert r.status_code == 200, r.text
        for _ in range(2):
            r = await send("long", chat())
            assert r.status_code == 200 and r.headers["x-tokenlane-replica"] == "bulk-0"
        # 5. a stall: fast-0 freezes (vLLM #37729's deadlock) with two streams mid-answer. The
        # eligible one is continued on the bulk pool (its spill_to) once the gateway ejects
        # fast-0 for the stall; the one that asked for logprobs cannot be, and ends with the
        # error event. A request arriving after the freeze never reaches the engine: the
        # gateway rescues it before its first token onto the bulk pool (a retry and a spill).
        # fast-0 generates nothing from here on.
        fast = sims["fast-0"]
        started_streams = {"continued": asyncio.Event(), "refused": asyncio.Event()}

        async def stream(name: str, body: dict[str, Any]) -> list[Any]:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                events: list[Any] = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        data = line.removeprefix("data: ")
                        events.append(data if data == "[DONE]" else json.loads(data))
                        started_streams[name].set()
            # A continued stream ends on the replica that finished it (the access line's
            # replica); its header named the one it started on.
            finished_on = FINISHED_ON.get(name, r.headers.get("x-tokenlane-replica", ""))
            inc.responses.append(("short", r.status_code, finished_on))
            return events

        long_answer = {**chat(stream=True, max_tokens=200), "temperature": 0}
        streams = {
            "continued": asyncio.create_task(stream("continued", long_answer)),
            "refused": asyncio.create_task(stream("refused", {**long_answer, "logprobs": True})),
        }
        await asyncio.wait_for(
            asyncio.gather(*(e.wait() for e in started_streams.values())), timeout=60
        )
        stalled_at = time.time()
        await fast.set_fault({"fault": "stall", "after_tokens": 0})

        async def frozen() -> bool:
            return bool(fast.engine.stalled)

        await until(frozen, 30, "fast-0's engine frozen with both streams running")
        rescued = asyncio.create_task(send("short", chat("hi", stream=True, max_tokens=64)))

        async def fast_ejected() -> bool:
            rows = (await client.get("/admin/replicas")).json()["replicas"]
            return any(r["name"] == "fast-0" and r["state"] == "ejected" for r in rows)

        await until(fast_ejected, 30, "fast-0 ejected for its stall")
        assert (await rescued).status_code == 200
        inc.continued, inc.refused = await streams["continued"], await streams["refused"]
        for _ in range(2):
            r = await send("short", chat("hi", stream=True))
            assert r.status_code == 200 and r.headers["x-tokenlane-replica"] == "bulk-0"
        # 6. the stall alert: a minute of fast-0 running with flat counters makes the rule
        # true, and it is pending for its `for:` (promtool proves the firing).
        stalled_alert = 'ALERTS{alertname="TokenlaneReplicaStalled", alertstate="pending"}'

        async def stall_alert_pending() -> bool:
            return bool(await _q(prom, stalled_alert))

        await until(stall_alert_pending, 180, "TokenlaneReplicaStalled pending")
        inc.admin = (await client.get("/admin/replicas")).json()["replicas"]

    for name, sim in sims.items():
        inc.sim_tokens[name] = {
            "generation": await sim_counter(sim.url, "vllm:generation_tokens_total"),
            "prompt": await sim_counter(sim.url, "vllm:prompt_tokens_total"),
        }

    inc.sim_preemptions = {
        n: await sim_counter(s.url, "vllm:num_preemptions_total") for n, s in sims.items()
    }
    hits, queries = [
        await sim_counter(fast.url, name) - before
        for name, before in zip(PREFIX_COUNTERS, prefix_before, strict=True)
    ]
    inc.fast_prefix = (hits, queries)
    (cont_req,) = [
        r["body"]
        for r in sims["bulk-0"].requests()
        if r["path"] == "/v1/completions" and isinstance((r["body"] or {}).get("prompt"), list)
    ]
    inc.replayed_tokens = len(cont_req["prompt"])
    # Settled: every target scraped (successfully) after the last event, and the "now" window
    # wholly after fast-0 froze; everything is then evaluated at that one instant, however long
    # the queries take on a loaded machine.
    t_end = max(time.time(), stalled_at + SHORT_RATE_S)

    at = 0.0

    async def settled() -> bool:
        """Every target up, scraped after the incident, and the rules evaluated on that: a
        scrape that timed out on a loaded machine leaves an `up == 0` alert pending until the
        next rule evaluation sees the target up again (an instant, not part of the incident)."""
        nonlocal at
        up = await _q(prom, "up")
        if not (all(s["value"][1] == "1" for s in up) and await scraped_after(t_end + 1)):
            return False
        at = await asyncio.to_thread(prom.last_scrape)
        return not await _q(prom, f'ALERTS{{alertname=~"{"|".join(UP_ALERTS)}"}}', at)

    await until(settled, 120, "every target up after the incident, and the rules seeing it")
    # Evaluated at one of the gateway's own scrapes, later than a post-incident scrape of every
    # other target: at any other instant the gateway's last sample lies before it, and rate()
    # extrapolates the counters over that gap (by up to a scrape interval: 9 counted as 9.8).
    latest = max(float(s["value"][1]) for s in await _q(prom, "timestamp(up)"))

    async def gateway_scraped_last() -> bool:
        nonlocal at
        (gw,) = await _q(prom, 'timestamp(up{job="tokenlane"})')
        at = float(gw["value"][1])
        return at > latest

    await until(gateway_scraped_last, 30, "the gateway scraped after every other target")
    inc.window_s = math.ceil(at - started) + 2
    window = f"{inc.window_s}s"
    for _, _, _, expr in dashboard_targets():
        inc.results[expr] = await _q(prom, as_promql(expr, window), at)
        inc.now_results[expr] = await _q(prom, as_promql(expr, f"{SHORT_RATE_S}s"), at)
    for expr in alert_exprs().values():
        inc.results[expr] = await _q(prom, expr, at)
    inc.alerts = await _q(prom, "ALERTS", at)
    # The interactive pool's index, as the gateway holds it: nothing routed to that pool since
    # fast-0 froze, so it is what the last scrape exported.
    router = cache_aware.routers(app.gateway.fleet)["interactive"]
    inc.cache_blocks = {name: len(ix) for name, ix in router.indexes.items()}
    inc.cache_bytes = sum(ix.nbytes for ix in router.indexes.values())


# -- what each expression must show --------------------------------------------------------


def values(result: list[dict[str, Any]], *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(s["metric"].get(k, "") for k in labels): float(s["value"][1]) for s in result}


def finite(v: float) -> bool:
    return not (math.isnan(v) or math.isinf(v))


@dataclass
class Row:
    panel: str
    expected: str
    got: str
    ok: bool


def counts_check(got: dict, want: dict, scale: float) -> tuple[str, str, bool]:
    """Counters read over the whole incident: `scale` turns a rate into a count."""
    shown = {k: round(v * scale, 2) for k, v in got.items()}
    rounded = {k: round(v) for k, v in shown.items()}
    want_all = {k: want.get(k, 0) for k in rounded}
    ok = bool(got) and rounded == want_all and set(want) <= set(rounded)
    return (
        str(dict(sorted(want.items()))),
        str(dict(sorted((k, v) for k, v in shown.items() if v))),
        ok,
    )


def check_panel(inc: Incident, stem: str, title: str, ref: str, expr: str) -> Row:
    res, now = inc.results[expr], inc.now_results[expr]
    w = inc.window_s
    key = f"{stem} / {title} / {ref}"
    lanes_200 = Counter((lane, str(st)) for lane, st, _ in inc.responses)
    by_replica = Counter((rep, str(st)) for _, st, rep in inc.responses)
    served = {rep for _, st, rep in inc.responses if st == 200}
    spills = inc.count(lambda lane, st, rep: lane == "short" and rep.startswith("bulk"))
    retries = {("long", "upstream_5xx"): 1, ("short", "replica_ejected"): 1}
    ejections = {("interactive", "fast-0", "stall"): 1, ("bulk", "bulk-1", "operator"): 1}
    total = len(inc.responses)

    def quantiles(labels: tuple[str, ...], must: set[tuple[str, ...]]) -> tuple[str, str, bool]:
        got = values(res, *labels)
        ok = all(k in got and finite(got[k]) and got[k] > 0 for k in must)
        return f"finite > 0 for {sorted(must)}", str({k: round(v, 4) for k, v in got.items()}), ok

    exp: str
    got: str
    ok: bool
    match (stem, title, ref):
        case ("tokenlane-ejections", "Replicas ejected now", _):
            exp, got, ok = "2", str(values(res)), values(res) == {(): 2.0}
        case ("tokenlane-ejections", "Ejections in range", _):
            v = values(res).get((), math.nan)
            exp, got, ok = "2", f"{v:.3f}", round(v) == 2
        case ("tokenlane-ejections", "Retries in range", _):
            v = values(res).get((), math.nan)
            exp, got, ok = "2", f"{v:.3f}", round(v) == 2
        case ("tokenlane-ejections", "Retried share", _):
            v = values(res).get((), math.nan)
            exp, got, ok = f"2/{total} = {2 / total:.3f}", f"{v:.3f}", abs(v - 2 / total) < 0.02
        case ("tokenlane-ejections", "Ejections by replica and reason", _):
            # increase() per interval, not a rate: read over the whole incident it is the count.
            exp, got, ok = counts_check(values(res, "pool", "replica", "reason"), ejections, 1)
            ok = ok and len(res) == 7 * 4  # every replica x reason, at 0 or more
        case ("tokenlane-ejections", "Retries/s by lane and reason", _):
            exp, got, ok = counts_check(values(res, "lane", "reason"), retries, w)
            ok = ok and len(res) == 3 * 4
        case ("tokenlane-ejections", "Ejections in range, by replica and reason", _):
            got_d = {k: round(v) for k, v in values(res, "pool", "replica", "reason").items()}
            exp, got, ok = str(ejections), str(got_d), got_d == ejections
        case ("tokenlane-ejections", "Stall signature: running vs generated tokens/s", "A"):
            got_d = values(res, "replica")
            exp = "fast-0 running > 0 (stalled, not idle); bulk-0, bulk-1 listed"
            got = str(got_d)
            ok = set(got_d) == {(n,) for n in NAMES} and got_d[("fast-0",)] > 0
        case ("tokenlane-ejections", "Stall signature: running vs generated tokens/s", "B"):
            got_d = values(now, "replica")
            exp, got = "fast-0 0 tokens/s now", str(got_d)
            ok = set(got_d) == {(n,) for n in NAMES} and got_d[("fast-0",)] == 0
        case ("tokenlane-lanes", "TTFT p50 / p99 per lane against its SLO", "A" | "B"):
            exp, got, ok = quantiles(("lane",), {("short",), ("long",)})
        case ("tokenlane-lanes", "TTFT p50 / p99 per lane against its SLO", "C"):
            got_d = values(res, "lane")
            exp, got = "short 5, long 10", str(got_d)
            ok = got_d == {("short",): 5.0, ("long",): 10.0}
        case ("tokenlane-lanes", "Requests/s by lane and status", _):
            exp, got, ok = counts_check(values(res, "lane", "status"), dict(lanes_200), w)
        case ("tokenlane-lanes", "Queue depth against max_queue", "A"):
            got_d = values(res, "lane")
            exp, got = "0 for huge, short, long", str(got_d)
            ok = got_d == {("huge",): 0, ("short",): 0, ("long",): 0}
        case ("tokenlane-lanes", "Queue depth against max_queue", "B"):
            got_d = values(res, "lane")
            exp, got = "long 64, others 256", str(got_d)
            ok = got_d == {("huge",): 256, ("short",): 256, ("long",): 64}
        case ("tokenlane-lanes", "Rejections/s by lane and reason", _):
            exp, got, ok = counts_check(
                values(res, "lane", "reason"), {("huge", "no_replica"): 2}, w
            )
            ok = ok and len(res) == 3 * 4 + 1
        case ("tokenlane-lanes", "Spills/s", _):
            exp, got, ok = counts_check(
                values(res, "lane", "from_pool", "to_pool"),
                {("short", "interactive", "bulk"): spills},
                w,
            )
        case (
            "tokenlane-lanes",
            "Queue wait p99" | "Request duration p50 / p99" | "Gateway overhead p99",
            _,
        ):
            exp, got, ok = quantiles(("lane",), {("short",), ("long",)})
        case ("tokenlane-lanes", "Inter-token gap p99", _):
            exp, got, ok = quantiles(("lane",), {("short",)})
        case ("tokenlane-lanes", "Prompt tokens: estimated / reported", _):
            got_d = values(res, "pool")
            exp, got = "bulk: a finite ratio near 1 (0.3 - 3)", str(got_d)
            ok = ("bulk",) in got_d and 0.3 < got_d[("bulk",)] < 3
        case ("tokenlane-lanes", "Policy reloads", _):
            got_d = values(res, "result")
            exp, got = "ok 0, invalid 0", str(got_d)
            ok = got_d == {("ok",): 0, ("invalid",): 0}
        case ("tokenlane-replicas", "Replica state", _):
            got_d = values(res, "replica")
            want = {("fast-0",): 4.0, ("bulk-1",): 4.0, ("bulk-0",): 1.0, ("dead-0",): 2.0}
            exp, got, ok = (
                "fast-0, bulk-1 ejected (4); bulk-0 healthy (1); dead-0 probing (2)",
                str(got_d),
                got_d == want,
            )
        case ("tokenlane-replicas", "In flight from the gateway", _):
            got_d = values(res, "replica")
            exp, got = "0 for the 4 replicas", str(got_d)
            ok = len(got_d) == 4 and set(got_d.values()) == {0}
        case ("tokenlane-replicas", "vLLM running / waiting", "A"):
            got_d = values(res, "replica")
            exp = "fast-0 > 0 (its stalled request), bulk-0 and bulk-1 0"
            got = str(got_d)
            ok = set(got_d) == {(n,) for n in NAMES} and got_d[("bulk-0",)] == 0
            ok = ok and got_d[("fast-0",)] > 0
        case ("tokenlane-replicas", "vLLM running / waiting", "B"):
            got_d = values(res, "replica")
            exp, got = "0 for fast-0, bulk-0, bulk-1", str(got_d)
            ok = got_d == {(n,): 0 for n in NAMES}
        case ("tokenlane-replicas", "vLLM tokens/s", _):
            kind = "generation" if ref == "A" else "prompt"
            got_d = {k[0]: v * w for k, v in values(res, "replica").items()}
            want = {n: inc.sim_tokens[n][kind] for n in NAMES}
            exp = f"{kind} tokens per replica, from the simulators: {want}"
            got = str({k: round(v, 1) for k, v in got_d.items()})
            ok = set(got_d) == set(want) and all(
                abs(got_d[n] - want[n]) <= 0.1 * want[n] + 2 for n in want
            )
        case ("tokenlane-replicas", "KV-cache usage", _):
            got_d = values(res, "replica")
            exp, got = "0..1 for fast-0, bulk-0, bulk-1", str(got_d)
            ok = set(got_d) == {(n,) for n in NAMES} and all(0 <= v <= 1 for v in got_d.values())
        case ("tokenlane-replicas", "Prefix-cache hit rate", _):
            got_d = values(res, "replica")
            exp, got = "0..1 for fast-0, bulk-0, bulk-1", str(got_d)
            ok = set(got_d) == {(n,) for n in NAMES} and all(0 <= v <= 1 for v in got_d.values())
        case ("tokenlane-replicas", "Preemptions/s", _):
            exp, got, ok = counts_check(
                values(res, "replica"),
                {(n,): inc.sim_preemptions[n] for n in NAMES if inc.sim_preemptions[n]},
                w,
            )
            ok = ok and len(res) == 3
        case ("tokenlane-replicas", "vLLM TTFT p99 (engine side)", _):
            exp, got, ok = quantiles(("replica",), {(n,) for n in NAMES})
        case ("tokenlane-replicas", "Requests/s by replica and status", _):
            exp, got, ok = counts_check(values(res, "replica", "status"), dict(by_replica), w)
        case ("tokenlane-replicas", "Pool panic", _):
            got_d = values(res, "pool")
            exp, got = "0 for interactive, bulk, nowhere", str(got_d)
            ok = got_d == {("interactive",): 0, ("bulk",): 0, ("nowhere",): 0}
        case ("tokenlane-replicas", "Gateway TTFT by replica: p50 / p99", _):
            exp, got, ok = quantiles(("replica",), {(n,) for n in served})
        case ("tokenlane-lanes", "Continuations/s by trigger and outcome", _):
            # Every lane continues (the lanes' switch is on by default): every lane x trigger x
            # outcome at 0 or more.
            exp, got, ok = counts_check(
                values(res, "lane", "trigger", "outcome"), {("short", "stall", "ok"): 1}, w
            )
            ok, got = ok and len(res) == 3 * 5 * 2, f"{got} ({len(res)} series)"
        case ("tokenlane-lanes", "Streams cut and not continued, by reason", _):
            exp, got, ok = counts_check(
                values(res, "lane", "reason"), {("short", "logprobs"): 1}, w
            )
            ok, got = ok and len(res) == 3 * 18, f"{got} ({len(res)} series)"
        case (
            "tokenlane-lanes",
            "Continuation gap p50 / p99, and tokens prefilled again",
            "A" | "B",
        ):
            exp, got, ok = quantiles(("lane",), {("short",)})
        case ("tokenlane-lanes", "Continuation gap p50 / p99, and tokens prefilled again", "C"):
            exp, got, ok = counts_check(values(res, "lane"), {("short",): inc.replayed_tokens}, w)
        case ("tokenlane-replicas", "cache_aware: prefix matched per pick, p50 / p99", _):
            # Four picks of one prompt: the later three matched the first's whole prefix.
            got_d = values(res, "pool")
            exp, got = "interactive > 0", str(got_d)
            ok = set(got_d) == {("interactive",)} and got_d[("interactive",)] > 0
        case ("tokenlane-replicas", "cache_aware: prefix-cache hit rate per pool", _):
            hits, queries = inc.fast_prefix
            true_rate = hits / queries if queries else math.nan
            got_d = values(res, "pool")
            exp, got = f"interactive {true_rate:.3f} (fast-0's own counters)", str(got_d)
            ok = (
                set(got_d) == {("interactive",)} and abs(got_d[("interactive",)] - true_rate) < 0.03
            )
        case ("tokenlane-replicas", "cache_aware: prefix index blocks per replica", _):
            got_d = {k[0]: v for k, v in values(res, "replica").items()}
            exp, got = f"the gateway's index: {inc.cache_blocks}", str(got_d)
            ok = got_d == inc.cache_blocks and got_d.get("fast-0", 0) > 0
        case ("tokenlane-replicas", "cache_aware: prefix index memory per pool", _):
            got_d = values(res, "pool")
            exp, got = f"interactive {inc.cache_bytes}", str(got_d)
            ok = got_d == {("interactive",): float(inc.cache_bytes)}
        case _:
            exp, got, ok = "a check for this panel", "none written", False
    return Row(key, exp, got, ok)


def alert_rows(inc: Incident) -> list[Row]:
    state = {
        (a["metric"]["alertname"], inc.subject(a["metric"])): a["metric"]["alertstate"]
        for a in inc.alerts
    }
    want = {
        # pending for its `for: 1m` when the incident ends; promtool proves the firing
        ("TokenlaneReplicaStalled", "fast-0"): "pending",
        ("TokenlaneReplicaEjected", "fast-0"): "firing",
        ("TokenlaneReplicaEjected", "bulk-1"): "firing",
        ("TokenlaneGatewayRejecting", "huge"): "pending",  # `for: 3m`
    }
    rows = [Row("alerts (ALERTS series)", str(want), str(state), state == want)]
    exprs = alert_exprs()
    expected_hits = {
        "TokenlaneReplicaStalled": {"fast-0"},
        "TokenlaneReplicaEjected": {"fast-0", "bulk-1"},
        "TokenlaneGatewayRejecting": {"huge"},
    }
    for name, expr in exprs.items():
        hits = {inc.subject(s["metric"]) for s in inc.results[expr]}
        want_hits = expected_hits.get(name, set())
        rows.append(
            Row(f"alert expr {name}", str(sorted(want_hits)), str(sorted(hits)), hits == want_hits)
        )
    return rows


@pytest.fixture(scope="module")
def incident(tmp_path_factory: pytest.TempPathFactory) -> Incident:
    return asyncio.run(run_incident(tmp_path_factory.mktemp("prometheus")))


def test_every_panel_and_alert_shows_what_happened(incident: Incident) -> None:
    rows = [check_panel(incident, *t) for t in dashboard_targets()] + alert_rows(incident)
    table = "\n".join(
        f"{'ok ' if r.ok else 'BAD'} | {r.panel} | expected {r.expected} | got {r.got}"
        for r in rows
    )
    print(f"incident over {incident.window_s}s, {len(incident.responses)} requests\n{table}")
    assert len(rows) >= 43 + len(alert_exprs())
    assert all(r.ok for r in rows), table


def test_a_stalled_replica_shows_the_deadlock_signature(incident: Incident) -> None:
    """vLLM #37729 as Prometheus sees the simulator's deadlock: fast-0 keeps the two streams
    the gateway moved elsewhere (and aborted on fast-0) running, and generates nothing; the
    continued one finished its answer and the other ended with the error event. A minute of
    that makes TokenlaneReplicaStalled pending (the alert rows); promtool tests its window and
    `for` (deploy/prometheus/alerts_test.yml)."""
    running_expr, tokens_expr = (
        next(
            e for _, t, r, e in dashboard_targets() if t.startswith("Stall signature") and r == ref
        )
        for ref in "AB"
    )
    running = values(incident.results[running_expr], "replica")
    assert running == {("fast-0",): 2, ("bulk-0",): 0, ("bulk-1",): 0}, running
    tokens_now = values(incident.now_results[tokens_expr], "replica")
    assert tokens_now[("fast-0",)] == 0, tokens_now
    rescued = [r for r in incident.responses if r[0] == "short" and r[2].startswith("bulk")]
    assert rescued and all(status == 200 for _, status, _ in rescued), incident.responses
    # The continued stream: one answer, whole, with no error event; 200 tokens in all.
    chunks = [e for e in incident.continued if isinstance(e, dict)]
    assert incident.continued[-1] == "[DONE]" and not any("error" in e for e in chunks)
    finishes = [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"], finishes
    # The one that asked for logprobs could not be continued: it ends with the error event.
    assert incident.refused[-1] == "[DONE]"
    assert any("error" in e for e in incident.refused if isinstance(e, dict))
