"""`tokenlane loadtest`: replay a trace or a scenario against any OpenAI-compatible server.

What to send and when (traces, scenarios, arrivals) is :mod:`loadtest.workload`; this module
sends it and is the command line. Its names stay importable from here.

Arrivals are open-loop: a request is sent at its time whatever the server is doing, since a
closed loop slows down with the server and hides exactly the queueing a gateway is for. The
generator's own lateness is recorded, so a run where the client fell behind says so.

Length: the sender, its report and the command line of one tool; the workload model is already its
own module.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import random
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from .client import LoadClient
from .prompts import DEFAULT_PREFIX_SEED, build_prompt
from .stats import INCOMPLETE, PENDING, RequestResult, format_summary, lateness, summarize
from .workload import (
    ClassSpec,
    Dist,
    LoadTestError,
    Scenario,
    TraceError,
    TraceRequest,
    load_scenario,
    load_trace,
    parse_dist,
    parse_scenario,
    parse_trace,
    poisson_arrivals,
    scenario_requests,
)

__all__ = [
    "ClassSpec",
    "Dist",
    "LoadTestError",
    "Progress",
    "RequestResult",
    "Scenario",
    "TraceError",
    "TraceRequest",
    "load_scenario",
    "load_trace",
    "main",
    "parse_dist",
    "parse_scenario",
    "parse_trace",
    "poisson_arrivals",
    "request_body",
    "run_scenario",
    "run_trace",
    "scenario_requests",
    "write_results",
]

T = TypeVar("T")

# The error of a request still in flight when ``stop_when`` ended the run.
STOPPED_EARLY = "not finished: the run stopped early (stop_when)"

API_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def request_body(
    req: TraceRequest,
    *,
    model: str,
    seed: int | str,
    api: str = "chat",
    prefix_seed: int = DEFAULT_PREFIX_SEED,
    ignore_eos: bool = False,
) -> dict[str, Any]:
    """The JSON body for one trace row. Streams ask for usage so output tokens are measured."""
    prompt = build_prompt(req.prompt_tokens, req.prefix_tokens, seed=seed, prefix_seed=prefix_seed)
    body: dict[str, Any] = {"model": req.model or model}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body["max_tokens"] = req.max_tokens
    body["stream"] = req.stream
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.priority is not None:
        body["priority"] = req.priority  # vLLM's extension (--scheduling-policy priority)
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension: output exactly max_tokens
    return body


class Progress:
    """Counts for the progress line; the runner updates it, ``line()`` renders it."""

    def __init__(self, total: int, planned_s: float) -> None:
        self.total = total
        self.planned_s = planned_s
        self.sent = 0
        self.done = 0
        self.failed = 0
        self.started = time.perf_counter()

    def on_sent(self) -> None:
        self.sent += 1

    def on_done(self, result: RequestResult) -> None:
        self.done += 1
        if not result.ok:
            self.failed += 1

    def line(self, width: int = 30) -> str:
        frac = self.done / self.total if self.total else 1.0
        filled = int(frac * width)
        elapsed = time.perf_counter() - self.started
        return (
            f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} done, "
            f"{self.sent - self.done} in flight, {self.failed} failed, "
            f"{elapsed:.1f}s of {self.planned_s:.1f}s planned"
        )


async def resolve_model(
    client: LoadClient, requests: Sequence[TraceRequest], model: str | None
) -> str:
    """The model to name in requests that name none: ``model``, else the server's first."""
    if model:
        return model
    if all(r.model for r in requests):
        return ""
    try:
        models = await client.models()
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        raise LoadTestError(
            f"no --model given and GET {client.base_url}/v1/models failed: {exc}"
        ) from exc
    if not models:
        raise LoadTestError(f"no --model given and {client.base_url}/v1/models lists none")
    return models[0]


async def run_trace(
    base_url: str,
    requests: Sequence[TraceRequest],
    *,
    model: str | None = None,
    api_key: str | None = None,
    api: str = "chat",
    concurrency_limit: int | None = None,
    timeout_s: float = 600.0,
    prompt_seed: int | None = None,
    prefix_seed: int = DEFAULT_PREFIX_SEED,
    ignore_eos: bool = False,
    progress: Progress | None = None,
    client: LoadClient | None = None,
    stop_when: Callable[[Sequence[RequestResult]], bool] | None = None,
) -> list[RequestResult]:
    """Send ``requests`` at their ``at_ms`` (open loop) and return one result per request,
    in the order given.

    ``model`` names the model for rows without one (default: the first of ``/v1/models``).
    ``concurrency_limit`` caps requests in flight; arrivals beyond it wait, which makes the
    run partly closed-loop (the lateness in the results shows by how much).
    ``prompt_seed`` draws the unshared part of the prompts; by default a fresh one per call,
    because a server with prefix caching would otherwise serve a repeated run (or round)
    from its cache. The shared prefix comes from ``prefix_seed`` and stays the same.
    Pass ``client`` to reuse one session across runs (benchmarks doing many rounds).
    ``stop_when`` is asked after each request ends; once it holds, the requests still in
    flight are cancelled (their connections close, which aborts them in vLLM) and marked
    incomplete with ``STOPPED_EARLY``, those not sent yet stay pending. A report that needs
    only some requests uses it to skip waiting for the others.
    """
    if api not in API_PATHS:
        raise LoadTestError(f"api must be one of {', '.join(API_PATHS)}, got {api!r}")
    requests = list(requests)
    if prompt_seed is None:
        prompt_seed = random.randrange(2**31)
    async with contextlib.AsyncExitStack() as stack:
        if client is None:
            limit = concurrency_limit or max(100, min(len(requests), 10_000))
            client = await stack.enter_async_context(
                LoadClient(base_url, api_key=api_key, max_connections=limit, timeout_s=timeout_s)
            )
        default_model = await resolve_model(client, requests, model)
        # Build every body before the clock starts: a 2048-token prompt takes a while to
        # make, and doing it at dispatch time would make the generator late.
        bodies = [
            request_body(
                r,
                model=default_model,
                seed=f"{prompt_seed}:{i}",
                api=api,
                prefix_seed=prefix_seed,
                ignore_eos=ignore_eos,
            )
            for i, r in enumerate(requests)
        ]
        results = [
            RequestResult(
                index=i,
                cls=r.cls,
                stream=r.stream,
                prompt_tokens=r.prompt_tokens,
                max_tokens=r.max_tokens,
                scheduled_s=r.at_ms / 1000,
                ttft_slo_s=None if r.ttft_slo_ms is None else r.ttft_slo_ms / 1000,
                model=body["model"],
            )
            for i, (r, body) in enumerate(zip(requests, bodies, strict=True))
        ]
        encoded = [json.dumps(body).encode() for body in bodies]
        del bodies
        await _dispatch(
            client,
            API_PATHS[api],
            requests,
            encoded,
            results,
            concurrency_limit,
            progress,
            stop_when,
        )
    return results


async def _dispatch(
    client: LoadClient,
    path: str,
    requests: Sequence[TraceRequest],
    bodies: Sequence[bytes],
    results: Sequence[RequestResult],
    concurrency_limit: int | None,
    progress: Progress | None,
    stop_when: Callable[[Sequence[RequestResult]], bool] | None = None,
) -> None:
    """The open loop: one task per request, started at its time, whatever came before."""
    gate = asyncio.Semaphore(concurrency_limit) if concurrency_limit else None
    stop = asyncio.Event()
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        try:
            results[i].start_s = time.perf_counter() - t0
            if progress:
                progress.on_sent()
            await client.send(path, bodies[i], results[i])
            if progress:
                progress.on_done(results[i])
            if stop_when is not None and stop_when(results):
                stop.set()
        finally:
            if gate:
                gate.release()

    tasks: dict[int, asyncio.Task[None]] = {}

    async def schedule() -> None:
        for i in sorted(range(len(requests)), key=lambda i: requests[i].at_ms):
            delay = t0 + requests[i].at_ms / 1000 - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if gate:
                await gate.acquire()
            tasks[i] = asyncio.create_task(one(i))
        await asyncio.gather(*tasks.values())

    scheduler = asyncio.create_task(schedule())
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait((scheduler, stopper), return_when=asyncio.FIRST_COMPLETED)
        if scheduler.done():
            scheduler.result()  # its exception, if any
    finally:
        everything = (scheduler, stopper, *tasks.values())
        for task in everything:
            task.cancel()
        # Let cancelled requests close their connections before the session goes.
        await asyncio.gather(*everything, return_exceptions=True)
    for i in tasks:
        if results[i].outcome == PENDING:
            results[i].outcome = INCOMPLETE
            results[i].error = STOPPED_EARLY


async def run_scenario(base_url: str, scenario: Scenario, **kwargs: Any) -> list[RequestResult]:
    """Run the trace a scenario stands for; keyword arguments as ``run_trace``."""
    kwargs.setdefault("model", scenario.model)
    return await run_trace(base_url, scenario_requests(scenario), **kwargs)


# --------------------------------------------------------------------------------------------
# Command line


def build_parser(prog: str = "tokenlane loadtest") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Replay a trace or a scenario against an OpenAI-compatible server.",
    )
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The loadtest options, for a subcommand parser of the main CLI."""
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8080")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="a trace: .jsonl, .json or .yaml")
    src.add_argument("--scenario", type=Path, help="a scenario: .yaml")
    p.add_argument("--out", type=Path, help="output directory (default loadtest/results/<time>/)")
    p.add_argument("--model", help="model for requests naming none (default: first of /v1/models)")
    p.add_argument("--api-key", help="sent as Authorization: Bearer")
    p.add_argument(
        "--api", choices=sorted(API_PATHS), default="chat", help="endpoint (default chat)"
    )
    p.add_argument("--concurrency-limit", type=int, help="cap on requests in flight (default none)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per request (default 600)")
    p.add_argument(
        "--seed",
        type=int,
        help="seed of the prompts' text (default: fresh each run) and of a scenario's arrivals",
    )
    p.add_argument("--ignore-eos", action="store_true", help="ask vLLM for exactly max_tokens")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument("--no-plots", action="store_true", help="write result.json only")


def _raise_open_files_limit() -> None:
    """One socket per request in flight: lift the soft file limit to the hard one (Linux
    often starts at 1024, fewer than an open-loop run at a few hundred requests/s holds)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop when it is installed: a cheaper event loop is a faster load generator."""
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


async def _with_progress(coro: Coroutine[Any, Any, T], progress: Progress | None) -> T:
    if progress is None:
        return await coro

    async def draw() -> None:
        while True:
            sys.stderr.write("\r" + progress.line())
            sys.stderr.flush()
            await asyncio.sleep(0.25)

    drawer = asyncio.create_task(draw())
    try:
        return await coro
    finally:
        drawer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await drawer
        sys.stderr.write("\r" + progress.line() + "\n")
        sys.stderr.flush()


def write_results(
    out: Path,
    results: Sequence[RequestResult],
    meta: dict[str, Any],
    *,
    plots: bool = True,
) -> dict[str, Any]:
    """Write ``result.json`` (and the plots) into ``out``; return the summary."""
    out.mkdir(parents=True, exist_ok=True)
    duration = meta.get("duration_s")
    summary = summarize(results, duration)
    doc = {
        **meta,
        "generator": {"lateness": lateness(results)},
        "summary": summary,
        "requests": [r.to_json() for r in results],
    }
    (out / "result.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    if plots:
        from . import plots as plotting  # matplotlib only when plots are wanted

        plotting.plot_ttft_cdf(results, out / "ttft_cdf.png")
        plotting.plot_ttft_over_time(results, out / "ttft_over_time.png")
    return summary


def main(argv: list[str] | None = None) -> int:
    """``tokenlane loadtest ...``: 0 when the run completed (whatever the server answered),
    1 when it could not run (bad file, no model), 2 for bad options."""
    args = build_parser().parse_args(argv)
    try:
        if args.trace is not None:
            requests = load_trace(args.trace)
            source: dict[str, Any] = {"trace": str(args.trace)}
            model = args.model
        else:
            scenario = load_scenario(args.scenario)
            if args.seed is not None:
                scenario = Scenario(
                    scenario.rate, scenario.duration_s, scenario.mix, args.seed, scenario.model
                )
            requests = scenario_requests(scenario)
            source = {"scenario": str(args.scenario), **scenario.to_json()}
            model = args.model or scenario.model
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not requests:
        print(
            "error: the scenario produced no requests (rate x duration too small)", file=sys.stderr
        )
        return 1

    prompt_seed = args.seed if args.seed is not None else random.randrange(2**31)
    _raise_open_files_limit()
    planned = requests[-1].at_ms / 1000
    progress = None if args.no_progress else Progress(len(requests), planned)
    started_at = dt.datetime.now(dt.UTC)
    try:
        results = _run_loop(
            _with_progress(
                run_trace(
                    args.base_url,
                    requests,
                    model=model,
                    api_key=args.api_key,
                    api=args.api,
                    concurrency_limit=args.concurrency_limit,
                    timeout_s=args.timeout_s,
                    prompt_seed=prompt_seed,
                    ignore_eos=args.ignore_eos,
                    progress=progress,
                ),
                progress,
            )
        )
    except LoadTestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    # The load's span, first send to last end: the base of every per-second figure.
    duration = max((r.start_s + (r.e2e_s or 0.0) for r in results), default=0.0)

    out = args.out or Path("loadtest/results") / started_at.strftime("%Y%m%d-%H%M%S")
    meta = {
        "tool": "tokenlane loadtest",
        "base_url": args.base_url,
        "api": args.api,
        "models": sorted({r.model for r in results}),
        "source": source,
        "prompt_seed": prompt_seed,
        "started_at": started_at.isoformat(timespec="seconds"),
        "duration_s": round(duration, 3),
        "concurrency_limit": args.concurrency_limit,
    }
    summary = write_results(out, results, meta, plots=not args.no_plots)
    print(format_summary(summary))
    late = lateness(results)
    if late["max_s"] is not None and late["p99_s"] is not None and late["max_s"] > 0.05:
        print(
            f"note: the generator sent some requests late (p99 {late['p99_s'] * 1000:.0f} ms, "
            f"max {late['max_s'] * 1000:.0f} ms); the load was not fully open-loop"
        )
    unsent = sum(1 for r in results if r.outcome == PENDING)
    if unsent:
        print(f"note: {unsent} requests were not sent")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
