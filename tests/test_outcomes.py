"""Outcomes are recorded off the request's path, in batches; the access line holds no secret."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import math
import random
import weakref
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtest.fake_upstream import running
from proxy.observe import accessline, accesslog
from proxy.observe.accessline import record_of, rounded, write_line
from proxy.observe.accesslog import flush_lines
from proxy.observe.metrics import Metrics
from proxy.observe.outcomes import FLUSH_S, MAX_QUEUED, Outcomes
from proxy.observe.record import Recorder
from proxy.policyfile import build_policy
from proxy.relay.call import Call
from proxy.routing.profile import Profile

from .gateway import policy_for, running_gateway

LANE = build_policy(policy_for({"p": ["http://127.0.0.1:9"]})).lanes[0]
CHAT = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "messages": [{"role": "user", "content": "hi"}]}


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


def recorder() -> tuple[Outcomes, list[str]]:
    seen: list[str] = []
    return Outcomes(lambda call, duration, ts: seen.append(call.request_id)), seen


async def test_an_outcome_is_recorded_within_the_flush_interval_not_on_the_spot() -> None:
    outcomes, seen = recorder()
    outcomes.add(a_call("r-1"), 0.5)
    outcomes.add(a_call("r-2"), 0.1)
    assert seen == []  # nothing done while the request's handler still runs
    await asyncio.sleep(FLUSH_S * 5)
    assert seen == ["r-1", "r-2"]


async def test_a_full_queue_is_recorded_at_once() -> None:
    outcomes, seen = recorder()
    for i in range(MAX_QUEUED):
        outcomes.add(a_call(f"r-{i}"), 0.1)
    assert len(seen) == MAX_QUEUED


def test_without_a_running_loop_an_outcome_is_recorded_at_once() -> None:
    outcomes, seen = recorder()
    outcomes.add(a_call(), 0.1)
    assert seen == ["r-1"]


async def test_close_records_what_waits_once_and_later_ones_at_once() -> None:
    outcomes, seen = recorder()
    outcomes.add(a_call("r-1"), 0.1)
    outcomes.close()  # as the gateway's stop does
    assert seen == ["r-1"]
    outcomes.add(a_call("r-2"), 0.1)  # a request that ended during shutdown
    assert seen == ["r-1", "r-2"]
    await asyncio.sleep(FLUSH_S * 3)
    assert seen == ["r-1", "r-2"]


def test_an_access_line_holds_no_body_and_no_header() -> None:
    text = json.dumps(record_of(a_call(status=200, ttft_s=0.0123), 0.5, 1.0))
    assert "secret" not in text and "authorization" not in text.lower()
    record = json.loads(text)
    assert record["ttft_ms"] == 12.3 and record["duration_ms"] == 500.0


def test_no_access_line_below_info() -> None:
    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    log = logging.getLogger("tokenlane.test-access")
    log.propagate = False
    log.handlers[:] = [Lines()]
    log.setLevel(logging.WARNING)
    write_line(a_call(), 0.1, 1.0, log)
    log.setLevel(logging.INFO)
    write_line(a_call(), 0.1, 1.0, log)
    assert len(lines) == 1


async def test_a_scrape_counts_every_request_that_ended_before_it() -> None:
    async with running(tokens=3) as up:
        async with running_gateway(policy_for({"p": [up.url]})) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:
                for _ in range(3):
                    assert (await client.post(url + "/v1/chat/completions", json=CHAT)).is_success
                text = (await client.get(url + "/metrics")).text
    # Every known label set exists from the start at 0; the one served counts all three.
    served = [
        ln
        for ln in text.splitlines()
        if ln.startswith("tokenlane_requests_total{") and 'status="200"' in ln
    ]
    assert len(served) == 1 and served[0].endswith(" 3.0"), served


class Lessons:
    def __init__(self) -> None:
        self.seen: list[tuple[Profile, int]] = []

    def observe(self, profile: Profile, reported_prompt_tokens: int) -> None:
        self.seen.append((profile, reported_prompt_tokens))


PROFILE = Profile(
    kind="chat",
    model="m",
    stream=True,
    prompt_chars=40,
    prompt_tokens_est=10,
    output_tokens=None,
    n=1,
    images=0,
    prompt_head="",
)


@pytest.mark.parametrize(
    ("outcome", "estimated", "reported", "lessons"),
    [
        pytest.param({}, None, None, 0, id="never-reached-a-pool"),
        pytest.param({"pool": "p"}, None, None, 0, id="no-profile"),
        # Estimated and reported count the same requests: one without usage counts in neither.
        pytest.param({"pool": "p", "profile": PROFILE}, None, None, 0, id="no-usage"),
        pytest.param(
            {"pool": "p", "profile": PROFILE, "usage": {"prompt_tokens": 0}},
            None,
            None,
            0,
            id="usage-of-zero",
        ),
        pytest.param(
            {"pool": "p", "profile": PROFILE, "usage": {"prompt_tokens": 12}},
            10.0,
            12.0,
            1,
            id="usage-reported",
        ),
    ],
)
def test_a_recorded_call_counts_and_teaches_only_what_it_carries(
    outcome: dict[str, object], estimated: float | None, reported: float | None, lessons: int
) -> None:
    metrics, learner = Metrics(), Lessons()
    recorder = Recorder(metrics, learner)
    recorder(a_call(status=200, **outcome), 0.5, 1.0)
    recorder.batch_done()
    sample = metrics.registry.get_sample_value
    pool = str(outcome.get("pool") or "")
    labels = {"lane": LANE.name, "pool": pool, "replica": "", "status": "200"}
    assert sample("tokenlane_requests_total", labels) == 1.0
    assert sample("tokenlane_prompt_tokens_estimated_total", {"pool": pool}) == estimated
    assert sample("tokenlane_prompt_tokens_reported_total", {"pool": pool}) == reported
    assert len(learner.seen) == lessons


def test_a_record_that_cannot_be_written_costs_its_batch_not_every_later_one() -> None:
    # Its line made at the batch's end: the error is raised there once, and the next batch is
    # written as ever (nothing of the failed one is held to fail again).
    stream = CountingStream()
    with access_log("tokenlane.access", stream):
        recorder = Recorder(Metrics(), Lessons())
        recorder(a_call("r-bad", usage={"prompt_tokens": object()}), 0.5, 1.0)
        with pytest.raises(TypeError):
            recorder.batch_done()
        recorder(a_call("r-good"), 0.5, 1.0)
        recorder.batch_done()
        assert [json.loads(x)["request_id"] for x in stream.getvalue().splitlines()] == ["r-good"]


def test_a_batch_is_added_to_its_series_at_its_end_each_value_counted() -> None:
    """Counts and observations of one batch are held until ``batch_done``, then added: every
    request counted, every value in its bucket and the sum, as one by one."""
    metrics, learner = Metrics(), Lessons()
    recorder = Recorder(metrics, learner)
    durations = [0.004, 0.3, 0.3, 7.0]
    for i, duration in enumerate(durations):
        recorder(a_call(f"r-{i}", status=200, pool="p", ttft_s=0.01 * (i + 1)), duration, 1.0)
    sample = metrics.registry.get_sample_value
    served = {"lane": LANE.name, "pool": "p", "replica": "", "status": "200"}
    assert sample("tokenlane_requests_total", served) in (None, 0.0)  # held
    recorder.batch_done()
    assert sample("tokenlane_requests_total", served) == 4.0
    lane = {"lane": LANE.name, "pool": "p"}
    assert sample("tokenlane_request_duration_seconds_count", lane) == 4.0
    assert sample("tokenlane_request_duration_seconds_sum", lane) == pytest.approx(sum(durations))
    one_by_one = Metrics()
    for duration in durations:
        one_by_one.duration.labels(LANE.name, "p").observe(duration)
    for bound in ("0.005", "0.5", "10.0", "+Inf"):
        want = one_by_one.registry.get_sample_value(
            "tokenlane_request_duration_seconds_bucket", {**lane, "le": bound}
        )
        assert want is not None
        assert sample("tokenlane_request_duration_seconds_bucket", {**lane, "le": bound}) == want
    assert sample("tokenlane_ttft_seconds_count", lane) == 4.0
    recorder.batch_done()  # an empty batch adds nothing
    assert sample("tokenlane_requests_total", served) == 4.0


class CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.flushes = 0
        self.writes = 0

    def write(self, s: str) -> int:
        self.writes += 1
        return super().write(s)

    def flush(self) -> None:
        self.flushes += 1
        super().flush()


@contextlib.contextmanager
def access_log(name: str, stream: io.StringIO) -> Iterator[tuple[logging.Logger, Any]]:
    """The logger ``name`` at INFO with the access log's handler over ``stream`` alone, put
    back as it was afterwards."""
    log = logging.getLogger(name)
    was = (log.propagate, log.level, log.handlers[:])
    log.propagate = False
    log.setLevel(logging.INFO)
    handler = accesslog.BatchedLines(stream)
    log.handlers[:] = [handler]
    try:
        yield log, handler
    finally:
        log.propagate, log.handlers[:] = was[0], was[2]
        log.setLevel(was[1])


@pytest.mark.parametrize("prefix", [None, "line "])
async def test_access_lines_are_written_once_per_batch_and_a_refusal_at_once(
    prefix: str | None,
) -> None:
    """As made, the handler is written to directly; given a formatter, through log records
    that it formats: the same lines either way, a batch in one write to the stream whatever
    its buffering (an unbuffered stdout made each line a system call)."""
    stream = CountingStream()
    log = logging.getLogger("tokenlane.access.test-batch")
    log.propagate = False
    log.setLevel(logging.INFO)
    handler = accesslog.BatchedLines(stream)
    if prefix is not None:
        handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    assert handler.plain is (prefix is None)
    log.addHandler(handler)
    try:
        outcomes = Outcomes(lambda c, d, ts: write_line(c, d, ts, log), lambda: flush_lines(log))
        outcomes.add(a_call("r-1"), 0.1)
        outcomes.add(a_call("r-2"), 0.1)
        assert stream.flushes == 0 and stream.writes == 0  # queued: nothing written yet
        outcomes.flush()
        text = stream.getvalue()
        if prefix is not None:
            assert text.startswith(prefix)
            text = text.replace(prefix, "")
        lines = [json.loads(x) for x in text.splitlines()]
        assert [x["request_id"] for x in lines] == ["r-1", "r-2"]
        assert stream.flushes == 1 and stream.writes == 1  # two lines, one write, one flush
        outcomes.flush()  # an empty batch writes nothing
        assert stream.flushes == 1 and stream.writes == 1
        accessline.write_refusal("/v1/chat/completions", 401, "r-3", "no key", 0.001, 0.0, log)
        assert stream.flushes == 2
        last = stream.getvalue().splitlines()[-1].removeprefix(prefix or "")
        assert json.loads(last)["status"] == 401
        handler.setLevel(logging.WARNING)  # the handler's own level holds on either path
        outcomes.add(a_call("r-4"), 0.1)
        outcomes.flush()
        assert "r-4" not in stream.getvalue()
    finally:
        log.removeHandler(handler)


def test_a_batchs_lines_go_to_the_handler_in_one_call_in_order() -> None:
    """``accessline.write_lines`` (the recorder's, once a batch): the level asked once, the
    lines handed over together and written as ``write_line`` writes each; below INFO none."""
    stream = CountingStream()
    with access_log("tokenlane.access.test-lines", stream) as (log, handler):
        accessline.write_lines([(a_call(f"r-{i}"), 0.1, 1.0) for i in range(3)], log)
        flush_lines(log)
        assert [json.loads(x)["request_id"] for x in stream.getvalue().splitlines()] == [
            "r-0", "r-1", "r-2",
        ]  # fmt: skip
        assert stream.writes == 1
        one = io.StringIO()
        handler.stream = one
        write_line(a_call("r-0"), 0.1, 1.0, log)
        flush_lines(log)
        assert one.getvalue() == stream.getvalue().splitlines(keepends=True)[0]
        log.setLevel(logging.WARNING)
        accessline.write_lines([(a_call("r-9"), 0.1, 1.0)], log)
        flush_lines(log)
        assert "r-9" not in one.getvalue()


class BrokenStream(io.StringIO):
    def write(self, s: str) -> int:
        raise BrokenPipeError("the reader is gone")


def test_an_access_line_that_cannot_be_written_is_reported_not_raised(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """As ``logging``'s own ``emit``: the rest of a batch's outcomes still get recorded."""
    log = logging.getLogger("tokenlane.access.test-broken")
    log.propagate = False
    log.setLevel(logging.INFO)
    handler = accesslog.BatchedLines(BrokenStream())
    log.addHandler(handler)
    try:
        write_line(a_call("r-1"), 0.1, 1.0, log)  # held for the batch
        flush_lines(log)  # does not raise
        assert "BrokenPipeError" in capsys.readouterr().err  # logging.raiseExceptions
        flush_lines(log)  # the failed batch is not written again
        assert capsys.readouterr().err == ""
    finally:
        log.removeHandler(handler)


@pytest.mark.parametrize(
    "record",
    [
        {"ts": 1767225600.123, "status": 200, "stream": True, "error": None, "ttft_ms": 1.23},
        {"queue_wait_ms": 0.0, "duration_ms": 12345.67, "retries": 2, "prompt_tokens": None},
        {"continuations": [{"from": "a", "to": "b", "at_token": 7, "trigger": "stall"}]},
        {"error": 'a "quoted"\\ reply\nwith\tcontrol \x01 bytes', "path": "/v1/x?y=%20"},
        {"error": "réplica caída ✗ 🙂", "model": "模型"},  # beyond ASCII: escaped, as json does
    ],
)
def test_an_access_line_is_what_json_writes(record: dict[str, object]) -> None:
    line = accessline.encode_line(record)
    assert line == json.dumps(record, separators=(",", ":"))
    assert line.isascii() and "\n" not in line and json.loads(line) == record


def test_lines_held_for_a_batch_are_written_at_exit() -> None:
    """``logging.shutdown`` (at interpreter exit) flushes every handler: what a batch held when
    the process ended is written, as the stream's own buffer would have been."""
    stream = CountingStream()
    with access_log("tokenlane.access.test-exit", stream) as (log, handler):
        write_line(a_call("r-1"), 0.1, 1.0, log)
        assert stream.writes == 0
        logging.shutdown([weakref.ref(handler)])
        assert json.loads(stream.getvalue())["request_id"] == "r-1"


@pytest.mark.parametrize(
    ("value", "scale", "expected"),
    [
        (1732844400.12345, 1000.0, 1732844400.123),
        (1732844400.1236, 1000.0, 1732844400.124),
        (12.3456, 100.0, 12.35),
        (0.0, 100.0, 0.0),
        (0.004, 100.0, 0.0),
        (999.999, 100.0, 1000.0),
        (float("inf"), 100.0, float("inf")),
        (1e307, 1000.0, 1e307),  # finite, its scaled value not
    ],
)
def test_rounded_is_round_to_the_scale(value: float, scale: float, expected: float) -> None:
    assert rounded(value, scale) == expected


def test_rounded_prints_as_round_does_but_for_ties() -> None:
    # Away from a tie both give the same double, so the access line prints the same text.
    rng = random.Random(7)
    for _ in range(20_000):
        ms = rng.uniform(0, 100_000)
        ts = rng.uniform(1.6e9, 2.0e9)
        for value, scale, digits in ((ms, 100.0, 2), (ts, 1000.0, 3)):
            scaled = value * scale
            if abs(scaled - math.floor(scaled) - 0.5) < 1e-6:
                continue  # a tie, or near enough that the product's error decides it
            assert repr(rounded(value, scale)) == repr(round(value, digits))
