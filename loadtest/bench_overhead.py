"""Core overhead benchmark: the same load direct to a fast fake vLLM and through the gateway.

The gateway runs as ``make run`` runs it (``python -m proxy serve``: uvloop, httptools, the
access log on); each upstream is a separate process (``loadtest.fake_upstream``); the load
generator is raw asyncio on uvloop in this process (httpx is too slow to generate load). Each
configuration is repeated and the median printed.

- burst: two upstreams send a 64-token stream in one write; TTFT p50/p99, req/s and the
  gateway's CPU ms per request (from /proc) at concurrency 1, 16, 64;
- paced: 256 concurrent streams of 64 tokens, 50 ms apart, one write per token; added
  inter-token latency p50/p99/max and gateway CPU µs per relayed chunk, with continuation off
  and on (on: every stream is eligible, so it asks for token ids, which the upstream sends as
  vLLM does, and the gateway parses every event and strips the ids).

``--peer`` runs the same load through nginx (when installed), vllm-router (PyPI, installed
into its own virtualenv on first use) and Tokenlane (and, with ``--workers N``, Tokenlane with
N workers; and, unless ``--continuation on``, Tokenlane with continuation off, every stream
relayed plain) in one run over the same two mocks, all started at once and measured in turns
(each round every gateway and the direct baseline once, the order turned each round), and
prints one table of the rounds' medians: added TTFT p50 at
concurrency 1, req/s and CPU ms per request at concurrency 64, CPU µs per relayed chunk and
added ITL p99 of 256 paced streams, and added TTFT p50 at concurrency 1 with a 2,048-token
prompt (``LONG_PROMPT_TOKENS``: the mocks send that many prompt ids to a stream that asks for
token ids, as vLLM does, so an eligible stream's first chunk is as long as a real one's). CPU
is each gateway's whole process tree.

``--workers N`` (without ``--peer``) runs the other modes' gateway with N workers.

``--tracing on|both`` runs the gateway with OpenTelemetry tracing on as well (exporting over
OTLP/HTTP to a receiver in this process that answers every export with 200): the burst rows
give the cost per request, a paced run (continuation off) the cost per chunk.

On a 2-core machine the generator, the upstreams and the gateway share the cores: the direct
run at each concurrency is the ceiling of generator + upstream, printed beside the gateway's.

    python -m loadtest.bench_overhead [--seconds 5] [--repeat 3] [--mode burst|paced|both]
        [--continuation off|on|both] [--tracing off|on|both] [--json out.json]
        [--peer] [--workers N]

Length: one benchmark whose modes (burst, paced, peer, tracing) share the load generator, the
gateways' set-up and the table; apart, each mode would repeat them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from . import gateways, peers
from .procs import (
    cpu_seconds,
    free_port,
    machine,
    process,
    tree_cpu_seconds,
    tree_wait_seconds,
    wait_port,
)

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
REDIS_URL: str | None = None  # --redis-url: the gateway keeps shared state in this Redis
WORKERS = 1  # --workers: the gateway's worker processes


# ---------------------------------------------------------------------------- the client


# The long prompt's run: about this many tokens (the mocks count 4 characters a token).
LONG_PROMPT_TOKENS = 2048


def stream_request(port: int, prompt_tokens: int = 0) -> bytes:
    """A 64-token streamed chat request, as bytes on the wire; with ``prompt_tokens``, its
    message that long (as the mocks count tokens), else "hi"."""
    content = ("lorem ipsum dolor sit amet " * (prompt_tokens // 6 + 1))[: 4 * prompt_tokens]
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": content or "hi"}],
            "stream": True,
            "max_tokens": 64,
        }
    ).encode()
    return request_bytes(port, body)


def request_bytes(port: int, stream_body: bytes) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (port, len(stream_body), stream_body)
    )


class StreamClient(asyncio.Protocol):
    """One keep-alive connection; records the arrival of content for each response."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] | None = None
        self.first_content: float = 0.0
        self.arrivals: list[float] = []
        self.record_arrivals = False
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        t = time.perf_counter()
        if not self.first_content and b'"content":" tok' in data:
            self.first_content = t
        if self.record_arrivals:
            # Chunks that arrive in one read arrive together: each is counted, at that time.
            self.arrivals.extend([t] * data.count(b'"content":" tok'))
        tail = self._tail + data
        if tail.endswith(b"0\r\n\r\n") and b"[DONE]" in tail[-64:]:
            self._tail = b""
            if self.done is not None and not self.done.done():
                self.done.set_result(None)
        else:
            self._tail = tail[-64:]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("connection lost"))

    async def send(self, payload: bytes) -> float:
        """Send one request; return its TTFT (to the first content chunk)."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self.done = loop.create_future()
        self.first_content = 0.0
        start = time.perf_counter()
        self.transport.write(payload)
        await self.done
        return self.first_content - start


async def connect(port: int) -> StreamClient:
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(StreamClient, "127.0.0.1", port)
    return proto


@dataclass
class BurstResult:
    ttft_ms: list[float] = field(default_factory=list)
    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0
    mocks_cpu_s: float = 0.0  # the mocks' CPU over the run, when their pids were given
    client_cpu_s: float = 0.0  # this process's (the load generator's)
    wait_s: float = 0.0  # the gateway's threads' time runnable without a core

    def summary(self) -> dict[str, float]:
        t = sorted(self.ttft_ms)
        per = 1000 / self.requests if self.requests else 0.0
        return {
            "ttft_p50_ms": t[len(t) // 2] if t else float("nan"),
            "ttft_p99_ms": t[min(len(t) - 1, int(len(t) * 0.99))] if t else float("nan"),
            "rps": self.requests / self.seconds if self.seconds else 0.0,
            "cpu_ms_per_req": self.cpu_s * per,
            "mocks_ms_per_req": self.mocks_cpu_s * per,
            "client_ms_per_req": self.client_cpu_s * per,
            # the share of the run the gateway's threads spent waiting for a core, summed
            "wait_per_s": self.wait_s / self.seconds if self.seconds else 0.0,
            "errors": self.errors,
        }


async def burst_run(
    port: int,
    concurrency: int,
    seconds: float,
    pid: int | None,
    prompt_tokens: int = 0,
    mock_pids: tuple[int, ...] = (),
) -> BurstResult:
    """``concurrency`` connections each sending the stream request again as its answer ends,
    for ``seconds``; the gateway's CPU (``pid``'s tree), the mocks' (``mock_pids``) and this
    process's over the run, and how long the gateway's threads waited for a core. On a
    machine the generator, the mocks and the gateway share, a gateway whose requests cost the
    mocks or the generator more is slower for it."""
    payload = stream_request(port, prompt_tokens)
    clients = [await connect(port) for _ in range(concurrency)]
    for c in clients:  # warm-up: connections and the gateway's pool
        await c.send(payload)
    result = BurstResult()
    cpu0 = tree_cpu_seconds(pid) if pid else 0.0
    wait0 = tree_wait_seconds(pid) if pid else 0.0
    mocks0 = sum(cpu_seconds(m) for m in mock_pids)
    client0 = time.process_time()
    start = time.perf_counter()
    deadline = start + seconds

    async def worker(c: StreamClient) -> None:
        while time.perf_counter() < deadline:
            try:
                ttft = await c.send(payload)
            except ConnectionError:
                result.errors += 1
                return
            result.ttft_ms.append(ttft * 1000)
            result.requests += 1

    await asyncio.gather(*(worker(c) for c in clients))
    result.seconds = time.perf_counter() - start
    result.cpu_s = (tree_cpu_seconds(pid) - cpu0) if pid else 0.0
    result.wait_s = (tree_wait_seconds(pid) - wait0) if pid else 0.0
    result.mocks_cpu_s = sum(cpu_seconds(m) for m in mock_pids) - mocks0
    result.client_cpu_s = time.process_time() - client0
    for c in clients:
        assert c.transport is not None
        c.transport.close()
    return result


async def paced_run(port: int | list[int], streams: int, pid: int | None) -> dict[str, float]:
    """``streams`` at once; given several ports (mocks, direct), spread over them evenly."""
    ports = port if isinstance(port, list) else [port]
    port = ports[0]
    payload = stream_request(port)
    warm = [await connect(port) for _ in range(8)]
    await asyncio.gather(*(c.send(payload) for c in warm))
    for c in warm:
        assert c.transport is not None
        c.transport.close()
    # Connected after the warm-up, not before: a connection left idle through it may meet the
    # server's keep-alive timeout on a loaded machine, and the run would write to a closed one.
    clients = [await connect(ports[i % len(ports)]) for i in range(streams)]
    for c in clients:
        c.record_arrivals = True
        c.arrivals = []
    cpu0 = tree_cpu_seconds(pid) if pid else 0.0
    user0 = tree_cpu_seconds(pid, user_only=True) if pid else 0.0
    await asyncio.gather(*(c.send(payload) for c in clients))
    cpu = (tree_cpu_seconds(pid) - cpu0) if pid else 0.0
    user = (tree_cpu_seconds(pid, user_only=True) - user0) if pid else 0.0
    gaps: list[float] = []
    chunks = 0
    for c in clients:
        a = c.arrivals
        chunks += len(a)
        gaps.extend((a[i] - a[i - 1]) * 1000 for i in range(1, len(a)))
        assert c.transport is not None
        c.transport.close()
    gaps.sort()
    return {
        "itl_p50_ms": gaps[len(gaps) // 2],
        "itl_p99_ms": gaps[int(len(gaps) * 0.99)],
        "itl_max_ms": gaps[-1],
        # Each stream is 64 tokens plus role, finish and [DONE] chunks relayed.
        "cpu_us_per_chunk": 1e6 * cpu / (streams * 67) if pid else 0.0,
        "user_us_per_chunk": 1e6 * user / (streams * 67) if pid else 0.0,
        "chunks_seen": chunks,
    }


# ---------------------------------------------------------------------------- the setup


class _Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver that reads each export and answers 200 (an empty protobuf
    ``ExportTraceServiceResponse`` is zero bytes)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def otlp_sink() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def fleet(
    interval_ms: float,
    continuation: bool = False,
    tracing: bool = False,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Iterator[tuple[list[int], int, int]]:
    """Two fake upstreams and a gateway over them; yields upstream ports, gateway port, pid.
    ``tracing``: the gateway exports its spans to a receiver in this process. ``env``: more of
    the gateway's environment; ``cwd``: the source tree it runs from (ours when None)."""
    with contextlib.ExitStack() as stack:
        ports, _ = stack.enter_context(mock_processes(interval_ms))
        env = dict(env or {})
        if tracing:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = stack.enter_context(otlp_sink())
        gw = stack.enter_context(
            gateways.tokenlane(ports, WORKERS, continuation, cwd=cwd, env=env, redis_url=REDIS_URL)
        )
        yield ports, gw.port, gw.pid


@contextlib.contextmanager
def mock_processes(interval_ms: float) -> Iterator[tuple[list[int], list[int]]]:
    """Two fake upstreams sending 64-token streams, ``interval_ms`` apart (0: one write);
    yields their ports and pids."""
    ports = [free_port(), free_port()]
    pids = []
    with contextlib.ExitStack() as stack:
        for p in ports:
            argv = [sys.executable, "-m", "loadtest.fake_upstream", "--port", str(p)]
            argv += ["--tokens", "64", "--interval-ms", str(interval_ms)]
            pids.append(stack.enter_context(process(argv, stderr=None)).pid)
            wait_port(p)
        yield ports, pids


@contextlib.contextmanager
def mocks(interval_ms: float) -> Iterator[list[int]]:
    with mock_processes(interval_ms) as (ports, _):
        yield ports


DIRECT = "direct"  # the baseline's name among the peers' rounds


def turn(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order: ``names`` turned by ``r``, so that each is measured first, second,
    ... as often as the others over as many rounds as there are names."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def run_peers(
    seconds: float, repeat: int, workers: int, only: list[str] | None = None, plain: bool = True
) -> list[dict[str, Any]]:
    """Every gateway over the same mocks, in one run (module docstring). ``plain``: Tokenlane
    also with continuation off, every stream relayed plain (continuation on, the default,
    makes every stream of this load eligible, which costs per chunk).

    Every gateway is started before the first measurement, and the rows are measured in
    turns: each round measures the direct baseline and every gateway once, in an order turned
    by one each round (``turn``), and a row's figures are the medians of its rounds. Measured
    one gateway after another, the machine's drift over the minutes between rows fell on one
    row and not another (the same gateway read 0.375 and 0.426 ms a request in two runs)."""
    kinds: list[tuple[str, Any]] = [
        ("nginx", gateways.nginx),
        ("vllm-router", gateways.vllm_router),
        ("tokenlane", gateways.tokenlane),
    ]
    if plain:
        kinds.append(("tokenlane (plain)", lambda ups: gateways.tokenlane(ups, continuation=False)))
    if workers > 1:
        kinds.append((f"tokenlane x{workers}", lambda ups: gateways.tokenlane(ups, workers)))
    if only:
        kinds = [k for k in kinds if k[0] in only]
    long = LONG_PROMPT_TOKENS

    def burst(port: int, concurrency: int, pid: int | None, prompt: int = 0) -> dict[str, float]:
        return asyncio.run(burst_run(port, concurrency, seconds, pid, prompt)).summary()

    with contextlib.ExitStack() as stack:
        burst_ports = stack.enter_context(mocks(0))
        paced_ports = stack.enter_context(mocks(50))
        # name -> (the gateway over the burst mocks, the one over the paced mocks)
        started: dict[str, tuple[gateways.Running, gateways.Running]] = {}
        unavailable: dict[str, str] = {}
        for name, start in kinds:
            try:
                with contextlib.ExitStack() as both:
                    pair = (
                        both.enter_context(start(burst_ports)),
                        both.enter_context(start(paced_ports)),
                    )
                    stack.enter_context(both.pop_all())
                started[name] = pair
            except peers.PeerUnavailable as exc:
                unavailable[name] = str(exc)
        samples: dict[str, dict[str, list[dict[str, float]]]] = {
            name: {"one": [], "many": [], "long": [], "paced": []} for name in [DIRECT, *started]
        }
        for r in range(repeat):
            for name in turn([DIRECT, *started], r):
                s = samples[name]
                if name == DIRECT:
                    s["one"].append(burst(burst_ports[0], 1, None))
                    s["long"].append(burst(burst_ports[0], 1, None, long))
                    s["paced"].append(asyncio.run(paced_run(paced_ports, 256, None)))
                    continue
                b, p = started[name]
                s["one"].append(burst(b.port, 1, b.pid))
                s["many"].append(burst(b.port, 64, b.pid))
                s["long"].append(burst(b.port, 1, b.pid, long))
                s["paced"].append(asyncio.run(paced_run(p.port, 256, p.pid)))
    direct = {k: median_of(v) for k, v in samples[DIRECT].items() if v}
    rows: list[dict[str, Any]] = []
    for name, _ in kinds:
        if name in unavailable:
            rows.append({"gateway": name, "unavailable": unavailable[name]})
            continue
        one, many, one_long, paced = (
            median_of(samples[name][k]) for k in ("one", "many", "long", "paced")
        )
        rows.append(
            {
                "gateway": name,
                "added_ttft_p50_ms_c1": one["ttft_p50_ms"] - direct["one"]["ttft_p50_ms"],
                "added_ttft_p50_ms_c1_long": one_long["ttft_p50_ms"]
                - direct["long"]["ttft_p50_ms"],
                "rps_c64": many["rps"],
                "cpu_ms_per_req_c64": many["cpu_ms_per_req"],
                "cpu_us_per_chunk": paced["cpu_us_per_chunk"],
                "added_itl_p99_ms": paced["itl_p99_ms"] - direct["paced"]["itl_p99_ms"],
                "errors": sum(
                    x["errors"] for k in ("one", "many", "long") for x in samples[name][k]
                ),
            }
        )
    return rows


def print_peers(rows: list[dict[str, Any]], seconds: float, repeat: int) -> None:
    print(
        f"peers, one run, the same two mocks: burst {seconds:g}s runs and 256 paced streams"
        f" (64 tokens, 50 ms apart), all started, measured in turns: median of {repeat} rounds"
    )
    print(
        f"{'gateway':<17} | {'+TTFT p50 c=1':>13} | {'req/s c=64':>10} | {'CPU ms/req':>10} |"
        f" {'CPU us/chunk':>12} | {'+ITL p99':>8} | {'+TTFT 2k prompt':>15} | err (all rounds)"
    )
    for r in rows:
        if "unavailable" in r:
            print(f"{r['gateway']:<17} | not run: {r['unavailable']}")
            continue
        print(
            f"{r['gateway']:<17} | {r['added_ttft_p50_ms_c1']:>+10.2f} ms | {r['rps_c64']:>10.0f} |"
            f" {r['cpu_ms_per_req_c64']:>10.3f} | {r['cpu_us_per_chunk']:>12.1f} |"
            f" {r['added_itl_p99_ms']:>+5.2f} ms | {r['added_ttft_p50_ms_c1_long']:>+12.2f} ms |"
            f" {int(r['errors'])}"
        )
    print("(CPU: the gateway's whole process tree; +: over the same load sent to a mock direct;")
    print(
        f" 2k prompt: c=1 with a {LONG_PROMPT_TOKENS}-token prompt, whose ids the mocks send to a"
        " stream that asks for them, as vLLM does)"
    )


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def run_burst(seconds: float, repeat: int, tracing: bool = False) -> list[dict[str, Any]]:
    rows = []
    with fleet(0, tracing=tracing) as (ports, gw_port, pid):
        for conc in (1, 16, 64):
            direct, through = [], []
            for _ in range(repeat):
                direct.append(asyncio.run(burst_run(ports[0], conc, seconds, None)).summary())
                through.append(asyncio.run(burst_run(gw_port, conc, seconds, pid)).summary())
            d, g = median_of(direct), median_of(through)
            rows.append(
                {
                    "mode": "burst",
                    "tracing": tracing,
                    "concurrency": conc,
                    **added(d, g, "ttft", ("p50", "p99")),
                }
            )
    return rows


def added(
    direct: dict[str, float], gateway: dict[str, float], what: str, stats: tuple[str, ...]
) -> dict[str, Any]:
    """A row's figures both ways and what the gateway adds: ``added_<what>_<stat>_ms``."""
    out: dict[str, Any] = {"direct": direct, "gateway": gateway}
    for stat in stats:
        key = f"{what}_{stat}_ms"
        out[f"added_{key}"] = gateway[key] - direct[key]
    return out


def run_paced(
    repeat: int, runs: list[tuple[bool, bool]], streams: int = 256
) -> list[dict[str, Any]]:
    """Paced runs of each (continuation, tracing) configuration. Every configuration's
    gateway (over its own two mocks) is up at once and their runs are interleaved, one of
    each in turn, so a drift in the machine's load falls on all of them alike; the turn's
    order reverses every round (A B, B A, ...), so neither always runs second. Two identical
    gateways run so (six rounds) differed by 6 % in their medians: the noise of the comparison."""
    with contextlib.ExitStack() as stack:
        fleets = [stack.enter_context(fleet(50, c, t)) for c, t in runs]
        direct = [asyncio.run(paced_run(fleets[0][0][0], streams, None)) for _ in range(repeat)]
        through: list[list[dict[str, float]]] = [[] for _ in runs]
        for round_ in range(repeat):
            turn = list(enumerate(fleets))
            for i, (_, gw_port, pid) in turn if round_ % 2 == 0 else reversed(turn):
                through[i].append(asyncio.run(paced_run(gw_port, streams, pid)))
    d = median_of(direct)
    out = []
    for (continuation, tracing), runs_of in zip(runs, through, strict=True):
        g = median_of(runs_of)
        out.append(
            {
                "mode": "paced",
                "continuation": continuation,
                "tracing": tracing,
                "streams": streams,
                **added(d, g, "itl", ("p50", "p99", "max")),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per burst run")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--mode", choices=["burst", "paced", "both"], default="both")
    parser.add_argument("--redis-url", default=None, help="gateway shares state in this Redis")
    parser.add_argument("--peer", action="store_true", help="nginx, vllm-router and Tokenlane")
    parser.add_argument("--workers", type=int, default=1, help="Tokenlane's worker processes")
    parser.add_argument(
        "--only", action="append", default=None, help="with --peer: this gateway only (repeat)"
    )
    parser.add_argument(
        "--continuation",
        choices=["off", "on", "both"],
        default="both",
        help="paced mode with continuation off, on, or both side by side; with --peer, off or "
        "both (the default) add a row for Tokenlane with continuation off",
    )
    parser.add_argument(
        "--tracing",
        choices=["off", "on", "both"],
        default="off",
        help="OpenTelemetry tracing off, on, or both side by side (burst, and paced with "
        "continuation off)",
    )
    args = parser.parse_args(argv)
    tracings = {"off": [False], "on": [True], "both": [False, True]}[args.tracing]
    global REDIS_URL, WORKERS
    REDIS_URL = args.redis_url
    WORKERS = args.workers
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    out: dict[str, Any] = {"cores": os.cpu_count(), "machine": machine(), "repeat": args.repeat}
    print(f"machine: {out['machine']}")
    if args.peer:
        plain = args.continuation != "on"
        out["peers"] = run_peers(args.seconds, args.repeat, args.workers, args.only, plain)
        print_peers(out["peers"], args.seconds, args.repeat)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
        return 0
    if REDIS_URL:
        out["redis_url"] = REDIS_URL
        print(f"gateway with shared state in Redis at {REDIS_URL}")
    if args.mode in ("burst", "both"):
        rows = [row for t in tracings for row in run_burst(args.seconds, args.repeat, t)]
        out["burst"] = rows
        print(
            f"burst mode: 64-token stream in one write, two upstreams, {args.seconds:g}s runs,"
            f" median of {args.repeat}"
            + (", tracing off then on" if len(tracings) == 2 else "")
            + (", tracing on" if tracings == [True] else "")
        )
        print(
            f"{'conc':>4} | {'direct p50':>10} {'p99':>7} {'req/s':>7} | {'gateway p50':>11} "
            f"{'p99':>7} {'req/s':>7} {'CPU ms/req':>10} | {'+p50 ms':>7} {'+p99 ms':>7} | err"
        )
        for r in rows:
            d, g = r["direct"], r["gateway"]
            print(
                f"{r['concurrency']:>4} | {d['ttft_p50_ms']:>10.2f} {d['ttft_p99_ms']:>7.2f} "
                f"{d['rps']:>7.0f} | {g['ttft_p50_ms']:>11.2f} {g['ttft_p99_ms']:>7.2f} "
                f"{g['rps']:>7.0f} {g['cpu_ms_per_req']:>10.3f} | "
                f"{r['added_ttft_p50_ms']:>+7.2f} {r['added_ttft_p99_ms']:>+7.2f} | "
                f"{int(g['errors'] + d['errors'])}" + ("  (tracing on)" if r["tracing"] else "")
            )
        print("(direct = the load generator and one upstream alone: the generator's ceiling)")
    if args.mode in ("paced", "both"):
        switches = {"off": [False], "on": [True], "both": [False, True]}[args.continuation]
        runs = [(on, False) for on in switches] if False in tracings else []
        runs += [(False, True)] if True in tracings else []
        paced = run_paced(args.repeat, runs)
        out["paced"] = paced
        for p in paced:
            d, g = p["direct"], p["gateway"]
            print(
                f"\npaced mode, continuation {'on' if p['continuation'] else 'off'}"
                f"{', tracing on' if p['tracing'] else ''}: "
                f"{p['streams']} streams x 64 tokens, 50 ms apart, median of {args.repeat}"
            )
            print(
                f"  ITL direct  p50 {d['itl_p50_ms']:.2f}  p99 {d['itl_p99_ms']:.2f}  "
                f"max {d['itl_max_ms']:.2f} ms"
            )
            print(
                f"  ITL gateway p50 {g['itl_p50_ms']:.2f}  p99 {g['itl_p99_ms']:.2f}  "
                f"max {g['itl_max_ms']:.2f} ms"
            )
            print(
                f"  added ITL p50 {p['added_itl_p50_ms']:+.2f}  p99 {p['added_itl_p99_ms']:+.2f}"
                f"  max {p['added_itl_max_ms']:+.2f} ms;  gateway CPU "
                f"{g['cpu_us_per_chunk']:.1f} us per relayed chunk"
            )
        plain = [p for p in paced if not p["continuation"] and not p["tracing"]]
        for p in paced:
            if plain and p is not plain[0]:
                off, on = plain[0]["gateway"]["cpu_us_per_chunk"], p["gateway"]["cpu_us_per_chunk"]
                what = "tracing" if p["tracing"] else "continuation"
                print(
                    f"\n{what} on costs {on - off:+.1f} us per relayed chunk "
                    f"({(on - off) / off * 100:+.0f} % of off)"
                )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
