"""``tokenlane serve --workers N``: the parent process that keeps N workers serving one port.

The supervisor binds the port (``Listeners``) and starts N worker processes (``tokenlane
worker``) that accept on it; it creates the run directory (the board,
``proxy.workers.board``, and the workers' sockets, ``proxy.workers.mesh``) and removes it at
the end. It handles no request.

- On Linux each worker listens on a socket of its own on the port (``SO_REUSEPORT``, as
  Envoy's workers and nginx's ``reuseport`` do) and the kernel hashes each new connection to
  one of them: connections are spread evenly (``Listeners``). On one listening socket shared
  by all (still the way elsewhere), whichever worker woke first took every connection
  waiting, and a client opening a thousand keep-alive connections at once left up to 69 % of
  them on one worker of two for their whole life (``docs/workers.md``).
- A worker that dies is started again under the same index; its column of the board is
  zeroed the moment its death is seen (within ``REAP_S``), so what it held (in-flight
  counts, queue places) is free for the others at once. One that keeps dying at start is
  restarted at most once per ``RESTART_BACKOFF_S``.
- Each worker's stdout (its access log) comes through a pipe and is written out a whole line
  at a time, so lines of different workers never interleave or tear.
- SIGTERM (or a first Ctrl-C) is passed to every worker once: each drains as a single process
  does (``server.shutdown_grace_s``), and the supervisor exits when all have. A second Ctrl-C
  is passed on too (the workers quit at once). SIGHUP goes to the leader, which reloads the
  policy for all. The workers run in a session of their own, so a terminal's signals reach
  them only through here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from proxy import compiled
from proxy.config import Policy
from proxy.workers.board import Board

log = logging.getLogger("tokenlane.workers")

REAP_S = 0.05
RESTART_BACKOFF_S = 1.0
BACKLOG = 4096


# ---------------------------------------------------------------------------- how many


def cgroup_cpus(cpu_max: str | None, v1_quota: str | None, v1_period: str | None) -> int | None:
    """CPUs a cgroup quota allows (rounded up), from cgroup v2's ``cpu.max`` or v1's
    ``cpu.cfs_quota_us``/``cpu.cfs_period_us``; None when unlimited or unknown."""
    quota: float | None = None
    period: float | None = None
    if cpu_max is not None:
        parts = cpu_max.split()
        if len(parts) == 2 and parts[0] != "max":
            with contextlib.suppress(ValueError):
                quota, period = float(parts[0]), float(parts[1])
    elif v1_quota is not None and v1_period is not None:
        with contextlib.suppress(ValueError):
            quota, period = float(v1_quota), float(v1_period)
    if quota is None or period is None or quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def auto_workers(affinity: int, cgroup: int | None) -> int:
    """``server.workers: auto``: the smaller of the CPUs this process may run on and its
    cgroup's quota (a 2-CPU pod on a 64-core node gets 2)."""
    return max(1, min(affinity, cgroup) if cgroup is not None else affinity)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def workers_for(setting: int | str) -> int:
    if isinstance(setting, int):
        return setting
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cgroup = cgroup_cpus(
        _read("/sys/fs/cgroup/cpu.max"),
        _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
        _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
    )
    return auto_workers(affinity or 1, cgroup)


# ---------------------------------------------------------------------------- the parent


def bind(host: str, port: int, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    """A TCP socket bound to ``host:port`` and, unless told not to, listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return _bound(family, (host, port), reuse_port, listen)


def _bound(
    family: int, address: tuple[object, ...], reuse_port: bool, listen: bool
) -> socket.socket:
    """A TCP socket of ``family`` bound to ``address`` (as ``getsockname`` gives it, an IPv6
    scope included), inheritable by the workers."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        if listen:
            sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def spreads_connections() -> bool:
    """Whether listening sockets sharing a port with ``SO_REUSEPORT`` share its connections:
    Linux hashes each to one of them; elsewhere the option only lets them bind (on macOS the
    last one bound takes every connection)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


class Listeners:
    """The serve's listening sockets on ``host:port`` (0: a free port), a worker's given to it
    as it starts (``for_worker``).

    Several workers where the kernel spreads connections (``spreads_connections``): a socket
    per worker, all bound with ``SO_REUSEPORT``. Every one is bound and listening before the
    first worker starts (connections wait in them while workers load), and once a worker has
    its socket the supervisor closes its own copy (``given``): the socket lives and dies with
    the worker, so a dead worker's new connections go to the others at once. The one started
    in its place gets a new socket, bound but not listening: its server listens once it
    serves (asyncio's ``create_server`` does), so no connection is hashed to a worker still
    loading while the others could take it. Otherwise: the one socket, shared by every worker
    and held here, as a single process has it.

    The port is first bound by a socket without ``SO_REUSEPORT``, as a single socket is: a
    port another process serves is refused as "address in use", even by a group of the same
    user's that ours could join; the group, once listening, refuses any bind that does not
    set ``SO_REUSEPORT`` (a second ``tokenlane serve`` on the port fails as it always did)."""

    def __init__(self, host: str, port: int, count: int) -> None:
        self.shared: socket.socket | None = None
        self.waiting: list[socket.socket] = []  # bound and listening, for workers to come
        if count <= 1 or not spreads_connections():
            self.shared = bind(host, port)
            self.family = self.shared.family
            self.address: tuple[object, ...] = self.shared.getsockname()
            return
        probe = bind(host, port, listen=False)
        # The port asked for, or the free one given for 0, with an IPv6 scope as bound.
        self.family, self.address = probe.family, probe.getsockname()
        probe.close()
        try:
            for _ in range(count):
                self.waiting.append(self._new())
        except BaseException:
            self.close()
            raise

    @property
    def port(self) -> int:
        return cast(int, self.address[1])

    def _new(self, listen: bool = True) -> socket.socket:
        return _bound(self.family, self.address, True, listen)

    def for_worker(self) -> socket.socket:
        """The socket for a worker about to start: listening at the serve's start, bound only
        for a worker started again (its server listens on it)."""
        if self.shared is not None:
            return self.shared
        return self.waiting.pop() if self.waiting else self._new(listen=False)

    def given(self, sock: socket.socket) -> None:
        """A worker started with ``sock``: a socket of its own is its alone from here."""
        if sock is not self.shared:
            sock.close()

    def close(self) -> None:
        for sock in self.waiting:
            sock.close()
        self.waiting = []
        if self.shared is not None:
            self.shared.close()


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_supervisor(supervisor: int) -> bool:
    """Have this worker sent SIGTERM (a drain, as on a shutdown) when its supervisor dies, even
    by SIGKILL: an orphaned worker would go on serving the port with nobody to restart it or
    carry its log lines, and a new ``serve`` could not take the port. On Linux that is the
    parent-death signal; elsewhere a thread watches the parent. False when the supervisor is
    already gone (it died before the signal was asked for)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    else:
        import threading

        def watch() -> None:
            while os.getppid() == supervisor:
                time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="tokenlane-supervisor-watch", daemon=True).start()
    return os.getppid() == supervisor


def run_dir() -> str:
    """Under /dev/shm when there is one: the board is memory, never written to a disk."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="tokenlane-", dir=base)


@dataclass
class Worker:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    partial: bytearray = field(default_factory=bytearray)


class Supervisor:
    def __init__(
        self,
        count: int,
        worker_args: Sequence[str],
        listeners: Listeners,
        rundir: str,
        out: int | None = None,
    ) -> None:
        self.count = count
        self.worker_args = list(worker_args)
        self.listeners = listeners
        self.rundir = rundir
        self.out = sys.stdout.fileno() if out is None else out
        self.board = Board(os.path.join(rundir, "board"), None, create=True, workers=count)
        self.workers = [Worker(i) for i in range(count)]
        self.stopping = False
        self.signals = 0
        self.restarts = 0

    def command(self, index: int, fd: int) -> list[str]:
        return [
            sys.executable, "-m", "proxy", "worker", *self.worker_args,
            "--fd", str(fd), "--rundir", self.rundir,
            "--index", str(index), "--workers", str(self.count),
            "--supervisor", str(os.getpid()),
        ]  # fmt: skip

    def start(self, worker: Worker) -> None:
        loop = asyncio.get_running_loop()
        try:
            sock = self.listeners.for_worker()
        except OSError as exc:
            # A new socket on the port, for a worker started again: refused only when every
            # worker was gone and something else took the port meanwhile. Tried again later.
            log.error("worker %d: cannot listen on the port (%s); trying again", worker.index, exc)
            loop.call_later(RESTART_BACKOFF_S, self._restart, worker)
            return
        try:
            worker.proc = subprocess.Popen(
                self.command(worker.index, sock.fileno()),
                pass_fds=(sock.fileno(),),
                stdout=subprocess.PIPE,
                start_new_session=True,  # a terminal's Ctrl-C reaches workers only through here
            )
        finally:
            self.listeners.given(sock)
        worker.started_at = time.monotonic()
        assert worker.proc.stdout is not None
        fd = worker.proc.stdout.fileno()
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._pipe, worker, fd)

    def _pipe(self, worker: Worker, fd: int) -> None:
        if self._copy_lines(worker, fd) is None:
            asyncio.get_running_loop().remove_reader(fd)

    def _copy_lines(self, worker: Worker, fd: int) -> bool | None:
        """Copy the whole lines a worker's stdout has to ours (one write per batch of lines):
        True when some were read, False when none are there now, None at its end."""
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        buf = worker.partial
        if not data:
            if buf:
                self._write(bytes(buf) + b"\n")
                buf.clear()
            return None
        buf += data
        end = buf.rfind(b"\n")
        if end >= 0:
            self._write(bytes(buf[: end + 1]))
            del buf[: end + 1]
        return True

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.out, view)
            except BlockingIOError:
                time.sleep(0.001)
                continue
            except OSError:
                return  # our stdout is gone: nothing to write to
            view = view[n:]

    def signal(self, sig: int) -> None:
        if sig == signal.SIGHUP:
            self._send(self.workers[:1], signal.SIGHUP)
            return
        self.signals += 1
        self.stopping = True
        # The first signal starts every worker's drain; a second one ends them at once.
        self._send(self.workers, signal.SIGTERM if self.signals == 1 else signal.SIGINT)

    def _send(self, workers: list[Worker], sig: int) -> None:
        for w in workers:
            if w.proc is not None and w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(sig)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self.signal, sig)
        for w in self.workers:
            self.start(w)
        log.info("tokenlane: %d workers serving (run directory %s)", self.count, self.rundir)
        while True:
            await asyncio.sleep(REAP_S)
            alive = 0
            for w in self.workers:
                proc = w.proc
                if proc is None:
                    continue
                code = proc.poll()
                if code is None:
                    alive += 1
                    continue
                self._reaped(w, code)
            if self.stopping and alive == 0:
                return 0

    def _reaped(self, worker: Worker, code: int) -> None:
        assert worker.proc is not None
        if worker.proc.stdout is not None:
            fd = worker.proc.stdout.fileno()
            with contextlib.suppress(OSError):
                while self._copy_lines(worker, fd):
                    pass
            asyncio.get_running_loop().remove_reader(fd)
            worker.proc.stdout.close()
        worker.proc = None
        self.board.zero_column(worker.index)  # what it held is free now
        if self.stopping:
            return
        self.restarts += 1
        log.warning("worker %d exited (%s); starting it again", worker.index, _exit_words(code))
        if time.monotonic() - worker.started_at < RESTART_BACKOFF_S:
            asyncio.get_running_loop().call_later(RESTART_BACKOFF_S, self._restart, worker)
        else:
            self.start(worker)

    def _restart(self, worker: Worker) -> None:
        if not self.stopping and worker.proc is None:
            self.start(worker)

    def close(self) -> None:
        self.board.close()
        self.listeners.close()
        shutil.rmtree(self.rundir, ignore_errors=True)


def _exit_words(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


def supervise(policy: Policy, count: int, worker_args: Sequence[str]) -> int:
    """Run ``count`` workers on the policy's port until a signal stops them all."""
    listeners = Listeners(policy.server.host, policy.server.port, count)
    supervisor = Supervisor(count, worker_args, listeners, run_dir())
    log.info(
        "tokenlane listening on http://%s:%d with %d workers (%d pools, %d lanes; request path %s)",
        policy.server.host,
        listeners.port,
        count,
        len(policy.pools),
        len(policy.lanes),
        compiled.status,
    )
    try:
        return asyncio.run(supervisor.run())
    finally:
        supervisor.close()


__all__ = [
    "Listeners",
    "Supervisor",
    "auto_workers",
    "cgroup_cpus",
    "supervise",
    "workers_for",
]
