"""Functions timed where they run: inside a gateway relaying 256 paced streams.

``bench_parse`` times a function in a loop over one stream's data, hot. In the gateway the same
function runs once per stream in turn, between system calls, uvloop and httptools, and finds
its data and the interpreter's paths cold: the relay's token check measured 7.1 µs there
against 1.7-3.4 µs in ``bench_parse`` (``docs/benchmarks.md``). This benchmark starts the
overhead benchmark's fleet (two paced mocks, one gateway) with ``loadtest/inplace`` on the
gateway's PYTHONPATH, which wraps each named function with two clock readings
(``loadtest/inplace/sitecustomize.py``), runs paced streams through it and prints each
function's calls and per-call percentiles, beside the run's CPU per relayed chunk. The
wrapper's own cost, hot, is printed too; the percentiles include it. The gateway runs
interpreted (``TOKENLANE_INTERPRETED=1``): compiled functions cannot be wrapped.

    python -m loadtest.bench_inplace [--function module:Qualified.name ...]
        [--continuation on|off] [--streams 256] [--runs 2] [--tree PATH]

By default it times the token relay's per-chunk functions: ``Splice.take_token`` and the two
pump handlers (an eligible stream's, ``_TokenRelay``; a plain one's, ``_Relayed``). ``--tree``
runs the gateway from another source tree (a git worktree), to compare two builds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from .bench_overhead import fleet, paced_run

SITE = Path(__file__).parent / "inplace"
DEFAULT_FUNCTIONS = [
    "proxy.relay.continuation:Splice.take_token",
    "proxy.relay.resume:_TokenRelay.__call__",
    "proxy.relay.respond:_Relayed.__call__",
]


def measure(
    functions: list[str], continuation: bool, streams: int, runs: int, tree: Path | None
) -> tuple[list[float], dict[str, Any]]:
    """(CPU µs per relayed chunk of each run, the gateway's summary of the timed calls)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "inplace"
        env = {
            "PYTHONPATH": str(SITE),
            "TOKENLANE_INPLACE": json.dumps(functions),
            "TOKENLANE_INPLACE_OUT": str(out),
            # A compiled function (``proxy/compiled.py``) cannot be wrapped: the gateway runs
            # interpreted here, and its CPU per chunk is the interpreted build's.
            "TOKENLANE_INTERPRETED": "1",
        }
        cpu: list[float] = []
        with fleet(50, continuation, env=env, cwd=tree) as (_, gw_port, pid):
            asyncio.run(paced_run(gw_port, streams, pid))  # warm-up, timed too
            for _ in range(runs):
                cpu.append(asyncio.run(paced_run(gw_port, streams, pid))["cpu_us_per_chunk"])
        # The gateway wrote its summary at exit, when the fleet stopped it.
        summaries = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("inplace.*"))]
    if not summaries:
        raise SystemExit("the gateway wrote no timings (did it start with loadtest/inplace?)")
    return cpu, summaries[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--function", action="append", dest="functions")
    parser.add_argument("--continuation", choices=("on", "off"), default="on")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--tree", type=Path, default=None)
    args = parser.parse_args(argv)
    functions = args.functions or DEFAULT_FUNCTIONS
    cpu, summary = measure(functions, args.continuation == "on", args.streams, args.runs, args.tree)
    print(
        f"in place: {args.streams} paced streams, continuation {args.continuation}, "
        f"{args.runs} runs after a warm-up; CPU µs per relayed chunk "
        f"{' / '.join(f'{c:.1f}' for c in cpu)} (median {statistics.median(cpu):.1f})"
    )
    width = max(len(name) for name in functions)
    print(f"{'function':<{width}} | {'calls':>7} | {'p10':>6} | {'p50':>6} | {'p90':>6} | "
          f"{'p99':>6} | {'mean':>6}  (µs a call)")  # fmt: skip
    for name in functions:
        f = summary["functions"][name]
        print(
            f"{name:<{width}} | {f['calls']:>7} | {f['p10_us']:>6.2f} | {f['p50_us']:>6.2f} | "
            f"{f['p90_us']:>6.2f} | {f['p99_us']:>6.2f} | {f['mean_us']:>6.2f}"
        )
    print(f"(the wrapper's own cost, hot: {summary['overhead_us']:.2f} µs a call, included)")


if __name__ == "__main__":
    main()
