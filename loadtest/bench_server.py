"""What the HTTP server under the gateway costs a request, without the gateway.

One ASGI app that answers every request at once (reads its body, then a 64-event SSE stream
in one body message and the end), served three ways, each in a process of its own, and
measured in turns with the overhead benchmark's burst generator (concurrency 64, keep-alive
connections; CPU of the server's process per request):

- ``uvicorn``: uvicorn's own httptools protocol and cycle (what the gateway ran until it had
  its own);
- ``tokenlane``: the gateway's protocol (``proxy/edge/connection.py``, ``proxy/edge/cycle.py``),
  compiled when its build is current, as ``make run`` runs it;
- ``bare``: a protocol that parses the request with httptools and writes the same answer,
  with no ASGI at all: the floor of a server in Python on this machine.

    python -m loadtest.bench_server [--seconds 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import statistics
import sys
from collections.abc import Iterator
from typing import Any

from .bench_overhead import burst_run
from .procs import free_port, process, wait_port

MODES = ("uvicorn", "tokenlane", "bare")
EVENTS = (
    b"".join(
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[{"index":0,"delta":{"content":"tok%d"},"finish_reason":null}]}\n\n' % i
        for i in range(64)
    )
    + b"data: [DONE]\n\n"
)
_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    more = True  # (served with the lifespan off: every scope is a request)
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    await send({"type": "http.response.body", "body": EVENTS, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


class _Bare(asyncio.Protocol):
    """Parses requests and writes the same answer, framed as the others frame it."""

    ANSWER = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n%b\r\n0\r\n\r\n" % (len(EVENTS), EVENTS)
    )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        import httptools

        self.transport: Any = transport
        self.parser = httptools.HttpRequestParser(self)
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.transport.write(self.ANSWER)


def serve(mode: str, port: int) -> None:
    import uvicorn
    import uvloop

    if mode == "bare":

        async def main() -> None:
            loop = asyncio.get_running_loop()
            server = await loop.create_server(_Bare, "127.0.0.1", port, backlog=4096)
            await server.serve_forever()

        uvloop.run(main())
        return
    http: Any = "httptools"
    if mode == "tokenlane":
        import proxy  # noqa: F401  (installs the compiled build when it is current)
        from proxy.edge.connection import GatewayProtocol

        http = GatewayProtocol
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http=http,
        lifespan="off",
        access_log=False,
        log_level="warning",
        proxy_headers=False,
        server_header=False,
        backlog=4096,
    )
    uvicorn.Server(config).run()


@contextlib.contextmanager
def server(mode: str) -> Iterator[tuple[int, int]]:
    port = free_port()
    argv = [sys.executable, "-m", "loadtest.bench_server", "--serve", mode, "--port", str(port)]
    with process(argv) as proc:
        wait_port(port)
        yield port, proc.pid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.port)
        return 0
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    errors = 0
    with contextlib.ExitStack() as stack:
        running = {m: stack.enter_context(server(m)) for m in MODES}
        for r in range(args.rounds):
            order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
            for mode in order:
                port, pid = running[mode]
                result = asyncio.run(burst_run(port, 64, args.seconds, pid))
                errors += result.errors
                rates[mode].append(result.requests / result.seconds)
                cpu[mode].append(1e6 * result.cpu_s / max(result.requests, 1))
    print(
        f"one app answering at once, three servers, burst c=64 for {args.seconds:g}s, "
        f"medians of {args.rounds} rounds in turns"
    )
    print(f"{'server':<10} | {'req/s':>7} | {'CPU us/req':>10}")
    for mode in MODES:
        print(
            f"{mode:<10} | {statistics.median(rates[mode]):7.0f} | "
            f"{statistics.median(cpu[mode]):10.1f}"
        )
    print(f"errors: {errors}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
