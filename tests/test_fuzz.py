"""The fuzz suite: generated request bodies through a real gateway process in front of two
simulated vLLM replicas, over real sockets (``tests/fuzz_bodies.py`` says what is generated).

Pass means, for every body: an answer (no hang within the client's timeout, no reset); no 5xx
that the gateway produced itself (the access line's ``error_origin`` tells it from a relayed
one; the simulator answers bad bodies with vLLM's 4xx, so a relayed 5xx fails too); a stream
answered 200 ends with its API's end event (``[DONE]``, ``message_stop``, ``response.completed``
...); one access line per request. After every batch the gateway
still answers a valid request; at the end no traceback is in its log and its RSS grew by less
than ``RSS_GROWTH_MB``.

``make test`` sends a 500-body slice; ``make fuzz`` sends 10,000 (``TOKENLANE_FUZZ_BODIES``),
seeded by ``TOKENLANE_FUZZ_SEED``: the same seed generates the same bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from loadtest.procs import process, rss_mb, wait_http
from proxy.relay import sse

from .fuzz_bodies import CHAT, MESSAGES, MODEL, RESPONSES, Case, cases
from .servers import free_ports
from .waiting import wait_until_sync

BODIES = int(os.environ.get("TOKENLANE_FUZZ_BODIES", "500"))
SEED = int(os.environ.get("TOKENLANE_FUZZ_SEED", "20261124"))
BATCH = 25  # bodies sent at once: one hypothesis example is one batch
CLIENT_TIMEOUT_S = 60.0  # a hang, not a slow answer: a fuzzed stream has a few dozen tokens
RSS_GROWTH_MB = 20.0  # flat in practice (72.2 -> 72.5 MB over 3,000 bodies); the rest is margin
KEY = "sk-fuzz-0123456789abcdef"


@dataclass
class Fleet:
    url: str
    pid: int
    log: Path
    rss_start_mb: float = 0.0
    sent: list[str] = field(default_factory=list)  # request ids, in order

    def access_lines(self) -> dict[str, dict[str, Any]]:
        lines: dict[str, dict[str, Any]] = {}
        for text in self.log.read_text(errors="replace").splitlines():
            if text.startswith("{") and '"request_id"' in text:
                with contextlib.suppress(ValueError):
                    record = json.loads(text)
                    lines[str(record["request_id"])] = record
        return lines


def _policy(sims: list[str], port: int) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": port},
        "pools": {
            "interactive": {
                "balance": "least_loaded",
                "replicas": [{"url": sims[0], "name": "fast-0"}],
            },
            "bulk": {
                "balance": "prefix_affinity",
                "replicas": [{"url": sims[1], "name": "bulk-0"}],
            },
        },
        "lanes": [
            {
                "name": "short",
                "pool": "interactive",
                "when": {"stream": True, "prompt_tokens_max": 1024, "output_tokens_max": 512},
                "spill_to": "bulk",
            },
            {"name": "long", "pool": "bulk"},
        ],
        "health": {"interval_s": 0.2},
        # Limits on, so the fuzzed counts reach the token arithmetic; high enough that the
        # run itself is never refused.
        "rate_limits": {"requests_per_min": 10**6, "tokens_per_min": 10**9},
        # Eligible streams are parsed event by event: the fuzz reaches that path too.
        "continuation": {"enabled": True},
    }


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fuzz")
    *sim_ports, port = free_ports(3)
    sim_args = ["--max-model-len", "4096", "--natural-len-max", "24", "--step-fixed-s", "0.002"]
    policy_path = tmp / "policy.yaml"
    sims = [f"http://127.0.0.1:{p}" for p in sim_ports]
    policy_path.write_text(yaml.safe_dump(_policy(sims, port)))
    log = tmp / "gateway.log"
    with contextlib.ExitStack() as stack:
        for i, p in enumerate(sim_ports):
            argv = [sys.executable, "-m", "loadtest.sim", "--port", str(p), "--name", f"sim-{i}"]
            stack.enter_context(process([*argv, *sim_args], log=tmp / f"sim-{i}.log"))
        for url in sims:
            wait_http(url + "/health", timeout_s=120)
        argv = [sys.executable, "-m", "proxy", "serve", "--config", str(policy_path)]
        gateway = stack.enter_context(process(argv, log=log, env={"TOKENLANE_API_KEYS": KEY}))
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/ready", timeout_s=120)
        fleet = Fleet(url, gateway.pid, log)
        _assert_serving(fleet)
        fleet.rss_start_mb = rss_mb(gateway.pid)
        yield fleet


def _assert_serving(fleet: Fleet) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "still there?"}],
    }
    r = httpx.post(
        fleet.url + CHAT, json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert r.status_code == 200, r.text


@dataclass
class Answer:
    case: Case
    status: int | None = None
    request_id: str | None = None
    body: bytes = b""
    failure: str | None = None  # no answer: a hang (timeout) or a reset


async def _send(client: httpx.AsyncClient, case: Case) -> Answer:
    answer = Answer(case)
    headers = {"authorization": f"Bearer {KEY}"}
    if case.content_type:
        headers["content-type"] = case.content_type
    try:
        async with client.stream("POST", case.path, content=case.body, headers=headers) as r:
            answer.status = r.status_code
            answer.request_id = r.headers.get("x-request-id")
            answer.body = await r.aread()
    except httpx.TimeoutException as exc:
        answer.failure = f"hang: {type(exc).__name__}"
    except httpx.HTTPError as exc:
        answer.failure = f"reset: {type(exc).__name__}: {exc}"
    return answer


async def _send_batch(url: str, batch: list[Case]) -> list[Answer]:
    limits = httpx.Limits(max_connections=BATCH)
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S, limits=limits) as client:
        return list(await asyncio.gather(*(_send(client, c) for c in batch)))


def _problems(answers: list[Answer], lines: dict[str, dict[str, Any]]) -> list[str]:
    problems = []
    for a in answers:
        if a.failure is not None:
            problems.append(f"{a.failure} for {a.case!r}")
            continue
        assert a.status is not None
        line = lines.get(a.request_id or "")
        if line is None:
            problems.append(f"no access line for {a.request_id} ({a.status}) {a.case!r}")
            continue
        if a.status >= 500:
            problems.append(
                f"{a.status} (origin {line.get('error_origin')}): {a.body[:300]!r} for {a.case!r}"
            )
        is_stream = a.status == 200 and line.get("stream") and a.case.path != "/tokenize"
        kind = {MESSAGES: "messages", RESPONSES: "responses"}.get(a.case.path, "chat")
        if is_stream and not sse.stream_complete(kind, a.body[-4096:]):
            problems.append(f"stream without its end: {a.body[-200:]!r} for {a.case!r}")
    return problems


@seed(SEED)
@settings(
    max_examples=max(1, BODIES // BATCH),
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
@given(batch=st.lists(cases(), min_size=BATCH, max_size=BATCH))
def test_no_fuzzed_body_gets_a_gateway_failure(fleet: Fleet, batch: list[Case]) -> None:
    answers = asyncio.run(_send_batch(fleet.url, batch))
    ids = {a.request_id for a in answers if a.request_id}
    fleet.sent.extend(sorted(i for i in ids if i))
    # Access lines are written off the request's path: wait until every answered request
    # has one (or the deadline passes, and the missing ones are reported below).
    with contextlib.suppress(Exception):
        wait_until_sync(lambda: ids <= fleet.access_lines().keys(), what="access lines", poll=0.05)
    problems = _problems(answers, fleet.access_lines())
    assert not problems, "\n".join(problems)
    _assert_serving(fleet)


def test_after_the_fuzz_the_log_has_no_traceback_and_rss_is_bounded(fleet: Fleet) -> None:
    """Runs after the fuzz (file order): what the whole run left behind."""
    assert fleet.sent, "the fuzz test did not run first"
    log = fleet.log.read_text(errors="replace")
    assert "Traceback" not in log, log[log.index("Traceback") - 500 :][:4000]
    growth = rss_mb(fleet.pid) - fleet.rss_start_mb
    lines = fleet.access_lines()
    statuses = Counter(str(lines[i]["status"]) for i in fleet.sent if i in lines)
    print(
        f"fuzz: {len(fleet.sent)} requests answered, by status {dict(sorted(statuses.items()))}; "
        f"gateway RSS {fleet.rss_start_mb:.0f} MB, +{growth:.1f} MB"
    )
    assert growth < RSS_GROWTH_MB
