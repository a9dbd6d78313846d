"""From events to panels, checked: a real Prometheus scrapes a gateway and three simulated
vLLM replicas during a scripted incident (a retry, a rejection, an operator ejection, a stall
that ejects a replica and spills its lane), then every expression of every dashboard and every
alert rule is evaluated through Prometheus' HTTP API and compared with what the script caused.

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

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def send(lane: str, body: dict[str, Any]) -> httpx.Response:
            r = await client.post("/v1/chat/completions", json=body)
            inc.responses.append((lane, r.status_code, r.headers.get("x-tokenlane-replica", "")))
            return r

        # 1. ordinary traffic on both lanes
        for _ in range(4):
            for lane, body in (("short", chat("hi", stream=True)), ("long", chat())):
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
        # 5. a stall: fast-0 freezes with a request running (the deadlock begins as its first
        # token is due: a request arriving after a stall began would never reach the engine);
        # the gateway ejects it (stall), rescues the request onto the bulk pool (a retry and a
        # spill), and the lane spills. fast-0 generates nothing from here on.
        stalled_at = time.time()
        await sims["fast-0"].set_fault({"fault": "stall", "after_tokens": 0})
        rescued = asyncio.create_task(send("short", chat("hi", stream=True, max_tokens=64)))

        async def fast_ejected() -> bool:
            rows = (await client.get("/admin/replicas")).json()["replicas"]
            return any(r["name"] == "fast-0" and r["state"] == "ejected" for r in rows)

        await until(fast_ejected, 30, "fast-0 ejected for its stall")
        assert (await rescued).status_code == 200
        for _ in range(2):
            r = await send("short", chat("hi", stream=True))
            assert r.status_code == 200 and r.headers["x-tokenlane-replica"] == "bulk-0"
        inc.admin = (await client.get("/admin/replicas")).json()["replicas"]

    for name, sim in sims.items():
        inc.sim_tokens[name] = {
            "generation": await sim_counter(sim.url, "vllm:generation_tokens_total"),
            "prompt": await sim_counter(sim.url, "vllm:prompt_tokens_total"),
        }

    inc.sim_preemptions = {
        n: await sim_counter(s.url, "vllm:num_preemptions_total") for n, s in sims.items()
    }
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
        case ("tokenlane-lanes", title, _) if title.startswith(
            ("Continuation", "Streams cut and not continued")
        ):
            # Continuation is off (the default) in this incident's policy: the stall's request
            # was rescued before it streamed, so nothing was continued or refused.
            shown = {k: v for k, v in values(res, "lane").items() if finite(v) and v != 0}
            exp, got, ok = "no series (continuation is off)", str(shown), not shown
        case ("tokenlane-replicas", title, _) if title.startswith("cache_aware:"):
            # No pool of this incident is cache_aware (step 2 needs round robin's order), so
            # these panels have no series; tests/test_cache_panels_prometheus.py proves them.
            shown = {k: v for k, v in values(res, "pool", "replica").items() if finite(v)}
            exp, got, ok = "no series (no cache_aware pool)", str(shown), not shown
        case _:
            exp, got, ok = "a check for this panel", "none written", False
    return Row(key, exp, got, ok)


def alert_rows(inc: Incident) -> list[Row]:
    state = {
        (a["metric"]["alertname"], a["metric"].get("replica") or a["metric"].get("lane", "")): a[
            "metric"
        ]["alertstate"]
        for a in inc.alerts
        if a["metric"]["alertname"] != "TokenlaneReplicaStalled"  # its own test
    }
    want = {
        ("TokenlaneReplicaEjected", "fast-0"): "firing",
        ("TokenlaneReplicaEjected", "bulk-1"): "firing",
        ("TokenlaneGatewayRejecting", "huge"): "pending",  # `for: 3m`
    }
    rows = [Row("alerts (ALERTS series)", str(want), str(state), state == want)]
    exprs = alert_exprs()
    expected_hits = {
        "TokenlaneReplicaEjected": {"fast-0", "bulk-1"},
        "TokenlaneGatewayRejecting": {"huge"},
    }
    for name, expr in exprs.items():
        if name == "TokenlaneReplicaStalled":
            continue  # its own test: it needs the simulator's stall to be a deadlock
        hits = {
            s["metric"].get("replica") or s["metric"].get("lane", "") for s in inc.results[expr]
        }
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
    """vLLM #37729 as Prometheus sees the simulator's deadlock: fast-0 keeps the request that
    the gateway rescued elsewhere (and aborted on fast-0) running, and generates nothing.
    TokenlaneReplicaStalled needs a minute of that before it is even pending, longer than the
    incident: promtool tests its window and `for` (deploy/prometheus/alerts_test.yml)."""
    running_expr, tokens_expr = (
        next(
            e for _, t, r, e in dashboard_targets() if t.startswith("Stall signature") and r == ref
        )
        for ref in "AB"
    )
    running = values(incident.results[running_expr], "replica")
    assert running == {("fast-0",): 1, ("bulk-0",): 0, ("bulk-1",): 0}, running
    tokens_now = values(incident.now_results[tokens_expr], "replica")
    assert tokens_now[("fast-0",)] == 0, tokens_now
    rescued = [r for r in incident.responses if r[0] == "short" and r[2].startswith("bulk")]
    assert rescued and all(status == 200 for _, status, _ in rescued), incident.responses
