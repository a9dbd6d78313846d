"""The stall benchmark's reading of the gateway's continuation counters and of the continued
streams as clients saw them (pure: no processes)."""

from __future__ import annotations

from prometheus_client import generate_latest

from loadtest.bench_stall import Sent, analyse, continuation_counts
from loadtest.stats import OK, RequestResult
from proxy.observe.metrics import Metrics


def test_continuation_counts_read_a_real_exposition() -> None:
    metrics = Metrics()
    metrics.continuations.labels("all", "stall", "ok").inc(5)
    metrics.continuations.labels("all", "reset", "ok").inc(2)
    metrics.continuations.labels("all", "stall", "failed").inc(1)
    metrics.continuation_refusals.labels("all", "stop").inc(3)
    metrics.continuation_refusals.labels("all", "busy")  # a series at zero is no refusal
    metrics.continuation_replayed.labels("all").inc(640)
    counts = continuation_counts(generate_latest(metrics.registry).decode())
    assert (counts.ok, counts.failed, counts.replayed_tokens) == (7, 1, 640)
    assert counts.refused == {"stop": 3}


def _sent(at: float, done_at: float, replica: str, itl: list[float]) -> Sent:
    result = RequestResult(index=0, cls="chat", stream=True, prompt_tokens=0, max_tokens=64,
                           scheduled_s=0.0, outcome=OK, content_chunks=len(itl) + 1,
                           itl_s=itl, headers={"x-tokenlane-replica": replica})  # fmt: skip
    return Sent(at, result, done_at)


def test_the_gap_is_read_from_streams_of_the_faulted_replica_that_spanned_the_fault() -> None:
    sent = [
        _sent(9.0, 14.0, "sim0", [0.01, 3.5, 0.01]),  # continued: a 3.5 s pause
        _sent(9.5, 14.5, "sim0", [0.01, 3.0]),  # continued
        _sent(9.0, 14.0, "sim1", [0.01, 0.02]),  # another replica's stream
        _sent(5.0, 8.0, "sim0", [0.01]),  # ended before the fault
    ]
    report = analyse(sent, stalled_replica="sim0", stalled_at=10.0, ejected_at=13.0,
                     ejected_wall=0.0, reason="stall", stalled_log=[])  # fmt: skip
    assert report.continued_streams_seen == 2
    assert report.gap_s["max"] == 3.5


def test_survivors_itl_is_split_at_the_fault() -> None:
    sent = [
        _sent(1.0, 8.0, "sim1", [0.01, 0.02]),  # a survivor's stream, ended before the fault
        _sent(9.0, 12.0, "sim1", [0.05, 0.04]),  # running when the re-prefills land
        _sent(20.0, 22.0, "sim1", [0.9]),  # long after: in neither
        _sent(9.0, 14.0, "sim0", [3.5]),  # the faulted replica's: not a survivor's
    ]
    report = analyse(sent, stalled_replica="sim0", stalled_at=10.0, ejected_at=13.0,
                     ejected_wall=0.0, reason="stall", stalled_log=[])  # fmt: skip
    assert report.survivor_itl_p99_s == {"before": 0.0199, "after": 0.0499}  # interpolated
