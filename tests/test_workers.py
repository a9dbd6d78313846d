"""`tokenlane serve --workers 2` as a user runs it: one port, two worker processes, one gateway.

Each test runs the real command (a supervisor and its workers) against fake replicas served in
this loop, and looks at each worker on its own through the workers' own sockets (the
questions ``proxy.workers.mesh`` answers), so that "every worker" is seen, not assumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.fake_upstream import MODEL, running
from loadtest.sim.server import run_sim
from proxy.workers.mesh import ask, socket_path

from .gateway import policy_for, running_gateway
from .redis_server import running_redis
from .servers import FAST_SIM, free_port
from .waiting import wait_until

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class Serve:
    url: str
    proc: subprocess.Popen[bytes]
    rundir: str
    out: Path
    err: Path
    config: Path

    async def ask(self, worker: int, message: dict[str, Any]) -> dict[str, Any] | None:
        """The worker's answer; None while it is down or still starting."""
        answer = await ask(socket_path(self.rundir, worker), message, 5.0)
        return None if answer is None or "error" in answer else answer

    async def worker_metric(self, worker: int, name: str, **labels: str) -> float:
        """One worker's own value of a sample (0 when it has none)."""
        answer = await self.ask(worker, {"ask": "metrics"})
        assert answer is not None, f"worker {worker} did not answer"
        total = 0.0
        for fam in answer["families"]:
            for sample_name, sample_labels, value in fam["samples"]:
                if sample_name == name and all(
                    sample_labels.get(k) == v for k, v in labels.items()
                ):
                    total += value
        return total

    async def everywhere(self, url: str, state: str) -> bool:
        """Every worker's own view has the replica at ``url`` in ``state``."""
        for w in (0, 1):
            answer = await self.ask(w, {"ask": "sync"})
            assert answer is not None
            if {x["url"]: x["state"] for x in answer["records"]}[url] != state:
                return False
        return True

    def worker_pids(self) -> list[int]:
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(p) for p in path.read_text().split()]

    def access_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.out.read_text().splitlines() if line]


@contextlib.asynccontextmanager
async def serve_workers(
    policy: dict[str, Any], tmp: Path, *, workers: int = 2, env: dict[str, str] | None = None
) -> AsyncIterator[Serve]:
    port = free_port()
    config = tmp / "policy.yaml"
    config.write_text(yaml.safe_dump(policy))
    out, err = tmp / "stdout", tmp / "stderr"
    argv = [
        sys.executable, "-m", "proxy", "serve", "--config", str(config),
        "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers),
    ]  # fmt: skip
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(
            argv, stdout=o, stderr=e, env={**os.environ, **(env or {})}, start_new_session=True
        )
    serve = Serve(f"http://127.0.0.1:{port}", proc, "", out, err, config)
    try:

        def rundir() -> bool:
            found = re.search(r"run directory (\S+)\)", err.read_text())
            if found:
                serve.rundir = found.group(1)
            return proc.poll() is not None or bool(found)

        await wait_until(rundir, what="the supervisor started", timeout=60)
        assert proc.poll() is None, err.read_text()[-3000:]

        async def every_worker_ready() -> bool:
            for w in range(workers):
                answer = await serve.ask(w, {"ask": "sync"})
                if answer is None or not any(r["state"] == "healthy" for r in answer["records"]):
                    return False
            return True

        await wait_until(every_worker_ready, what="every worker ready", timeout=120, poll=0.05)
        yield serve
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)  # the supervisor passes it on
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        for pid in _leftover(serve):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _exited(pid: int) -> bool:
    """The process has exited (a zombie, its files closed, or reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _leftover(serve: Serve) -> list[int]:
    """Workers still alive after their supervisor ended (there must be none)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                cmd = (entry / "cmdline").read_bytes()
                if serve.rundir and serve.rundir.encode() in cmd:
                    out.append(int(entry.name))
    return out


async def metric(client: httpx.AsyncClient, url: str, name: str) -> dict[str, float]:
    """A merged scrape's samples of ``name``: label text → value."""
    text = (await client.get(url + "/metrics")).text
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


async def until_both_workers_served(serve: Serve, client: httpx.AsyncClient) -> None:
    """New connections until each worker has answered a request (the kernel spreads them)."""
    for _ in range(400):
        counts = [await serve.worker_metric(w, "tokenlane_requests_total") for w in (0, 1)]
        if all(counts):
            return
        async with httpx.AsyncClient(timeout=30) as fresh:
            r = await fresh.post(serve.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2})
            assert r.status_code == 200
    raise AssertionError("the kernel never gave worker 0 and worker 1 a connection each")


async def test_two_workers_are_one_gateway_for_limits_metrics_and_the_access_log(
    tmp_path: Path,
) -> None:
    async with running(tokens=20, interval_s=0.02) as up:
        policy = policy_for({"p": [up.url]}, lanes=[{"name": "all", "pool": "p", "max_queue": 64}])
        policy["pools"]["p"]["replicas"][0]["max_in_flight"] = 3
        async with serve_workers(policy, tmp_path) as serve:
            async with httpx.AsyncClient(timeout=60) as client:
                await until_both_workers_served(serve, client)
                warmup = len(serve.access_lines())

                async def stream() -> str:
                    async with httpx.AsyncClient(timeout=60) as own:  # its own connection
                        body = {**CHAT, "stream": True, "max_tokens": 20}
                        r = await own.post(serve.url + "/v1/chat/completions", json=body)
                        return f"{r.status_code} {r.text[-40:]}"

                results = await asyncio.gather(*(stream() for _ in range(16)))
                assert all(r.startswith("200") and "[DONE]" in r for r in results), results
                # The replica's limit is the gateway's, not each worker's: never 4 at once.
                assert up.stats.max_streaming == 3
                # Both workers queued and served some of the 16.
                per_worker = [
                    await serve.worker_metric(w, "tokenlane_requests_total", status="200")
                    for w in (0, 1)
                ]
                assert all(per_worker), per_worker
                total = warmup + 16
                assert sum(per_worker) == total
                # Any scrape, whichever worker answers it, counts every request exactly.
                for _ in range(6):
                    async with httpx.AsyncClient() as fresh:
                        served = await metric(fresh, serve.url, "tokenlane_requests_total")
                        assert sum(served.values()) == total, served
                        scraped = await metric(fresh, serve.url, "tokenlane_workers_scraped")
                        assert scraped == {"tokenlane_workers_scraped": 2.0}

                def all_lines() -> bool:
                    return len(serve.access_lines()) == total

                # One whole JSON line per request, whichever worker wrote it.
                await wait_until(all_lines, what=f"{total} access lines", timeout=30)
                assert [line["status"] for line in serve.access_lines()].count(200) == total


async def test_a_killed_worker_comes_back_and_what_it_held_is_free_at_once(tmp_path: Path) -> None:
    async with running(tokens=400, interval_s=0.05) as up:  # a stream lasts ~20 s
        policy = policy_for({"p": [up.url]})
        policy["pools"]["p"]["replicas"][0]["max_in_flight"] = 2
        async with serve_workers(policy, tmp_path) as serve:
            async with httpx.AsyncClient(timeout=60) as client:
                await until_both_workers_served(serve, client)
                pids = serve.worker_pids()
                assert len(pids) == 2

                async def long_stream() -> None:
                    with contextlib.suppress(httpx.HTTPError):
                        async with httpx.AsyncClient(timeout=60) as own:
                            body = {**CHAT, "stream": True}
                            await own.post(serve.url + "/v1/chat/completions", json=body)

                streams = [asyncio.create_task(long_stream()) for _ in range(2)]
                await wait_until(lambda: up.stats.streaming == 2, what="two long streams")
                held = [await serve.worker_metric(w, "tokenlane_replica_in_flight") for w in (0, 1)]
                victim = 0 if held[0] else 1
                answer = await serve.ask(victim, {"ask": "sync"})
                assert answer is not None
                victim_pid = answer["pid"]
                assert victim_pid in pids
                # What it has counted (at least one request: until_both_workers_served).
                counted = await serve.worker_metric(victim, "tokenlane_requests_total")
                assert counted >= 1
                os.kill(victim_pid, signal.SIGKILL)
                # Its listening socket goes with it: until then a new connection could be
                # hashed to it and reset (``docs/workers.md``).
                await wait_until(lambda: _exited(victim_pid), what="the killed worker gone")

                # Its slot is free again: a new stream starts while the other long one runs.
                async with httpx.AsyncClient(timeout=60) as own:
                    body = {**CHAT, "stream": True, "max_tokens": 3}
                    r = await own.post(serve.url + "/v1/chat/completions", json=body)
                assert r.status_code == 200 and "[DONE]" in r.text
                # ...inside the survivor's long streams: without the dead worker's slots freed,
                # the limit (2) would have held this one back until those ended.
                assert sum(not t.done() for t in streams) == held[1 - victim]

                def back() -> bool:
                    now = serve.worker_pids()
                    return len(now) == 2 and victim_pid not in now

                await wait_until(back, what="the killed worker restarted", timeout=60)

                async def answers() -> bool:
                    return await serve.ask(victim, {"ask": "sync"}) is not None

                await wait_until(answers, what="the new worker answering", timeout=60)
                assert "starting it again" in serve.err.read_text()
                # The new worker counts on from its slot's counts (its stream died unfinished,
                # and it has served nothing since): the serve's sums never drop.
                assert await serve.worker_metric(victim, "tokenlane_requests_total") == counted
                assert await serve.worker_metric(victim, "tokenlane_replica_in_flight") == 0
                for t in streams:
                    t.cancel()


async def test_reloads_operator_actions_and_rate_limits_hold_for_every_worker(
    tmp_path: Path,
) -> None:
    async with running(tokens=3) as up, running(tokens=3) as up2:
        policy = policy_for(
            {"p": [up.url, up2.url]},
            server={"admin_token_env": "NO_SUCH_TOKEN_VAR"},
            rate_limits={"requests_per_min": 6},
        )
        env = {"TOKENLANE_API_KEYS": "k-one"}
        async with serve_workers(policy, tmp_path, env=env) as serve:
            auth = {"authorization": "Bearer k-one"}

            async def versions() -> list[int]:
                out = []
                for w in (0, 1):
                    answer = await serve.ask(w, {"ask": "sync"})
                    assert answer is not None
                    out.append(answer["version"])
                return out

            async with httpx.AsyncClient(timeout=30) as client:
                # A reload asked of whichever worker: both run version 2 after it.
                policy["lanes"][0]["queue_timeout_s"] = 7
                serve.config.write_text(yaml.safe_dump(policy))
                r = await client.post(serve.url + "/admin/reload")
                assert r.json()["version"] == 2
                assert await versions() == [2, 2]
                # A bad file is refused by all: both keep version 2.
                serve.config.write_text("pools: [not, a, mapping]\n")
                r = await client.post(serve.url + "/admin/reload")
                assert r.status_code == 422
                assert await versions() == [2, 2]
                # A worker that restarts while the file is broken starts from what the
                # leader runs (version 2), not from the file.
                answer = await serve.ask(1, {"ask": "sync"})
                assert answer is not None
                os.kill(answer["pid"], signal.SIGKILL)

                async def back_at_2() -> bool:
                    again = await serve.ask(1, {"ask": "sync"})
                    return again is not None and again["pid"] != answer["pid"]

                await wait_until(back_at_2, what="worker 1 restarted", timeout=60)
                assert await versions() == [2, 2]
                serve.config.write_text(yaml.safe_dump(policy))
                # SIGHUP to the supervisor: the leader reloads for all.
                policy["lanes"][0]["queue_timeout_s"] = 8
                serve.config.write_text(yaml.safe_dump(policy))
                os.kill(serve.proc.pid, signal.SIGHUP)

                async def at_3() -> bool:
                    return await versions() == [3, 3]

                await wait_until(at_3, what="both workers at version 3", timeout=30)

                # An operator's ejection, asked of whichever worker, reaches both.
                r = await client.post(serve.url + "/admin/replicas/eject", json={"url": up2.url})
                assert r.status_code == 200

                await wait_until(
                    lambda: serve.everywhere(up2.url, "ejected"),
                    what="the ejection in both workers",
                )

                # The key's 6 requests a minute are the gateway's: over fresh connections
                # (spread over both workers) exactly 6 pass.
                codes = []
                for _ in range(9):
                    async with httpx.AsyncClient(timeout=30) as fresh:
                        r = await fresh.post(
                            serve.url + "/v1/chat/completions", json=CHAT, headers=auth
                        )
                        codes.append(r.status_code)
                assert sorted(codes) == [200] * 6 + [429] * 3, codes
                # Ejected in both workers: no client request went there (canaries may have).
                assert [h for h in up2.stats.headers if "x-tokenlane-canary" not in h] == []


async def test_sigterm_drains_every_worker_then_the_serve_exits(tmp_path: Path) -> None:
    async with running(tokens=30, interval_s=0.05) as up:  # ~1.5 s streams
        policy = policy_for({"p": [up.url]}, server={"shutdown_grace_s": 30})
        async with serve_workers(policy, tmp_path) as serve:
            async with httpx.AsyncClient(timeout=60) as client:
                await until_both_workers_served(serve, client)
                texts: list[str] = []

                async def stream() -> None:
                    async with httpx.AsyncClient(timeout=60) as own:
                        body = {**CHAT, "stream": True}
                        r = await own.post(serve.url + "/v1/chat/completions", json=body)
                        texts.append(r.text)

                tasks = [asyncio.create_task(stream()) for _ in range(6)]
                await wait_until(lambda: up.stats.streaming == 6, what="six streams")
                os.kill(serve.proc.pid, signal.SIGTERM)
                await asyncio.gather(*tasks)
                assert len(texts) == 6 and all(t.rstrip().endswith("[DONE]") for t in texts)
                code = await asyncio.to_thread(serve.proc.wait, 60)
                assert code == 0
                assert _leftover(serve) == []


async def test_a_sigkilled_supervisor_takes_its_workers_with_it(tmp_path: Path) -> None:
    """Orphaned workers would go on serving the port with nobody to restart them or to carry
    their log lines: they drain and end with their supervisor, and the port is free again."""
    async with running(tokens=20, interval_s=0.05) as up:  # ~1 s streams
        policy = policy_for({"p": [up.url]}, server={"shutdown_grace_s": 30})
        async with serve_workers(policy, tmp_path) as serve:
            pids = serve.worker_pids()
            assert len(pids) == 2
            async with httpx.AsyncClient(timeout=60) as client:
                stream = asyncio.create_task(
                    client.post(serve.url + "/v1/chat/completions", json={**CHAT, "stream": True})
                )
                await wait_until(lambda: up.stats.streaming == 1, what="a stream under way")
                os.kill(serve.proc.pid, signal.SIGKILL)
                # The stream under way is drained, not cut.
                r = await stream
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")

            def gone() -> bool:
                return not _leftover(serve)

            await wait_until(gone, what="the workers ended", timeout=60)
            port = int(serve.url.rsplit(":", 1)[1])
            with socket.socket() as sock:  # a new serve could take the port
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))


async def test_workers_with_redis_share_with_another_instance(tmp_path: Path) -> None:
    """With redis.url set each worker is also an instance of the Redis-shared gateway: a serve
    of two workers and a second gateway agree on an ejection, and serve."""
    with running_redis() as redis:
        async with running(tokens=3) as up, running(tokens=3) as up2:
            policy = policy_for(
                {"p": [up.url, up2.url]},
                redis={"url": redis.url, "timeout_ms": 2000, "heartbeat_s": 0.2, "ttl_s": 1.0},
            )
            async with serve_workers(policy, tmp_path) as serve:
                async with running_gateway(policy) as (other_url, other):
                    async with httpx.AsyncClient(timeout=30) as client:
                        r = await client.post(
                            other_url + "/admin/replicas/eject", json={"url": up2.url}
                        )
                        assert r.status_code == 200

                        await wait_until(
                            lambda: serve.everywhere(up2.url, "ejected"),
                            what="ejected in the serve",
                        )
                        for _ in range(6):
                            async with httpx.AsyncClient(timeout=30) as fresh:
                                r = await fresh.post(serve.url + "/v1/chat/completions", json=CHAT)
                                assert r.status_code == 200
                        clients = [h for h in up2.stats.headers if "x-tokenlane-canary" not in h]
                        assert clients == []
                        assert other.gateway.shared.up


async def test_a_detector_in_a_worker_ejects_for_every_worker(tmp_path: Path) -> None:
    """A replica that never sends a first token is ejected by the traffic's own detector in
    whichever worker sees it (the prober finds nothing wrong: its counters move), and every
    worker stops sending it requests."""
    async with running(tokens=3) as good, running(tokens=3, interval_s=0.01) as stuck:
        stuck.first_token_delay_s = 600.0
        policy = policy_for(
            {"p": [good.url, stuck.url]},
            lanes=[{"name": "all", "pool": "p", "first_token_timeout_s": 0.5}],
        )
        async with serve_workers(policy, tmp_path) as serve:

            async def one() -> int:
                async with httpx.AsyncClient(timeout=60) as fresh:
                    body = {**CHAT, "stream": True}
                    r = await fresh.post(serve.url + "/v1/chat/completions", json=body)
                    return r.status_code

            async def ejected() -> bool:
                assert await one() == 200  # retried on the good replica
                return await serve.everywhere(stuck.url, "ejected")

            await wait_until(ejected, what="the stuck replica ejected in both workers", poll=0.0)
            for w in (0, 1):
                answer = await serve.ask(w, {"ask": "sync"})
                assert answer is not None
                (rec,) = [x for x in answer["records"] if x["url"] == stuck.url]
                assert rec["reason"] == "first_token_timeout"


async def test_a_stored_response_learned_by_one_worker_is_found_by_the_other(
    tmp_path: Path,
) -> None:
    """Responses API affinity across workers: a response created through one worker is
    retrieved through either, always from the replica that holds it (an id a worker never
    heard of would get vLLM's 404 without a replica being asked)."""
    async with run_sim(FAST_SIM, name="a") as a, run_sim(FAST_SIM, name="b") as b:
        async with serve_workers(policy_for({"p": [a.url, b.url]}), tmp_path) as serve:
            async with httpx.AsyncClient(timeout=30) as client:
                made = await client.post(
                    serve.url + "/v1/responses",
                    json={"model": MODEL, "input": "hello", "max_output_tokens": 4},
                )
                assert made.status_code == 200, made.text
                rid, home = made.json()["id"], made.headers["x-tokenlane-replica"]

            async def retrieved_by_both() -> bool:
                async with httpx.AsyncClient(timeout=30) as fresh:  # a new connection
                    got = await fresh.get(serve.url + f"/v1/responses/{rid}")
                assert got.status_code == 200, got.text
                assert got.json()["id"] == rid and got.headers["x-tokenlane-replica"] == home
                served = [await serve.worker_metric(w, "tokenlane_requests_total") for w in (0, 1)]
                return all(served)  # each worker has answered (the create, or a retrieve)

            await wait_until(retrieved_by_both, what="the response retrieved through both workers")


async def test_a_prefix_placed_by_one_worker_is_matched_by_the_other(tmp_path: Path) -> None:
    """``cache_aware`` across workers: where one worker sent a prompt, the other worker knows
    it too (its own index learns the placement), so a later request with the same prefix is
    matched and sent to the same replica whichever worker takes it."""
    system = " ".join(f"rule{i} keeps the answer short and exact." for i in range(80))

    def body(question: str) -> dict[str, Any]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return {"model": MODEL, "messages": messages, "max_tokens": 2}

    async def served() -> list[float]:
        return [await serve.worker_metric(w, "tokenlane_requests_total") for w in (0, 1)]

    async def send(question: str) -> tuple[int, str]:
        """Which worker took it, and the replica it went to."""
        before = await served()
        async with httpx.AsyncClient(timeout=30) as fresh:  # a new connection
            r = await fresh.post(serve.url + "/v1/chat/completions", json=body(question))
        assert r.status_code == 200, r.text
        after = await served()
        (worker,) = [w for w in (0, 1) if after[w] > before[w]]
        return worker, r.headers["x-tokenlane-replica"]

    async with run_sim(FAST_SIM, name="a") as a, run_sim(FAST_SIM, name="b") as b:
        policy = policy_for({"p": [a.url, b.url]}, balance="cache_aware")
        async with serve_workers(policy, tmp_path) as serve:
            first, home = await send("question 0")
            other = 1 - first

            async def other_learned() -> bool:
                blocks = await serve.worker_metric(
                    other, "tokenlane_prefix_index_blocks", replica=home
                )
                return blocks > 0

            await wait_until(other_learned, what=f"worker {other} learned the placement")
            # Until the other worker takes one (the kernel spreads new connections).
            for i in range(1, 400):
                worker, replica = await send(f"question {i}")
                assert replica == home, (i, worker)
                if worker == other:
                    break
            else:
                raise AssertionError(f"worker {other} never took a connection")
            matched = await serve.worker_metric(other, "tokenlane_prefix_match_tokens_sum")
            assert matched > 0  # its own pick matched the prefix: it did not guess
