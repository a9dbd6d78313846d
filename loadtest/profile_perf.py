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

Needs ``perf`` (``apt-get install linux-perf``). The shares drift less with the machine than
times do; the µs (a share times the run's CPU per request) drift as that CPU does. A symbol
under 0.5 % is noise.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import uvloop

from . import gateways
from .bench_overhead import burst_run, mocks
from .bench_segments import perf_command, recording

CONCURRENCY = 64


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


@dataclass(frozen=True)
class Profile:
    title: str
    rps: float
    cpu_ms_per_req: float
    symbols: list[tuple[float, str]]  # (share %, symbol), largest first
    objects: dict[str, float]  # shared object: share %

    def us_per_req(self, share: float) -> float:
        return share * self.cpu_ms_per_req * 10  # % of the ms a request costs, in µs


def profile(continuation: bool, seconds: float, data: Path) -> Profile:
    """One gateway over fresh mocks, warmed, then sampled for ``seconds`` under the load."""
    with mocks(0) as ports, gateways.tokenlane(ports, 1, continuation) as gw:
        uvloop.run(burst_run(gw.port, CONCURRENCY, 1.0, gw.pid))  # connections and pools
        with recording(gw.pid, data, ("-F", "1999")):
            load = uvloop.run(burst_run(gw.port, CONCURRENCY, seconds, gw.pid)).summary()
    return Profile(
        "continuation " + ("on" if continuation else "off"),
        load["rps"],
        load["cpu_ms_per_req"],
        shares(data, "sym"),
        {name: pct for pct, name in shares(data, "dso")},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--continuation", choices=["on", "off", "both"], default="both")
    parser.add_argument("--top", type=int, default=30, help="symbols printed per run")
    args = parser.parse_args(argv)
    if perf_command() is None:
        print("perf is not installed (apt-get install linux-perf)", file=sys.stderr)
        return 2
    runs = {"on": [True], "off": [False], "both": [True, False]}[args.continuation]
    with tempfile.TemporaryDirectory() as tmp:
        profiles = [profile(on, args.seconds, Path(tmp) / f"perf.{on}") for on in runs]
    for p in profiles:
        print(f"== {p.title}: {p.rps:.0f} req/s at c={CONCURRENCY}, "
              f"{p.cpu_ms_per_req:.3f} CPU ms/req (perf attached)")  # fmt: skip
        print("   by shared object (share, and that share of the CPU per request):")
        for name, pct in sorted(p.objects.items(), key=lambda kv: -kv[1])[:10]:
            print(f"   {pct:6.2f} %  {p.us_per_req(pct):6.1f} us/req  {name}")
        print(f"   top {args.top} symbols ([k] kernel, [.] user):")
        for pct, name in p.symbols[: args.top]:
            print(f"   {pct:6.2f} %  {name}")
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
