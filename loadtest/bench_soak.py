"""Soak: streaming load through the demo fleet with a rotating fault every minute.

``python -m loadtest.bench_soak`` (``make soak``; ``--minutes`` for a shorter run) runs
``tokenlane demo`` (a gateway and three simulated replicas under a supervisor that restarts
a crashed one) with continuation on, and keeps ``--streams`` streaming chat requests open
(temperature 0, one of ``PROMPTS`` prompts each). Each minute one fault from ``ROTATION`` hits
the next replica for ``--fault-s`` seconds, then the fleet has the rest of the minute to heal:
every simulator fault kind, and a policy reload. Every answer is checked against the same
prompt's answer taken before the first fault (the simulator's output at temperature 0 is a
function of the prompt), so a lost or repeated token shows as a differing text.

With ``--redis`` (``redis-server`` on the PATH, as ``make test`` installs it) the gateway
keeps its shared state in a Redis of its own, a second instance (``tokenlane serve`` on the
same policy) takes half the clients, and the rotation gains a Redis SIGKILL (restarted after
the fault's time) and a SIGKILL of the second instance (restarted after 10 s). While that
instance is down its clients use the first, as a load balancer's health check would; the
streams it held when killed fail, and are counted under that fault.

The rotation also black-holes Redis (SIGSTOP, then SIGCONT after the fault's time:
RELIABILITY T16) and SIGKILLs one worker of the second instance, which runs with
``--workers 2`` (its supervisor starts another; the streams that worker held are cut).

It prints one row per minute (the fault, requests ended, failures by kind, streams continued,
texts that differ, the demo gateway's RSS and open file descriptors) and the totals against
the targets: no lost or repeated token, no hang, no failure the design can avoid, RSS growth
under 1 MB a minute after the warm-up minute. Requests count under the minute they ended in
(a fault at a minute's start cuts streams begun in the minute before). A SIGKILLed instance's
workers drain the streams they hold (they end with their supervisor, as on a SIGTERM); a
SIGKILLed worker's own streams are cut with it (no gateway can finish a stream whose
connection died): its clients are the ones counted mid-stream in that minute.

Length: one benchmark: the fault rotation, the checked streams and the per-minute table of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml

from loadtest.procs import free_port, process, rss_mb, spawn, wait_http, wait_port
from loadtest.procs import stop as stop_process

ROOT = Path(__file__).resolve().parent.parent
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
PROMPTS = 16
# One a minute, in this order, each on the next replica (a "reload" edits the policy file).
ROTATION: list[tuple[str, dict[str, Any]]] = [
    ("stall", {"fault": "stall"}),
    ("cut_close", {"fault": "cut_close", "after_tokens": 8}),
    ("cut_reset", {"fault": "cut_reset", "after_tokens": 8}),
    ("cut_error", {"fault": "cut_error", "after_tokens": 8}),
    ("cut_abort", {"fault": "cut_abort", "after_tokens": 8}),
    ("engine_dead", {"fault": "engine_dead"}),
    ("crash", {"fault": "crash"}),
    ("refuse", {"fault": "refuse"}),
    ("hang_accept", {"fault": "hang_accept"}),
    ("health_fail", {"fault": "health_fail"}),
    ("slow", {"fault": "slow", "factor": 4}),
    ("error_rate", {"fault": "error_rate", "rate": 0.5}),
    ("reload", {}),
]
# Added with --redis.
SHARED_ROTATION: list[tuple[str, dict[str, Any]]] = [
    ("redis_kill", {}),
    ("instance_kill", {}),
    ("redis_pause", {}),  # RELIABILITY T16: Redis black-holed (SIGSTOP), then back (SIGCONT)
    ("worker_kill", {}),  # one worker of the second instance (`serve --workers 2`) SIGKILLed
]
SECOND_WORKERS = 2
INSTANCE_DOWN_S = 10.0
# How a request ended, as the client saw it.
OK, DIFFERS, BEFORE_FIRST, MID_STREAM, HANG = (
    "ok",
    "differs",
    "before_first_token",
    "mid_stream",
    "hang",
)


@dataclass
class Ended:
    """One request as the client saw it."""

    prompt: int
    minute: int
    outcome: str = OK
    text: str = ""
    request_id: str | None = None
    detail: str = ""
    retry_after_s: float = 0.0  # a refusal's Retry-After: the client waits, as SDKs do


@dataclass
class Minute:
    fault: str
    target: str
    rss_mb: float = 0.0
    fds: int = 0
    ended: Counter[str] = field(default_factory=Counter)


def chat_body(prompt: int, max_tokens: int) -> bytes:
    """Even prompts are short (the demo's ``short`` lane, on the interactive pool); odd ones
    ~1,500 tokens long (the ``long`` lane, on the bulk pool): faults on either pool meet load."""
    filler = " and then" * 500 if prompt % 2 else ""
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"soak prompt {prompt}: a story{filler}"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
    ).encode()


async def stream_one(
    session: aiohttp.ClientSession, url: str, prompt: int, minute: int, max_tokens: int
) -> Ended:
    """One streaming request read to its end: its text and how it ended."""
    ended = Ended(prompt, minute)
    got_content = False
    try:
        async with session.post(url, data=chat_body(prompt, max_tokens)) as resp:
            ended.request_id = resp.headers.get("x-request-id")
            if resp.status != 200:
                ended.outcome, ended.detail = BEFORE_FIRST, f"status {resp.status}"
                with contextlib.suppress(ValueError):
                    ended.retry_after_s = min(5.0, float(resp.headers.get("retry-after", 0)))
                await resp.read()
                return ended
            done = False
            parts: list[str] = []
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    ended.outcome = MID_STREAM if got_content else BEFORE_FIRST
                    ended.detail = str(obj["error"].get("message", ""))[:120]
                    return ended
                for choice in obj.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        got_content = True
                        parts.append(text)
            ended.text = "".join(parts)
            if not done:
                ended.outcome = MID_STREAM if got_content else BEFORE_FIRST
                ended.detail = "ended without [DONE]"
    except TimeoutError:
        ended.outcome, ended.detail = HANG, "no end within the client timeout"
    except aiohttp.ClientError as exc:
        ended.outcome = MID_STREAM if got_content else BEFORE_FIRST
        ended.detail = f"{type(exc).__name__}: {exc}"[:120]
    return ended


def fds_of(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def soak_policy(ports: list[int], gateway_port: int) -> dict[str, Any]:
    """The demo's policy on free ports, with continuation on, fast health checks and short
    ejections (10 s, at most 30 s): a replica ejected for one minute's fault is back before the
    next minute's fault hits its peer, so the next fault meets a pool that can take its load.
    With the default 30 s doubling, a cut fault (whose one-token canary passes) is readmitted,
    re-ejected for 60 s, and the peer's fault a minute later finds no replica to move to."""
    policy = yaml.safe_load((ROOT / "config/policy.demo.yaml").read_text())
    replicas = [r for pool in policy["pools"].values() for r in pool["replicas"]]
    for replica, port in zip(replicas, ports, strict=True):
        replica["url"] = f"http://127.0.0.1:{port}"
    policy["server"]["port"] = gateway_port
    policy["continuation"] = {"enabled": True}
    policy["health"] = {
        **policy.get("health", {}),
        "interval_s": 0.5,
        "stall_after_s": 3,
        "eject_base_s": 10,
        "eject_max_s": 30,
    }
    return policy


def access_lines(log: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for text in log.read_text(errors="replace").splitlines():
        if text.startswith("{") and '"request_id"' in text:
            with contextlib.suppress(ValueError):
                rec = json.loads(text)
                out[str(rec["request_id"])] = rec
    return out


def rss_slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (minute, MB): growth in MB a minute."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


async def inject(replica_url: str, body: dict[str, Any], duration_s: float) -> str:
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(replica_url + "/sim/fault", json={**body, "duration_s": duration_s})
        return "" if r.status_code == 200 else f"fault refused: {r.status_code} {r.text[:100]}"


def reload_policy(path: Path, flip: int) -> None:
    """A harmless edit, saved by rename as editors do: the demo reloads it."""
    policy = yaml.safe_load(path.read_text())
    policy["retry"] = {**policy.get("retry", {}), "max_attempts": 2 + flip % 2}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(policy))
    tmp.replace(path)


class Redis:
    """A redis-server on a fixed port, killed and started again by the rotation."""

    def __init__(self, port: int, log: Path) -> None:
        self.port, self.log = port, log
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no"]
        self.proc = spawn(argv, log=self.log)
        wait_port(self.port)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """Black-holed: connections are accepted by the kernel and never answered."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            stop_process(self.proc)


class Instance:
    """The second gateway instance (``--redis``), killed and started again by the rotation."""

    def __init__(self, policy: Path, port: int, log: Path) -> None:
        self.argv = [sys.executable, "-m", "proxy", "serve", "--config", str(policy)]
        self.argv += ["--port", str(port), "--workers", str(SECOND_WORKERS)]
        self.base, self.log = f"http://127.0.0.1:{port}", log
        self.proc: subprocess.Popen[bytes] | None = None
        self.up = False

    async def start(self) -> None:
        self.proc = spawn(self.argv, log=self.log)
        await asyncio.to_thread(wait_http, self.base + "/ready", 120)
        self.up = True

    def kill(self) -> None:
        self.up = False
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def kill_worker(self) -> int | None:
        """SIGKILL one worker process (its supervisor starts another); its pid."""
        if self.proc is None:
            return None
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except OSError:
            return None
        pids = [int(c) for c in children.split()]
        if not pids:
            return None
        os.kill(pids[0], signal.SIGKILL)
        return pids[0]

    def stop(self) -> None:
        self.up = False
        if self.proc is not None and self.proc.poll() is None:
            stop_process(self.proc)


async def run(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="tokenlane-soak-"))
    ports = [free_port() for _ in range(3)]
    gw_port = free_port()
    policy = soak_policy(ports, gw_port)
    redis: Redis | None = None
    if args.redis:
        if shutil.which("redis-server") is None:
            print("--redis needs redis-server on the PATH (apt-get install redis-server)")
            return 2
        redis = Redis(free_port(), workdir / "redis.log")
        redis.start()
        policy["redis"] = {"url": redis.url}
    names = [r["name"] for pool in policy["pools"].values() for r in pool["replicas"]]
    urls = [r["url"] for pool in policy["pools"].values() for r in pool["replicas"]]
    path = workdir / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    log = workdir / "demo.log"
    base = f"http://127.0.0.1:{gw_port}"
    argv = [sys.executable, "-m", "proxy", "demo", "--policy", str(path)]
    second = Instance(path, free_port(), workdir / "instance-2.log") if redis else None
    # The shared faults first, so a short run (--minutes 2) already meets both.
    rotation = (SHARED_ROTATION if redis else []) + ROTATION
    with contextlib.ExitStack() as cleanup, process(argv, log=log, grace_s=30) as demo:
        await asyncio.to_thread(wait_http, base + "/ready", 120)
        if redis is not None:
            cleanup.callback(redis.stop)
        if second is not None:
            await second.start()
            cleanup.callback(second.stop)
        timeout = aiohttp.ClientTimeout(total=args.client_timeout_s)
        connector = aiohttp.TCPConnector(limit=args.streams + 8)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            url = base + "/v1/chat/completions"
            expected: dict[int, str] = {}
            for p in range(PROMPTS):  # the unfaulted answers
                first = await stream_one(session, url, p, -1, args.max_tokens)
                if first.outcome != OK:
                    print(
                        f"baseline request failed: {first.outcome} {first.detail}", file=sys.stderr
                    )
                    return 1
                expected[p] = first.text
            ended: list[Ended] = []
            minutes: list[Minute] = []
            stop = asyncio.Event()
            minute_now = 0

            async def client(k: int) -> None:
                i = k
                while not stop.is_set():
                    # Odd clients use the second instance while it is up (a balancer's view).
                    to = url
                    if second is not None and k % 2 and second.up:
                        to = second.base + "/v1/chat/completions"
                    e = await stream_one(session, to, i % PROMPTS, minute_now, args.max_tokens)
                    e.minute = minute_now  # the minute it ended in
                    if e.outcome == OK and e.text != expected[e.prompt]:
                        e.outcome, e.detail = (
                            DIFFERS,
                            f"{len(e.text)} chars, expected {len(expected[e.prompt])}",
                        )
                    ended.append(e)
                    i += args.streams
                    if e.retry_after_s > 0:
                        await asyncio.sleep(e.retry_after_s)

            clients = [asyncio.create_task(client(k)) for k in range(args.streams)]
            restarts: list[asyncio.Task[None]] = []
            started = time.monotonic()
            print(f"soak: {args.minutes} min, {args.streams} streams, demo log {log}", flush=True)
            print(_header(), flush=True)
            for m in range(args.minutes):
                minute_now = m
                name, body = rotation[(m - 1) % len(rotation)]
                if m == 0:
                    name, target, note = "none (warm-up)", "-", ""
                elif name == "reload":
                    target, note = "policy", ""
                    reload_policy(path, m)
                elif name == "redis_kill" and redis is not None:
                    target, note = "redis", ""
                    redis.kill()
                    restarts.append(_later(args.fault_s, redis.start))
                elif name == "instance_kill" and second is not None:
                    target, note = "gw-2", ""
                    second.kill()
                    restarts.append(_later(INSTANCE_DOWN_S, second.start))
                elif name == "redis_pause" and redis is not None:
                    target, note = "redis", ""
                    redis.pause()
                    restarts.append(_later(args.fault_s, redis.resume))
                elif name == "worker_kill" and second is not None:
                    target = "gw-2"
                    pid = second.kill_worker()
                    note = f"worker pid {pid}" if pid else "no worker found"
                else:
                    target = names[(m - 1) % len(names)]
                    note = await inject(urls[(m - 1) % len(urls)], body, args.fault_s)
                minutes.append(Minute(name, target))
                await asyncio.sleep(max(0.0, started + 60 * (m + 1) - time.monotonic()))
                row = minutes[-1]
                row.rss_mb, row.fds = rss_mb(demo.pid), fds_of(demo.pid)
                row.ended = Counter(e.outcome for e in ended if e.minute == m)
                print(_row(m, row) + (f"  {note}" if note else ""), flush=True)
            stop.set()
            await asyncio.wait(clients + restarts, timeout=args.client_timeout_s + 10)
        lines = access_lines(log)
        if second is not None:
            lines.update(access_lines(second.log))
    return _report(args, ended, minutes, lines, log)


def _later(delay_s: float, start: Callable[[], Any]) -> asyncio.Task[None]:
    """Run ``start`` (a function or a coroutine function) after ``delay_s``."""

    async def later() -> None:
        await asyncio.sleep(delay_s)
        result = start()
        if asyncio.iscoroutine(result):
            await result
        else:
            await asyncio.sleep(0)

    return asyncio.create_task(later())


def _header() -> str:
    return (
        f"{'min':>3} {'fault':<14} {'target':<8} {'ended':>6} {'ok':>6} {'before':>6} "
        f"{'mid':>4} {'differ':>6} {'hang':>4} {'RSS MB':>7} {'fds':>5}"
    )


def _row(m: int, row: Minute) -> str:
    c = row.ended
    return (
        f"{m:>3} {row.fault:<14} {row.target:<8} {sum(c.values()):>6} {c[OK]:>6} "
        f"{c[BEFORE_FIRST]:>6} {c[MID_STREAM]:>4} {c[DIFFERS]:>6} {c[HANG]:>4} "
        f"{row.rss_mb:>7.1f} {row.fds:>5}"
    )


def _report(
    args: argparse.Namespace,
    ended: list[Ended],
    minutes: list[Minute],
    lines: dict[str, dict[str, Any]],
    log: Path,
) -> int:
    total = Counter(e.outcome for e in ended)
    continued = sum(
        1 for e in ended if e.request_id and (lines.get(e.request_id) or {}).get("continuations")
    )
    by_fault: dict[str, Counter[str]] = {}
    for e in ended:
        if e.outcome != OK and 0 <= e.minute < len(minutes):
            by_fault.setdefault(minutes[e.minute].fault, Counter())[e.outcome] += 1
    points = [(float(m), row.rss_mb) for m, row in enumerate(minutes) if m >= 1]
    slope = rss_slope(points)
    traceback = "Traceback" in log.read_text(errors="replace")
    print()
    print(f"requests {len(ended)}: " + ", ".join(f"{k} {v}" for k, v in sorted(total.items())))
    print(f"streams continued on another replica: {continued}")
    for fault, c in by_fault.items():
        print(f"  failures during {fault}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    why: Counter[str] = Counter()
    for e in ended:
        if e.outcome in (BEFORE_FIRST, MID_STREAM) and 0 <= e.minute < len(minutes):
            error = str((lines.get(e.request_id or "") or {}).get("error") or e.detail)
            # "... ; not continued: <reason>" names why a stream was not saved
            why[f"{minutes[e.minute].fault}: {error.rpartition('; ')[2][:70]}"] += 1
    for reason, n in why.most_common(12):
        print(f"  {n:>6}  {reason}")
    for e in [e for e in ended if e.outcome != OK][:10]:
        print(f"  e.g. minute {e.minute} {e.outcome}: {e.detail}")
    print(f"RSS growth after the warm-up minute: {slope:+.2f} MB/min (target < 1)")
    fds = [row.fds for row in minutes]
    if fds:
        print(f"open fds: first {fds[0]}, last {fds[-1]}, max {max(fds)}")
    print(f"traceback in the gateway's log: {'yes' if traceback else 'no'} ({log})")
    lost = total[DIFFERS]
    print(f"targets: lost or repeated tokens {lost} (0), hangs {total[HANG]} (0)")
    return 0 if lost == 0 and total[HANG] == 0 and slope < 1.0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--minutes", type=int, default=30, help="length of the run (one fault a minute)"
    )
    parser.add_argument("--streams", type=int, default=24, help="concurrent streaming clients")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--fault-s", type=float, default=35.0, help="how long each fault lasts")
    parser.add_argument("--client-timeout-s", type=float, default=120.0, help="a hang, past this")
    parser.add_argument(
        "--redis",
        action="store_true",
        help="shared state in a Redis, a second instance, and their SIGKILLs in the rotation",
    )
    args = parser.parse_args(argv)
    return asyncio.run(run(args))


if __name__ == "__main__":
    raise SystemExit(main())
