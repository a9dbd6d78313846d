"""``tokenlane top``: a live terminal view of one running gateway, from its ``/metrics`` and
``/admin/replicas``, refreshed every second.

Rates (requests/s, tokens/s) and TTFT quantiles are taken between two consecutive refreshes,
so they show what is happening now, not averages since the gateway started. The reading and
the arithmetic are pure functions over plain data (``parse``, ``view``); only ``run`` does I/O.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Scrape:
    """One refresh: the gateway's samples by name and labels, its replicas, and when."""

    at: float
    samples: Mapping[str, Mapping[Labels, float]]
    replicas: list[dict[str, Any]] = field(default_factory=list)

    def series(self, name: str) -> Mapping[Labels, float]:
        return self.samples.get(name, {})


def parse(text: str, replicas: list[dict[str, Any]], at: float) -> Scrape:
    samples: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return Scrape(at, samples, replicas)


def _sum_by(series: Mapping[Labels, float], key: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in series.items():
        k = dict(labels).get(key, "")
        out[k] = out.get(k, 0.0) + value
    return out


def _delta(cur: Mapping[str, float], prev: Mapping[str, float] | None) -> dict[str, float]:
    """Counter increase since the last refresh; a counter that went down restarted."""
    if prev is None:
        return {k: 0.0 for k in cur}
    return {k: v - prev.get(k, 0.0) if v >= prev.get(k, 0.0) else v for k, v in cur.items()}


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts (``le`` -> count): linear
    within the bucket, the lower bound of the last finite bucket when it falls in +Inf."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def _buckets_by(series: Mapping[Labels, float], key: str) -> dict[str, dict[float, float]]:
    out: dict[str, dict[float, float]] = {}
    for labels, value in series.items():
        d = dict(labels)
        le = float(d["le"])
        by = out.setdefault(d.get(key, ""), {})
        by[le] = by.get(le, 0.0) + value
    return out


@dataclass(frozen=True)
class LaneRow:
    lane: str
    rate: float
    queue: float
    max_queue: float | None
    p50: float | None
    p99: float | None
    rejections: float
    rejections_rate: float


@dataclass(frozen=True)
class ReplicaRow:
    pool: str
    name: str
    state: str
    reason: str | None
    in_flight: int
    tokens_s: float | None
    kv: float | None
    ejections: int


@dataclass(frozen=True)
class View:
    lanes: list[LaneRow]
    replicas: list[ReplicaRow]


def view(cur: Scrape, prev: Scrape | None) -> View:
    """What the screen shows: per lane and per replica, rates over the last interval."""
    dt = max(cur.at - prev.at, 1e-9) if prev is not None else None

    def rate(name: str, key: str) -> tuple[dict[str, float], dict[str, float]]:
        total = _sum_by(cur.series(name), key)
        before = _sum_by(prev.series(name), key) if prev is not None else None
        delta = _delta(total, before)
        return total, {k: (v / dt if dt else 0.0) for k, v in delta.items()}

    _, req_rate = rate("tokenlane_requests_total", "lane")
    rej_total, rej_rate = rate("tokenlane_rejections_total", "lane")
    queue = _sum_by(cur.series("tokenlane_queue_depth"), "lane")
    max_queue = _sum_by(cur.series("tokenlane_lane_max_queue"), "lane")
    ttft_now = _buckets_by(cur.series("tokenlane_ttft_seconds_bucket"), "lane")
    ttft_before = _buckets_by(prev.series("tokenlane_ttft_seconds_bucket"), "lane") if prev else {}
    lanes = sorted(set(queue) | set(req_rate) | set(max_queue))
    lane_rows = []
    for lane in lanes:
        if lane == "none":  # unauthorized requests, before any lane is known
            continue
        buckets = ttft_now.get(lane, {})
        before = ttft_before.get(lane)
        recent = {le: c - before.get(le, 0.0) for le, c in buckets.items()} if before else {}
        # The last interval's requests; the whole history while none came in the interval.
        shown = recent if recent and max(recent.values()) > 0 else buckets
        lane_rows.append(
            LaneRow(
                lane=lane,
                rate=req_rate.get(lane, 0.0),
                queue=queue.get(lane, 0.0),
                max_queue=max_queue.get(lane),
                p50=quantile(0.5, shown),
                p99=quantile(0.99, shown),
                rejections=rej_total.get(lane, 0.0),
                rejections_rate=rej_rate.get(lane, 0.0),
            )
        )
    previous = {(r["pool"], r["name"]): r for r in (prev.replicas if prev else [])}
    replica_rows = []
    for r in cur.replicas:
        stats = r.get("stats") or {}
        tokens_s = None
        old = previous.get((r["pool"], r["name"]))
        if old is not None and dt:
            a = (old.get("stats") or {}).get("generation_tokens_total")
            b = stats.get("generation_tokens_total")
            if a is not None and b is not None and b >= a:
                tokens_s = (b - a) / dt
        replica_rows.append(
            ReplicaRow(
                pool=r["pool"],
                name=r["name"],
                state=r["state"],
                reason=r.get("reason"),
                in_flight=int(r.get("in_flight", 0)),
                tokens_s=tokens_s,
                kv=None if stats.get("stale", True) else stats.get("kv_cache_usage"),
                ejections=int(r.get("ejections", 0)),
            )
        )
    return View(lane_rows, replica_rows)


STATE_STYLE = {"healthy": "green", "probing": "yellow", "draining": "cyan", "ejected": "bold red"}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def render(v: View, url: str, error: str | None = None) -> Group:
    parts: list[Any] = []
    title = Text(f"tokenlane top  {url}  {time.strftime('%H:%M:%S')}", style="bold")
    parts.append(title)
    if error is not None:
        parts.append(Text(f"gateway unreachable at {url}: {error}", style="bold white on red"))
    lanes = Table(title="lanes", expand=True)
    for col in ("lane", "req/s", "queue", "TTFT p50", "TTFT p99", "rejections", "rej/s"):
        lanes.add_column(col, justify="left" if col == "lane" else "right")
    for row in v.lanes:
        queue = f"{row.queue:.0f}" + (f"/{row.max_queue:.0f}" if row.max_queue is not None else "")
        lanes.add_row(
            row.lane, f"{row.rate:.1f}", queue, _ms(row.p50), _ms(row.p99),
            f"{row.rejections:.0f}", f"{row.rejections_rate:.1f}",
        )  # fmt: skip
    replicas = Table(title="replicas", expand=True)
    for col in ("pool", "replica", "state", "reason", "in flight", "tokens/s", "KV", "ejections"):
        replicas.add_column(
            col, justify="left" if col in ("pool", "replica", "state", "reason") else "right"
        )
    for r in v.replicas:
        replicas.add_row(
            r.pool, r.name, Text(r.state, style=STATE_STYLE.get(r.state, "")), r.reason or "",
            str(r.in_flight), "-" if r.tokens_s is None else f"{r.tokens_s:.0f}",
            "-" if r.kv is None else f"{r.kv:.0%}", str(r.ejections),
        )  # fmt: skip
    parts += [lanes, replicas]
    return Group(*parts)


def fetch(client: httpx.Client, url: str, token: str | None) -> Scrape:
    """One refresh; raises ``httpx.HTTPError`` (unreachable) or ``PermissionError`` (token)."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    metrics = client.get(url + "/metrics")
    metrics.raise_for_status()
    admin = client.get(url + "/admin/replicas", headers=headers)
    if admin.status_code in (401, 403):
        raise PermissionError(f"/admin/replicas answered {admin.status_code}: {_detail(admin)}")
    admin.raise_for_status()
    return parse(metrics.text, admin.json()["replicas"], time.monotonic())


def _detail(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


def run(
    url: str,
    token: str | None,
    *,
    interval_s: float = 1.0,
    iterations: int | None = None,
    console: Console | None = None,
) -> int:
    """Refresh until interrupted (or ``iterations`` times). An unreachable gateway is shown,
    with the last data seen, and retried at the next refresh."""
    url = url.rstrip("/")
    console = console or Console()
    prev: Scrape | None = None
    last = View([], [])
    done = 0
    with httpx.Client(timeout=max(interval_s, 1.0)) as client:
        with Live(render(last, url), console=console, refresh_per_second=4) as live:
            try:
                while iterations is None or done < iterations:
                    error = None
                    try:
                        cur = fetch(client, url, token)
                        last = view(cur, prev)
                        prev = cur
                    except httpx.HTTPError as exc:
                        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                    except PermissionError as exc:
                        error = f"{exc} (set --admin-token or TOKENLANE_ADMIN_TOKEN)"
                    live.update(render(last, url, error))
                    done += 1
                    if iterations is None or done < iterations:
                        time.sleep(interval_s)
            except KeyboardInterrupt:
                pass
    return 0
