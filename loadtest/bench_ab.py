"""Paired before/after: Tokenlane from two or more source trees over the same mocks, alternated.

On the 2-core machine the same build measures up to 2x apart from one minute to the next (see
``docs/benchmarks.md``): two runs made one after the other compare the machine's minutes as
much as the builds. Here every gateway runs at once over the same two burst mocks, and the
load alternates between them in short slices, in turn order A B, B A, ...; each slice of one
gateway is paired with the same round's slice of the first, and the median of those paired
differences is printed beside each gateway's medians. A tree is a git worktree
(``git worktree add /tmp/before <commit>``), each run with its own sources by this project's
virtualenv.

    python -m loadtest.bench_ab --tree /tmp/before --tree . [--tree .:2] [--rounds 10]
        [--slice-s 1.5] [--continuation on|off]

``TREE:N`` runs that tree with N workers. Per slice: CPU ms per request and req/s at
concurrency 64, TTFT p50 in ms at concurrency 1 (absolute: every gateway has the same mocks).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from . import gateways
from .bench_overhead import burst_run, mocks
from .procs import free_port, wait_http

FIGURES = ("cpu_ms_per_req", "rps", "ttft_p50_ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", action="append", required=True, help="PATH or PATH:WORKERS")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--slice-s", type=float, default=1.5)
    parser.add_argument("--continuation", choices=("on", "off"), default="on")
    args = parser.parse_args(argv)
    specs: list[tuple[str, Path, int]] = []
    for spec in args.tree:
        path, _, workers = spec.partition(":")
        specs.append((spec, Path(path).resolve(), int(workers or 1)))
    results = run(specs, args.rounds, args.slice_s, args.continuation == "on")
    first = specs[0][0]
    print(
        f"paired A/B: {args.rounds} rounds of {args.slice_s:g}s slices, continuation"
        f" {args.continuation}; medians, and the median of paired differences from {first}"
    )
    print(f"{'tree':<28} | {'CPU ms/req c=64':>16} | {'req/s c=64':>12} | {'TTFT p50 c=1':>14}")
    for spec, _, _ in specs:
        mine, base = results[spec], results[first]
        cells = []
        for k, digits in zip(FIGURES, (3, 0, 2), strict=True):
            diff = statistics.median(a - b for a, b in zip(mine[k], base[k], strict=True))
            cells.append(f"{statistics.median(mine[k]):.{digits}f} ({diff:+.{digits}f})")
        print(f"{spec:<28} | {cells[0]:>16} | {cells[1]:>12} | {cells[2]:>14}")
    return 0


def run(
    specs: list[tuple[str, Path, int]], rounds: int, slice_s: float, continuation: bool
) -> dict[str, dict[str, list[float]]]:
    """Every tree's gateway up at once over the same mocks; ``rounds`` alternated slices."""
    results: dict[str, dict[str, list[float]]] = {s[0]: {k: [] for k in FIGURES} for s in specs}
    with mocks(0) as ports, tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        running: list[tuple[str, int, int]] = []
        for i, (spec, tree, workers) in enumerate(specs):
            port = free_port()
            policy = gateways.tokenlane_policy(port, ports, workers)
            policy["continuation"] = {"enabled": continuation}
            path = Path(tmp) / f"policy-{i}.yaml"
            path.write_text(yaml.safe_dump(policy))
            log = stack.enter_context((Path(tmp) / f"gateway-{i}.log").open("w"))
            argv = [sys.executable, "-m", "proxy", "serve", "--config", str(path)]
            gw = subprocess.Popen(
                [*argv, "--log-level", "info"], cwd=tree, stdout=log, stderr=subprocess.STDOUT
            )
            stack.callback(_stop, gw)
            wait_http(f"http://127.0.0.1:{port}/ready")
            running.append((spec, port, gw.pid))
        for _, port, pid in running:  # warm-up: pools, caches, the first requests' imports
            asyncio.run(burst_run(port, 64, 1.0, pid))
            asyncio.run(burst_run(port, 1, 0.5, pid))
        for r in range(rounds):
            for spec, port, pid in running if r % 2 == 0 else running[::-1]:
                many = asyncio.run(burst_run(port, 64, slice_s, pid)).summary()
                one = asyncio.run(burst_run(port, 1, slice_s, pid)).summary()
                results[spec]["cpu_ms_per_req"].append(many["cpu_ms_per_req"])
                results[spec]["rps"].append(many["rps"])
                results[spec]["ttft_p50_ms"].append(one["ttft_p50_ms"])
    return results


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    raise SystemExit(main())
