"""Real servers for tests: an ASGI app on a real socket in this event loop, or a subprocess.

Integration tests talk over loopback TCP, never through an in-memory transport, so that
disconnects, backpressure and socket options are the real thing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import httpx
import uvicorn

from loadtest.sim.settings import SimSettings

from .waiting import WaitTimeout, wait_until, wait_until_sync

# A simulator as fast as it goes: the tests that use it check shapes and routing, not timing.
FAST_SIM = SimSettings(step_fixed_s=0.001, decode_per_seq_s=0.0, prefill_per_token_s=0.000001,
                       request_overhead_s=0.0)  # fmt: skip


def bound_socket(host: str = "127.0.0.1") -> socket.socket:
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that name it, and
    # without it every small response waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    with contextlib.closing(bound_socket(host)) as sock:
        return int(sock.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports: all held at once while chosen (one at a time, the kernel may
    hand the same port out twice)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(contextlib.closing(bound_socket(host))) for _ in range(n)]
        return [int(sock.getsockname()[1]) for sock in socks]


class _QuietServer(uvicorn.Server):
    # Tests run many servers in one loop; they must not take over the process's signals.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serve_app(app: Any, *, host: str = "127.0.0.1", **config: Any) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port in the running loop; yield its URL."""
    sock = bound_socket(host)
    port = sock.getsockname()[1]
    cfg = uvicorn.Config(app, log_level="warning", lifespan="on", **config)
    server = _QuietServer(cfg)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        # A backstop only: a lifespan may take its time on a loaded machine (joining Redis).
        await wait_until(
            lambda: server.started or task.done(), what="uvicorn started", timeout=120, poll=0.005
        )
        if task.done():
            task.result()
            raise RuntimeError("server exited during start-up")
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(task, 10)
        except (TimeoutError, asyncio.CancelledError):
            task.cancel()
        sock.close()


def wait_http_ok(url: str, timeout_s: float = 20.0) -> None:
    """Until ``url`` answers 200; ``WaitTimeout`` otherwise."""

    def ok() -> bool | str:
        try:
            return httpx.get(url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until_sync(ok, what=f"{url} answers 200", timeout=timeout_s, poll=0.05)


@contextlib.contextmanager
def run_process(
    argv: Sequence[str], *, ready_url: str | None = None, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Run a command (``[sys.executable, "-m", "proxy", ...]``) until the block ends."""
    proc = subprocess.Popen(
        list(argv),
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        if ready_url:
            try:
                wait_http_ok(ready_url)
            except WaitTimeout:
                proc.kill()
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"{argv} did not start:\n{err[-4000:]}") from None
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


PYTHON = sys.executable
