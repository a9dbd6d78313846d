"""Overload benchmark (issue 5): does the interactive lane stay fast at 2x and 4x capacity?

An open-loop Poisson mix (80 % short streamed chats; 20 % long work: long-prompt streams and
non-streamed requests) at 1x, 2x and 4x a base rate, each for ``--duration-s``, sent to the
same simulated fleet through two gateways in turn:

- ``tokenlane``: lanes. Short streams go to the ``interactive`` pool (2 replicas) with a small
  queue and a short queue timeout; everything else goes to the ``bulk`` pool (2 replicas) with
  a bounded queue. Replica ``max_in_flight`` equals the simulator's ``max_num_seqs``, so no
  request ever waits inside an engine: all waiting happens in the gateway's bounded queues.
- ``roundrobin``: the same gateway code with one pool of the same 4 replicas, round robin, no
  limits and no first-token or idle watchdog, i.e. a plain round-robin proxy: every request
  reaches an engine and waits there (until the client's own timeout, ``--client-timeout-s``).

The fleet is 4 simulator processes slowed by the ``slow`` fault (``--factor``) and with a small
``max_num_seqs``, so that 4x its capacity is a load this 2-core machine can generate and relay
(the CPU of the load generator, the gateway and the simulators is reported to show it).
1x is chosen near the fleet's capacity with lanes (~70 % of each pool's slots); the measured
goodput at 1x is reported as the capacity.

Reported per gateway and level: TTFT p50/p99 and goodput (completed within the class's TTFT
SLO, per second) per class, answers by status, the gateway's rejections by lane and reason,
the most requests queued per lane, CPU, and the gateway's RSS; over time, queue depth and RSS
(a PNG). Targets (issue 5) are checked for tokenlane at 4x.

    python -m loadtest.bench_overload [--duration-s 60] [--rate 14] [--factor 10]
        [--levels 1,2,4] [--gateways tokenlane,roundrobin] [--plot docs/overload.png]

Length: one benchmark from the fleet's set-up to the printed table and plot; none of its parts is
used elsewhere, and splitting them would only scatter one run's story.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import resource
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from .client import LoadClient
from .procs import await_http, cpu_seconds, free_port, process, rss_mb
from .runner import run_trace
from .stats import CONNECT_ERROR, INCOMPLETE, TIMEOUT, RequestResult, lateness, percentile
from .workload import ClassSpec, Dist, Scenario, scenario_requests

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
DEFAULT_PLOT = Path("docs/overload.png")
WARMUP_S = 10.0  # RSS growth is measured after this much of each level


# ---------------------------------------------------------------------------- the workload


def mix(factor: float) -> tuple[ClassSpec, ...]:
    """80 % short streams, 10 % long-prompt streams, 10 % non-streamed. SLOs are unslowed
    figures (100 ms for a chat's first token, 1 s for long work) times the slow factor."""
    return (
        ClassSpec(
            name="short", weight=8,
            prompt_tokens=Dist("lognormal", {"median": 200, "sigma": 0.5, "min": 50, "max": 800}),
            max_tokens=Dist("uniform", {"min": 8, "max": 32}),
            prefix_tokens=64, stream=True, ttft_slo_ms=100 * factor,
        ),
        ClassSpec(
            name="long", weight=1,
            prompt_tokens=Dist("normal", {"mean": 3000, "std": 400, "min": 2000, "max": 4000}),
            max_tokens=Dist("uniform", {"min": 32, "max": 64}),
            stream=True, ttft_slo_ms=1000 * factor,
        ),
        ClassSpec(
            name="batch", weight=1,
            prompt_tokens=Dist("uniform", {"min": 500, "max": 1500}),
            max_tokens=Dist("uniform", {"min": 32, "max": 64}),
            stream=False, ttft_slo_ms=1000 * factor,
        ),
    )  # fmt: skip


def tokenlane_policy(urls: Sequence[str], port: int, args: argparse.Namespace) -> dict[str, Any]:
    seqs = args.max_num_seqs
    return {
        "server": {"host": "127.0.0.1", "port": port},
        "pools": {
            "interactive": {
                "balance": "least_loaded",
                "replicas": [
                    {"url": u, "name": f"sim{i}", "max_in_flight": seqs}
                    for i, u in enumerate(urls[:2])
                ],
            },
            "bulk": {
                "balance": "least_loaded",
                "replicas": [
                    {"url": u, "name": f"sim{i + 2}", "max_in_flight": seqs}
                    for i, u in enumerate(urls[2:])
                ],
            },
        },
        "lanes": [
            {
                "name": "short",
                "pool": "interactive",
                "priority": 10,
                "when": {"stream": True, "prompt_tokens_max": 1024, "output_tokens_max": 64},
                # Wait a little, never long: a short stream's SLO is its first token.
                "max_queue": 8,
                "queue_timeout_s": 0.025 * args.factor,
                "ttft_slo_s": 0.1 * args.factor,
            },
            {
                "name": "long",
                "pool": "bulk",
                "max_queue": 32,
                "queue_timeout_s": 0.8 * args.factor,
                "ttft_slo_s": 1.0 * args.factor,
            },
        ],
        "health": {"interval_s": 1.0, "canary_timeout_s": 30.0},
    }


def roundrobin_policy(urls: Sequence[str], port: int, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": port},
        "pools": {
            "all": {
                "balance": "round_robin",
                # No gateway limit: every request goes straight to an engine.
                "replicas": [
                    {"url": u, "name": f"sim{i}", "max_in_flight": 1_000_000}
                    for i, u in enumerate(urls)
                ],
            }
        },
        # A plain proxy waits for the engine however long it takes: no first-token or idle
        # watchdog (which would eject replicas whose queues are merely long).
        "lanes": [
            {
                "name": "all",
                "pool": "all",
                "max_queue": 0,
                "first_token_timeout_s": 3600,
                "stream_idle_timeout_s": 3600,
            }
        ],
        "health": {"interval_s": 1.0, "canary_timeout_s": 30.0},
    }


POLICIES = {"tokenlane": tokenlane_policy, "roundrobin": roundrobin_policy}


# ---------------------------------------------------------------------------- processes


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def raise_open_files_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    del soft


async def wait_idle(http: httpx.AsyncClient, sims: Sequence[str], timeout_s: float) -> None:
    """Until no simulator runs or queues anything (the next level starts from empty)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = [(await http.get(u + "/sim/stats")).json() for u in sims]
        if all(s["running"] == 0 and s["waiting"] == 0 for s in stats):
            return
        await asyncio.sleep(0.25)


# ---------------------------------------------------------------------------- sampling


def scrape(text: str) -> dict[str, dict[tuple[str, ...], float]]:
    """The series this report reads from a gateway's ``/metrics``."""
    want = {
        "tokenlane_queue_depth": ("lane",),
        "tokenlane_rejections": ("lane", "reason"),
        "tokenlane_queue_wait_seconds": ("lane", "le"),  # cumulative buckets
    }
    out: dict[str, dict[tuple[str, ...], float]] = {k: {} for k in want}
    for family in text_string_to_metric_families(text):
        labels = want.get(family.name)
        if labels is None:
            continue
        for s in family.samples:
            if s.name.endswith(("_created", "_sum", "_count")):
                continue
            out[family.name][tuple(s.labels[k] for k in labels)] = s.value
    return out


def waits_beyond(
    before: dict[tuple[str, ...], float], after: dict[tuple[str, ...], float], lane: str,
    timeout_s: float,
) -> dict[str, float]:  # fmt: skip
    """Of the requests ``lane`` dispatched between two scrapes: how many, and how many waited
    longer than the first histogram bucket at or above ``timeout_s`` (must be none)."""

    def delta(le: str) -> float:
        return after.get((lane, le), 0.0) - before.get((lane, le), 0.0)

    bounds = sorted(float(le) for (ln, le) in after if ln == lane and le != "+Inf")
    total = delta("+Inf")
    edge = next((b for b in bounds if b >= timeout_s), None)
    within = delta(_le(edge)) if edge is not None else total
    return {"dispatched": total, "beyond": total - within, "bucket_s": edge or float("inf")}


def _le(bound: float) -> str:
    # prometheus_client writes bucket bounds with repr-like floats: 0.3, 10.0
    return repr(float(bound))


@dataclass
class Timeline:
    """One sample a second: run time, level, gateway RSS, queue depth by lane."""

    t: list[float] = field(default_factory=list)
    level: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    depth: list[dict[str, float]] = field(default_factory=list)


async def sample(
    http: httpx.AsyncClient, gateway: str, pid: int, tl: Timeline, t0: float,
    level: list[float], stop: asyncio.Event,
) -> None:  # fmt: skip
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError):
            m = scrape((await http.get(gateway + "/metrics")).text)
            tl.t.append(time.monotonic() - t0)
            tl.level.append(level[0])
            tl.rss_mb.append(rss_mb(pid))
            tl.depth.append({k[0]: v for k, v in m["tokenlane_queue_depth"].items()})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


# ---------------------------------------------------------------------------- analysis


def slope_per_min(ts: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of ``ys`` over ``ts`` (seconds), per minute."""
    n = len(ts)
    if n < 3:
        return None
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        return None
    return 60 * sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var


def class_report(rs: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    ok = [r for r in rs if r.ok and r.ttft_s is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    statuses: dict[str, int] = {}
    for r in rs:
        statuses[r.status_label] = statuses.get(r.status_label, 0) + 1
    met = sum(1 for r in rs if r.met_slo)
    return {
        "n": len(rs),
        "ok": len(ok),
        "statuses": dict(sorted(statuses.items())),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "met_slo": met,
        "goodput_rps": met / duration_s,
        "offered_rps": len(rs) / duration_s,
        # the slowest answer of any kind, measured to the first byte of content or the error
        "max_answer_s": max((r.ttft_s if r.ok else r.e2e_s) or 0.0 for r in rs) if rs else None,
    }


def late_answers(
    rs: Sequence[RequestResult], queue_timeout_s: float, service_p99_s: float | None
) -> dict[str, int]:
    """Requests not answered within ``queue_timeout_s`` plus their service time: no answer at
    all (client timeout, connection error, cut short), a refusal later than the queue timeout
    (+0.5 s), or a first token later than the queue timeout plus the class's TTFT p99 at 1x
    (its service time to first token; informational, as service time grows with load)."""
    unanswered = sum(1 for r in rs if r.outcome in (TIMEOUT, CONNECT_ERROR, INCOMPLETE))
    slow_refusal = sum(
        1 for r in rs if r.status in (429, 503) and (r.e2e_s or 0) > queue_timeout_s + 0.5
    )
    slow_first = 0
    if service_p99_s is not None:
        bound = queue_timeout_s + service_p99_s
        slow_first = sum(1 for r in rs if r.ok and r.ttft_s is not None and r.ttft_s > bound)
    return {
        "unanswered": unanswered,
        "late_refusals": slow_refusal,
        "late_first_tokens": slow_first,
    }


# ---------------------------------------------------------------------------- one gateway


@contextlib.asynccontextmanager
async def gateway(
    policy: dict[str, Any], workdir: Path, name: str, http: httpx.AsyncClient
) -> AsyncIterator[tuple[str, int]]:
    path = workdir / f"policy-{name}.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    argv = [sys.executable, "-m", "proxy", "serve", "--config", str(path),
            "--log-level", "warning"]  # fmt: skip
    with process(argv, log=workdir / f"gateway-{name}.log", grace_s=15) as proc:
        url = f"http://127.0.0.1:{policy['server']['port']}"
        await await_http(http, url + "/ready", 90, interval_s=0.1)
        yield url, proc.pid


async def run_gateway(
    name: str, sims: list[str], sim_pids: list[int], workdir: Path, args: argparse.Namespace,
    http: httpx.AsyncClient,
) -> dict[str, Any]:  # fmt: skip
    port = free_port()
    policy = POLICIES[name](sims, port, args)
    lane_timeout = {lane["name"]: lane.get("queue_timeout_s", 10.0) for lane in policy["lanes"]}
    levels_out: list[dict[str, Any]] = []
    tl = Timeline()
    async with gateway(policy, workdir, name, http) as (url, pid):
        t0 = time.monotonic()
        level = [0.0]
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample(http, url, pid, tl, t0, level, stop))
        async with LoadClient(url, max_connections=20_000, timeout_s=args.client_timeout_s) as lc:
            for mult in args.levels:
                level[0] = mult
                scenario = Scenario(args.rate * mult, args.duration_s, mix(args.factor),
                                    seed=args.seed, model=MODEL)  # fmt: skip
                requests = scenario_requests(scenario)
                before_all = scrape((await http.get(url + "/metrics")).text)
                before = before_all["tokenlane_rejections"]
                cpu0 = (self_cpu_s(), cpu_seconds(pid), sum(cpu_seconds(p) for p in sim_pids))
                wall0 = time.monotonic()
                print(
                    f"  {name} {mult:g}x: {len(requests)} requests at "
                    f"{args.rate * mult:g}/s for {args.duration_s:g}s",
                    file=sys.stderr,
                )
                results = await run_trace(
                    url, requests, model=MODEL, client=lc, prompt_seed=args.seed,
                    timeout_s=args.client_timeout_s,
                )  # fmt: skip
                wall = time.monotonic() - wall0
                cpu1 = (self_cpu_s(), cpu_seconds(pid), sum(cpu_seconds(p) for p in sim_pids))
                after_all = scrape((await http.get(url + "/metrics")).text)
                after = after_all["tokenlane_rejections"]
                waits = {
                    lane: waits_beyond(
                        before_all["tokenlane_queue_wait_seconds"],
                        after_all["tokenlane_queue_wait_seconds"], lane, timeout,
                    )
                    for lane, timeout in lane_timeout.items()
                }  # fmt: skip
                level_t = [(t, y) for t, y, lv in zip(tl.t, tl.rss_mb, tl.level, strict=True)
                           if lv == mult]  # fmt: skip
                start_t = level_t[0][0] if level_t else 0.0
                warm = [(t, y) for t, y in level_t if t - start_t >= WARMUP_S]
                slope = slope_per_min([t for t, _ in warm], [y for _, y in warm])
                mean_rss = sum(y for _, y in warm) / len(warm) if warm else None
                depths = [d for d, lv in zip(tl.depth, tl.level, strict=True) if lv == mult]
                by_class: dict[str, list[RequestResult]] = {}
                for r in results:
                    by_class.setdefault(r.cls, []).append(r)
                levels_out.append({
                    "level": mult,
                    "rate_rps": args.rate * mult,
                    "wall_s": wall,
                    "classes": {c: class_report(rs, args.duration_s) for c, rs in by_class.items()},
                    "rejections": {
                        f"{lane}/{reason}": v - before.get((lane, reason), 0.0)
                        for (lane, reason), v in sorted(after.items())
                        if v - before.get((lane, reason), 0.0) > 0
                    },
                    "queue_waits": waits,
                    "max_queue_depth": {
                        lane: max((d.get(lane, 0.0) for d in depths), default=0.0)
                        for lane in lane_timeout
                    },
                    "cpu_pct": {
                        "load_generator": 100 * (cpu1[0] - cpu0[0]) / wall,
                        "gateway": 100 * (cpu1[1] - cpu0[1]) / wall,
                        "simulators": 100 * (cpu1[2] - cpu0[2]) / wall,
                    },
                    "rss_mb": {"mean": mean_rss, "max": max((y for _, y in level_t), default=None),
                               "growth_pct_per_min": (100 * slope / mean_rss
                                                      if slope is not None and mean_rss else None)},
                    "generator_lateness": lateness(results),
                    "_results": results,
                })  # fmt: skip
                await wait_idle(http, sims, 120)
        stop.set()
        await sampler
    return {"policy": policy, "lane_timeout": lane_timeout, "levels": levels_out,
            "timeline": tl.__dict__}  # fmt: skip


def lane_of(cls: str, gateway_name: str) -> str:
    if gateway_name == "roundrobin":
        return "all"
    return "short" if cls == "short" else "long"


def check_targets(gw: dict[str, Any]) -> dict[str, Any]:
    """Issue 5's targets for one gateway's run (meaningful for tokenlane)."""
    levels = {lv["level"]: lv for lv in gw["levels"]}
    if 1 not in levels:
        return {}
    base, top_level = levels[1], max(levels)
    top = levels[top_level]
    s1, s4 = base["classes"]["short"], top["classes"]["short"]
    out: dict[str, Any] = {"at": top_level}
    if s1["ttft_p99_s"] and s4["ttft_p99_s"]:
        ratio = s4["ttft_p99_s"] / s1["ttft_p99_s"]
        out["short_ttft_p99_ratio"] = ratio
        out["short_ttft_p99_within_2x"] = ratio <= 2.0
    ratio_g = s4["goodput_rps"] / s1["goodput_rps"] if s1["goodput_rps"] else None
    out["short_goodput_ratio"] = ratio_g
    out["short_goodput_at_least_90pct"] = (out["short_goodput_ratio"] or 0) >= 0.9
    late: dict[str, int] = {"unanswered": 0, "late_refusals": 0, "late_first_tokens": 0}
    for lv in gw["levels"]:
        for cls, rs in _by_class(lv["_results"]).items():
            timeout = gw["lane_timeout"][lane_of(cls, gw["name"])]
            p99_1x = base["classes"].get(cls, {}).get("ttft_p99_s")
            for k, v in late_answers(rs, timeout, p99_1x).items():
                late[k] += v
    out["late_answers"] = late  # late_first_tokens: informational (service time grows with load)
    beyond = sum(w["beyond"] for lv in gw["levels"] for w in lv["queue_waits"].values())
    out["dispatched_after_queue_timeout"] = beyond
    out["every_request_answered_in_time"] = (
        late["unanswered"] == 0 and late["late_refusals"] == 0 and beyond == 0
    )
    growth = [lv["rss_mb"]["growth_pct_per_min"] for lv in gw["levels"]]
    growth = [g for g in growth if g is not None]
    out["rss_growth_pct_per_min_max"] = max(growth) if growth else None
    out["rss_growth_under_5pct_per_min"] = bool(growth) and max(growth) < 5.0
    # The process's own warm-up (allocator arenas, connection pools) shows in its first level.
    later = growth[1:]
    out["rss_growth_pct_per_min_max_after_first_level"] = max(later) if later else None
    return out


def _by_class(results: Sequence[RequestResult]) -> dict[str, list[RequestResult]]:
    out: dict[str, list[RequestResult]] = {}
    for r in results:
        out.setdefault(r.cls, []).append(r)
    return out


# ---------------------------------------------------------------------------- output


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:,.0f}"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| gateway | load | class | offered /s | TTFT p50 ms | TTFT p99 ms | goodput /s "
        "| answers | rejections (gateway, lane/reason) | max queue | CPU % gen / gw / sims "
        "| RSS MB (growth %/min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for gw in report["gateways"]:
        for lv in gw["levels"]:
            first = True
            for cls, c in lv["classes"].items():
                extra = ["", "", "", ""]
                if first:
                    rej = ", ".join(f"{k} {v:.0f}" for k, v in lv["rejections"].items()) or "none"
                    q = ", ".join(f"{k} {v:.0f}" for k, v in lv["max_queue_depth"].items())
                    cpu = lv["cpu_pct"]
                    rss = lv["rss_mb"]
                    growth = rss["growth_pct_per_min"]
                    extra = [
                        rej, q,
                        f"{cpu['load_generator']:.0f} / {cpu['gateway']:.0f} / "
                        f"{cpu['simulators']:.0f}",
                        f"{rss['max']:.0f} ({growth:+.1f})" if growth is not None
                        else f"{rss['max'] or 0:.0f}",
                    ]  # fmt: skip
                answers = ", ".join(f"{k}: {v}" for k, v in c["statuses"].items())
                lines.append(
                    f"| {gw['name'] if first else ''} | {lv['level']:g}x | {cls} "
                    f"| {c['offered_rps']:.1f} | {ms(c['ttft_p50_s'])} | {ms(c['ttft_p99_s'])} "
                    f"| {c['goodput_rps']:.2f} | {answers} | {' | '.join(extra)} |"
                )
                first = False
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    gws = report["gateways"]
    fig = Figure(figsize=(13, 8.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    # TTFT p99 of the short class by load
    ax = axes[0][0]
    for gw in gws:
        xs = [lv["level"] for lv in gw["levels"]]
        for q, style in (("ttft_p99_s", "-o"), ("ttft_p50_s", "--o")):
            ys = [(lv["classes"]["short"][q] or float("nan")) * 1000 for lv in gw["levels"]]
            ax.plot(xs, ys, style, label=f"{gw['name']} short {q[5:8]}")
    ax.set_yscale("log")
    ax.set_xticks([lv["level"] for lv in gws[0]["levels"]])
    ax.set_xlabel("offered load (x capacity)")
    ax.set_ylabel("TTFT ms (log)")
    ax.set_title("short streams: TTFT of completed requests")
    ax.legend(fontsize=8)
    # goodput by class
    ax = axes[0][1]
    width = 0.8 / max(1, len(gws))
    for i, gw in enumerate(gws):
        xs = [j + i * width for j in range(len(gw["levels"]))]
        bottoms = [0.0] * len(xs)
        for cls in ("short", "long", "batch"):
            ys = [lv["classes"].get(cls, {}).get("goodput_rps", 0.0) for lv in gw["levels"]]
            ax.bar(xs, ys, width, bottom=bottoms, label=f"{gw['name']} {cls}",
                   alpha=0.9 if i == 0 else 0.5)  # fmt: skip
            bottoms = [b + y for b, y in zip(bottoms, ys, strict=True)]
    ax.set_xticks([j + width * (len(gws) - 1) / 2 for j in range(len(gws[0]["levels"]))])
    ax.set_xticklabels([f"{lv['level']:g}x" for lv in gws[0]["levels"]])
    ax.set_ylabel("goodput (requests/s within TTFT SLO)")
    ax.set_title("goodput by class")
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    # queue depth over time (tokenlane)
    ax = axes[1][0]
    for gw in gws:
        if gw["name"] != "tokenlane":
            continue
        tl = gw["timeline"]
        lanes = sorted({k for d in tl["depth"] for k in d})
        for lane in lanes:
            ax.plot(tl["t"], [d.get(lane, 0.0) for d in tl["depth"]], label=f"queue {lane}")
        _mark_levels(ax, tl)
    ax.set_xlabel("s since the gateway started")
    ax.set_ylabel("requests queued")
    ax.set_title("tokenlane: queue depth by lane")
    ax.legend(fontsize=8)
    # RSS over time
    ax = axes[1][1]
    for gw in gws:
        tl = gw["timeline"]
        ax.plot(tl["t"], tl["rss_mb"], label=gw["name"])
    ax.set_xlabel("s since the gateway started")
    ax.set_ylabel("gateway RSS MB")
    ax.set_title("gateway memory")
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def _mark_levels(ax: Any, tl: dict[str, Any]) -> None:
    prev = None
    for t, lv in zip(tl["t"], tl["level"], strict=True):
        if lv != prev:
            ax.axvline(t, color="grey", lw=0.5)
            ax.text(t, 0, f" {lv:g}x", fontsize=8, va="bottom")
            prev = lv


# ---------------------------------------------------------------------------- main


async def run(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    workdir = out / "work"
    workdir.mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in range(4)]
    sims = [f"http://127.0.0.1:{p}" for p in ports]
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        procs = [
            stack.enter_context(process(
                [sys.executable, "-m", "loadtest.sim", "--port", str(p), "--name", f"sim{i}",
                 "--max-num-seqs", str(args.max_num_seqs), "--request-log-size", "0",
                 "--fault", "slow", "--fault-param", f"factor={args.factor}"],
                log=workdir / f"sim{i}.log", grace_s=15,
            ))
            for i, p in enumerate(ports)
        ]  # fmt: skip
        async with httpx.AsyncClient(timeout=10) as http:
            for url in sims:
                await await_http(http, url + "/health", 60, interval_s=0.1)
            gateways = []
            for name in args.gateways:
                gw = await run_gateway(name, sims, [p.pid for p in procs], workdir, args, http)
                gw["name"] = name
                gw["targets"] = check_targets(gw)
                gateways.append(gw)
    return {
        "settings": {
            "duration_s": args.duration_s, "rate_1x": args.rate, "levels": args.levels,
            "factor": args.factor, "max_num_seqs": args.max_num_seqs, "seed": args.seed,
            "cores": os.cpu_count(), "client_timeout_s": args.client_timeout_s,
        },
        "runtime_s": time.monotonic() - started,
        "gateways": gateways,
    }  # fmt: skip


def _strip(report: dict[str, Any]) -> dict[str, Any]:
    """The report without per-request results (kept separately), for JSON."""
    doc = json.loads(json.dumps(report, default=lambda o: None))
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_overload", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--duration-s", type=float, default=60.0, help="per load level (default 60)")
    p.add_argument("--rate", type=float, default=14.0, help="1x rate, requests/s (default 14)")
    p.add_argument("--levels", default="1,2,4", help="multiples of --rate (default 1,2,4)")
    p.add_argument("--factor", type=float, default=10.0, help="slow fault factor (default 10)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="per simulator (default 16)")
    p.add_argument("--gateways", default="tokenlane,roundrobin")
    p.add_argument(
        "--client-timeout-s",
        type=float,
        default=60.0,
        help="a request unanswered this long counts as unanswered (default 60)",
    )
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--out", type=Path, help="results directory (loadtest/results/overload-<time>)")
    p.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help=f"PNG (default {DEFAULT_PLOT})")
    p.add_argument("--replot", type=Path, help="only redraw the PNG from an overload.json")
    args = p.parse_args(argv)
    if args.replot is not None:
        plot(json.loads(args.replot.read_text()), args.plot)
        return 0
    args.levels = [float(x) for x in args.levels.split(",")]
    args.gateways = [g.strip() for g in args.gateways.split(",")]
    if unknown := [g for g in args.gateways if g not in POLICIES]:
        p.error(f"unknown gateway(s) {unknown}; known: {', '.join(POLICIES)}")
    raise_open_files_limit()
    out = args.out or Path("loadtest/results") / dt.datetime.now().strftime(
        "overload-%Y%m%d-%H%M%S"
    )
    out.mkdir(parents=True, exist_ok=True)
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        report = runner.run(run(args, out))
    for gw in report["gateways"]:
        for lv in gw["levels"]:
            rows = lv.pop("_results")
            with (out / f"requests-{gw['name']}-{lv['level']:g}x.jsonl").open("w") as f:
                for r in rows:
                    f.write(json.dumps(r.to_json()) + "\n")
    (out / "overload.json").write_text(json.dumps(_strip(report), indent=1) + "\n")
    table = markdown(report)
    (out / "overload.md").write_text(table + "\n")
    plot(report, args.plot)
    print(table)
    for gw in report["gateways"]:
        print(f"\n{gw['name']} targets at {gw['targets'].get('at', '?')}x: "
              f"{json.dumps(gw['targets'], indent=1)}")  # fmt: skip
    print(f"\nruntime {report['runtime_s']:.0f} s; results {out}; plot {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
