"""Paired before/after: Tokenlane from two or more source trees over the same mocks, alternated.

On the 2-core machine the same build measures up to 2x apart from one minute to the next (see
``docs/benchmarks.md``): two runs made one after the other compare the machine's minutes as
much as the builds. Here every gateway runs at once over the same two burst mocks, and the
load alternates between them in short slices, in turn order A B, B A, ...; each slice of one
gateway is paired with the same round's slice of the first, and the median of those paired
differences is printed beside each gateway's medians; below them, each gateway's ratio to the
first (the median of the rounds' ratios) and the middle half of those ratios (their first and
third quartiles: how far the rounds agree). A tree is a git worktree
(``git worktree add /tmp/before <commit>``), each run with its own sources by this project's
virtualenv.

    python -m loadtest.bench_ab --tree /tmp/before --tree . [--tree .:2] [--tree .:1:off]
        [--rounds 10] [--slice-s 1.5] [--continuation on|off] [--mode burst|paced]
        [--prompt-tokens N]

``TREE:N`` runs that tree with N workers, ``TREE:N:off`` (or ``:on``) with continuation so
whatever ``--continuation`` says. A tree named ``vllm-router`` or ``nginx`` is that peer
(``loadtest/gateways.py``), in the timed modes: ``--tree vllm-router --tree . --tree .:1:off
--tree .:2`` pairs Tokenlane's slices with the router's of the same round, so each ratio
(printed below the rows) compares the same minute of the machine, where the peer
benchmark's rounds of 5 s in turns compare minutes apart. ``--mode burst`` (mocks sending a
64-token stream in one write), per slice: CPU ms per request and req/s at concurrency 64,
TTFT p50 in ms at concurrency 1 (absolute: every gateway has the same mocks), and the CPU ms
per request the mocks and the load generator (this process) spent at concurrency 64: on a
machine they share with the gateway, what a gateway's requests cost them is CPU its req/s
cannot use; and the seconds a second the gateway's threads, summed, waited runnable for a core
(``/proc``'s schedstat: one busy thread that never waits reads 0, a router's many threads
queued behind each other read more);
``--prompt-tokens N`` sends a prompt of about N tokens instead of "hi" (the mocks send N
prompt ids to a stream that asks for token ids, as vLLM does). ``--mode paced`` (mocks sending
one token per write, 50 ms apart), per round: 256 streams at once, CPU µs per relayed chunk, the
user part of it alone (the kernel's network stack, the same work for every gateway, is the
noisiest part of the whole) and ITL p99 in ms; this is how continuation's cost per chunk is
measured (``--tree .:1:off --tree .:1:on``). ``--mode instructions`` (burst mocks), per
round: the instructions each gateway ran per request, counted by valgrind's callgrind over
``--requests`` requests from 8 clients (``apt-get install valgrind``; one worker a tree). The
count does not drift with the machine as time does (timed runs on this VM spread 20 %); two
counts of one build differ by 1 to 2 % (what the health prober and scrapes do in the window),
so a change of a few per cent shows. It counts work, not stalls (cache and branch misses): a
change that moves work into or out of C is timed as well. ``--mode paced-instructions``, the
same over the paced mocks: per round, ``--requests`` paced streams from 8 clients (8 at a
time, so that the gateway, slowed 50-fold by callgrind, still reads one token a read as it
does at full speed), the instructions divided by the chunks relayed (64 tokens, role, finish
and ``[DONE]``: 67 a stream, as ``--mode paced`` divides its CPU): the per-chunk cost of
``--mode paced``, counted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from . import gateways, procs
from .bench_overhead import (
    StreamClient,
    burst_run,
    connect,
    mock_processes,
    mocks,
    paced_run,
    stream_request,
)

FIGURES = {
    "burst": (("CPU ms/req c=64", "cpu_ms_per_req", 3), ("req/s c=64", "rps", 0),
              ("TTFT p50 c=1", "ttft_p50_ms", 2), ("mocks ms/req", "mocks_ms_per_req", 3),
              ("client ms/req", "client_ms_per_req", 3), ("wait s/s", "wait_per_s", 2)),
    "paced": (("CPU us/chunk", "cpu_us_per_chunk", 1), ("user us/chunk", "user_us_per_chunk", 1),
              ("ITL p99 ms", "itl_p99_ms", 2)),
    "instructions": (("instructions/req", "instructions_per_req", 0),),
    "paced-instructions": (("instructions/chunk", "instructions_per_chunk", 0),),
}  # fmt: skip
COUNTED = ("instructions", "paced-instructions")  # the modes run under callgrind
PACED_CHUNKS = 67  # a paced stream's relayed chunks: 64 tokens, role, finish, [DONE]
Spec = tuple[str, Path | str, int, bool]  # a tree's path, or a peer's name (``PEERS``)
PEERS = {"vllm-router": gateways.vllm_router, "nginx": gateways.nginx}
T = TypeVar("T")


def _alternated(running: list[T], r: int) -> list[T]:
    """Round ``r``'s order: as started in even rounds, reversed in odd ones."""
    return running if r % 2 == 0 else running[::-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", action="append", required=True, help="PATH[:WORKERS[:on|off]]")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--slice-s", type=float, default=1.5, help="burst mode's slices")
    parser.add_argument("--continuation", choices=("on", "off"), default="on")
    parser.add_argument("--mode", choices=tuple(FIGURES), default="burst")
    parser.add_argument("--requests", type=int, default=400, help="instructions: per round")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="burst: a prompt this long")
    parser.add_argument(
        "--keep", type=Path, help="instructions: keep callgrind's dumps here (callgrind_annotate)"
    )
    args = parser.parse_args(argv)
    if args.prompt_tokens and args.mode != "burst":
        parser.error("--prompt-tokens applies to --mode burst")
    if args.keep is not None and args.mode not in COUNTED:
        parser.error("--keep applies to the counted modes (instructions, paced-instructions)")
    if args.keep is not None and args.keep.is_dir() and any(args.keep.iterdir()):
        # A dump of an earlier run with the same name (pid, number) would be read as this one's.
        parser.error(f"--keep {args.keep}: not empty")
    specs: list[Spec] = []
    for i, spec in enumerate(args.tree):
        path, _, rest = spec.partition(":")
        workers, _, cont = rest.partition(":")
        # A tree given twice is an A/A control: each copy its own gateway and row.
        label = spec if args.tree.count(spec) == 1 else f"{spec} ({i + 1})"
        if path in PEERS and rest:
            parser.error(f"--tree {spec}: a peer runs as it is, without workers or continuation")
        tree: Path | str = path if path in PEERS else Path(path).resolve()
        specs.append((label, tree, int(workers or 1), (cont or args.continuation) == "on"))
    if args.mode in COUNTED:
        if any(isinstance(tree, str) for _, tree, _, _ in specs):
            parser.error(f"--mode {args.mode} counts Tokenlane's trees, not a peer")
        if any(workers != 1 for _, _, workers, _ in specs):
            parser.error(f"--mode {args.mode} counts one worker a tree")
        if args.requests < 1:
            parser.error("--requests must be at least 1")
        if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
            parser.error(f"--mode {args.mode} needs valgrind (apt-get install valgrind)")
        paced = args.mode != "instructions"
        results = run_counted(specs, args.rounds, args.requests, paced, args.keep)
    else:
        results = run(specs, args.mode, args.rounds, args.slice_s, args.prompt_tokens)
    columns = FIGURES[args.mode]
    first = specs[0][0]
    print(f"machine: {procs.machine()}")
    print(
        f"paired A/B, {args.mode}: {args.rounds} rounds, continuation {args.continuation} unless"
        f" the tree says; medians, and the median of paired differences from {first}"
        + (f"; a {args.prompt_tokens}-token prompt" if args.prompt_tokens else "")
    )
    print(f"{'tree':<28} | " + " | ".join(f"{name:>16}" for name, _, _ in columns))
    for spec, *_ in specs:
        mine, base = results[spec], results[first]
        cells = []
        for _, k, digits in columns:
            diff = statistics.median(a - b for a, b in zip(mine[k], base[k], strict=True))
            cells.append(f"{statistics.median(mine[k]):.{digits}f} ({diff:+.{digits}f})")
        print(f"{spec:<28} | " + " | ".join(f"{cell:>16}" for cell in cells))
    print(
        f"{'ratios, the same round':<28} | " + " | ".join(f"{name:>16}" for name, _, _ in columns)
    )
    for spec, *_ in specs[1:]:
        mine, base = results[spec], results[first]
        cells = [f"{paired_ratio(mine[k], base[k]):.3f}x" for _, k, _ in columns]
        print(f"{spec + ' / ' + first:<28} | " + " | ".join(f"{cell:>16}" for cell in cells))
    # How far the rounds agree: on this VM a ratio of 10 rounds moves by several per cent
    # from one run to the next, so a median alone would claim more than the rounds show.
    print_spans("middle half of the rounds", specs, results, columns, ratio_quartiles)
    # Where the median ratio lies, for this run's processes: a claim of "at or above" needs
    # the low end at or above 1 (needed, not enough: each gateway is one process for the
    # run, and two processes of one tree differ by a few per cent for their life).
    title = "95 % interval, median ratio" if args.rounds >= 6 else "range (under 6 rounds)"
    print_spans(title, specs, results, columns, lambda a, b: median_interval(_ratios(a, b)))
    return 0


def print_spans(
    title: str,
    specs: list[Spec],
    results: dict[str, dict[str, list[float]]],
    columns: Sequence[tuple[str, str, int]],
    span: Callable[[list[float], list[float]], tuple[float, float]],
) -> None:
    """A table of each later tree's span (``span`` of its figures and the first tree's, per
    column) against the first tree."""
    first = specs[0][0]
    print(f"{title:<28} | " + " | ".join(f"{name:>16}" for name, _, _ in columns))
    for spec, *_ in specs[1:]:
        mine, base = results[spec], results[first]
        cells = [
            f"{lo:.3f}-{hi:.3f}x" for lo, hi in (span(mine[k], base[k]) for _, k, _ in columns)
        ]
        print(f"{spec + ' / ' + first:<28} | " + " | ".join(f"{cell:>16}" for cell in cells))


def _ratios(mine: list[float], base: list[float]) -> list[float]:
    """Each round's ratio of ``mine`` to ``base`` (nan where a base is 0)."""
    return [a / b if b else float("nan") for a, b in zip(mine, base, strict=True)]


def paired_ratio(mine: list[float], base: list[float]) -> float:
    """The median of each round's ratio of ``mine`` to ``base``."""
    return statistics.median(_ratios(mine, base))


def ratio_quartiles(mine: list[float], base: list[float]) -> tuple[float, float]:
    """The first and third quartiles of the rounds' ratios of ``mine`` to ``base``: the
    middle half of the rounds lies between them (a single round: its ratio, twice)."""
    ratios = _ratios(mine, base)
    if len(ratios) < 2:
        return ratios[0], ratios[0]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return q1, q3


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """An interval that holds the median of ``values`` (nan left out) with ``confidence``,
    whatever their distribution: order statistics, as a table of them gives (24 values: the
    7th and 18th). Fewer than six values cannot reach 95 %: their least and greatest."""
    xs = sorted(v for v in values if not math.isnan(v))
    n = len(xs)
    if n == 0:
        return math.nan, math.nan
    # Leaving out k at each end, the median is outside when k or fewer values lie below it
    # (or above): a chance of P(Binomial(n, 1/2) <= k) at each end.
    tail = (1 - confidence) / 2
    k = 0
    below = 1 / 2**n  # P(B <= 0)
    while k < (n - 1) // 2:
        below += math.comb(n, k + 1) / 2**n  # P(B <= k + 1)
        if below > tail:
            break
        k += 1
    return xs[k], xs[n - 1 - k]


def run(
    specs: list[Spec], mode: str, rounds: int, slice_s: float, prompt_tokens: int = 0
) -> dict[str, dict[str, list[float]]]:
    """Every tree's gateway up at once over the same mocks; ``rounds`` alternated turns."""
    keys = [k for _, k, _ in FIGURES[mode]]
    results: dict[str, dict[str, list[float]]] = {s[0]: {k: [] for k in keys} for s in specs}
    interval_ms = 0 if mode == "burst" else 50
    with mock_processes(interval_ms) as (ports, pids), contextlib.ExitStack() as stack:
        mock_pids = tuple(pids)
        running: list[tuple[str, int, int]] = []
        for spec, tree, workers, continuation in specs:
            if isinstance(tree, str):
                gw = stack.enter_context(PEERS[tree](ports))
            else:
                gw = stack.enter_context(gateways.tokenlane(ports, workers, continuation, cwd=tree))
            running.append((spec, gw.port, gw.pid))
        for _, port, pid in running:  # warm-up: pools, caches, the first requests' imports
            asyncio.run(burst_run(port, 64, 1.0, pid) if mode == "burst" else _paced(port, pid))
            if mode == "burst":
                asyncio.run(burst_run(port, 1, 0.5, pid))
        for r in range(rounds):
            for spec, port, pid in _alternated(running, r):
                if mode == "paced":
                    figures = asyncio.run(_paced(port, pid))
                else:
                    many = asyncio.run(
                        burst_run(port, 64, slice_s, pid, prompt_tokens, mock_pids)
                    ).summary()
                    one = asyncio.run(burst_run(port, 1, slice_s, pid, prompt_tokens)).summary()
                    figures = {**many, "ttft_p50_ms": one["ttft_p50_ms"]}
                for k in keys:
                    results[spec][k].append(figures[k])
    return results


def callgrind_total(dump: str) -> int | None:
    """The instructions a callgrind dump counted: its ``totals:`` line, the dump's last, so
    None while it is being written (its ``summary:``, in the header, comes first)."""
    for line in reversed(dump.splitlines()):
        if line.startswith("totals:"):
            return int(line.split()[1])
    return None


def round_dumps(r: int) -> tuple[int, int]:
    """Round ``r``'s two dumps, as callgrind numbers a run's dumps (1, 2, ...): the one that
    opens it, thrown away, and the one it reads.

    The counters are reset by a dump, not by ``callgrind_control -z``: a dump after a zero
    read 1.7 times the instructions of a paced round (its ``totals`` 67.2 million against its
    ``summary``'s 39.6), while with dumps alone the two agree and a round twice as long counts
    twice (``docs/benchmarks.md``)."""
    return 2 * r + 1, 2 * r + 2


def run_counted(
    specs: list[Spec], rounds: int, requests: int, paced: bool = False, keep: Path | None = None
) -> dict[str, dict[str, list[float]]]:
    """Every tree's gateway under callgrind at once over the same mocks (burst, or paced);
    per round and tree, the counters reset (a dump), ``requests`` sent, the count dumped and read,
    divided by the requests (burst) or the chunks relayed (paced). The dumps go to ``keep``
    when given (``tree{i}.{pid}.{n}``, n callgrind's dump number: ``round_dumps``), else to a
    directory removed after."""
    key = FIGURES["paced-instructions" if paced else "instructions"][0][1]
    per = requests * PACED_CHUNKS if paced else requests
    results: dict[str, dict[str, list[float]]] = {s[0]: {key: []} for s in specs}
    with (
        tempfile.TemporaryDirectory() as scratch,
        mocks(50 if paced else 0) as ports,
        contextlib.ExitStack() as stack,
    ):
        # Absolute: callgrind runs in each tree's directory and would place a relative one there.
        tmp = (keep or Path(scratch)).resolve()
        tmp.mkdir(parents=True, exist_ok=True)
        running: list[tuple[str, int, int, Path]] = []
        for i, (spec, tree, _, continuation) in enumerate(specs):
            assert isinstance(tree, Path)  # ``main`` refuses a peer here
            out = tmp / f"tree{i}"
            wrap = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}.%p"]
            # Under valgrind the start (imports, the compiled build's load) takes a minute.
            # The replicas scraped once an hour, not each second: a scrape of the two mocks
            # runs about 1.6 million instructions under callgrind, which in a 13 s paced round
            # of 16 streams was half the count; it is the fleet's cost per second, not the
            # relay's per request.
            started = gateways.tokenlane(
                ports, 1, continuation, cwd=tree, wrap=wrap, ready_s=600, health_interval_s=3600
            )
            gw = stack.enter_context(started)
            running.append((spec, gw.port, gw.pid, out))
        for _, port, _, _ in running:  # warm-up: pools, caches, the first requests' imports
            asyncio.run(_sequential(port, 16 if paced else 200))
        for r in range(rounds):
            for spec, port, pid, out in _alternated(running, r):
                opening, counted = round_dumps(r)
                _control("-d", pid)
                _dumped(out.parent / f"{out.name}.{pid}.{opening}")
                asyncio.run(_sequential(port, requests))
                _control("-d", pid)
                total = _dumped(out.parent / f"{out.name}.{pid}.{counted}")
                results[spec][key].append(total / per)
    return results


def _control(flag: str, pid: int) -> None:
    """``callgrind_control FLAG PID``; it exits 0 when it found no such run, so its words are
    read too."""
    done = subprocess.run(
        ["callgrind_control", flag, str(pid)], capture_output=True, text=True, timeout=120
    )
    said = done.stdout + done.stderr
    if done.returncode or "Error" in said or "No active" in said or "not detected" in said:
        raise RuntimeError(f"callgrind_control {flag} {pid}: {said.strip()}")


def _dumped(path: Path, timeout_s: float = 120.0) -> int:
    """The count in the dump at ``path``, once callgrind has written it whole."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        total = callgrind_total(path.read_text(errors="replace")) if path.exists() else None
        if total is not None:
            return total
        time.sleep(0.05)
    raise TimeoutError(f"no callgrind dump at {path} after {timeout_s:g} s")


async def _sequential(port: int, requests: int, clients: int = 8) -> None:
    """``requests`` streamed chat requests from ``clients`` connections, each waiting for its
    answer before the next."""
    payload = stream_request(port, 0)
    conns = [await connect(port) for _ in range(clients)]

    async def one(conn: StreamClient, n: int) -> None:
        for _ in range(n):
            # An answer that is not a finished stream (an error with a length) never ends
            # ``send``: a loud failure rather than a hang.
            await asyncio.wait_for(conn.send(payload), timeout=60)

    share, extra = divmod(requests, clients)
    await asyncio.gather(*(one(c, share + (i < extra)) for i, c in enumerate(conns)))
    for c in conns:
        if c.transport is not None:
            c.transport.close()


async def _paced(port: int, pid: int) -> dict[str, float]:
    return await paced_run(port, 256, pid)


if __name__ == "__main__":
    raise SystemExit(main())
