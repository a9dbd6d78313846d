"""Head-of-line report (issue 3): the trace of vLLM issue #37308 against one simulated fleet,
three ways, with chunked prefill off and on.

    python -m loadtest.hol_report [--rounds 50] [--out DIR] [--plot docs/hol_37308.png]

For each chunked-prefill setting one fleet of simulated replicas (``python -m loadtest.sim``
processes, all with the same settings) serves, in rounds that interleave the setups in a
shuffled order, so that a noisy machine hurts every setup alike:

- ``single``: the whole trace straight to one replica (what the issue reported);
- ``round_robin``: through a gateway with one pool balanced round robin and one lane;
- ``lanes``: through a gateway with Tokenlane lanes: short streaming requests to an
  interactive pool of one replica, the rest to a bulk pool of the others (prefix affinity);
- ``idle`` / ``idle_gateway``: one light request alone on an idle replica, direct and through
  the lanes gateway. The direct one's median is *the* idle TTFT the target is stated against.

Every round starts on an idle fleet (nothing running or waiting on any replica, nothing in
flight in a gateway) and sends fresh prompt text behind the trace's shared 32-token prefix,
so prefix caching helps as much as it would help real traffic and no more. By default a round
ends once both light requests have finished: the heavy ones still running are cut (their
connections close, the replicas abort them). Nothing after that can change a light request's
TTFT, and waiting for a 512-token decode would triple the runtime; ``--full-rounds`` waits.

Length: one benchmark from the fleet's set-up to the report and plot; none of its parts is used
elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from .client import LoadClient
from .procs import ProcessExitedError, await_http, free_port, spawn, stop
from .runner import _run_loop, run_trace
from .sim.settings import DEFAULT_MODEL, SimSettings
from .sim.supervisor import SimSpec, Supervisor
from .stats import PENDING, RequestResult, percentile
from .workload import TraceRequest, load_trace

TRACE = Path(__file__).with_name("traces") / "hol_37308.yaml"
DEFAULT_PLOT = Path("docs/hol_37308.png")
LIGHT = "light"
TARGET_RATIO = 1.5  # issue 3: through lanes, light TTFT p99 <= 1.5 x idle
SETTLE_S = 0.05  # after the fleet is idle, so the last round's teardown is not in the next
SETUPS = {
    "single": "(a) one replica, direct",
    "round_robin": "(b) round robin, gateway",
    "lanes": "(c) Tokenlane lanes, gateway",
}
ADMIN_FIELDS = ("pool", "name", "state", "reason", "ejections")  # kept from /admin/replicas
IDLE = {"idle": "idle: light alone, direct", "idle_gateway": "idle: light alone, via gateway"}
# Settings that differ from the simulator's defaults (Qwen2.5-0.5B on one L4; the issue's
# server had prefix caching, which is also vLLM V1's default).
SIM_CHANGES: dict[str, Any] = {"enable_prefix_caching": True, "request_log_size": 100}


class HolReportError(RuntimeError):
    """The fleet did not start or did not come back to idle; the message says which part."""


# ----------------------------------------------------------------------------- what runs


def sim_settings(chunked_prefill: bool) -> SimSettings:
    return SimSettings().replace(enable_chunked_prefill=chunked_prefill, **SIM_CHANGES)


def sim_flags(settings: SimSettings) -> list[str]:
    """``tokenlane sim`` flags for every setting that differs from the defaults."""
    flags: list[str] = []
    for f in dataclasses.fields(SimSettings):
        value = getattr(settings, f.name)
        if f.name in ("name", "models") or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def settings_json(settings: SimSettings) -> dict[str, Any]:
    """The engine settings that decide the result, with the effective step budget."""
    keep = ("enable_chunked_prefill", "enable_prefix_caching", "max_num_seqs",
            "long_prefill_token_threshold", "scheduling_policy", "step_fixed_s",
            "decode_per_seq_s", "prefill_per_token_s", "request_overhead_s")  # fmt: skip
    return {"max_num_batched_tokens": settings.batched_tokens} | {
        k: getattr(settings, k) for k in keep
    }


def _replicas(urls: Sequence[str]) -> list[dict[str, str]]:
    return [{"url": u, "name": f"sim{i}"} for i, u in enumerate(urls)]


def round_robin_policy(urls: Sequence[str], port: int) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": port},
        "pools": {"fleet": {"balance": "round_robin", "replicas": _replicas(urls)}},
        "lanes": [{"name": "all", "pool": "fleet"}],
    }


def lanes_policy(urls: Sequence[str], port: int) -> dict[str, Any]:
    """One interactive replica for short streams; the others, with prefix affinity, for the
    rest. The replicas are the same processes (same engine settings) as in the other setups."""
    replicas = _replicas(urls)
    return {
        "server": {"host": "127.0.0.1", "port": port},
        "pools": {
            "interactive": {"balance": "least_loaded", "replicas": replicas[:1]},
            "bulk": {"balance": "prefix_affinity", "replicas": replicas[1:]},
        },
        "lanes": [
            {"name": "short", "pool": "interactive",
             "when": {"stream": True, "prompt_tokens_max": 512}},
            {"name": "long", "pool": "bulk"},
        ],
    }  # fmt: skip


def idle_requests(trace: Sequence[TraceRequest]) -> list[TraceRequest]:
    """Each light row of the trace on its own, sent at once."""
    return [dataclasses.replace(r, at_ms=0.0) for r in trace if r.cls == LIGHT]


def lights_done(results: Sequence[RequestResult]) -> bool:
    return all(r.outcome != PENDING for r in results if r.cls == LIGHT)


# ----------------------------------------------------------------------------- summaries


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


def _pct(values: Sequence[float], *qs: int) -> dict[str, float | None]:
    return {f"p{q}": _ms(percentile(values, q)) for q in qs}


def summarize_lights(results: Sequence[RequestResult]) -> dict[str, Any]:
    """Light TTFTs of one setup over all its rounds, and where the light requests went."""
    lights = [r for r in results if r.cls == LIGHT]
    ttfts = sorted(r.ttft_s for r in lights if r.ok and r.ttft_s is not None)
    slo = [r.met_slo for r in lights if r.ttft_slo_s is not None]
    return {
        "n": len(lights),
        "failed": sum(1 for r in lights if not r.ok),
        "errors": sorted({r.error for r in lights if r.error})[:5],
        "ttft_ms": _pct(ttfts, 50, 99) | {"max": _ms(ttfts[-1] if ttfts else None)},
        "slo_met": sum(slo) / len(slo) if slo else None,
        # The two light rows (told apart by max_tokens): the later one may queue behind.
        "by_max_tokens": {
            str(m): _pct([r.ttft_s for r in lights if r.max_tokens == m and r.ttft_s], 50, 99)
            for m in sorted({r.max_tokens for r in lights})
        },
        "heavy_ttft_ms": _pct([r.ttft_s for r in results if r.cls != LIGHT and r.ttft_s], 50),
        "replicas": dict(Counter(r.headers.get("x-tokenlane-replica", "direct") for r in lights)),
        "samples_ms": [_ms(t) for t in ttfts],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 2)


def judge(run: Mapping[str, Any]) -> dict[str, Any]:
    """Each setup's light p50/p99 over the idle TTFT (the direct idle median), the target,
    and the idle run's own p99 over its median: the tail the machine adds with no load."""
    idle = run["idle"]["ttft_ms"]
    ratios = {
        k: {q: _ratio(s["ttft_ms"][q], idle["p50"]) for q in ("p50", "p99")}
        for k, s in run["setups"].items()
    }
    lanes_p99 = ratios.get("lanes", {}).get("p99")
    return {
        "idle_ms": idle["p50"],
        "ratios": ratios,
        "idle_p99_ratio": _ratio(idle["p99"], idle["p50"]),
        "target_met": None if lanes_p99 is None else lanes_p99 <= TARGET_RATIO,
    }


def _fmt(value: float | None, suffix: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:.0f}{suffix}" if value >= 100 else f"{value:.1f}{suffix}"


def markdown_table(report: Mapping[str, Any]) -> str:
    """Light TTFT per chunked-prefill setting and setup, against the idle TTFT."""
    lines = [
        "| chunked prefill | setup | light TTFT p50 (ms) | p99 (ms) | max (ms) "
        "| p50 / idle | p99 / idle | within 97 ms | failed |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for run in report["runs"]:
        rows: list[tuple[str, Any, Any]] = [(IDLE[k], run[k], {}) for k in IDLE if run[k]["n"]]
        rows += [(SETUPS[k], s, run["verdict"]["ratios"][k]) for k, s in run["setups"].items()]
        for label, s, ratio in rows:
            t = s["ttft_ms"]
            slo = "-" if s["slo_met"] is None else f"{s['slo_met'] * 100:.0f}%"
            lines.append(
                f"| {'on' if run['chunked_prefill'] else 'off'} | {label} | {_fmt(t['p50'])} "
                f"| {_fmt(t['p99'])} | {_fmt(t['max'])} | {_fmt(ratio.get('p50'), 'x')} "
                f"| {_fmt(ratio.get('p99'), 'x')} | {slo} | {s['failed']}/{s['n']} |"
            )
    return "\n".join(lines)


def notes(report: Mapping[str, Any]) -> list[str]:
    """The simulator settings of each run and the verdict on the target."""
    out = []
    for run in report["runs"]:
        name = f"chunked prefill {'on' if run['chunked_prefill'] else 'off'}"
        s, v = run["sim_settings"], run["verdict"]
        out.append(f"{name}: " + ", ".join(f"{k}={x}" for k, x in s.items()))
        met = {True: "met", False: "NOT met", None: "not measured"}[v["target_met"]]
        out.append(
            f"{name}: lanes light TTFT p99 = {_fmt(v['ratios'].get('lanes', {}).get('p99'), 'x')}"
            f" idle ({_fmt(v['idle_ms'])} ms): target <= {TARGET_RATIO}x {met}; idle's own"
            f" p99 is {_fmt(v['idle_p99_ratio'], 'x')} its median"
        )
    return out


# ----------------------------------------------------------------------------- processes


@contextlib.asynccontextmanager
async def gateway(
    policy: dict[str, Any], workdir: Path, http: httpx.AsyncClient
) -> AsyncIterator[str]:
    """``python -m proxy serve`` with ``policy``, as ``make run`` runs it; yields its URL."""
    name = "-".join(policy["pools"])
    path = workdir / f"policy-{name}.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    argv = [sys.executable, "-m", "proxy", "serve", "--config", str(path), "--log-level", "warning"]
    proc = spawn(argv, log=workdir / f"gateway-{name}.log")
    url = f"http://127.0.0.1:{policy['server']['port']}"
    try:
        try:
            await await_http(http, url + "/ready", 60, proc=proc)
        except (TimeoutError, ProcessExitedError) as exc:
            raise HolReportError(f"gateway {name} did not become ready (see its log)") from exc
        yield url
    finally:
        await asyncio.to_thread(stop, proc, 10)


async def wait_idle(
    http: httpx.AsyncClient, sims: Sequence[str], gateways: Sequence[str], timeout_s: float = 60
) -> float:
    """Wait until no replica runs or queues a request and no gateway has one in flight;
    return how long that took."""
    started = time.monotonic()
    while True:
        busy = []
        for url in sims:
            s = (await http.get(url + "/sim/stats")).json()
            busy += [url] if s["running"] or s["waiting"] else []
        for url in gateways:
            rows = (await http.get(url + "/admin/replicas")).json()["replicas"]
            busy += [f"{url} {r['name']}" for r in rows if r["in_flight"]]
        if not busy:
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise HolReportError(f"still busy after {timeout_s:.0f}s: {', '.join(busy)}")
        await asyncio.sleep(0.005)


# ----------------------------------------------------------------------------- measuring


async def measure_fleet(
    args: argparse.Namespace, chunked: bool, trace: Sequence[TraceRequest], workdir: Path
) -> dict[str, Any]:
    """Start a fleet with one chunked-prefill setting, run every setup on it, stop it."""
    settings = sim_settings(chunked)
    flags = ["--port", "0", *sim_flags(settings)]
    with (workdir / "sims.log").open("ab") as log:
        supervisor = Supervisor([SimSpec(f"sim{i}", flags) for i in range(args.replicas)],
                                stderr=log)  # fmt: skip
        try:
            urls = list((await supervisor.astart()).values())
        except RuntimeError as exc:
            raise HolReportError(f"simulators: {exc}") from exc
        try:
            run = await _rounds(args, chunked, trace, urls, workdir)
        finally:
            await supervisor.astop()
    run |= {"sim_settings": settings_json(settings), "sim_flags": flags[2:]}
    run["verdict"] = judge(run)
    return run


async def _rounds(
    args: argparse.Namespace,
    chunked: bool,
    trace: Sequence[TraceRequest],
    urls: list[str],
    workdir: Path,
) -> dict[str, Any]:
    rng = random.Random(f"{args.seed}:{chunked}")
    policies = {"round_robin": round_robin_policy(urls, free_port()),
                "lanes": lanes_policy(urls, free_port())}  # fmt: skip
    for policy in policies.values():
        if args.health_interval_s is not None:
            policy["health"] = {"interval_s": args.health_interval_s}
    wanted = [k for k in policies if k in args.setups]
    kinds = [k for k in (*IDLE, *args.setups) if k != "idle_gateway" or "lanes" in wanted]
    idle_rows = idle_requests(trace)
    results: dict[str, list[RequestResult]] = {k: [] for k in (*IDLE, *args.setups)}
    waited: list[float] = []
    log: list[dict[str, list[float | None]]] = []  # per round and kind: light TTFTs, ms
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=10))
        gateways = {k: await stack.enter_async_context(gateway(policies[k], workdir, http))
                    for k in wanted}  # fmt: skip
        targets = {"single": urls[0], "idle": urls[0], **gateways}
        targets["idle_gateway"] = gateways.get("lanes", urls[0])
        clients = {url: await stack.enter_async_context(LoadClient(url, timeout_s=60))
                   for url in set(targets.values())}  # fmt: skip
        for n in range(args.warmup + args.rounds):
            rng.shuffle(kinds)  # no setup always runs right after another
            this_round: dict[str, list[float | None]] = {}
            for kind in kinds:
                waited.append(await wait_idle(http, urls, list(gateways.values())))
                await asyncio.sleep(SETTLE_S)
                # Idle: one light request alone, the light rows taking turns.
                rows = [idle_rows[n % len(idle_rows)]] if kind in IDLE else trace
                client = clients[targets[kind]]
                got = await run_trace(
                    client.base_url, rows, model=DEFAULT_MODEL, client=client,
                    prompt_seed=rng.randrange(2**31),
                    stop_when=None if args.full_rounds else lights_done,
                )  # fmt: skip
                results[kind] += got if n >= args.warmup else []
                this_round[kind] = [_ms(r.ttft_s) for r in got if r.cls == LIGHT]
            log += [this_round] if n >= args.warmup else []
            print(f"\r  chunked prefill {'on' if chunked else 'off'}: round {n + 1}/"
                  f"{args.warmup + args.rounds}", end="", file=sys.stderr, flush=True)  # fmt: skip
        print(file=sys.stderr)
        ends = {k: (await http.get(u + "/admin/replicas")).json()["replicas"]
                for k, u in gateways.items()}  # fmt: skip
    return {
        "chunked_prefill": chunked,
        "policies": {k: policies[k] for k in wanted},
        **{k: summarize_lights(results[k]) for k in IDLE},
        "setups": {k: summarize_lights(results[k]) for k in args.setups},
        "gateway_replicas_at_end": {
            k: [{f: r.get(f) for f in ADMIN_FIELDS} for r in rows] for k, rows in ends.items()
        },
        "wait_for_idle_ms": _pct(waited, 50, 100),
        "rounds": log,
    }


async def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    trace = load_trace(args.trace)
    if not any(r.cls == LIGHT for r in trace):
        raise HolReportError(f"{args.trace} has no '{LIGHT}' requests")
    started, load_before = time.monotonic(), os.getloadavg()
    runs = [await measure_fleet(args, c, trace, workdir) for c in args.chunked]
    return {
        "tool": "loadtest.hol_report",
        "trace": str(args.trace),
        "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        **{
            k: getattr(args, k)
            for k in ("rounds", "warmup", "replicas", "full_rounds", "seed", "health_interval_s")
        },
        "target": f"lanes light TTFT p99 <= {TARGET_RATIO} x idle light TTFT p50 (direct)",
        "runs": runs,
        "runtime_s": round(time.monotonic() - started, 1),
        "cpus": os.cpu_count(),
        "loadavg_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
    }


# ----------------------------------------------------------------------------- plot

Y_TICKS_MS = (5, 10, 20, 30, 50, 100, 200, 300, 500, 1000, 2000, 5000, 10_000)


def plot_report(report: Mapping[str, Any], path: Path) -> Path:
    """One panel per chunked-prefill setting: every light TTFT per setup (dots), p50 and p99
    (bars), the idle TTFT, the 1.5x target and the 97 ms objective; log scale."""
    from matplotlib import ticker
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = report["runs"]
    fig = Figure(figsize=(5.0 * len(runs) + 1, 5.0), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(runs), sharey=True, squeeze=False)[0]
    jitter = random.Random(0)
    for ax, run in zip(axes, runs, strict=True):
        kinds = [run["idle"], *run["setups"].values()]
        for x, s in enumerate(kinds):
            pts = s["samples_ms"]
            ax.scatter([x + jitter.uniform(-0.18, 0.18) for _ in pts], pts, s=7, alpha=0.35)
            for q, style in (("p50", "-"), ("p99", "--")):
                if s["ttft_ms"][q] is not None:
                    ax.hlines(s["ttft_ms"][q], x - 0.3, x + 0.3, colors="k", linestyles=style)
        idle = run["verdict"]["idle_ms"]
        if idle:
            ax.axhline(idle, color="tab:green", linewidth=1, label=f"idle p50 {idle:.0f} ms")
            ax.axhline(idle * TARGET_RATIO, color="tab:green", linestyle=":",
                       label=f"target {TARGET_RATIO}x idle")  # fmt: skip
        ax.axhline(97, color="tab:red", linestyle=":", linewidth=1, label="97 ms objective")
        shown = [v for s in kinds for v in s["samples_ms"]] + [97.0, *([idle] if idle else [])]
        ax.set_yscale("log")
        ax.set_ylim(min(shown) / 1.3, max(shown) * 1.3)
        # Round numbers in ms as labels; log's default minor labels read "6x10^1".
        ax.yaxis.set_major_locator(ticker.FixedLocator(Y_TICKS_MS))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xticks(range(len(kinds)))
        ax.set_xticklabels(["idle", *(SETUPS[k].split(",")[0] for k in run["setups"])], fontsize=8)
        ax.grid(True, which="both", axis="y", alpha=0.3)
        ax.set_title(f"chunked prefill {'on' if run['chunked_prefill'] else 'off'}")
        ax.legend(loc="upper left", fontsize=8)
    axes[0].set_ylabel("light request TTFT (ms; bars: p50 solid, p99 dashed)")
    fig.suptitle(
        f"vLLM #37308 trace, {report['rounds']} rounds, {report['replicas']} simulated replicas"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


# ----------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.hol_report",
        description="Head-of-line report: the vLLM #37308 trace against one simulated fleet, "
        "direct to one replica, round robin and through Tokenlane lanes.",
    )
    p.add_argument("--rounds", type=int, default=50, help="measured rounds per setup (50)")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured rounds first (5)")
    p.add_argument("--replicas", type=int, default=3, help="simulated replicas (3)")
    p.add_argument("--chunked-prefill", choices=("off", "on", "both"), default="both")
    p.add_argument("--setups", default=",".join(SETUPS), help="comma-separated subset")
    p.add_argument("--full-rounds", action="store_true", help="let heavy requests finish")
    p.add_argument("--seed", type=int, default=37308, help="seed of prompts and round order")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--health-interval-s", type=float, help="gateways' scrape period")
    p.add_argument("--out", type=Path, help="result directory (loadtest/results/hol-<time>/)")
    p.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help=f"PNG ({DEFAULT_PLOT})")
    args = p.parse_args(argv)
    args.setups = tuple(s.strip() for s in args.setups.split(",") if s.strip())
    if not args.setups or any(s not in SETUPS for s in args.setups):
        p.error(f"--setups: choose from {', '.join(SETUPS)}")
    if args.rounds < 1 or args.warmup < 0 or args.replicas < 2:
        p.error("--rounds must be >= 1, --warmup >= 0, --replicas >= 2")
    args.chunked = {"off": (False,), "on": (True,), "both": (False, True)}[args.chunked_prefill]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or Path("loadtest/results") / dt.datetime.now().strftime("hol-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hol-") as tmp:
        try:
            report = _run_loop(measure(args, Path(tmp)))
        except HolReportError as exc:
            logs = "".join(p.read_text(errors="replace")[-2000:] for p in Path(tmp).glob("*.log"))
            print(f"hol_report: {exc}\n{logs}", file=sys.stderr)
            return 1
    (out / "hol_report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    plot = plot_report(report, args.plot)
    print(markdown_table(report), "", *notes(report), sep="\n")
    print(f"runtime {report['runtime_s']:.0f} s; results {out / 'hol_report.json'}; plot {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
