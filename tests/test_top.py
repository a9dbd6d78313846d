"""`tokenlane top`: the arithmetic on plain data, and the real command driven in a
pseudo-terminal against a running gateway while one of its replicas stalls."""

from __future__ import annotations

import asyncio
import os
import pty
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from loadtest.sim.server import run_sim
from proxy.observe.top import parse, quantile, view

from .gateway import policy_for, running_gateway, wait_healthy
from .servers import free_port

ROOT = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Between two cells of a table row: spaces and the column rule rich draws ("│", "┃" or "|").
CELL = r"[ │┃|]+"
# A screen is a few kilobytes: each look at the output goes this far back before the new bytes.
SCREEN_BYTES = 64 * 1024


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        (0.5, {0.1: 0, 0.2: 10, float("inf"): 10}, 0.15),
        (0.99, {0.1: 0, 0.2: 10, float("inf"): 10}, 0.199),
        (0.5, {0.1: 10, float("inf"): 10}, 0.05),
        (0.99, {0.1: 0, float("inf"): 10}, 0.1),  # in +Inf: the last finite bound
        (0.5, {0.1: 0, float("inf"): 0}, None),  # no requests: no quantile
        (0.5, {}, None),
    ],
)
def test_quantile_is_prometheus_histogram_quantile(
    q: float, buckets: dict[float, float], expected: float | None
) -> None:
    got = quantile(q, buckets)
    assert got == (pytest.approx(expected) if expected is not None else None)


METRICS_T0 = """
tokenlane_requests_total{lane="short",pool="i",replica="a",status="200"} 10
tokenlane_rejections_total{lane="short",reason="queue_full"} 1
tokenlane_queue_depth{lane="short"} 3
tokenlane_lane_max_queue{lane="short"} 64
tokenlane_ttft_seconds_bucket{lane="short",pool="i",le="0.1"} 10
tokenlane_ttft_seconds_bucket{lane="short",pool="i",le="1.0"} 10
tokenlane_ttft_seconds_bucket{lane="short",pool="i",le="+Inf"} 10
"""
METRICS_T1 = """
tokenlane_requests_total{lane="short",pool="i",replica="a",status="200"} 30
tokenlane_rejections_total{lane="short",reason="queue_full"} 5
tokenlane_queue_depth{lane="short"} 7
tokenlane_lane_max_queue{lane="short"} 64
tokenlane_ttft_seconds_bucket{lane="short",pool="i",le="0.1"} 10
tokenlane_ttft_seconds_bucket{lane="short",pool="i",le="1.0"} 30
tokenlane_ttft_seconds_bucket{lane="short",pool="i",le="+Inf"} 30
"""


def replica(tokens: float, state: str = "healthy", reason: str | None = None) -> dict:
    return {
        "pool": "i", "name": "a", "state": state, "reason": reason, "in_flight": 2,
        "ejections": 1 if reason else 0,
        "stats": {"generation_tokens_total": tokens, "kv_cache_usage": 0.25, "stale": False},
    }  # fmt: skip


def test_view_takes_rates_and_ttft_over_the_last_interval() -> None:
    t0 = parse(METRICS_T0, [replica(100)], at=10.0)
    t1 = parse(METRICS_T1, [replica(300, "ejected", "stall")], at=12.0)
    first = view(t0, None)
    (lane,) = first.lanes
    assert lane.rate == 0 and lane.p50 == pytest.approx(0.05)  # history until a second refresh
    v = view(t1, t0)
    (lane,) = v.lanes
    assert lane.rate == pytest.approx(10.0) and lane.rejections_rate == pytest.approx(2.0)
    assert lane.queue == 7 and lane.max_queue == 64 and lane.rejections == 5
    # the last interval's 20 requests all took 0.1 - 1.0 s; the first 10 are history
    assert 0.1 < lane.p50 < 1.0
    (r,) = v.replicas
    assert r.tokens_s == pytest.approx(100.0) and r.kv == 0.25
    assert (r.state, r.reason, r.ejections, r.in_flight) == ("ejected", "stall", 1, 2)


def test_a_restarted_gateway_gives_no_negative_rate() -> None:
    t0 = parse(METRICS_T1, [], at=1.0)
    t1 = parse(METRICS_T0, [], at=2.0)
    assert view(t1, t0).lanes[0].rate >= 0


class Terminal:
    """`python -m proxy top ...` in a pseudo-terminal; its screen output collected as text."""

    def __init__(self, *args: str) -> None:
        master, slave = pty.openpty()
        env = {**os.environ, "COLUMNS": "160", "LINES": "50", "TERM": "xterm-256color",
               "PYTHONPATH": str(ROOT)}  # fmt: skip
        env.pop("TOKENLANE_ADMIN_TOKEN", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "top", *args],
            stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT, close_fds=True,
        )  # fmt: skip
        os.close(slave)
        self.master = master
        self.raw = b""
        self.ended = False  # the command's output reached its end: it exited
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                break
            if not chunk:
                break
            with self.changed:
                self.raw += chunk
                self.changed.notify_all()
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    @property
    def text(self) -> str:
        return self._text_from(0)

    def _text_from(self, start: int) -> str:
        return ANSI.sub("", self.raw[start:].decode(errors="replace"))

    def wait_for(self, pattern: str, timeout_s: float = 180.0) -> str:
        """Until the output matches ``pattern``; returns the latest screen. Generous: the
        command starts a Python interpreter, slow on a loaded machine. Only the bytes since the
        last look (and a screen before them) are searched: the live view redraws 4 times a
        second, and searching the whole history each time would starve the reader."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        with self.changed:
            while True:
                start = max(0, seen - SCREEN_BYTES)
                seen = len(self.raw)
                if re.search(pattern, self._text_from(start)):
                    return self._text_from(max(0, seen - SCREEN_BYTES))
                left = deadline - time.monotonic()
                assert left > 0, f"{pattern!r} never shown; screen:\n{self.text[-3000:]}"
                assert not self.ended, f"exited before {pattern!r}:\n{self.text[-3000:]}"
                self.changed.wait(min(left, 0.5))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        os.close(self.master)


async def test_top_shows_a_stalled_replica_ejected_with_an_admin_token() -> None:
    token = "s3cret-admin"
    async with run_sim(name="fast-0") as fast, run_sim(name="bulk-0") as bulk:
        policy = policy_for(
            {"interactive": [fast.url], "bulk": [bulk.url]},
            lanes=[
                {
                    "name": "short",
                    "pool": "interactive",
                    "when": {"stream": True},
                    "spill_to": "bulk",
                    "first_token_timeout_s": 60,
                },
                {"name": "long", "pool": "bulk"},
            ],
            health={"interval_s": 0.25, "stall_after_s": 1.0, "eject_base_s": 300},
        )
        policy["pools"]["interactive"]["replicas"][0]["name"] = "fast-0"
        policy["pools"]["bulk"]["replicas"][0]["name"] = "bulk-0"
        env = {"TOKENLANE_ADMIN_TOKEN": token}
        async with running_gateway(policy, ready=False, environ=env) as (url, app):
            await wait_healthy(app, 2)
            # Without the token the admin API refuses, and top says so.
            bare = Terminal("--url", url)
            try:
                await asyncio.to_thread(bare.wait_for, r"answered 401.*admin-token")
            finally:
                bare.close()
            term = Terminal("--url", url, "--admin-token", token)
            try:
                await asyncio.to_thread(term.wait_for, rf"fast-0{CELL}healthy")
                async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                    await fast.set_fault({"fault": "stall"})
                    body = {
                        "model": "Qwen/Qwen2.5-0.5B-Instruct", "stream": True, "max_tokens": 16,
                        "messages": [{"role": "user", "content": "hi"}],
                    }  # fmt: skip
                    r = await client.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200
                screen = await asyncio.to_thread(term.wait_for, rf"fast-0{CELL}ejected{CELL}stall")
                assert re.search(rf"bulk-0{CELL}healthy", screen)
                assert re.search(rf"short{CELL}[\d.]+{CELL}0/\d+", screen)  # the lanes table
                await fast.set_fault(None)
            finally:
                term.close()


def test_top_says_when_the_gateway_is_unreachable() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    term = Terminal("--url", url, "--interval", "0.2")
    try:
        term.wait_for(r"gateway unreachable at " + re.escape(url) + r": ConnectError")
    finally:
        term.close()
