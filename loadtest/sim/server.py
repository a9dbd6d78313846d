"""Serving a simulated replica (:class:`.replica.Sim`) with uvicorn on a socket the simulator
owns (:func:`run_sim`, :func:`start`), or as an ASGI app to serve yourself (:func:`build_app`).

Owning the socket is what makes the network faults real (``listener.py``). ``crash`` exits the
process in the CLI (see ``cli.py`` and ``supervisor.py``). In process (:func:`run_sim`), it is
emulated: every connection is cut, the listener closes, and after ``duration_s`` a fresh engine
with fresh metrics listens again (``/sim/stats`` and ``/sim/requests`` survive, so tests can
still inspect what came before).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from .app import build_routes
from .faults import Fault
from .listener import Listener, bind_socket
from .replica import ENGINE_DEAD_MESSAGE, Sim
from .settings import SimSettings

__all__ = ["ENGINE_DEAD_MESSAGE", "Sim", "bind_socket", "build_app", "run_sim", "start", "stop"]


def build_app(settings: SimSettings | None = None) -> tuple[Sim, ASGIApp]:
    """A simulator's ASGI app to serve yourself (then ``refuse``, ``hang_accept`` and ``crash``
    are unavailable: they need the socket)."""
    sim = Sim(settings or SimSettings())
    return sim, build_routes(sim)


# -- serving ------------------------------------------------------------------------------------


class _InProcessServer(uvicorn.Server):
    # Several simulators share a test process: none may take over its signals.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def uvicorn_config(app: ASGIApp, *, loop: str = "none") -> uvicorn.Config:
    http = "httptools"
    try:
        import httptools  # noqa: F401
    except ImportError:  # pragma: no cover - httptools is a dependency
        http = "h11"
    return uvicorn.Config(
        app,
        http=http,
        loop=loop,
        lifespan="on",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=1,
        timeout_keep_alive=5,  # vLLM's (uvicorn's default)
        # The scope's client stays the TCP peer: faults that reset "this request's connection"
        # find its socket by that address. A gateway in front sends X-Forwarded-For, which
        # uvicorn's proxy-headers default would put there instead (with port 0).
        proxy_headers=False,
    )


async def start(
    sim: Sim, host: str, port: int, *, in_process: bool, sock: socket.socket | None = None
) -> tuple[uvicorn.Server, asyncio.Task[None]]:
    """Serve ``sim`` on ``host:port`` (0: any free port), or on ``sock``, in the running loop."""
    if sock is None:
        sock = bind_socket(host, port)
    port = sock.getsockname()[1]
    server_cls = _InProcessServer if in_process else uvicorn.Server
    server = server_cls(uvicorn_config(build_routes(sim)))
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            sock.close()
            task.result()
            raise RuntimeError("the simulator exited during start-up")
        await asyncio.sleep(0.005)
    sim.listener = Listener(server, host, port)
    return server, task


async def stop(server: uvicorn.Server, task: asyncio.Task[None], timeout_s: float = 10.0) -> None:
    server.should_exit = True
    try:
        await asyncio.wait_for(task, timeout_s)
    except (TimeoutError, asyncio.CancelledError):
        task.cancel()


@contextlib.asynccontextmanager
async def run_sim(
    settings: SimSettings | None = None,
    *,
    name: str | None = None,
    model: str | Sequence[str] | None = None,
    fault: Fault | Mapping[str, Any] | None = None,
    api_key: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
) -> AsyncIterator[Sim]:
    """A simulator on a real loopback socket in this event loop, for tests.

    Yields the :class:`Sim`: ``sim.url``, ``await sim.set_fault(...)``, ``sim.stats()``,
    ``sim.requests()``, ``sim.engine``. ``crash`` is emulated (see the module docstring).
    """
    changes: dict[str, Any] = {}
    if name is not None:
        changes["name"] = name
    if model is not None:
        changes["models"] = (model,) if isinstance(model, str) else tuple(model)
    if api_key is not None:
        changes["api_key"] = api_key
    sim = Sim((settings or SimSettings()).replace(**changes))
    server, task = await start(sim, host, port, in_process=True)
    try:
        if fault is not None:
            await sim.set_fault(fault)
        yield sim
    finally:
        await stop(server, task)
