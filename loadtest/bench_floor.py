"""The floor of a relay in Python on this machine: how little CPU a chunk can cost.

Two bare HTTP/1.1 streaming relays on uvloop and httptools, with none of the gateway's logic
(no routing, metrics, logs or checks), each run over the same two paced mocks and measured
with the overhead benchmark's generator (CPU of the relay's process per relayed chunk):

- ``callback``: each upstream body chunk is written to the client from the upstream
  connection's ``on_body``, as the gateway's pump does (``proxy/relay/h1.py``);
- ``task``: each chunk wakes a task that writes it, as a relay built on an async iterator
  (``async for chunk in body: await send(...)``) does.

Their difference is what waking a task per token costs, which decided the gateway's design
(``docs/benchmarks.md``, "The relay's own client").

    python -m loadtest.bench_floor [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import statistics
import subprocess
import sys
from collections.abc import Iterator

import httptools

from . import bench_overhead, gateways
from .procs import free_port, wait_port

MODES = ("callback", "task")


class _Upstream(asyncio.Protocol):
    """One connection to a mock; relays one answer at a time to its client."""

    def __init__(self, client: _Client, mode: str) -> None:
        self.client = client
        self.mode = mode
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.buffer: list[bytes] = []
        self.waiter: asyncio.Future[None] | None = None
        self.ended = False
        self.task: asyncio.Future[None] | None = None  # the task mode's relay

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_headers_complete(self) -> None:
        assert self.client.transport is not None
        self.client.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        if self.mode == "task":
            self.ended = False
            self.task = asyncio.ensure_future(self._relay())

    def on_body(self, body: bytes) -> None:
        if self.mode == "callback":
            assert self.client.transport is not None
            self.client.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
            return
        self.buffer.append(body)
        self._wake()

    def on_message_complete(self) -> None:
        if self.mode == "callback":
            assert self.client.transport is not None
            self.client.transport.write(b"0\r\n\r\n")
            self.client.idle.append(self)
            return
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def _relay(self) -> None:
        transport = self.client.transport
        assert transport is not None
        while True:
            while not self.buffer and not self.ended:
                self.waiter = asyncio.get_running_loop().create_future()
                await self.waiter
            if self.buffer:
                chunk = b"".join(self.buffer)
                self.buffer = []
                transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                continue
            transport.write(b"0\r\n\r\n")
            self.client.idle.append(self)
            return


class _Client(asyncio.Protocol):
    """One client connection: each request goes to a mock, round robin."""

    def __init__(self, upstreams: list[int], mode: str, turn: list[int]) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.upstreams = upstreams
        self.mode = mode
        self.turn = turn
        self.transport: asyncio.Transport | None = None
        self.idle: list[_Upstream] = []
        self.url = b""
        self.body: list[bytes] = []
        self.connecting: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url
        self.body = []

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        request = b"POST %b HTTP/1.1\r\nhost: mock\r\ncontent-type: application/json\r\n" % (
            self.url
        ) + b"content-length: %d\r\n\r\n%b" % (len(body), body)
        if self.idle:
            upstream = self.idle.pop()
            assert upstream.transport is not None
            upstream.transport.write(request)
        else:
            self.connecting = asyncio.ensure_future(self._connect(request))

    async def _connect(self, request: bytes) -> None:
        self.turn[0] += 1
        port = self.upstreams[self.turn[0] % len(self.upstreams)]
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_connection(
            lambda: _Upstream(self, self.mode), "127.0.0.1", port
        )
        transport.write(request)


async def _serve(port: int, upstreams: list[int], mode: str) -> None:
    turn = [0]
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(upstreams, mode, turn), "127.0.0.1", port)
    await server.serve_forever()


def _relay_main(argv: list[str]) -> None:
    import uvloop

    port, upstreams, mode = int(argv[0]), [int(p) for p in argv[1].split(",")], argv[2]
    uvloop.run(_serve(port, upstreams, mode))


@contextlib.contextmanager
def relay(upstreams: list[int], mode: str = "callback") -> Iterator[gateways.Running]:
    """A bare relay of ``mode`` over ``upstreams``, in a process of its own."""
    port = free_port()
    argv = [sys.executable, "-m", "loadtest.bench_floor", "--relay", str(port)]
    proc = subprocess.Popen([*argv, ",".join(map(str, upstreams)), mode])
    try:
        wait_port(port)
        yield gateways.Running(f"bare relay ({mode})", port, proc.pid)
    finally:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--relay", nargs=3, help=argparse.SUPPRESS)  # the relay process itself
    args = parser.parse_args(argv)
    if args.relay:
        _relay_main(args.relay)
        return 0
    print(f"bare relays, 256 paced streams (64 tokens, 50 ms apart), median of {args.repeat}")
    with bench_overhead.mocks(50) as ports:
        for mode in MODES:
            with relay(ports, mode) as running:
                runs = [
                    asyncio.run(bench_overhead.paced_run(running.port, 256, running.pid))
                    for _ in range(args.repeat)
                ]
            us = statistics.median(r["cpu_us_per_chunk"] for r in runs)
            p99 = statistics.median(r["itl_p99_ms"] for r in runs)
            print(f"  {mode:<9} {us:6.1f} us of CPU per relayed chunk, ITL p99 {p99:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
