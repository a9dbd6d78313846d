"""``tokenlane serve --workers N``: the parent process that keeps N workers serving one port.

The supervisor binds the port (``listener``) and starts N worker processes (``tokenlane
worker``) that accept on it; it creates the run directory (the board,
``proxy.workers.board``, and the workers' sockets, ``proxy.workers.mesh``) and removes it at
the end. It handles no request.

- On Linux each worker listens on a socket of its own on the port (``SO_REUSEPORT``, as
  Envoy's workers and nginx's ``reuseport`` do) and the kernel hashes each new connection to
  one of them: connections are spread evenly. On one listening socket shared by all (still
  the way elsewhere), whichever worker woke first took every connection waiting, and a client
  opening a thousand keep-alive connections at once left up to 69 % of them on one worker of
  two for their whole life (``docs/workers.md``). The supervisor holds the port with a socket
  that does not listen, so the port stays the serve's while workers come and go; a worker
  that dies takes its socket with it, and new connections go to the others at once.

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
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
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


def listener(host: str, port: int, count: int) -> socket.socket:
    """The serve's socket on ``host:port`` (0: a free port), passed to every worker: where the
    kernel spreads connections over sockets sharing a port (``spreads_connections``) and
    there are several workers, a socket that holds the port without listening, beside which
    each worker listens on its own (``worker_listener``); else the one listening socket.

    The port is first bound by a socket without ``SO_REUSEPORT``, as a single socket is: a
    port another process serves is refused as "address in use", even by a group of the same
    user's that ours could join; and the port, once held, refuses any later bind without
    ``SO_REUSEPORT`` (a second ``tokenlane serve`` on it fails as it always did)."""
    if count <= 1 or not spreads_connections():
        return bind(host, port)
    probe = bind(host, port, listen=False)
    port = probe.getsockname()[1]  # the port asked for, or the free one given for 0
    probe.close()
    return bind(host, port, reuse_port=True, listen=False)


def worker_listener(passed: socket.socket) -> socket.socket:
    """A worker's listening socket, from the one its supervisor passed (``listener``): that
    one when it listens (shared by all workers), else one of the worker's own on its port."""
    if passed.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        return passed
    host, port = passed.getsockname()[:2]
    own = bind(host, port, reuse_port=True)
    passed.close()
    return own


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
        sock: socket.socket,
        rundir: str,
        out: int | None = None,
    ) -> None:
        self.count = count
        self.worker_args = list(worker_args)
        self.sock = sock
        self.rundir = rundir
        self.out = sys.stdout.fileno() if out is None else out
        self.board = Board(os.path.join(rundir, "board"), None, create=True, workers=count)
        self.workers = [Worker(i) for i in range(count)]
        self.stopping = False
        self.signals = 0
        self.restarts = 0

    def command(self, index: int) -> list[str]:
        return [
            sys.executable, "-m", "proxy", "worker", *self.worker_args,
            "--fd", str(self.sock.fileno()), "--rundir", self.rundir,
            "--index", str(index), "--workers", str(self.count),
            "--supervisor", str(os.getpid()),
        ]  # fmt: skip

    def start(self, worker: Worker) -> None:
        loop = asyncio.get_running_loop()
        worker.proc = subprocess.Popen(
            self.command(worker.index),
            pass_fds=(self.sock.fileno(),),
            stdout=subprocess.PIPE,
            start_new_session=True,  # a terminal's Ctrl-C reaches workers only through here
        )
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
        self.sock.close()
        shutil.rmtree(self.rundir, ignore_errors=True)


def _exit_words(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


def supervise(policy: Policy, count: int, worker_args: Sequence[str]) -> int:
    """Run ``count`` workers on the policy's port until a signal stops them all."""
    sock = listener(policy.server.host, policy.server.port, count)
    supervisor = Supervisor(count, worker_args, sock, run_dir())
    log.info(
        "tokenlane listening on http://%s:%d with %d workers (%d pools, %d lanes; request path %s)",
        policy.server.host,
        sock.getsockname()[1],
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
    "Supervisor",
    "auto_workers",
    "cgroup_cpus",
    "listener",
    "supervise",
    "worker_listener",
    "workers_for",
]
