"""Where the gateway's time goes, sampled: ``perf`` over one gateway under the burst load.

Callgrind (``bench_ab --mode instructions``) counts instructions, which is steady enough to
see a change of 1 %, but it is not time: it counts a ``rep movsb`` copy once per byte, so a
copy of a 16 kB body reads as 16,000 instructions where the CPU spends well under a
microsecond, and it does not see the kernel. This samples the gateway's process with
``perf record`` (CPU clock, every thread, kernel included) while the overhead benchmark's
generator holds 64 burst streams on it over the same two mocks, and prints the shares of
its CPU by shared object and the top symbols: what a lever is worth in time before it is
pulled. With ``--continuation both`` the two runs are printed side by side.

    python -m loadtest.profile_perf [--seconds 10] [--continuation on|off|both] [--top 30]
        [--workers N] [--stacks] [--gateway tokenlane|vllm-router] [--syscalls]

``--stacks`` records call stacks too (``--call-graph dwarf``, at a lower rate: each sample
copies 16 kB of stack) and prints the gateway's compiled functions by inclusive share: the
samples whose stack holds the function, whatever it called (a function's own share misses
what it spends in libpython and the kernel). ``--workers N`` samples a gateway of N workers
(every process of it): on a machine whose cores it shares with the mocks and the generator,
compare the shares by shared object to one worker's to tell more work from the same work
done slower. ``--gateway vllm-router`` samples the Rust peer under the same load instead
(``--continuation`` and ``--workers`` do not apply to it). ``--syscalls`` counts the
system calls a request costs, by name (``perf trace -s`` of a recording of every thread of
the gateway, in a run of its own after the sampled one): a system call is a switch into the
kernel, and on loopback a send also runs the receiver's side of TCP and its wake-up in the
sender's time.

Needs ``perf`` (``apt-get install linux-perf``). The shares drift less with the machine than
times do; the µs (a share times the run's CPU per request) drift as that CPU does. A symbol
under 0.5 % is noise.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast

import uvloop

from . import gateways
from .bench_overhead import burst_run, mocks
from .bench_segments import perf_command, recording

CONCURRENCY = 64
Gateway = Literal["tokenlane", "vllm-router"]


def shares(data: Path, key: str) -> list[tuple[float, str]]:
    """``perf report``'s flat shares of samples by ``key`` (``dso`` or ``sym``), largest first."""
    text = subprocess.run(
        ["perf", "report", "-i", str(data), "--stdio", "--no-children", "-g", "none",
         "--sort", key],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rows = []
    for line in text.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[0].endswith("%"):
            rows.append((float(parts[0][:-1]), parts[1].strip()))
    return rows


def stack_samples(script: str) -> list[list[str]]:
    """``perf script -F ip,sym``'s samples, each its stack's symbols, the sampled one first
    (an inlined frame by its own name)."""
    samples: list[list[str]] = []
    stack: list[str] = []
    for line in script.splitlines():
        parts = line.split(None, 1)
        if not parts:  # a blank line ends a sample
            if stack:
                samples.append(stack)
            stack = []
        elif len(parts) == 2:
            stack.append(parts[1].removesuffix(" (inlined)").strip())
    if stack:
        samples.append(stack)
    return samples


# mypyc's names for a compiled function and for an async function's generator body.
_COMPILED = "CPyDef_"
_GENERATOR = "_gen_____mypyc_generator_helper__"


def inclusive_shares(samples: list[list[str]]) -> list[tuple[float, str]]:
    """Each compiled gateway function's inclusive share of ``samples`` (%, every sample with
    it anywhere on its stack counted once), largest first, by its module and name."""
    counts: Counter[str] = Counter()
    for stack in samples:
        counts.update({f for f in stack if f.startswith(_COMPILED) and not f.endswith("_clear")})
    n = len(samples) or 1
    rows = [(100 * c / n, f[len(_COMPILED) :].removesuffix(_GENERATOR)) for f, c in counts.items()]
    return sorted(rows, key=lambda r: (-r[0], r[1]))


def stack_shares(data: Path) -> list[tuple[float, str]]:
    text = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "ip,sym", "--no-demangle"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return inclusive_shares(stack_samples(text))


def trace_counts(summary: str) -> Counter[str]:
    """The calls by system call name in ``perf trace -s``'s summary, summed over its threads
    (a table a thread, its rows ``name calls errors total min avg max stddev``)."""
    counts: Counter[str] = Counter()
    for line in summary.splitlines():
        parts = line.split()
        if len(parts) == 8 and parts[1].isdigit() and parts[2].isdigit():
            counts[parts[0]] += int(parts[1])
    return counts


def syscall_summary(data: Path) -> str:
    """``perf trace -s``'s summary of a recording of system calls (``recording``'s default);
    perf prints it on its standard error."""
    done = subprocess.run(
        ["perf", "trace", "-i", str(data), "-s"], capture_output=True, text=True, check=True
    )
    return done.stdout + done.stderr


@dataclass(frozen=True)
class Profile:
    title: str
    rps: float
    cpu_ms_per_req: float
    symbols: list[tuple[float, str]]  # (share %, symbol), largest first
    objects: dict[str, float]  # shared object: share %
    inclusive: list[tuple[float, str]] = field(default_factory=list)  # with --stacks
    syscalls: dict[str, float] = field(default_factory=dict)  # with --syscalls: calls a request

    def us_per_req(self, share: float) -> float:
        return share * self.cpu_ms_per_req * 10  # % of the ms a request costs, in µs


def profile(
    continuation: bool,
    seconds: float,
    data: Path,
    workers: int = 1,
    stacks: bool = False,
    gateway: Gateway = "tokenlane",
    syscalls: bool = False,
) -> Profile:
    """One gateway over fresh mocks, warmed, then sampled for ``seconds`` under the load (and,
    with ``syscalls``, traced for as long again: the calls of that run's connections and first
    requests are counted in, about 0.1 % of a 6-second run's requests)."""
    what = ("-F", "499", "--call-graph", "dwarf,16384") if stacks else ("-F", "1999")
    peer = gateway != "tokenlane"
    with (
        mocks(0) as ports,
        (
            gateways.vllm_router(ports)
            if peer
            else gateways.tokenlane(ports, workers, continuation)
        ) as gw,
    ):
        uvloop.run(burst_run(gw.port, CONCURRENCY, 1.0, gw.pid))  # connections and pools
        with recording(gw.pid, data, what):
            load = uvloop.run(burst_run(gw.port, CONCURRENCY, seconds, gw.pid)).summary()
        per_request: dict[str, float] = {}
        if syscalls:
            # A file of its own a run: ``recording`` waits for perf to write one.
            calls = data.with_name(data.name + ".syscalls")
            with recording(gw.pid, calls):  # every system call's entry and exit
                traced = uvloop.run(burst_run(gw.port, CONCURRENCY, seconds, gw.pid))
            counts = trace_counts(syscall_summary(calls))
            if not counts:
                print("perf trace -s printed no rows this reads", file=sys.stderr)
            if traced.requests:
                per_request = {k: v / traced.requests for k, v in counts.items()}
    title = gateway if peer else "continuation " + ("on" if continuation else "off")
    return Profile(
        title if workers == 1 or peer else f"{title}, {workers} workers",
        load["rps"],
        load["cpu_ms_per_req"],
        shares(data, "sym"),
        {name: pct for pct, name in shares(data, "dso")},
        stack_shares(data) if stacks else [],
        per_request,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--continuation", choices=["on", "off", "both"], default=None)
    parser.add_argument("--top", type=int, default=30, help="symbols printed per run")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--stacks", action="store_true", help="inclusive shares, by call stack")
    parser.add_argument("--gateway", choices=["tokenlane", "vllm-router"], default="tokenlane")
    parser.add_argument("--syscalls", action="store_true", help="system calls a request, by name")
    args = parser.parse_args(argv)
    if args.gateway != "tokenlane" and (args.continuation or args.workers != 1):
        parser.error(f"--gateway {args.gateway}: a peer runs as it is, without workers or"
                     " continuation")  # fmt: skip
    if perf_command() is None:
        print("perf is not installed (apt-get install linux-perf)", file=sys.stderr)
        return 2
    both = {"on": [True], "off": [False], "both": [True, False]}[args.continuation or "both"]
    runs = both if args.gateway == "tokenlane" else [True]  # the peer: one run
    with tempfile.TemporaryDirectory() as tmp:
        profiles = [
            profile(
                on,
                args.seconds,
                Path(tmp) / f"perf.{on}",
                args.workers,
                args.stacks,
                cast(Gateway, args.gateway),
                args.syscalls,
            )
            for on in runs
        ]
    for p in profiles:
        print(f"== {p.title}: {p.rps:.0f} req/s at c={CONCURRENCY}, "
              f"{p.cpu_ms_per_req:.3f} CPU ms/req (perf attached)")  # fmt: skip
        print("   by shared object (share, and that share of the CPU per request):")
        for name, pct in sorted(p.objects.items(), key=lambda kv: -kv[1])[:10]:
            print(f"   {pct:6.2f} %  {p.us_per_req(pct):6.1f} us/req  {name}")
        print(f"   top {args.top} symbols ([k] kernel, [.] user):")
        for pct, name in p.symbols[: args.top]:
            print(f"   {pct:6.2f} %  {name}")
        if p.inclusive:
            print(f"   top {args.top} compiled functions by inclusive share (what they called"
                  " included):")  # fmt: skip
            for pct, name in p.inclusive[: args.top]:
                print(f"   {pct:6.2f} %  {name}")
        if p.syscalls:
            total = sum(p.syscalls.values())
            print(f"   system calls a request: {total:.2f} (a traced run of its own)")
            for name, n in sorted(p.syscalls.items(), key=lambda kv: -kv[1]):
                if n >= 0.01:
                    print(f"   {n:8.2f}  {name}")
    if len(profiles) == 2:
        on, off = profiles
        print("== CPU us per request by shared object, continuation on - off:")
        delta = {
            name: on.us_per_req(on.objects.get(name, 0.0))
            - off.us_per_req(off.objects.get(name, 0.0))
            for name in on.objects.keys() | off.objects.keys()
        }
        for name, us in sorted(delta.items(), key=lambda kv: -abs(kv[1])):
            if abs(us) >= 0.3:
                print(f"   {us:+6.1f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
