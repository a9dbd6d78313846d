"""loadtest/bench_clients.py: reading inference-perf's per-request report and the gateway's
access lines (the run itself needs inference-perf: `make bench-clients`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtest import bench_clients as bc


def entry(start: float, chunks: list[float], error: Any = None) -> dict[str, Any]:
    metrics = {"chunk_times": chunks, "output_token_times": []}  # as Messages mode leaves it
    return {"start_time": start, "info": {"response_metrics": metrics}, "error": error}


@pytest.mark.parametrize(
    ("e", "expected"),
    [
        (entry(10.0, [10.25, 10.5]), 0.25),  # the first content chunk
        (entry(10.0, []), None),  # no content
        (entry(10.0, [10.25], error={"error_type": "HTTP Error 503"}), None),
        ({"start_time": 1.0, "info": None, "error": None}, None),
    ],
)
def test_client_ttft(e: dict[str, Any], expected: float | None) -> None:
    assert bc.client_ttft_s(e) == expected


def test_access_lines_of_the_runs_api_and_window() -> None:
    def line(ts: float, api: str | None, ttft: float | None, status: int = 200) -> str:
        record = {"ts": ts, "request_id": "r", "api": api, "ttft_ms": ttft, "status": status}
        return "2026-01-01 00:00:00,000 INFO tokenlane.access: " + json.dumps(record)

    log = [
        line(99.0, "chat", 1.0),  # before the run
        line(100.5, "chat", 30.0),
        line(101.0, "chat", 50.0),
        line(101.5, "chat", None, 503),  # counted, no TTFT
        line(101.0, "messages", 9.0),  # another API
        line(103.0, "chat", 7.0),  # after the run
        "2026-01-01 00:00:00,000 INFO tokenlane.health: replica=fast-0 to=healthy",
    ]
    run = bc.ModeRun("chat", started=100.0, ended=102.0)
    bc.read_access(list(bc.access_records(log)), run)
    assert run.access_lines == 3
    assert run.access_statuses == {200: 2, 503: 1}
    assert run.access_ttfts_ms == [30.0, 50.0]


@pytest.mark.parametrize(
    ("client", "gateway", "expected"),
    [(33.0, 30.0, 0.1), (27.0, 30.0, -0.1), (None, 30.0, None), (30.0, None, None), (1.0, 0, None)],
)
def test_relative(client: float | None, gateway: float | None, expected: float | None) -> None:
    got = bc.relative(client, gateway)
    assert got == pytest.approx(expected) if expected is not None else got is None


def test_every_mode_streams_and_writes_its_per_request_report() -> None:
    for mode in bc.MODES:
        config = bc.ip_config(mode, "http://127.0.0.1:1", Path("/t"), Path("/o"), 2.0, 25)
        assert config["api"] == {"type": mode, "streaming": True}
        assert config["report"]["request_lifecycle"]["per_request"] is True
