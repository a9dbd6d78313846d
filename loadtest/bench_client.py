"""The load generator's own ceiling: requests/s and stream chunks/s it consumes on one core.

Every benchmark that drives load with ``tokenlane loadtest`` must say how much the generator
itself can do, or a gateway limit and a client limit look the same. This runs the real
runner path (``run_trace``: prebuilt bodies, the aiohttp client, SSE parsing, per-chunk
timestamps) against a fake upstream built to be cheaper than the client: a raw asyncio
HTTP/1.1 server in its own process, answering with prebuilt bytes. The client is one
asyncio thread, so it can use at most one core; its CPU share is printed to show whether it
was the bottleneck (near 100 %) or the fake was.

    python -m loadtest.bench_client [--seconds 5] [--concurrency 64] [--tokens 256]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any

from .procs import free_port, process, wait_port
from .runner import TraceRequest, _run_loop, run_trace

MODEL = "bench"


def _frame(data: bytes) -> bytes:
    """One SSE event as one HTTP chunk of a chunked body."""
    event = b"data: " + data + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


def _event(obj: Any) -> bytes:
    return _frame(json.dumps(obj, separators=(",", ":")).encode())


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


class FakeUpstream(asyncio.Protocol):
    """Just enough HTTP/1.1 for the bench: keep-alive, Content-Length bodies, prebuilt replies."""

    PLAIN_BODY = json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 1,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hi"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 16, "completion_tokens": 1, "total_tokens": 17},
        }
    ).encode()
    PLAIN = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(PLAIN_BODY),
        PLAIN_BODY,
    )
    STREAM_HEAD = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    ROLE = _event(_chunk({"role": "assistant", "content": ""}))
    TOKEN = _event(_chunk({"content": " word"}))
    FINISH = _event(_chunk({"content": ""}, "stop"))
    DONE = _frame(b"[DONE]")
    MAX_TOKENS = re.compile(rb'"max_tokens": ?(\d+)')

    gap_s = 0.0  # pause between tokens; 0 = as fast as the socket takes them

    def __init__(self) -> None:
        self.buf = b""
        self.transport: Any = None  # uvloop's transports are not asyncio.Transport instances
        self.can_write = asyncio.Event()
        self.can_write.set()
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.worker: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.worker = asyncio.get_running_loop().create_task(self.serve())

    def connection_lost(self, exc: Exception | None) -> None:
        if self.worker:
            self.worker.cancel()

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            m = re.search(rb"content-length: *(\d+)", head)
            length = int(m.group(1)) if m else 0
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            self.queue.put_nowait(body)

    async def serve(self) -> None:
        assert self.transport is not None
        while True:
            body = await self.queue.get()
            if b'"stream": true' not in body:
                self.transport.write(self.PLAIN)
                continue
            m = self.MAX_TOKENS.search(body)
            n = int(m.group(1)) if m else 16
            usage = _event(
                {
                    "id": "chatcmpl-bench",
                    "object": "chat.completion.chunk",
                    "created": 1,
                    "model": MODEL,
                    "choices": [],
                    "usage": {"prompt_tokens": 16, "completion_tokens": n, "total_tokens": 16 + n},
                }
            )
            self.transport.write(self.STREAM_HEAD + self.ROLE)
            if self.gap_s > 0:
                await PACER.stream(self, n)
            else:
                for _ in range(n):
                    await self.can_write.wait()
                    self.transport.write(self.TOKEN)
                    # Yield between tokens so concurrent streams interleave as a server's do.
                    await asyncio.sleep(0)
            self.transport.write(self.FINISH + usage + self.DONE + b"0\r\n\r\n")


class Pacer:
    """Decode steps: every ``gap_s`` each active stream gets one token, in its own write.

    One timer for all streams, like an engine step, so the fake stays cheaper than the client
    even with hundreds of streams. A stream whose socket is full skips the step.
    """

    def __init__(self) -> None:
        self.active: dict[FakeUpstream, list[Any]] = {}  # stream -> [tokens left, done future]
        self.task: asyncio.Task[None] | None = None

    async def stream(self, proto: FakeUpstream, n: int) -> None:
        done = asyncio.get_running_loop().create_future()
        self.active[proto] = [n, done]
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self.run())
        try:
            await done
        finally:
            self.active.pop(proto, None)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(FakeUpstream.gap_s)
            for proto, state in list(self.active.items()):
                if state[0] > 0 and proto.can_write.is_set():
                    proto.transport.write(proto.TOKEN)
                    state[0] -= 1
                if state[0] == 0 and not state[1].done():
                    state[1].set_result(None)


PACER = Pacer()


def serve(port: int, gap_ms: float) -> None:
    FakeUpstream.gap_s = gap_ms / 1000

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(FakeUpstream, "127.0.0.1", port, backlog=4096)
        async with server:
            await server.serve_forever()

    _run_loop(main())


@contextlib.contextmanager
def fake_upstream(gap_ms: float = 0.0) -> Iterator[str]:
    """The fake in its own process (so it does not share the client's core); yields its URL."""
    port = free_port()
    argv = [sys.executable, "-m", "loadtest.bench_client", "--serve", str(port)]
    with process([*argv, "--gap-ms", str(gap_ms)], stderr=None):
        wait_port(port, 10, connect_s=0.5)
        yield f"http://127.0.0.1:{port}"


def measure(
    base_url: str, n: int, *, stream: bool, tokens: int, concurrency: int
) -> dict[str, Any]:
    reqs = [
        TraceRequest(at_ms=0, cls="bench", prompt_tokens=16, max_tokens=tokens, stream=stream)
        for _ in range(n)
    ]
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    results = _run_loop(
        run_trace(base_url, reqs, model=MODEL, concurrency_limit=concurrency, timeout_s=120)
    )
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    first = min(r.start_s for r in results)
    wall = max(r.start_s + (r.e2e_s or 0) for r in results) - first
    total = time.perf_counter() - t0
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    ok = sum(r.ok for r in results)
    errors = {r.error for r in results if not r.ok}
    chunks = sum(r.content_chunks for r in results)
    return {
        "requests": n,
        "errors": sorted(e or "" for e in errors)[:3],
        "ok": ok,
        "wall_s": wall,
        "requests_per_s": ok / wall,
        "chunks_per_s": chunks / wall if stream else None,
        # CPU over the whole call (body building included) against its whole wall time.
        "client_cpu_share": cpu / total,
        # CPU per unit of work: unlike rates, it holds when the fake or a neighbour was the
        # bottleneck, and 1/it is the one-core ceiling.
        "cpu_us_per_request": cpu / max(ok, 1) * 1e6,
        "cpu_us_per_chunk": cpu / max(chunks, 1) * 1e6 if stream else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_client", description=__doc__)
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=4.0, help="rough length of each measurement")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256, help="content chunks per stream")
    p.add_argument("--gap-ms", type=float, default=5.0, help="token gap of the paced streams")
    p.add_argument("--paced-concurrency", type=int, default=512, help="streams of the paced run")
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve, args.gap_ms)
        return 0

    c, tokens = args.concurrency, args.tokens
    with fake_upstream() as url:
        measure(url, 200, stream=False, tokens=1, concurrency=c)  # warm-up
        probe = measure(url, 500, stream=False, tokens=1, concurrency=c)
        n = max(500, int(probe["requests_per_s"] * args.seconds))
        plain = measure(url, n, stream=False, tokens=1, concurrency=c)
        probe = measure(url, 20, stream=True, tokens=tokens, concurrency=c)
        n = max(40, int(probe["requests_per_s"] * args.seconds))
        burst = measure(url, n, stream=True, tokens=tokens, concurrency=c)
    # Decode-like streams: every stream sends one token per --gap-ms, so each event tends to
    # come in its own read and the per-read cost, not JSON parsing, sets the ceiling.
    paced_c = args.paced_concurrency
    with fake_upstream(args.gap_ms) as url:
        per_stream_s = tokens * args.gap_ms / 1000
        n = max(paced_c, int(paced_c * args.seconds / max(per_stream_s, 0.01)))
        paced = measure(url, n, stream=True, tokens=tokens, concurrency=paced_c)

    failed = [m for m in (plain, burst, paced) if m["ok"] < m["requests"]]
    if failed:
        print(f"error: some requests failed: {failed}", file=sys.stderr)
        return 1
    offered = paced_c * 1000 / args.gap_ms
    print(
        f"load generator ceiling (aiohttp client, one asyncio thread; {os.cpu_count()} cores "
        f"shared with the fake upstream), {tokens} chunks per stream:"
    )
    print(
        f"  non-streamed, concurrency {c}: {plain['requests_per_s']:.0f} requests/s measured "
        f"at {plain['client_cpu_share']:.0%} client CPU; {plain['cpu_us_per_request']:.0f} us "
        f"CPU per request -> one-core ceiling ~{1e6 / plain['cpu_us_per_request']:.0f} requests/s"
    )
    for name, m in (
        (f"streamed as fast as possible, concurrency {c}", burst),
        (
            f"streamed at one token per {args.gap_ms:g} ms per stream, concurrency {paced_c} "
            f"(offered {offered:.0f} chunks/s)",
            paced,
        ),
    ):
        print(
            f"  {name}: {m['chunks_per_s']:.0f} chunks/s measured at "
            f"{m['client_cpu_share']:.0%} client CPU; {m['cpu_us_per_chunk']:.1f} us CPU per "
            f"chunk -> one-core ceiling ~{1e6 / m['cpu_us_per_chunk']:.0f} chunks/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
