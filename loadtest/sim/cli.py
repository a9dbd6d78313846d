"""``tokenlane sim`` / ``python -m loadtest.sim``: one simulated vLLM replica in this process.

Standard output carries one JSON object per line, for supervisors:

- ``{"event": "listening", "name": N, "url": U, "pid": P}`` once the port accepts connections;
- ``{"event": "crash", "name": N, "restart_after_s": S}`` just before a ``crash`` fault ends the
  process with exit status 70 (:data:`CRASH_EXIT`); a supervisor restarts it after ``S``
  seconds (``supervisor.py``).

Human-readable logs go to standard error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

from . import faults
from .faults import Fault, FaultError
from .listener import bind_socket
from .replica import Sim
from .server import start
from .settings import DEFAULT_MODEL, SettingsError, SimSettings, validated

CRASH_EXIT = 70
# Settings with a flag of their own below, or none.
_SPECIAL = {"name", "models", "api_key", "max_num_batched_tokens"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenlane sim",
        description="A simulated vLLM OpenAI server (one replica) for tests, demos and benchmarks.",
    )
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="listen port; 0 picks a free one")
    p.add_argument("--name", default=None, help="label of this replica (default sim-PORT)")
    p.add_argument(
        "--model", action="append", default=None, metavar="ID",
        help=f"served model id, repeatable or comma-separated (default {DEFAULT_MODEL})",
    )  # fmt: skip
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument(
        "--fault", default=None, choices=sorted(faults.FAULTS), help="start with a fault"
    )
    p.add_argument(
        "--fault-param", action="append", default=[], metavar="KEY=VALUE",
        help="a parameter of --fault (repeatable), e.g. factor=3 or duration_s=10",
    )  # fmt: skip
    p.add_argument(
        "--fault-json", default=None, help='the fault as JSON, e.g. \'{"fault": "stall"}\''
    )
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None,
        help="token budget of one step (default 2048 with chunked prefill, else "
        "max(max_model_len, 2048))",
    )  # fmt: skip
    for f in dataclasses.fields(SimSettings):
        if f.name in _SPECIAL:
            continue
        flag = "--" + f.name.replace("_", "-")
        helptext = f"{f.metadata['help']} (default {f.default})"
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=helptext)
        elif f.type in ("int", int):
            p.add_argument(flag, type=int, default=None, help=helptext)
        elif f.type in ("float", float):
            p.add_argument(flag, type=float, default=None, help=helptext)
        elif f.name == "scheduling_policy":
            p.add_argument(flag, choices=("fcfs", "priority"), default=None, help=helptext)
        else:  # pragma: no cover - every setting has a type above
            p.add_argument(flag, default=None, help=helptext)
    p.add_argument(
        "--exit-on-stdin-eof", action="store_true",
        help="exit when standard input closes (a supervisor's lifeline: no orphan if it dies)",
    )  # fmt: skip
    p.add_argument("--log-level", default="warning", help="stderr log level (default warning)")
    return p


def settings_from_args(args: argparse.Namespace) -> SimSettings:
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(SimSettings):
        if f.name in _SPECIAL:
            continue
        value = getattr(args, f.name)
        if value is not None:
            changes[f.name] = value
    if args.model:
        changes["models"] = tuple(
            m.strip() for item in args.model for m in item.split(",") if m.strip()
        )
    changes["name"] = args.name or ""  # "": serve() names it after its port
    changes["api_key"] = args.api_key
    changes["max_num_batched_tokens"] = args.max_num_batched_tokens
    return validated(SimSettings().replace(**changes))


def _emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _crash_exit(sim: Sim, fault: Fault) -> None:
    """The real ``crash``: announce when to restart, stop listening, and leave without cleanup."""
    _emit({"event": "crash", "name": sim.settings.name, "restart_after_s": fault.duration_s})
    if sim.listener is not None:
        sim.listener.close()
    # A moment for the POST /sim/fault response to leave the socket buffer.
    asyncio.get_running_loop().call_later(0.05, os._exit, CRASH_EXIT)


async def serve(
    settings: SimSettings,
    host: str,
    port: int,
    fault: Fault | None = None,
    *,
    exit_on_stdin_eof: bool = False,
) -> None:
    sock = bind_socket(host, port)
    if settings.name == "":  # named after the port it got
        settings = settings.replace(name=f"sim-{sock.getsockname()[1]}")
    sim = Sim(settings, on_crash=None)
    sim.on_crash = lambda f: _crash_exit(sim, f)
    server, task = await start(sim, host, port, in_process=False, sock=sock)
    _emit({"event": "listening", "name": settings.name, "url": sim.url, "pid": os.getpid()})
    logging.getLogger("tokenlane.sim").warning("%s listening on %s", settings.name, sim.url)
    if fault is not None:
        await sim.set_fault(fault)
    if exit_on_stdin_eof:
        loop = asyncio.get_running_loop()

        def watch_stdin() -> None:
            # A thread, not add_reader: stdin may be a file or /dev/null, which epoll refuses.
            with contextlib.suppress(OSError):
                while os.read(sys.stdin.fileno(), 4096):
                    pass
            loop.call_soon_threadsafe(setattr, server, "should_exit", True)

        threading.Thread(target=watch_stdin, name="stdin-lifeline", daemon=True).start()
    await task


def _run(coro: Any) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        asyncio.run(coro)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = settings_from_args(args)
        fault = faults.from_cli(args.fault, args.fault_param, args.fault_json)
    except (SettingsError, FaultError) as exc:
        print(f"tokenlane sim: {exc}", file=sys.stderr)
        return 2
    try:
        _run(serve(settings, args.host, args.port, fault, exit_on_stdin_eof=args.exit_on_stdin_eof))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        print(f"tokenlane sim: {exc}", file=sys.stderr)
        return 1
    return 0
