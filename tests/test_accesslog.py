"""The access log: one JSON line per request, written off the request's path in batches."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from proxy.accesslog import FLUSH_S, MAX_QUEUED, AccessLog, record_of
from proxy.config import build_policy
from proxy.relay import Call

from .gateway import policy_for

LANE = build_policy(policy_for({"p": ["http://127.0.0.1:9"]})).lanes[0]


def a_call(request_id: str = "r-1", **outcome: object) -> Call:
    call = Call(
        request_id=request_id,
        kind="chat",
        path="/v1/chat/completions",
        body=b'{"messages": [{"role": "user", "content": "my secret prompt"}]}',
        headers=[(b"authorization", b"Bearer sk-secret")],
        stream=True,
        model="m",
        lane=LANE,
        profile=None,
        wants_usage=False,
        received_at=0.0,
    )
    for key, value in outcome.items():
        setattr(call, key, value)
    return call


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def log() -> tuple[AccessLog, Lines]:
    logger = logging.getLogger("tokenlane.test-access")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    lines = Lines()
    logger.handlers[:] = [lines]
    return AccessLog(logger), lines


async def test_a_line_is_written_within_the_flush_interval_not_on_the_spot(
    log: tuple[AccessLog, Lines],
) -> None:
    access, lines = log
    access.add(a_call("r-1", status=200, ttft_s=0.0123), 0.5)
    access.add(a_call("r-2", status=502, error="no replica"), 0.1)
    assert lines.lines == []  # nothing written while the request's handler still runs
    await asyncio.sleep(FLUSH_S * 5)
    records = [json.loads(line) for line in lines.lines]
    assert [(r["request_id"], r["status"]) for r in records] == [("r-1", 200), ("r-2", 502)]
    assert records[0]["ttft_ms"] == 12.3 and records[0]["duration_ms"] == 500.0
    assert records[1]["error"] == "no replica"


async def test_a_full_queue_is_written_at_once(log: tuple[AccessLog, Lines]) -> None:
    access, lines = log
    for i in range(MAX_QUEUED):
        access.add(a_call(f"r-{i}"), 0.1)
    assert len(lines.lines) == MAX_QUEUED


def test_without_a_running_loop_the_line_is_written_at_once(log: tuple[AccessLog, Lines]) -> None:
    access, lines = log
    access.add(a_call(), 0.1)
    assert len(lines.lines) == 1


async def test_close_writes_what_waits_and_nothing_twice(log: tuple[AccessLog, Lines]) -> None:
    access, lines = log
    access.add(a_call(), 0.1)
    access.close()  # as the gateway's stop does
    await asyncio.sleep(FLUSH_S * 3)
    assert len(lines.lines) == 1


async def test_after_close_a_line_is_written_at_once(log: tuple[AccessLog, Lines]) -> None:
    access, lines = log
    access.close()
    access.add(a_call(), 0.1)  # a request that ended during shutdown
    assert len(lines.lines) == 1


def test_a_record_holds_no_body_and_no_header() -> None:
    text = json.dumps(record_of(a_call(), 0.1, 1.0))
    assert "secret" not in text and "authorization" not in text.lower()


def test_disabled_below_info(log: tuple[AccessLog, Lines]) -> None:
    access, _ = log
    assert access.enabled
    access.log.setLevel(logging.WARNING)
    assert not access.enabled
