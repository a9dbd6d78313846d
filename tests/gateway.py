"""Starting a gateway for tests: in this event loop over a real socket, or as a process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from types import AsyncGeneratorType
from typing import Any

import httpx
import yaml

import proxy
from proxy.config import LaneConfig, Policy
from proxy.edge.connection import GatewayProtocol
from proxy.edge.routes import GatewayApp
from proxy.gateway import create_app
from proxy.policyfile import build_policy
from proxy.relay.call import Call

from .servers import free_port, run_process, serve_app
from .waiting import TIMEOUT_S, WaitTimeout, wait_until


def policy_for(
    pools: dict[str, Sequence[str]],
    *,
    lanes: list[dict[str, Any]] | None = None,
    balance: str = "round_robin",
    **sections: Any,
) -> dict[str, Any]:
    """A policy as plain data: ``pools`` maps pool name to replica URLs; one catch-all lane on
    the first pool unless ``lanes`` are given. Health probes fast so tests start quickly."""
    data: dict[str, Any] = {
        "pools": {
            name: {"balance": balance, "replicas": [{"url": u} for u in urls]}
            for name, urls in pools.items()
        },
        "lanes": lanes or [{"name": "all", "pool": next(iter(pools))}],
        "health": {"interval_s": 0.1, "timeout_s": 1.0},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return data


async def wait_ready(url: str, timeout_s: float = TIMEOUT_S) -> None:
    """Until the gateway at ``url`` answers /ready with 200; ``WaitTimeout`` otherwise."""
    async with httpx.AsyncClient() as client:

        async def ready() -> bool:
            try:
                return (await client.get(url + "/ready")).status_code == 200
            except httpx.HTTPError:
                return False

        await wait_until(ready, what=f"gateway at {url} ready", timeout=timeout_s, poll=0.02)


async def wait_healthy(app: GatewayApp, count: int, timeout_s: float = TIMEOUT_S) -> None:
    """Until ``count`` replicas are healthy (when /ready cannot tell: a lane is meant to
    have none)."""
    await wait_until(
        lambda: sum(r.state.value == "healthy" for r in app.gateway.fleet.replicas()) >= count,
        what=f"{count} healthy replicas",
        timeout=timeout_s,
        poll=0.02,
    )


@contextlib.asynccontextmanager
async def running_gateway(
    policy: Policy | dict[str, Any],
    *,
    ready: bool = True,
    environ: dict[str, str] | None = None,
) -> AsyncIterator[tuple[str, GatewayApp]]:
    """Serve a gateway in this loop; yield its URL and the app (``app.gateway`` for state)."""
    if isinstance(policy, dict):
        policy = build_policy(policy)
    app = create_app(policy, environ=environ or {})
    async with serve_app(app, http=GatewayProtocol) as url:
        if ready:
            await wait_ready(url)
        yield url, app


@contextlib.asynccontextmanager
async def gateway_process(
    policy: dict[str, Any], tmp: Path, *, stderr: list[str] | None = None
) -> AsyncIterator[tuple[str, int]]:
    """Run ``python -m proxy serve`` as `make run` does (uvloop, httptools); yield URL, pid.

    Waits for readiness without blocking the loop, which may be serving the upstreams. Given
    ``stderr``, the block's end waits for the process to exit (the test has signalled it) and
    appends what it wrote to stderr."""
    port = free_port()
    path = tmp / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    argv = [
        sys.executable,
        "-m",
        "proxy",
        "serve",
        "--config",
        str(path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    url = f"http://127.0.0.1:{port}"
    with run_process(argv) as proc:
        try:
            await wait_ready(url, timeout_s=120)  # a backstop: a loaded host starts slowly
        except WaitTimeout:
            proc.kill()
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"gateway did not start:\n{err[-3000:]}") from None
        yield url, proc.pid
        if stderr is not None:
            await asyncio.to_thread(proc.wait, 30)
            assert proc.stderr is not None
            stderr.append(proc.stderr.read().decode(errors="replace"))


@contextlib.contextmanager
def generators_left_to_the_loop() -> Iterator[list[str]]:
    """The gateway's async generators (of the ``proxy`` package) that reach the running
    loop's finalizer while this is entered: each one left suspended, which the loop closes in
    a task of its own, woken through its self-pipe. Yields their qualified names as they come.
    Enter it inside the running loop, before the requests it watches."""
    left: list[str] = []
    package = os.path.dirname(proxy.__file__) + os.sep
    firstiter, finalizer = sys.get_asyncgen_hooks()
    assert finalizer is not None, "enter it inside a running event loop"

    def noted(agen: AsyncGeneratorType[object, object]) -> None:
        code = agen.ag_code
        if code.co_filename.startswith(package):
            left.append(code.co_qualname)
        finalizer(agen)

    sys.set_asyncgen_hooks(firstiter, noted)
    try:
        yield left
    finally:
        sys.set_asyncgen_hooks(firstiter, finalizer)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def data_events(raw: str) -> list[Any]:
    """The data of each event of an SSE body: its JSON objects, and ``"[DONE]"`` as itself."""
    out: list[Any] = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def content_of(event: bytes | str) -> str:
    """The text of one SSE chunk event (``data: {...}``), chat or transcription."""
    raw = event.encode() if isinstance(event, str) else event
    obj = json.loads(raw[len(b"data: ") :])
    return "".join(c["delta"].get("content") or "" for c in obj["choices"])


def a_call(lane: LaneConfig, model: str = "m") -> Call:
    """A streamed chat request's record on ``lane``, for tests of the parts that read one (the
    request path may be compiled, ``proxy/compiled.py``: it takes its own types only)."""
    return Call("r", "chat", "/v1/chat/completions", b"{}", [], True, model, lane, None, False, 0.0)
