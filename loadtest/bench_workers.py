"""Scaling with workers: paced streams offered at rising chunk rates, direct and through
Tokenlane with 1 and N workers, in one run over the same mocks and the same load generator.

Each stream is 64 tokens, one write per token, ``--interval-ms`` apart (50: 20 chunks/s a
stream), so a rate of R chunks/s is R / 20 streams kept open: each client sends its next
stream as soon as one ends. The clients' first streams start spread over one stream's life
(3.2 s), so streams begin at the steady rate the load implies (R / 64 a second), not all at
once every 3.2 s; the run is measured for ``--seconds`` from when the last client has begun.
Per rate and target the run prints the chunks/s
delivered, the added inter-token latency (p50/p99/max, over the direct run at the same rate),
the CPU per delivered chunk of every process (gateway tree, load generator, mocks) and the
streams that failed (a connection lost or an answer without ``[DONE]``).

On a machine with fewer cores than the load needs, the generator and mocks take cores from the
gateway: a rate the machine cannot carry shows as delivered < offered and ITL rising, and the
figure to judge scaling on is CPU per chunk (what a core buys), printed with what each rate
leaves free. ``--hold`` also runs ``--hold-streams`` (1,000) streams held open for a minute
(tokens every 250 ms) through N workers and prints the gateway's RSS per open stream.

    python -m loadtest.bench_workers [--rates 5000,10000,20000,40000] [--workers 2]
        [--seconds 10] [--hold] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import gateways
from .bench_overhead import MODEL, StreamClient, connect, mock_processes, mocks, request_bytes
from .procs import descendants, machine, tree_cpu_seconds, tree_rss_mb

TOKENS = 64  # a stream's tokens (``mock_processes`` sends as many)


def paced_request(port: int, tokens: int = TOKENS) -> bytes:
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": tokens,
        }
    ).encode()
    return request_bytes(port, body)


def arrived_by(arrivals: list[float], deadline: float) -> int:
    """How many of a stream's chunks (their arrival times, in order) came by ``deadline``."""
    return bisect.bisect_right(arrivals, deadline)


def windowed(arrivals: list[float], begin: float, deadline: float) -> tuple[int, int, list[float]]:
    """One stream's share of a window that opens at ``begin`` (when every client has begun)
    and closes at ``deadline``: its chunks that came from ``begin`` on (the CPU is measured
    from then), those of them that came by ``deadline`` (the delivered rate), and the gaps in
    ms before each chunk that came from ``begin`` on (a gap spanning ``begin`` included)."""
    first = bisect.bisect_left(arrivals, begin)
    gaps = [(arrivals[i] - arrivals[i - 1]) * 1000 for i in range(max(first, 1), len(arrivals))]
    return len(arrivals) - first, arrived_by(arrivals, deadline) - first, gaps


def start_delay(i: int, concurrency: int, spread_s: float) -> float:
    """When client ``i`` sends its first stream: the clients' starts spread evenly over
    ``spread_s`` (one stream's life), so that streams begin at the steady rate the offered
    load implies (concurrency / stream life) and keep doing so as each client sends its next
    stream when one ends. Started within a few milliseconds, as they were, every stream
    ended and began again together: at 20,000 chunks/s a thousand requests in one instant
    every 3.2 s, which was what the added ITL p99 measured (``docs/benchmarks.md``)."""
    return spread_s * i / concurrency


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@dataclass
class RateResult:
    streams: int = 0
    failed: int = 0
    chunks: int = 0
    in_window: int = 0  # chunks that arrived within the offered ``window_s``
    gaps_ms: list[float] = field(default_factory=list)
    seconds: float = 0.0
    window_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        g = sorted(self.gaps_ms) or [float("nan")]
        per = {k: 1e6 * v / self.chunks if self.chunks else 0.0 for k, v in self.cpu_s.items()}
        return {
            "streams": self.streams,
            "failed": self.failed,
            # Counted within the window the load was offered for: streams are whole (a
            # client starts one while the window is open), so counting every chunk of them over
            # the whole run made the rate step with how many streams each client fitted in
            # (3 or 4 of 3.2 s in 10 s: a gateway whose first streams started later read 20 %
            # lower at 10,000 chunks/s while it kept up).
            "chunks_per_s": self.in_window / self.window_s if self.window_s else 0.0,
            "itl_p50_ms": g[len(g) // 2],
            "itl_p99_ms": g[min(len(g) - 1, int(len(g) * 0.99))],
            "itl_max_ms": g[-1],
            "cpu_us_per_chunk": per,
            "cores_busy": {k: v / self.seconds for k, v in self.cpu_s.items()},
        }


async def offered(
    ports: list[int],
    concurrency: int,
    seconds: float,
    pids: dict[str, list[int]],
    spread_s: float = 0.0,
) -> RateResult:
    """``concurrency`` clients, each sending paced streams back to back, their first starts
    spread over ``spread_s`` (``start_delay``); measured for ``seconds`` from when the last
    client has begun (the load then steady): chunks, gaps and CPU from then on."""
    result = RateResult()
    clients: list[StreamClient] = []
    for i in range(concurrency):
        clients.append(await connect(ports[i % len(ports)]))
    payloads = [paced_request(ports[i % len(ports)]) for i in range(concurrency)]
    start = time.perf_counter()
    begin = start + spread_s  # the window opens: every client has begun
    deadline = begin + seconds

    async def client(i: int) -> None:
        c, payload = clients[i], payloads[i]
        await asyncio.sleep(start_delay(i, concurrency, spread_s))
        c.record_arrivals = True
        while time.perf_counter() < deadline:
            c.arrivals = []
            try:
                await c.send(payload)
            except ConnectionError:
                result.failed += 1
                return
            chunks, in_window, gaps = windowed(c.arrivals, begin, deadline)
            result.streams += 1
            result.chunks += chunks
            result.in_window += in_window
            result.gaps_ms.extend(gaps)

    def cpu_now() -> dict[str, float]:
        cpu = {name: sum(tree_cpu_seconds(p) for p in ps) for name, ps in pids.items()}
        cpu["generator"] = own_cpu_s()
        return cpu

    async def cpu_at_opening() -> tuple[float, dict[str, float]]:
        """When the window opened (a sleep late) and every process's CPU then."""
        await asyncio.sleep(spread_s)
        return time.perf_counter(), cpu_now()

    opening = asyncio.ensure_future(cpu_at_opening())
    await asyncio.gather(opening, *(client(i) for i in range(concurrency)))
    read_at, cpu0 = opening.result()
    result.seconds = time.perf_counter() - read_at
    result.window_s = seconds
    result.cpu_s = {name: v - cpu0[name] for name, v in cpu_now().items()}
    for c in clients:
        if c.transport is not None:
            c.transport.close()
    return result


def run_rates(
    rates: list[int], workers: int, seconds: float, interval_ms: float
) -> list[dict[str, Any]]:
    per_stream = 1000.0 / interval_ms
    stream_s = TOKENS * interval_ms / 1000  # one stream's life: the starts' spread
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        ports, mock_pids = stack.enter_context(mock_processes(interval_ms))
        targets: list[tuple[str, Any]] = [("direct", None), ("tokenlane", 1)]
        if workers > 1:
            targets.append((f"tokenlane x{workers}", workers))
        for rate in rates:
            concurrency = max(1, round(rate / per_stream))
            row: dict[str, Any] = {"offered_chunks_per_s": rate, "streams_open": concurrency}
            for name, n in targets:
                pids: dict[str, list[int]] = {"mocks": mock_pids}
                if n is None:
                    res = asyncio.run(offered(ports, concurrency, seconds, pids, stream_s))
                else:
                    with gateways.tokenlane(ports, n) as g:
                        _warm(g.port)
                        pids["gateway"] = [g.pid]
                        res = asyncio.run(offered([g.port], concurrency, seconds, pids, stream_s))
                row[name] = res.summary()
            rows.append(row)
    return rows


def _warm(port: int) -> None:
    async def warm() -> None:
        clients = [await connect(port) for _ in range(8)]
        await asyncio.gather(*(c.send(paced_request(port, 2)) for c in clients))
        for c in clients:
            if c.transport is not None:
                c.transport.close()

    asyncio.run(warm())


def run_hold(workers: int, streams: int, seconds: float) -> dict[str, Any]:
    """``streams`` paced streams held open for ``seconds`` through ``workers`` workers."""
    interval_ms = 250.0
    tokens = int(seconds * 1000 / interval_ms)
    with mocks(interval_ms) as ports, gateways.tokenlane(ports, workers) as g:
        _warm(g.port)
        idle_mb = tree_rss_mb(g.pid)
        peak = [idle_mb]

        async def hold() -> tuple[int, int]:
            clients = [await connect(g.port) for _ in range(streams)]
            payload = paced_request(g.port, tokens)
            done = asyncio.Event()

            async def sample() -> None:
                while not done.is_set():
                    peak[0] = max(peak[0], tree_rss_mb(g.pid))
                    await asyncio.sleep(1.0)

            sampler = asyncio.create_task(sample())
            results = await asyncio.gather(
                *(c.send(payload) for c in clients), return_exceptions=True
            )
            done.set()
            await sampler
            failed = sum(isinstance(r, BaseException) for r in results)
            for c in clients:
                if c.transport is not None:
                    c.transport.close()
            return streams - failed, failed

        ok, failed = asyncio.run(hold())
    return {
        "workers": workers,
        "streams": streams,
        "seconds": seconds,
        "ok": ok,
        "failed": failed,
        "rss_idle_mb": idle_mb,
        "rss_peak_mb": peak[0],
        "rss_kb_per_stream": 1024 * (peak[0] - idle_mb) / streams,
    }


def run_propagation(workers: int, rounds: int) -> dict[str, Any]:
    """How long an operator's ejection, asked of any worker, takes to reach every worker: the
    admin call's start to the moment each worker's own state (asked over its socket) shows it."""
    from proxy.workers.mesh import ask, socket_path

    async def states(rundir: str, url: str) -> list[str | None]:
        out: list[str | None] = []
        for w in range(workers):
            answer = await ask(socket_path(rundir, w), {"ask": "sync"}, 2.0)
            rec = [r for r in (answer or {}).get("records", []) if r["url"] == url]
            out.append(rec[0]["state"] if rec else None)
        return out

    async def measure(port: int, rundir: str, url: str) -> list[float]:
        import httpx

        took = []
        async with httpx.AsyncClient(timeout=10) as client:
            for _ in range(rounds):
                while await states(rundir, url) != ["healthy"] * workers:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)  # another process's state: nothing to await
                start = time.perf_counter()
                await client.post(
                    f"http://127.0.0.1:{port}/admin/replicas/eject", json={"url": url}
                )
                while await states(rundir, url) != ["ejected"] * workers:
                    pass
                took.append((time.perf_counter() - start) * 1000)
                await client.post(
                    f"http://127.0.0.1:{port}/admin/replicas/readmit", json={"url": url}
                )
        return sorted(took)

    with mocks(0) as ports, gateways.tokenlane(ports, workers) as g:
        rundir = _rundir(g.pid)
        took = asyncio.run(measure(g.port, rundir, f"http://127.0.0.1:{ports[0]}"))
    return {"rounds": rounds, "p50_ms": took[len(took) // 2], "max_ms": took[-1]}


def run_scrape_cost(workers: int, scrapes: int = 50) -> dict[str, Any]:
    """A /metrics scrape's time and the serve's CPU for it, with one worker and with N (where
    the answering worker asks the others and merges)."""
    import urllib.request

    out: dict[str, Any] = {}
    with mocks(0) as ports:
        for n in sorted({1, workers}):
            with gateways.tokenlane(ports, n) as g:
                url = f"http://127.0.0.1:{g.port}/metrics"
                times = []
                cpu0 = tree_cpu_seconds(g.pid)
                for _ in range(scrapes):
                    start = time.perf_counter()
                    with urllib.request.urlopen(url, timeout=10) as r:
                        size = len(r.read())
                    times.append((time.perf_counter() - start) * 1000)
                cpu = tree_cpu_seconds(g.pid) - cpu0
                times.sort()
                out[str(n)] = {
                    "p50_ms": times[len(times) // 2],
                    "max_ms": times[-1],
                    "cpu_ms": 1000 * cpu / scrapes,
                    "bytes": size,
                }
    return out


def _rundir(supervisor_pid: int) -> str:
    """The serve's run directory, from its first worker's command line."""
    for pid in descendants(supervisor_pid):
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--rundir" in args:
            return args[args.index(b"--rundir") + 1].decode()
    raise RuntimeError("no worker with a run directory")


def print_rates(rows: list[dict[str, Any]], seconds: float, interval_ms: float) -> None:
    cores = os.cpu_count() or 1
    print(
        f"paced streams, {TOKENS} tokens {interval_ms:g} ms apart, starts spread over a stream's"
        f" life, {seconds:g}s per rate once all began, {cores} cores"
    )
    print(
        f"{'offered':>8} {'target':<14} | {'chunks/s':>8} | {'ITL p50':>7} {'p99':>7} {'max':>7}"
        f" | {'+p99':>6} | {'us/chunk gw':>11} {'gen':>5} {'mocks':>5} | {'cores gw':>8}"
        f" {'all':>5} | fail"
    )
    for row in rows:
        direct = row["direct"]
        for name, s in row.items():
            if not isinstance(s, dict):
                continue
            per, busy = s["cpu_us_per_chunk"], s["cores_busy"]
            added = s["itl_p99_ms"] - direct["itl_p99_ms"] if name != "direct" else 0.0
            print(
                f"{row['offered_chunks_per_s']:>8} {name:<14} | {s['chunks_per_s']:>8.0f} |"
                f" {s['itl_p50_ms']:>7.1f} {s['itl_p99_ms']:>7.1f} {s['itl_max_ms']:>7.1f} |"
                f" {added:>+6.1f} | {per.get('gateway', 0.0):>11.1f} {per['generator']:>5.1f}"
                f" {per['mocks']:>5.1f} | {busy.get('gateway', 0.0):>8.2f}"
                f" {sum(busy.values()):>5.2f} | {s['failed']}"
            )
    print(
        "(us/chunk: CPU per delivered chunk; cores: CPU seconds per second; 'all' is gateway +"
        " generator + mocks, of the machine's cores)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="5000,10000,20000,40000")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--interval-ms", type=float, default=50.0)
    parser.add_argument("--hold", action="store_true", help="also hold --hold-streams a minute")
    parser.add_argument("--hold-streams", type=int, default=1000)
    parser.add_argument("--hold-seconds", type=float, default=60.0)
    parser.add_argument("--propagation", type=int, default=20, help="ejection rounds (0: none)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    rates = [int(r) for r in args.rates.split(",")]
    out: dict[str, Any] = {"cores": os.cpu_count(), "machine": machine(), "workers": args.workers}
    print(f"machine: {out['machine']}")
    out["rates"] = run_rates(rates, args.workers, args.seconds, args.interval_ms)
    print_rates(out["rates"], args.seconds, args.interval_ms)
    if args.propagation and args.workers > 1:
        out["propagation"] = p = run_propagation(args.workers, args.propagation)
        print(
            f"\nan operator's ejection reaching all {args.workers} workers ({p['rounds']} rounds,"
            f" from the admin call's start): p50 {p['p50_ms']:.1f} ms, max {p['max_ms']:.1f} ms"
        )
    if args.workers > 1:
        out["scrape"] = sc = run_scrape_cost(args.workers)
        for n, c in sc.items():
            print(
                f"/metrics with {n} worker(s): p50 {c['p50_ms']:.1f} ms, max {c['max_ms']:.1f} ms,"
                f" {c['cpu_ms']:.1f} ms of CPU per scrape, {c['bytes']} bytes"
            )
    if args.hold:
        out["hold"] = h = run_hold(args.workers, args.hold_streams, args.hold_seconds)
        print(
            f"\nhold: {h['streams']} streams for {h['seconds']:g}s through {h['workers']} workers:"
            f" {h['ok']} ended whole, {h['failed']} failed; gateway RSS {h['rss_idle_mb']:.0f} MB"
            f" idle, {h['rss_peak_mb']:.0f} MB peak: {h['rss_kb_per_stream']:.1f} KB per stream"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
