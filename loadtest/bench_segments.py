"""Where a gateway's added TTFT at concurrency 1 goes: before it writes the request upstream
(*ingress*), and between the replica's answer and its first write to the client (*egress*).

The overhead benchmark gives each gateway's added TTFT as one figure. This one splits it by the
gateway's own system calls, recorded by ``perf`` on the kernel's syscall tracepoints (two
events a call, microseconds of overhead, no ptrace stop as with strace), for the same burst
load (``bench_overhead.burst_run``, concurrency 1, the 64-token mocks sending a stream in one
write):

- **ingress**: from the return of the read that brought the client's request to the write of
  that request to a replica (parse, route, pick, frame; in Tokenlane uvicorn's callbacks and
  the app's task too);
- **egress**: from the return of the read that brought the replica's answer to the first
  write to the client (in Tokenlane the answer's parse and the response's start; for an
  eligible stream its first events, noted for continuation).

What is left of the added TTFT is outside these two spans: the kernel's loopback hops and
wake-ups, the gateway's turn of its loop before each read, its time inside the writes, and
perf's cost per call (the *traced* column: the added TTFT while perf records).
The gateways run in turns over the same mocks (nginx when installed, vllm-router installed by
``loadtest.peers`` when missing, Tokenlane with continuation on and off, and the bare Python
relay of ``loadtest.bench_floor``: uvloop and httptools with no logic at all, what any gateway
in Python on this machine costs at least); each row's figures are the medians of its rounds.
Needs ``perf`` and permission to trace (root here).

    python -m loadtest.bench_segments [--seconds 3] [--repeat 3] [--only NAME]... [--tree PATH]...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import bench_floor, gateways, peers
from .bench_overhead import DIRECT, burst_run, mocks, stream_request, turn

# x86-64 syscall numbers: what reads a socket and what writes one, in every gateway measured
# (read, readv, recvfrom, recvmsg; write, writev, sendto, sendmsg; pread/pwrite never on sockets
# but harmless).
READS = frozenset({0, 17, 19, 45, 47})
WRITES = frozenset({1, 18, 20, 44, 46})
# A replica's answer to the burst request is ~14 KB; an eventfd or pipe wake-up (vllm-router's
# threads, uvloop's) moves 8 bytes, a request to a replica a few hundred.
MIN_UPSTREAM_WRITE = 100
MIN_ANSWER_READ = 1000

_LINE = re.compile(
    r"\s*(\d+)\s+(\d+\.\d+):\s+raw_syscalls:sys_(enter|exit):\s+NR (\d+)\s*"
    r"(?:\(([0-9a-f]+)|= (-?\d+))?"
)


@dataclass(frozen=True, slots=True)
class Syscall:
    """One system call of a traced process: when it was entered and returned, on which
    descriptor (its first argument), and what it returned."""

    entered: float
    returned: float
    nr: int
    fd: int
    ret: int


def parse_calls(lines: Iterable[str]) -> list[Syscall]:
    """The calls in ``perf script [--ns] -F tid,time,event,trace`` output of ``raw_syscalls`` enter
    and exit events, paired per thread, in the order they were entered. A call whose enter or
    exit is missing (the recording started or stopped inside it) is left out."""
    entered: dict[int, tuple[float, int, int]] = {}
    calls: list[Syscall] = []
    for line in lines:
        m = _LINE.match(line)
        if m is None:
            continue
        tid, t, nr = int(m.group(1)), float(m.group(2)), int(m.group(4))
        if m.group(3) == "enter":
            entered[tid] = (t, nr, int(m.group(5), 16) if m.group(5) else -1)
            continue
        start = entered.pop(tid, None)
        if start is None or start[1] != nr or m.group(6) is None:
            continue
        calls.append(Syscall(start[0], t, nr, start[2], int(m.group(6))))
    calls.sort(key=lambda c: c.entered)
    return calls


def segments(calls: Iterable[Syscall], request_size: int) -> dict[str, list[float]]:
    """Ingress and egress times (seconds) of each request in ``calls``: requests one at a time
    (concurrency 1), each ``request_size`` bytes read from the client in one read. The write
    upstream is the first large write on the descriptor the answer is then read from (not a
    log line flushed meanwhile). A request whose sequence is broken (a recording's edge) is
    left out."""
    ingress: list[float] = []
    egress: list[float] = []
    state = "idle"
    client_fd = -1
    mark = 0.0
    sent: dict[int, float] = {}  # descriptor -> when its first large write began
    for c in calls:
        if c.nr in READS and c.ret == request_size:
            state, client_fd, mark, sent = "ingress", c.fd, c.returned, {}
        elif state == "ingress" and c.nr in WRITES and c.ret >= MIN_UPSTREAM_WRITE:
            sent.setdefault(c.fd, c.entered)
        elif state == "ingress" and c.nr in READS and c.ret >= MIN_ANSWER_READ:
            if c.fd in sent:
                ingress.append(sent[c.fd] - mark)
                state, mark = "egress", c.returned
        elif state == "egress" and c.nr in WRITES and c.ret > 0 and c.fd == client_fd:
            egress.append(c.entered - mark)
            state = "idle"
    return {"ingress": ingress, "egress": egress}


def median_us(values: list[float]) -> float:
    return 1e6 * statistics.median(values) if values else float("nan")


class PerfRefused(RuntimeError):
    """``perf record`` would not run (no permission to trace, no build for this kernel)."""


def perf_command() -> str | None:
    return shutil.which("perf")


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (nginx serves from its master's children)."""
    tree, i = [pid], 0
    while i < len(tree):
        for task in Path(f"/proc/{tree[i]}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                tree += [int(c) for c in task.read_text().split()]
        i += 1
    return tree


# What ``recording`` records unless told: every system call's entry and exit.
SYSCALLS = ("-e", "raw_syscalls:sys_enter,raw_syscalls:sys_exit")


@contextlib.contextmanager
def recording(pid: int, out: Path, what: tuple[str, ...] = SYSCALLS) -> Iterator[None]:
    """``perf record`` of ``pid``'s process tree (every thread) while the block runs: its
    system calls, or what ``what`` (perf's options) says (``("-F", "1999")``: CPU samples)."""
    perf = perf_command()
    assert perf is not None
    argv = [perf, "record", "-q", *what]
    pids = ",".join(map(str, process_tree(pid)))
    proc = subprocess.Popen([*argv, "-p", pids, "-o", str(out)], stderr=subprocess.PIPE)
    # perf says nothing when it is attached; the file's header is written first.
    deadline = time.monotonic() + 10
    while not (out.exists() and out.stat().st_size > 0) and time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode()[-500:] if proc.stderr else ""
            raise PerfRefused(f"perf could not trace here: {err.strip()}")
        time.sleep(0.05)
    time.sleep(0.5)  # its events enabled after the header: a margin, not a signal perf gives
    try:
        yield
    finally:
        proc.send_signal(2)
        proc.wait(timeout=60)


def read_calls(data: Path) -> list[Syscall]:
    perf = perf_command()
    assert perf is not None
    out = subprocess.run(
        [perf, "script", "-i", str(data), "--ns", "-F", "tid,time,event,trace"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return parse_calls(out.splitlines())


def tokenlane_from(tree: Path | None = None, continuation: bool = True) -> Callable[..., Any]:
    """Starts Tokenlane (from ``tree``, else this one) over the mocks, scraping them hourly:
    a scrape's work is the fleet's, not a request's."""

    def start(upstreams: list[int]) -> Any:
        return gateways.tokenlane(
            upstreams, continuation=continuation, cwd=tree, health_interval_s=3600
        )

    return start


def run(
    seconds: float, repeat: int, only: list[str] | None = None, trees: list[str] | None = None
) -> list[dict[str, Any]]:
    """Each gateway's added TTFT and its split (module docstring); ``trees``: Tokenlane from
    other source trees too (git worktrees, each compiled), for a before and after."""
    kinds: list[tuple[str, Callable[[list[int]], Any]]] = [
        ("nginx", gateways.nginx),
        ("vllm-router", gateways.vllm_router),
        ("bare relay", bench_floor.relay),
        ("tokenlane", tokenlane_from()),
        ("tokenlane (plain)", tokenlane_from(continuation=False)),
    ]
    for tree in trees or ():
        kinds.append((f"tokenlane ({tree})", tokenlane_from(Path(tree).resolve())))
    if only:
        kinds = [k for k in kinds if k[0] in only]
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        ports = stack.enter_context(mocks(0))
        started: dict[str, gateways.Running] = {}
        unavailable: dict[str, str] = {}
        for name, start in kinds:
            try:
                started[name] = stack.enter_context(start(ports))
            except peers.PeerUnavailable as exc:
                unavailable[name] = str(exc)
        ttft: dict[str, list[float]] = {name: [] for name in [DIRECT, *started]}
        seg: dict[str, dict[str, list[float]]] = {
            name: {"ingress": [], "egress": [], "ttft_traced": []} for name in started
        }
        for running in started.values():  # connections and pools warm
            asyncio.run(burst_run(running.port, 1, 0.5, None))
        for r in range(repeat):
            for name in turn([DIRECT, *started], r):
                if name == DIRECT:
                    res = asyncio.run(burst_run(ports[0], 1, seconds, None))
                    ttft[name].append(res.summary()["ttft_p50_ms"])
                    continue
                gw = started[name]
                res = asyncio.run(burst_run(gw.port, 1, seconds, None))
                ttft[name].append(res.summary()["ttft_p50_ms"])
                data = Path(tmp) / f"{r}-{len(ttft[name])}-{gw.pid}.data"
                with recording(gw.pid, data):
                    traced = asyncio.run(burst_run(gw.port, 1, seconds, None))
                split = segments(read_calls(data), len(stream_request(gw.port)))
                data.unlink()
                seg[name]["ingress"].append(median_us(split["ingress"]))
                seg[name]["egress"].append(median_us(split["egress"]))
                seg[name]["ttft_traced"].append(traced.summary()["ttft_p50_ms"])
        direct = statistics.median(ttft[DIRECT])
        for name, _ in kinds:
            if name in unavailable:
                rows.append({"gateway": name, "unavailable": unavailable[name]})
                continue
            s = seg[name]
            rows.append(
                {
                    "gateway": name,
                    "added_ttft_ms": statistics.median(ttft[name]) - direct,
                    "added_ttft_traced_ms": statistics.median(s["ttft_traced"]) - direct,
                    "ingress_us": statistics.median(s["ingress"]),
                    "egress_us": statistics.median(s["egress"]),
                }
            )
    return rows


def print_rows(rows: list[dict[str, Any]], seconds: float, repeat: int) -> None:
    print(
        f"added TTFT at concurrency 1, split by the gateway's system calls "
        f"({repeat} rounds of {seconds:g} s each, medians)"
    )
    print(
        f"{'gateway':<24} | {'added TTFT':>10} | {'traced':>8} | {'ingress':>8} | "
        f"{'egress':>8} | {'the rest':>8}"
    )
    for row in rows:
        if "unavailable" in row:
            print(f"{row['gateway']:<24} | unavailable: {row['unavailable']}")
            continue
        inside = (row["ingress_us"] + row["egress_us"]) / 1000
        print(
            f"{row['gateway']:<24} | {row['added_ttft_ms']:>+8.3f}ms | "
            f"{row['added_ttft_traced_ms']:>+6.3f}ms | {row['ingress_us']:>6.0f}µs | "
            f"{row['egress_us']:>6.0f}µs | {row['added_ttft_traced_ms'] - inside:>+6.3f}ms"
        )
    print(
        "traced: the added TTFT while perf records (its cost included); the rest: traced less "
        "ingress and egress (loopback hops, wake-ups, the loop's turns, the writes themselves)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", action="append", help="a gateway's name (repeatable)")
    ap.add_argument(
        "--tree", action="append", help="Tokenlane from this source tree too (repeatable)"
    )
    args = ap.parse_args(argv)
    if perf_command() is None:
        # Skipped, not failed: ``make bench`` runs it where perf may not be installed.
        print("bench_segments: skipped, perf is not installed (apt-get install linux-perf)")
        return 0
    try:
        rows = run(args.seconds, args.repeat, args.only, args.tree)
    except PerfRefused as exc:
        print(f"bench_segments: skipped, {exc}")
        return 0
    print_rows(rows, args.seconds, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
