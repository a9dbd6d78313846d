"""Process plumbing for the benchmarks: ports, child processes, their CPU and memory, readiness.

Every benchmark runs each part (simulators, fake upstreams, the gateway) as its own process,
as in production, and must stop all of it afterwards, even when a run fails halfway. Each
child gets its own session, so stopping its process group also stops whatever it started.
Linux only: CPU and RSS come from /proc.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import httpx

CLK_TCK = os.sysconf("SC_CLK_TCK")

# What Popen accepts for a child's stderr: a file, subprocess.DEVNULL/STDOUT, or None (inherit).
Stream = int | IO[Any] | None


class ProcessExitedError(RuntimeError):
    """A child process ended while we were waiting for it to become ready."""


def free_port(host: str = "127.0.0.1") -> int:
    """A loopback port free right now (another process may take it before the child binds)."""
    with contextlib.closing(socket.socket()) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def spawn(
    argv: list[str],
    *,
    log: Path | None = None,
    stderr: Stream = subprocess.DEVNULL,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own session with no stdin, our environment plus ``env``, in
    ``cwd`` (ours when None).

    With ``log``, stdout and stderr are appended to that file (read it when a run fails);
    without, stdout is discarded and stderr goes to ``stderr`` (``None`` inherits ours).
    """
    environ = {**os.environ, **env} if env else None
    if log is None:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
            env=environ,
            cwd=cwd,
        )
    with log.open("ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
            env=environ,
            cwd=cwd,
        )


def stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM the child's process group, then SIGKILL it if the child outlives ``grace_s``."""
    # The group, not the pid: a leader that already exited may have left children behind.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def process(
    argv: list[str],
    *,
    log: Path | None = None,
    stderr: Stream = subprocess.DEVNULL,
    grace_s: float = 10.0,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` (see :func:`spawn`) for the duration of the block, then :func:`stop` it."""
    proc = spawn(argv, log=log, stderr=stderr, env=env, cwd=cwd)
    try:
        yield proc
    finally:
        stop(proc, grace_s)


def cpu_seconds(pid: int, *, user_only: bool = False) -> float:
    """User + system CPU time the process has used so far, from /proc/<pid>/stat
    (``user_only``: user time alone)."""
    # The command name (field 2) may hold spaces; the fields after its closing ")" do not.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    if user_only:
        return int(fields[11]) / CLK_TCK  # utime
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def descendants(pid: int) -> list[int]:
    """``pid``'s children, theirs, and so on (from /proc; those alive now)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{parent}/task").iterdir():
                kids = [int(k) for k in (task / "children").read_text().split()]
                out.extend(kids)
                todo.extend(kids)
    return out


def tree_cpu_seconds(pid: int, *, user_only: bool = False) -> float:
    """CPU time of ``pid`` and every live descendant (a supervisor's workers, nginx's), plus
    what its children that already exited used (cutime + cstime). ``user_only``: user time
    alone (utime, cutime), without the kernel's share, whose network stack is the same for
    every gateway and the noisiest part of the figure."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = [int(f) for f in fields[11:15]]
    total = (ticks[0] + ticks[2] if user_only else sum(ticks)) / CLK_TCK
    for child in descendants(pid):
        with contextlib.suppress(OSError):
            total += cpu_seconds(child, user_only=user_only)
    return total


def tree_wait_seconds(pid: int) -> float:
    """How long the threads of ``pid`` and its live descendants have waited, runnable, for a
    core so far (the second field of each task's /proc/<pid>/task/<tid>/schedstat): on a
    machine whose cores the load generator and the mocks share, the time a gateway could have
    run and did not."""
    total = 0
    for p in (pid, *descendants(pid)):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p}/task").iterdir():
                total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


def cpu_model(cpuinfo: str) -> str:
    """The processor in ``/proc/cpuinfo``'s text: its first ``model name``, with its family,
    model and stepping numbers where given (a virtual machine's name may be as plain as
    "Intel(R) Xeon(R) Processor"; the numbers still tell two generations apart); on arm64,
    which names none, its implementer and part; else "unknown"."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block is enough
        key, sep, value = line.partition(":")
        value = " ".join(value.split())
        if sep and value and value != "unknown":
            fields.setdefault(key.strip(), value)
    name = fields.get("model name")
    if name is None:
        parts = (("implementer", "CPU implementer"), ("part", "CPU part"))
        arm = [f"{said} {fields[key]}" for said, key in parts if key in fields]
        return f"ARM ({', '.join(arm)})" if arm else "unknown"
    named = (("family", "cpu family"), ("model", "model"), ("stepping", "stepping"))
    numbers = [f"{said} {fields[key]}" for said, key in named if key in fields]
    return f"{name} ({', '.join(numbers)})" if numbers else name


def machine() -> str:
    """What a run's figures were measured on, printed above them: the processor's name, the
    cores this process may use and the kernel: figures of two days compare only on one kind
    of machine, and the days' notes named none (``docs/benchmarks.md``)."""
    try:
        model = cpu_model(Path("/proc/cpuinfo").read_text())
    except OSError:
        model = "unknown"
    return f"{model}, {len(os.sched_getaffinity(0))} cores, Linux {os.uname().release}"


def tree_rss_mb(pid: int) -> float:
    total = rss_mb(pid)
    for child in descendants(pid):
        with contextlib.suppress(OSError):
            total += rss_mb(child)
    return total


def rss_mb(pid: int) -> float:
    """The process's resident set size in MiB, from /proc/<pid>/status (0 if not reported)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def wait_port(
    port: int, timeout_s: float = 20.0, *, host: str = "127.0.0.1", connect_s: float = 0.2
) -> None:
    """Block until something accepts TCP connections on ``host:port``; TimeoutError if not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), connect_s):
            return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} not open after {timeout_s:g}s")


def wait_http(url: str, timeout_s: float = 20.0) -> None:
    """Block until ``GET url`` answers 200; TimeoutError if not.

    Standard library only: a load generator on raw sockets need not pull in an HTTP client.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as r:
            if r.status == 200:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{url} not answering 200 after {timeout_s:g}s")


async def await_http(
    http: httpx.AsyncClient,
    url: str,
    timeout_s: float = 30.0,
    *,
    interval_s: float = 0.05,
    proc: subprocess.Popen[bytes] | None = None,
) -> None:
    """Wait until ``GET url`` answers 200; TimeoutError if not within ``timeout_s``.

    With ``proc`` (the server's process), ProcessExitedError as soon as it exits, rather
    than waiting out the deadline for a server that will never answer.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if (await http.get(url)).status_code == 200:
                return
        if proc is not None and proc.poll() is not None:
            raise ProcessExitedError(f"{url}: its process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not answering 200 after {timeout_s:g}s")
        await asyncio.sleep(interval_s)
