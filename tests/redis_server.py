"""A real ``redis-server`` for tests: on a free loopback port, no persistence, and the faults the
shared-state tests need (pause with SIGSTOP for "slow", kill for "down", restart on the same port).

Tests wrap ``running_redis()`` in a fixture. It fails, not skips, when
``redis-server`` is missing: shared state untested must not pass silently.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from .servers import free_port


def _die_with_parent() -> None:
    # A test run killed from outside (a timeout) skips its fixtures' cleanup: the kernel then
    # ends the server instead (Linux PR_SET_PDEATHSIG).
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)


class RedisServer:
    """One redis-server process; ``url`` stays the same across ``kill()`` / ``start()``."""

    def __init__(self, binary: str, port: int) -> None:
        self.binary = binary
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        argv = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--daemonize", "no",
            "--loglevel", "warning", "--dir", "/tmp",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited at start:\n{err[-2000:]}")
            if self._pong():
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server not answering on port {self.port}")
            time.sleep(0.01)

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def pause(self) -> None:
        """Slow: the port still accepts connections, nothing answers."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """Down: the process and everything it held are gone."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process dies only when woken
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def command(self, *args: str) -> bytes:
        """One command over a raw socket, bypassing any client (a test's "other writer");
        returns the raw RESP reply."""
        parts = [f"*{len(args)}\r\n".encode()]
        for arg in args:
            raw = arg.encode()
            parts.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
            sock.sendall(b"".join(parts))
            return sock.recv(65536)

    def value(self, *args: str) -> bytes | None:
        """The bulk-string reply of a command (HGET, GET), or None."""
        reply = self.command(*args)
        if reply.startswith(b"$-1"):
            return None
        assert reply.startswith(b"$"), reply
        return reply.split(b"\r\n", 2)[1]


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        pytest.fail(
            "redis-server is not installed: run scripts/system-deps.sh (make test does) or "
            "apt-get install redis-server; the shared-state tests need a real one",
            pytrace=False,
        )
    return found


@contextlib.contextmanager
def running_redis() -> Iterator[RedisServer]:
    server = RedisServer(redis_binary(), free_port())
    server.start()
    try:
        yield server
    finally:
        server.kill()
