"""A real client through the gateway: inference-perf's three API modes, its TTFT against ours.

``python -m loadtest.bench_clients`` (``make bench-clients``) runs ``tokenlane demo`` (the
gateway and three simulated vLLM replicas) and, for each inference-perf API mode (``chat``,
``completion``, ``anthropic_messages``), runs inference-perf 0.7.0 (PyPI, installed by
``loadtest/peers.py`` into a virtualenv of its own with Python >= 3.12) against the gateway:
streaming, a constant ``--rate`` (2 req/s) for ``--duration-s`` (25 s), its ``mock`` data (short
prompts, 30 output tokens; nothing downloaded). Its tokenizer is a local one
(``loadtest/hf_tokenizer.py``), trained on those prompts and on the simulator's replies.

Two things are measured. First, that a client vLLM users run speaks the gateway's three APIs:
per mode, the requests inference-perf sent, completed and failed (from its per-request report),
and the gateway's access lines for them (``api`` ``chat`` / ``completion`` / ``messages``, ended
within the run's time window). Second, that the gateway's TTFT is the one a client sees: the
median TTFT inference-perf measured (send to first content chunk) against the median
``ttft_ms`` of those access lines (received to first token relayed), and their relative
difference (target: within 10 %; the client's includes the network and the request's read,
so it runs a little higher). Figures are printed, never asserted.

Exit status: 0 when the three modes ran (whatever the figures), 1 when one did not, 2 when
inference-perf could not be installed (the reason is printed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest import hf_tokenizer, peers
from loadtest.procs import free_port, process, wait_http

ROOT = Path(__file__).resolve().parent.parent
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"  # the simulator's model
# inference-perf's API mode -> the ``api`` of the gateway's access line for its requests.
MODES = {"chat": "chat", "completion": "completion", "anthropic_messages": "messages"}
PEER = "inference-perf"
TARGET = 0.10  # the relative TTFT difference aimed at
# Replies sampled from the fleet before the runs, for the tokenizer's training text.
SAMPLES = 8
SAMPLE_TOKENS = 200


@dataclass
class ModeRun:
    """One inference-perf run and what both sides recorded of it."""

    mode: str
    started: float = 0.0  # wall clock, as the access line's ``ts``
    ended: float = 0.0
    returncode: int | None = None
    problem: str = ""
    sent: int = 0
    completed: int = 0
    failed: int = 0
    client_ttfts_s: list[float] = field(default_factory=list)
    access_ttfts_ms: list[float] = field(default_factory=list)
    access_lines: int = 0
    access_statuses: dict[int, int] = field(default_factory=dict)


def demo_policy(ports: list[int], gateway_port: int) -> dict[str, Any]:
    """The demo's policy (config/policy.demo.yaml) as it is, on free ports."""
    policy: dict[str, Any] = yaml.safe_load((ROOT / "config/policy.demo.yaml").read_text())
    replicas = [r for pool in policy["pools"].values() for r in pool["replicas"]]
    for replica, port in zip(replicas, ports, strict=True):
        replica["url"] = f"http://127.0.0.1:{port}"
    policy["server"]["port"] = gateway_port
    return policy


def mock_prompts(n: int) -> list[str]:
    """The prompts inference-perf's ``mock`` data sends (``1 2 3 <i>`` as completions,
    ``mock prompt <i>`` as messages), the tokenizer's first training text."""
    return [p for i in range(1, n + 1) for p in (f"1 2 3 {i}", f"mock prompt {i}")]


def ip_config(
    mode: str, base_url: str, tokenizer_dir: Path, out_dir: Path, rate: float, duration_s: int
) -> dict[str, Any]:
    """inference-perf's config for one mode (its schema rejects unknown keys)."""
    return {
        "api": {"type": mode, "streaming": True},
        # mock: short prompts and no dataset to download; the output length is inference-perf's
        # default max_tokens, 30, with ignore_eos (the Messages API has no ignore_eos).
        "data": {"type": "mock"},
        "load": {
            "type": "constant",
            "stages": [{"rate": rate, "duration": duration_s}],
            # one worker process is plenty at a few requests/s, and starts faster
            "num_workers": 1,
            "request_timeout": 60,
        },
        "server": {"type": "vllm", "model_name": MODEL, "base_url": base_url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer_dir)},
        "report": {
            "request_lifecycle": {
                "summary": True,
                "per_stage": False,
                "per_request": True,  # per_request_lifecycle_metrics.json: what is read here
                "per_request_fields": {
                    "request": False,
                    "response": False,
                    "info": True,
                    "response_chunks": False,
                    "computed_metrics": False,  # not read: see client_ttft_s
                },
            },
            "prometheus": {"summary": False, "per_stage": False},
        },
        "storage": {"local_storage": {"path": str(out_dir)}},
    }


def client_ttft_s(entry: dict[str, Any]) -> float | None:
    """inference-perf's TTFT of one request: its first content chunk's arrival less the send
    time (both ``perf_counter``), from the raw ``chunk_times`` (content-bearing chunks only).

    Not from ``output_token_times`` nor ``computed_metrics``: inference-perf 0.7.0 re-derives
    those from the chunks' JSON, which it reads only in OpenAI's shapes, so in
    ``anthropic_messages`` mode they come out empty and its own TTFT is null (summary
    included). For the other two modes both give the same figure."""
    if entry.get("error"):
        return None
    metrics = (entry.get("info") or {}).get("response_metrics") or {}
    times = metrics.get("chunk_times") or []
    start = entry.get("start_time")
    if not times or not isinstance(start, int | float):
        return None
    return float(times[0]) - float(start)


def read_client(report_dir: Path, run: ModeRun) -> None:
    """Fill ``run`` from inference-perf's per-request report."""
    path = report_dir / "per_request_lifecycle_metrics.json"
    if not path.exists():
        run.problem = run.problem or f"no {path.name} in {report_dir}"
        return
    entries = json.loads(path.read_text())
    run.sent = len(entries)
    run.failed = sum(1 for e in entries if e.get("error"))
    run.completed = run.sent - run.failed
    run.client_ttfts_s = [t for e in entries if (t := client_ttft_s(e)) is not None]


def access_records(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The gateway's access records among its stdout's lines (the demo's log lines are
    ``<time> INFO <logger>: <message>``; an access line's message is one JSON object)."""
    for line in lines:
        start = line.find("{")
        if start < 0 or '"request_id"' not in line:
            continue
        with contextlib.suppress(ValueError):
            record = json.loads(line[start:])
            if isinstance(record, dict) and "ttft_ms" in record:
                yield record


def read_access(records: list[dict[str, Any]], run: ModeRun) -> None:
    """Fill ``run`` with the access lines of its API that ended within its window."""
    api = MODES[run.mode]
    mine = [
        r
        for r in records
        if r.get("api") == api and run.started <= float(r.get("ts") or 0) <= run.ended
    ]
    run.access_lines = len(mine)
    statuses: dict[int, int] = {}
    for r in mine:
        statuses[int(r.get("status") or 0)] = statuses.get(int(r.get("status") or 0), 0) + 1
    run.access_statuses = statuses
    run.access_ttfts_ms = [
        float(r["ttft_ms"]) for r in mine if r.get("status") == 200 and r.get("ttft_ms") is not None
    ]


def relative(client: float | None, gateway: float | None) -> float | None:
    """(client - gateway) / gateway; None without both."""
    if client is None or gateway is None or gateway <= 0:
        return None
    return (client - gateway) / gateway


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def header() -> str:
    return (
        f"{'mode':<19} {'sent':>5} {'ok':>5} {'failed':>6} {'access':>6} "
        f"{'TTFT p50 client ms':>18} {'gateway ms':>10} {'diff':>7}"
    )


def row(run: ModeRun) -> str:
    client = median(run.client_ttfts_s)
    client_ms = client * 1000 if client is not None else None
    gateway = median(run.access_ttfts_ms)
    diff = relative(client_ms, gateway)

    def ms(x: float | None) -> str:
        return f"{x:.1f}" if x is not None else "-"

    return (
        f"{run.mode:<19} {run.sent:>5} {run.completed:>5} {run.failed:>6} {run.access_lines:>6} "
        f"{ms(client_ms):>18} {ms(gateway):>10} "
        f"{(f'{diff:+.1%}' if diff is not None else '-'):>7}"
    )


def sample_replies(base: str) -> list[str]:
    """A few of the fleet's replies (non-streamed chat), so the tokenizer has seen the words
    the simulator writes and counts output tokens near the server's ``completion_tokens``.
    They also warm the fleet before the first measured request."""
    texts = []
    with httpx.Client(base_url=base, timeout=60) as http:
        for i in range(SAMPLES):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"tokenizer sample {i}: a story"}],
                "max_tokens": SAMPLE_TOKENS,
            }
            r = http.post("/v1/chat/completions", json=body)
            if r.status_code == 200:
                texts.append(str(r.json()["choices"][0]["message"]["content"] or ""))
    return texts


def run_mode(
    exe: Path, mode: str, base: str, tokenizer_dir: Path, workdir: Path, args: argparse.Namespace
) -> ModeRun:
    run = ModeRun(mode)
    out = workdir / f"report-{mode}"
    cfg = workdir / f"inference-perf-{mode}.yaml"
    config = ip_config(mode, base, tokenizer_dir, out, args.rate, args.duration_s)
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    log = workdir / f"inference-perf-{mode}.log"
    run.started = time.time()
    with log.open("wb") as sink:
        try:
            done = subprocess.run(
                [str(exe), "--config_file", str(cfg)],
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                timeout=args.duration_s + 600,  # its start (imports) and reports take a while
                check=False,
            )
            run.returncode = done.returncode
        except subprocess.TimeoutExpired:
            run.problem = "timed out"
    run.ended = time.time()
    if run.returncode not in (0, None):
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        run.problem = f"exit {run.returncode}: " + " | ".join(tail)[:300]
    read_client(out, run)
    return run


def run(args: argparse.Namespace) -> int:
    try:
        exe = peers.ensure(PEER)
    except peers.PeerUnavailable as exc:
        print(f"{PEER}: not run: {exc}")
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="tokenlane-clients-"))
    ports = [free_port() for _ in range(3)]
    gw_port = free_port()
    policy = demo_policy(ports, gw_port)
    path = workdir / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    log = workdir / "demo.log"
    base = f"http://127.0.0.1:{gw_port}"
    argv = [sys.executable, "-m", "proxy", "demo", "--policy", str(path)]
    runs: list[ModeRun] = []
    print(f"{PEER} {peers.PEERS[PEER].version} ({exe}); work dir {workdir}", flush=True)
    with process(argv, log=log, grace_s=30):
        wait_http(base + "/ready", 120)
        corpus = mock_prompts(int(args.rate * args.duration_s) + 1) + sample_replies(base)
        tokenizer_dir = hf_tokenizer.build(workdir / "tokenizer", corpus)
        for mode in MODES:
            print(f"running {PEER} --config_file inference-perf-{mode}.yaml ...", flush=True)
            runs.append(run_mode(exe, mode, base, tokenizer_dir, workdir, args))
        time.sleep(1.0)  # access lines are written off the request's path: let the last land
    records = list(access_records(log.read_text(errors="replace").splitlines()))
    for r in runs:
        read_access(records, r)
    print()
    print(header())
    for r in runs:
        print(row(r))
    for r in runs:
        odd = {s: n for s, n in r.access_statuses.items() if s != 200}
        if odd:
            print(f"  {r.mode}: access lines not 200: {odd}")
        if r.problem:
            print(f"  {r.mode}: {r.problem}")
    print(
        f"TTFT: inference-perf's (send to first content chunk) against the gateway's access "
        f"line (received to first token relayed); target within {TARGET:.0%}"
    )
    if args.keep or any(r.problem for r in runs):
        print(f"reports and logs: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if all(r.returncode == 0 and not r.problem for r in runs) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=2.0, help="requests/s, constant")
    parser.add_argument("--duration-s", type=int, default=25, help="per mode")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (reports, logs)")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
