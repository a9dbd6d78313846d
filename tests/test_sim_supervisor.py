"""The simulator as a process: the CLI's start-up line, flags, crash, and the supervisor."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from loadtest.sim.supervisor import SimSpec, Supervisor, restart_args

from .waiting import wait_until_sync

SIM = [sys.executable, "-m", "loadtest.sim"]


@contextlib.contextmanager
def _sim_process(*args: str):
    proc = subprocess.Popen(
        [*SIM, "--port", "0", "--exit-on-stdin-eof", *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0); it is gone once its state says so.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=1).status_code
    except httpx.HTTPError:
        return None


def test_cli_prints_its_url_serves_and_exits_when_its_lifeline_closes():
    with _sim_process("--name", "cli-test") as proc:
        event = json.loads(proc.stdout.readline())
        assert event["event"] == "listening" and event["name"] == "cli-test"
        assert event["url"].startswith("http://127.0.0.1:") and event["pid"] == proc.pid
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        resp = httpx.post(event["url"] + "/v1/chat/completions", json=chat, timeout=10)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        proc.stdin.close()
        assert proc.wait(10) == 0


def test_cli_names_itself_after_its_port_and_starts_with_a_fault():
    with _sim_process("--fault", "health_fail", "--fault-param", "status=500") as proc:
        event = json.loads(proc.stdout.readline())
        assert event["name"] == "sim-" + event["url"].rsplit(":", 1)[1]
        assert _health(event["url"]) == 500


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--no-enable-chunked-prefill", "--max-num-batched-tokens", "100"], "chunked prefill"),
        (["--fault", "slow"], "'factor' is required"),
        (["--fault-param", "rate=1"], "--fault-param needs --fault"),
        (["--num-gpu-blocks", "0"], "--num-gpu-blocks must be at least 1"),
    ],
)
def test_cli_rejects_bad_flags_with_exit_status_2(args, message):
    done = subprocess.run([*SIM, "--port", "0", *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and message in done.stderr


def test_restart_args_drop_the_fault_and_keep_the_first_port():
    args = ["--port", "0", "--fault", "crash", "--fault-param=duration_s=1", "--fault-json",
            "{}", "--name", "a", "--max-num-seqs", "8"]  # fmt: skip
    assert restart_args(args, 4321) == ["--name", "a", "--max-num-seqs", "8", "--port", "4321"]
    assert restart_args(["--port=0", "--name", "b"], 99) == ["--name", "b", "--port", "99"]


def test_crash_exits_the_process_and_the_supervisor_restarts_it_after_duration():
    sup = Supervisor([SimSpec("a", ["--port", "0"]), SimSpec("b", ["--port", "0"])])
    pids: set[int] = set()
    try:
        urls = sup.start()
        pids |= {s["pid"] for s in sup.status()}
        url = urls["a"]
        assert _health(url) == 200
        resp = httpx.post(url + "/sim/fault", json={"fault": "crash", "duration_s": 1.0}, timeout=5)
        assert resp.status_code == 200
        t0 = time.monotonic()
        wait_until_sync(
            lambda: sup.status()[0]["state"] == "crashed",
            what='sup.status()[0]["state"] == "crashed"',
        )
        assert sup.status()[0]["exit_code"] == 70
        assert _health(url) is None  # nothing listens while it is down
        wait_until_sync(lambda: _health(url) == 200, what="_health(url) == 200")
        assert time.monotonic() - t0 >= 0.9  # not before duration_s
        wait_until_sync(
            lambda: sup.status()[0]["state"] == "running",
            what='sup.status()[0]["state"] == "running"',
        )
        a, b = sup.status()
        pids |= {a["pid"], b["pid"]}
        assert (a["state"], a["restarts"], b["restarts"]) == ("running", 1, 0)
        assert sup.urls["a"] == url  # same port after the restart
        stats = httpx.get(url + "/sim/stats", timeout=5).json()
        assert stats["fault"] is None and stats["requests_received"] <= 2  # a fresh process
    finally:
        sup.stop()
    assert len(pids) == 3
    for pid in pids:
        wait_until_sync(lambda pid=pid: _gone(pid), what="lambda pid=pid: _gone(pid)")


async def test_supervisor_runs_from_asyncio_with_bare_argument_lists():
    sup = Supervisor([["--port", "0", "--name", "x"], ["--port", "0"]])
    try:
        urls = await sup.astart()
        assert set(urls) == {"x", "sim-1"}
        async with httpx.AsyncClient(timeout=5) as c:
            for url in urls.values():
                assert (await c.get(url + "/health")).status_code == 200
        pids = [s["pid"] for s in sup.status()]
    finally:
        await sup.astop()
    assert all(s["state"] == "stopped" for s in sup.status())
    for pid in pids:
        wait_until_sync(lambda pid=pid: _gone(pid), what="lambda pid=pid: _gone(pid)")
