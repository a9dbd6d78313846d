"""Run several simulator processes and bring back the ones that ``crash``.

The protocol with each child (``python -m loadtest.sim ... --exit-on-stdin-eof``), see
``cli.py``: it prints ``{"event": "listening", "url": ...}`` when ready, and before a ``crash``
fault ends it ``{"event": "crash", "restart_after_s": S}`` then exits with status 70. The
supervisor then waits until ``S`` seconds after the crash and starts it again with the same
arguments, minus any ``--fault`` options (a restarted replica starts healthy) and with the port
it had (so ``--port 0`` keeps its first port). A child that exits any other way stays down and
is reported by :meth:`Supervisor.status`.

No process outlives the supervisor: each child's standard input is a pipe the supervisor holds,
and the child exits when it closes (also when the supervisor is killed); :meth:`Supervisor.stop`
closes the pipes, sends SIGTERM to each child's process group, then SIGKILL after a grace period.

Threads, not asyncio, so that both worlds can use it: ``with Supervisor(specs) as sup:`` or
``await asyncio.to_thread(sup.start)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .cli import CRASH_EXIT

log = logging.getLogger("tokenlane.sim.supervisor")

_FAULT_FLAGS = ("--fault", "--fault-param", "--fault-json")


@dataclass
class SimSpec:
    """One replica: its name and its ``tokenlane sim`` arguments (without the program)."""

    name: str
    args: list[str] = field(default_factory=list)


def _spec(index: int, args: Sequence[str]) -> SimSpec:
    args = list(args)
    for i, arg in enumerate(args):
        if arg == "--name" and i + 1 < len(args):
            return SimSpec(args[i + 1], args)
        if arg.startswith("--name="):
            return SimSpec(arg.split("=", 1)[1], args)
    return SimSpec(f"sim-{index}", args)


def restart_args(args: Sequence[str], port: int | None) -> list[str]:
    """The arguments of a restart: no fault options, and the port the first run got."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in _FAULT_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    if port is not None:
        cleaned: list[str] = []
        skip = False
        for arg in out:
            if skip:
                skip = False
                continue
            if arg == "--port":
                skip = True
                continue
            if arg.startswith("--port="):
                continue
            cleaned.append(arg)
        out = [*cleaned, "--port", str(port)]
    return out


class _Child:
    def __init__(self, spec: SimSpec, python: str, env: dict[str, str] | None, stderr: Any) -> None:
        self.spec = spec
        self.python = python
        self.env = env
        self.stderr = stderr
        self.proc: subprocess.Popen[bytes] | None = None
        self.url: str | None = None
        self.port: int | None = None
        self.state = "starting"  # starting, running, crashed, exited, stopped
        self.restarts = 0
        self.exit_code: int | None = None
        self.ready = threading.Event()  # set when listening, or when it exited for good
        self.thread = threading.Thread(target=self._run, name=f"sim-{spec.name}", daemon=True)
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def _spawn(self, args: list[str]) -> subprocess.Popen[bytes]:
        argv = [self.python, "-m", "loadtest.sim", *args, "--exit-on-stdin-eof"]
        if "--name" not in args and not any(a.startswith("--name=") for a in args):
            argv[3:3] = ["--name", self.spec.name]
        return subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env={**os.environ, **(self.env or {})},
            start_new_session=True,  # its own process group: signals reach it and its children
        )

    def _run(self) -> None:
        args = list(self.spec.args)
        while True:
            with self._lock:
                if self.state == "stopped":
                    return
                self.state = "starting"
                self.proc = proc = self._spawn(args)
            crash_at: float | None = None
            restart_after = 0.0
            assert proc.stdout is not None
            for raw in proc.stdout:
                try:
                    event = json.loads(raw)
                except ValueError:
                    continue
                if event.get("event") == "listening":
                    with self._lock:
                        self.url = event["url"]
                        self.port = int(event["url"].rsplit(":", 1)[1])
                        if self.state == "starting":
                            self.state = "running"
                    self.ready.set()
                elif event.get("event") == "crash":
                    crash_at = time.monotonic()
                    restart_after = float(event.get("restart_after_s") or 0.0)
            self.exit_code = proc.wait()
            with self._lock:
                if self.state == "stopped":
                    return
                if crash_at is None or self.exit_code != CRASH_EXIT:
                    self.state = "exited"
                    self.ready.set()
                    log.warning(
                        "sim %s exited with %s; not restarted", self.spec.name, self.exit_code
                    )
                    return
                self.state = "crashed"
            delay = max(0.0, crash_at + restart_after - time.monotonic())
            log.info("sim %s crashed; restarting in %.2fs", self.spec.name, delay)
            if self._stopping.wait(delay):
                return
            self.restarts += 1
            args = restart_args(self.spec.args, self.port)

    def stop(self, timeout_s: float) -> None:
        with self._lock:
            self.state = "stopped"
            proc = self.proc
        self._stopping.set()
        if proc is not None and proc.poll() is None:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.thread.is_alive():
            self.thread.join(timeout_s)


class Supervisor:
    """Start, watch and stop a fleet of simulator processes."""

    def __init__(
        self,
        specs: Sequence[SimSpec | Sequence[str]],
        *,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        stderr: Any = None,
    ) -> None:
        """``specs``: a :class:`SimSpec` or a bare argument list (named by its ``--name``, else
        ``sim-<index>``) per simulator. ``stderr``: where their logs go (default: ours)."""
        resolved = [s if isinstance(s, SimSpec) else _spec(i, s) for i, s in enumerate(specs)]
        names = [s.name for s in resolved]
        if len(set(names)) != len(names):
            raise ValueError(f"simulator names must be unique: {names}")
        self._children = [_Child(s, python, env, stderr) for s in resolved]
        self._started = False

    def start(self, timeout_s: float = 30.0) -> dict[str, str]:
        """Start every simulator and wait until all listen; returns name -> URL."""
        if self._started:
            raise RuntimeError("already started")
        self._started = True
        for child in self._children:
            child.thread.start()
        deadline = time.monotonic() + timeout_s
        for child in self._children:
            if not child.ready.wait(max(0.0, deadline - time.monotonic())) or child.url is None:
                self.stop()
                raise RuntimeError(
                    f"simulator {child.spec.name} did not start (state {child.state}, "
                    f"exit code {child.exit_code})"
                )
        return self.urls

    @property
    def urls(self) -> dict[str, str]:
        return {c.spec.name: c.url for c in self._children if c.url is not None}

    def status(self) -> list[dict[str, Any]]:
        return [
            {
                "name": c.spec.name,
                "url": c.url,
                "state": c.state,
                "pid": c.proc.pid if c.proc is not None else None,
                "restarts": c.restarts,
                "exit_code": c.exit_code,
            }
            for c in self._children
        ]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every simulator; returns once no child process is left."""
        for child in self._children:
            child.stop(timeout_s)

    async def astart(self, timeout_s: float = 30.0) -> dict[str, str]:
        return await asyncio.to_thread(self.start, timeout_s)

    async def astop(self, timeout_s: float = 10.0) -> None:
        await asyncio.to_thread(self.stop, timeout_s)

    def __enter__(self) -> Supervisor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
