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

Needs ``perf`` (``apt-get install linux-perf``); the figures are shares of samples, so they
do not drift with the machine as times do, but a symbol under 0.5 % is noise.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import uvloop

from . import gateways
from .bench_overhead import burst_run, mocks

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


def profile(continuation: bool, seconds: float, data: Path) -> dict[str, float]:
    """One gateway over fresh mocks, warmed, then sampled for ``seconds`` under the load."""
    with mocks(0) as ports, gateways.tokenlane(ports, 1, continuation) as gw:
        uvloop.run(burst_run(gw.port, CONCURRENCY, 1.0, gw.pid))  # connections and pools
        argv = ["perf", "record", "-q", "-F", "1999", "-p", str(gw.pid), "-o", str(data)]
        recorder = subprocess.Popen([*argv, "--", "sleep", str(seconds + 1.0)])
        time.sleep(0.5)  # perf attached before the load starts
        result = uvloop.run(burst_run(gw.port, CONCURRENCY, seconds, gw.pid))
        recorder.wait()
    return result.summary()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--continuation", choices=["on", "off", "both"], default="both")
    parser.add_argument("--top", type=int, default=30, help="symbols printed per run")
    args = parser.parse_args(argv)
    if shutil.which("perf") is None:
        print("perf is not installed (apt-get install linux-perf)", file=sys.stderr)
        return 2
    runs = {"on": [True], "off": [False], "both": [True, False]}[args.continuation]
    tables: list[tuple[str, dict[str, float], list[tuple[float, str]], dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for on in runs:
            data = Path(tmp) / f"perf.{'on' if on else 'off'}"
            load = profile(on, args.seconds, data)
            dso = {name: pct for pct, name in shares(data, "dso")}
            tables.append(("continuation " + ("on" if on else "off"), load,
                           shares(data, "sym"), dso))  # fmt: skip
    for title, load, syms, dso in tables:
        print(f"== {title}: {load['rps']:.0f} req/s at c={CONCURRENCY}, "
              f"{load['cpu_ms_per_req']:.3f} CPU ms/req (perf attached)")  # fmt: skip
        print("   by shared object (share, and that share of the CPU per request):")
        for name, pct in sorted(dso.items(), key=lambda kv: -kv[1])[:10]:
            print(f"   {pct:6.2f} %  {pct * load['cpu_ms_per_req'] * 10:6.1f} us/req  {name}")
        print(f"   top {args.top} symbols ([k] kernel, [.] user):")
        for pct, name in syms[: args.top]:
            print(f"   {pct:6.2f} %  {name}")
    if len(tables) == 2:
        # In time, not share points: each share times its run's CPU per request.
        (_, load_on, _, dso_on), (_, load_off, _, dso_off) = tables
        us_on = {n: p * load_on["cpu_ms_per_req"] * 10 for n, p in dso_on.items()}
        us_off = {n: p * load_off["cpu_ms_per_req"] * 10 for n, p in dso_off.items()}
        print("== CPU us per request by shared object, continuation on - off:")
        names = set(us_on) | set(us_off)
        for name in sorted(names, key=lambda n: -abs(us_on.get(n, 0) - us_off.get(n, 0))):
            delta = us_on.get(name, 0.0) - us_off.get(name, 0.0)
            if abs(delta) >= 0.3:
                print(f"   {delta:+6.1f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
