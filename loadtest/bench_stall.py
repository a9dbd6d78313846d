"""Stall benchmark (issue 4): stall (or SIGKILL) one of N simulated replicas under streaming load.

Reports the time from the stall to the gateway's ejection of that replica, the failed requests
split into those that had received no content yet (the gateway must save every one of them)
and those already streaming from the stalled replica (they can only be ended with an SSE
error), the client requests that reached the stalled replica after its ejection (canaries
apart; target zero), and p99 TTFT of requests sent before the stall, between stall and
ejection, and after the ejection. Streams cut mid-answer are continued on another replica
(issue 13): the report counts those continued, those whose continuation failed and those not
continued (by reason, from the gateway's metrics), the client-visible gap of the continued ones
(their longest pause between two chunks), and the tokens the survivors prefilled again. The
answers are greedy, so each continued stream's text is checked against the same prompt asked of
a survivor directly; and the survivors' own streams' ITL p99 before the fault and just after it.

Every part is its own process, as in production: the simulators (``python -m loadtest.sim``),
the gateway (``python -m proxy serve``); this process only generates load (a closed loop of
streaming chat requests) and watches ``/admin/replicas``.

    python -m loadtest.bench_stall [--replicas 3] [--workers 24] [--interval-s 1]
        [--stall-after-s 3] [--fault stall|kill] [--json out.json]
    python -m loadtest.bench_stall --fault kill --replicas 2 --workers 200   # ~100 streams

Length: one benchmark, one fault under load: the load, the fault, the report's analysis (pure,
tested in ``tests/test_bench_stall.py``) and its rendering read one run's figures together.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from .client import LoadClient
from .procs import await_http, free_port, process
from .stats import OK, RequestResult, percentile

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
CANARY_HEADER = "x-tokenlane-canary"


# ---------------------------------------------------------------------------- load


@dataclass
class Sent:
    """One client request: when it left (monotonic) and what came back."""

    at: float
    result: RequestResult
    done_at: float | None = None


def chat_body(i: int, max_tokens: int) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"request {i}: write a short poem"}],
            "max_tokens": max_tokens,
            "stream": True,
            # Greedy: the simulator's answer is then a function of the prompt, so a continued
            # stream's text can be checked against the same prompt asked of a survivor.
            "temperature": 0,
        }
    ).encode()


async def send_one(client: LoadClient, out: list[Sent], max_tokens: int) -> None:
    """One streaming chat request, appended to ``out`` as it leaves and timed to its end."""
    i = len(out)
    result = RequestResult(
        index=i, cls="chat", stream=True, prompt_tokens=0, max_tokens=max_tokens,
        scheduled_s=0.0, text=[],
    )  # fmt: skip
    sent = Sent(time.monotonic(), result)
    out.append(sent)
    await client.send("/v1/chat/completions", chat_body(i, max_tokens), result)
    sent.done_at = time.monotonic()


async def closed_loop(
    base_url: str,
    workers: int,
    max_tokens: int,
    stop: asyncio.Event,
    out: list[Sent],
    timeout_s: float = 60.0,
) -> None:
    """``workers`` clients, each sending its next streaming request when the last one ends,
    until ``stop`` is set. Every request is appended to ``out`` as it leaves."""
    async with LoadClient(base_url, timeout_s=timeout_s, max_connections=workers + 8) as client:

        async def worker() -> None:
            while not stop.is_set():
                await send_one(client, out, max_tokens)

        await asyncio.gather(*(worker() for _ in range(workers)))


# ---------------------------------------------------------------------------- analysis


@dataclass
class StallReport:
    requests: int
    time_to_ejection_s: float
    ejection_reason: str | None
    failed_not_streaming: int  # failed before any content reached the client
    failed_mid_stream: int  # failed after content: ended with an SSE error event
    failed_mid_stream_elsewhere: int  # ... on a replica that was not stalled
    unfinished: int  # still open when the run ended (a hang)
    to_stalled_after_ejection: int  # client requests the stalled replica received after it
    ttft_p99_s: dict[str, float | None] = field(default_factory=dict)
    ttft_p50_s: dict[str, float | None] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    # Continuation (from the gateway's metrics, and the continued streams as clients saw them)
    continued_ok: int = 0
    continued_failed: int = 0
    not_continued: dict[str, int] = field(default_factory=dict)  # refusal reason -> streams
    replayed_tokens: int = 0
    continued_streams_seen: int = 0  # OK streams of the faulted replica that spanned the fault
    gap_s: dict[str, float | None] = field(default_factory=dict)  # p50, p99, max of those
    # The other replicas' streams: ITL p99 of those that ended before the fault, and of those
    # that ran during the SURVIVOR_WINDOW_S after it (the re-prefills land then).
    survivor_itl_p99_s: dict[str, float | None] = field(default_factory=dict)
    # Continued streams whose text differs from the same prompt's answer on a survivor.
    continued_text_differs: int | None = None


SURVIVOR_WINDOW_S = 5.0


@dataclass
class ContinuationCounts:
    ok: int = 0
    failed: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    replayed_tokens: int = 0


def continuation_counts(exposition: str) -> ContinuationCounts:
    """The gateway's continuation counters from its ``/metrics`` text."""
    counts = ContinuationCounts()
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == "tokenlane_continuations_total":
                if sample.labels["outcome"] == "ok":
                    counts.ok += int(sample.value)
                else:
                    counts.failed += int(sample.value)
            elif sample.name == "tokenlane_continuation_refusals_total" and sample.value:
                reason = sample.labels["reason"]
                counts.refused[reason] = counts.refused.get(reason, 0) + int(sample.value)
            elif sample.name == "tokenlane_continuation_replayed_tokens_total":
                counts.replayed_tokens += int(sample.value)
    return counts


def continued(sent: Sequence[Sent], stalled_replica: str, stalled_at: float) -> list[Sent]:
    """Streams of the faulted replica that were under way when it failed and finished whole:
    the ones continued on another replica."""
    return [
        s
        for s in sent
        if s.done_at is not None
        and s.result.outcome == OK
        and s.at < stalled_at < s.done_at
        and s.result.content_chunks > 0
        and s.result.headers.get("x-tokenlane-replica") == stalled_replica
        and s.result.itl_s
    ]


async def texts_differing(survivor: str, streams: Sequence[Sent], max_tokens: int) -> int:
    """How many of ``streams`` have a text other than the same prompt's answer from
    ``survivor`` asked directly (greedy: the simulator's answer is a function of the prompt),
    so a lost, repeated or altered token shows."""
    differ = 0
    async with LoadClient(survivor, timeout_s=60, max_connections=16) as client:
        for s in streams:
            ref = RequestResult(
                index=s.result.index, cls="chat", stream=True, prompt_tokens=0,
                max_tokens=max_tokens, scheduled_s=0.0, text=[],
            )  # fmt: skip
            await client.send("/v1/chat/completions", chat_body(s.result.index, max_tokens), ref)
            if ref.outcome != OK or "".join(ref.text or ()) != "".join(s.result.text or ()):
                differ += 1
    return differ


def phase_of(at: float, stalled_at: float, ejected_at: float) -> str:
    if at < stalled_at:
        return "before"
    return "during" if at < ejected_at else "after"


def analyse(
    sent: Sequence[Sent],
    *,
    stalled_replica: str,
    stalled_at: float,
    ejected_at: float,
    ejected_wall: float,
    reason: str | None,
    stalled_log: Sequence[dict[str, Any]],
    continuation: ContinuationCounts | None = None,
) -> StallReport:
    """The figures of one run. Times are monotonic except ``ejected_wall`` (Unix time, to
    compare with the simulator's ``arrived_at``)."""
    failed_early = failed_mid = failed_mid_elsewhere = unfinished = 0
    errors: list[str] = []
    ttfts: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    gaps = [max(s.result.itl_s) for s in continued(sent, stalled_replica, stalled_at)]
    survivor_itl: dict[str, list[float]] = {"before": [], "after": []}
    for s in sent:
        r = s.result
        if s.done_at is None:
            unfinished += 1
            continue
        if r.outcome == OK and r.headers.get("x-tokenlane-replica") != stalled_replica:
            if s.done_at < stalled_at:
                survivor_itl["before"] += r.itl_s
            elif s.at < stalled_at + SURVIVOR_WINDOW_S:
                survivor_itl["after"] += r.itl_s
        if r.outcome == OK:
            if r.ttft_s is not None:
                ttfts[phase_of(s.at, stalled_at, ejected_at)].append(r.ttft_s)
            continue
        if r.content_chunks == 0:
            failed_early += 1
            errors.insert(0, f"not yet streaming: {r.outcome} {r.status} {r.error}")
            continue
        elif r.headers.get("x-tokenlane-replica") == stalled_replica:
            failed_mid += 1
        else:
            failed_mid_elsewhere += 1
        if len(errors) < 5:
            errors.append(f"mid-stream: {r.outcome} {r.status} {r.error}")
    after = [
        e
        for e in stalled_log
        if e["path"] in ("/v1/chat/completions", "/v1/completions")
        and e["headers"].get(CANARY_HEADER) != "1"
        and e["arrived_at"] > ejected_wall
    ]
    return StallReport(
        requests=len(sent),
        time_to_ejection_s=round(ejected_at - stalled_at, 3),
        ejection_reason=reason,
        failed_not_streaming=failed_early,
        failed_mid_stream=failed_mid,
        failed_mid_stream_elsewhere=failed_mid_elsewhere,
        unfinished=unfinished,
        to_stalled_after_ejection=len(after),
        ttft_p99_s={k: _r(percentile(v, 99)) for k, v in ttfts.items()},
        ttft_p50_s={k: _r(percentile(v, 50)) for k, v in ttfts.items()},
        errors=errors,
        continued_ok=continuation.ok if continuation else 0,
        continued_failed=continuation.failed if continuation else 0,
        not_continued=dict(continuation.refused) if continuation else {},
        replayed_tokens=continuation.replayed_tokens if continuation else 0,
        continued_streams_seen=len(gaps),
        gap_s={
            "p50": _r(percentile(gaps, 50)),
            "p99": _r(percentile(gaps, 99)),
            "max": _r(max(gaps)) if gaps else None,
        },
        survivor_itl_p99_s={k: _r(percentile(v, 99)) for k, v in survivor_itl.items()},
    )


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


# ---------------------------------------------------------------------------- processes


def policy(urls: list[str], args: argparse.Namespace, port: int) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": port},
        "pools": {
            "main": {
                "balance": "least_loaded",
                "replicas": [{"url": u, "name": f"sim{i}"} for i, u in enumerate(urls)],
            }
        },
        "lanes": [{"name": "all", "pool": "main"}],
        "continuation": {
            "enabled": not args.no_continuation,
            "max_in_flight_per_replica": args.reprefills_per_replica,
        },
        "health": {
            "interval_s": args.interval_s,
            "stall_after_s": args.stall_after_s,
            "timeout_s": min(2.0, args.interval_s * 2),
            "eject_base_s": 60.0,  # stays out for the rest of the run
            "canary_timeout_s": 2.0,
        },
    }


async def replica_row(client: httpx.AsyncClient, gateway: str, name: str) -> dict[str, Any]:
    rows = (await client.get(gateway + "/admin/replicas")).json()["replicas"]
    return next(r for r in rows if r["name"] == name)


async def run(args: argparse.Namespace) -> StallReport:
    ports = [free_port() for _ in range(args.replicas)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    gw_port = free_port()
    gateway = f"http://127.0.0.1:{gw_port}"
    with contextlib.ExitStack() as stack:
        sims: list[subprocess.Popen[bytes]] = []
        for i, port in enumerate(ports):
            sims.append(
                stack.enter_context(
                    process(
                        [
                            sys.executable,
                            "-m",
                            "loadtest.sim",
                            "--port",
                            str(port),
                            "--name",
                            f"sim{i}",
                            "--request-log-size",
                            "20000",
                        ]
                    )
                )
            )
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        (tmp / "policy.yaml").write_text(yaml.safe_dump(policy(urls, args, gw_port)))
        stack.enter_context(
            process(
                [sys.executable, "-m", "proxy", "serve", "--config", str(tmp / "policy.yaml")],
                stderr=sys.stderr if args.verbose else subprocess.DEVNULL,
            )
        )
        async with httpx.AsyncClient(timeout=10) as http:
            for url in urls:
                await await_http(http, url + "/health")
            await await_http(http, gateway + "/ready")
            stop = asyncio.Event()
            sent: list[Sent] = []
            load = asyncio.create_task(
                closed_loop(gateway, args.workers, args.max_tokens, stop, sent)
            )
            await asyncio.sleep(args.warmup_s)
            stalled_at = time.monotonic()
            if args.fault == "kill":
                sims[0].kill()  # SIGKILL: the streams it held are reset mid-answer
            else:
                await http.post(urls[0] + "/sim/fault", json={"fault": "stall"})
            deadline = stalled_at + args.stall_after_s + 20 * args.interval_s + 10
            while (row := await replica_row(http, gateway, "sim0"))["state"] != "ejected":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the faulted replica was not ejected: {row}")
                await asyncio.sleep(0.02)
            # The row says when the state changed (Unix time); map it onto this clock.
            ejected_wall = row["stats"]["state_changed_at"]
            ejected_at = time.monotonic() - (time.time() - ejected_wall)
            await asyncio.sleep(args.after_s)
            stop.set()
            try:
                await asyncio.wait_for(load, args.drain_s)
            except TimeoutError:
                pass  # the requests still open are the hangs the report counts
            # A killed replica keeps no log: nothing reached it after its ejection.
            log = []
            if args.fault != "kill":
                log = (await http.get(urls[0] + "/sim/requests")).json()["requests"]
            exposition = (await http.get(gateway + "/metrics")).text
            report = analyse(
                sent,
                stalled_replica="sim0",
                stalled_at=stalled_at,
                ejected_at=ejected_at,
                ejected_wall=ejected_wall,
                reason=row["reason"],
                stalled_log=log,
                continuation=continuation_counts(exposition),
            )
            report.continued_text_differs = await texts_differing(
                urls[1], continued(sent, "sim0", stalled_at), args.max_tokens
            )
        return report


def render(report: StallReport, args: argparse.Namespace) -> str:
    target = args.stall_after_s + args.interval_s

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.0f} ms"

    lines = [
        f"{args.fault} benchmark: {args.replicas} replicas, {args.workers} streaming clients, "
        f"max_tokens {args.max_tokens}, interval_s {args.interval_s:g}, "
        f"stall_after_s {args.stall_after_s:g}",
        f"  requests                          {report.requests}",
        f"  time to ejection                  {report.time_to_ejection_s:.2f} s "
        f"(target <= {target:g} s), reason {report.ejection_reason}",
        f"  failed, not yet streaming         {report.failed_not_streaming} (target 0)",
        f"  failed, mid-stream (faulted)      {report.failed_mid_stream} (eligible: target 0)",
        f"  failed, mid-stream (elsewhere)    {report.failed_mid_stream_elsewhere}",
        f"  unfinished at the end (hangs)     {report.unfinished} (target 0)",
        f"  client requests to it after eject {report.to_stalled_after_ejection} (target 0)",
        "  TTFT p50 / p99   before {} / {}   during {} / {}   after {} / {}".format(
            *(
                ms(d[k])
                for k in ("before", "during", "after")
                for d in (report.ttft_p50_s, report.ttft_p99_s)
            )
        ),
    ]
    refused = ", ".join(f"{k} {v}" for k, v in sorted(report.not_continued.items())) or "none"
    gap = report.gap_s
    itl = report.survivor_itl_p99_s
    lines += [
        f"  continued, ok / failed            {report.continued_ok} / {report.continued_failed}",
        f"  not continued, by reason          {refused}",
        f"  continued streams seen by clients {report.continued_streams_seen}; client-visible "
        f"gap p50 / p99 / max {ms(gap.get('p50'))} / {ms(gap.get('p99'))} / {ms(gap.get('max'))}",
        f"  tokens prefilled again            {report.replayed_tokens}",
        f"  continued texts unlike the unfaulted answer {report.continued_text_differs} (target 0)",
        f"  survivors' ITL p99                before {ms(itl.get('before'))}   "
        f"{SURVIVOR_WINDOW_S:g} s after the fault {ms(itl.get('after'))} (target: not doubled)",
    ]
    lines += [f"  error: {e}" for e in report.errors]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--workers", type=int, default=24, help="concurrent streaming clients")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--interval-s", type=float, default=1.0, help="health.interval_s")
    parser.add_argument("--stall-after-s", type=float, default=3.0, help="health.stall_after_s")
    parser.add_argument("--warmup-s", type=float, default=4.0, help="load before the stall")
    parser.add_argument("--after-s", type=float, default=5.0, help="load after the ejection")
    parser.add_argument("--drain-s", type=float, default=30.0, help="wait for open requests")
    parser.add_argument(
        "--fault", choices=("stall", "kill"), default="stall",
        help="stall: vLLM #37729's deadlock (/health 200, no tokens); kill: SIGKILL the process",
    )  # fmt: skip
    parser.add_argument(
        "--no-continuation", action="store_true",
        help="leave continuation off (the policy default): streams cut mid-answer end in errors",
    )  # fmt: skip
    parser.add_argument(
        "--reprefills-per-replica", type=int, default=32,
        help="continuation.max_in_flight_per_replica (the policy default is 32)",
    )  # fmt: skip
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--verbose", action="store_true", help="show the gateway's log")
    args = parser.parse_args(argv)
    report = asyncio.run(run(args))
    print(render(report, args))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2))
    ok = (
        report.failed_not_streaming == 0
        and report.unfinished == 0
        and report.to_stalled_after_ejection == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
