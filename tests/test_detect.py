"""The pure detectors and the ejection arithmetic, driven by made-up times."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from proxy.fleet.detect import (
    SILENT_IN_ROW,
    Progress,
    backoff_s,
    decay,
    ejection_cap,
    flat_for,
    may_eject,
    not_generating,
    note_scrape,
    probe_early,
    silent_failure_ejects,
    silent_streams,
    slow_start_weight,
    stall_threshold,
    stalled,
    traffic_stalled,
    unchanged_for,
)


def scrapes(rows: list[tuple[float, float, float]]) -> Progress:
    """Fold (time, running, tokens) scrapes into a progress view."""
    p = Progress()
    for at, running, tokens in rows:
        p = note_scrape(p, at, running, tokens)
    return p


# stall_after_s = 10, interval_s = 1 throughout
STALL_CASES = [
    ("busy and moving", [(t, 3, 100 * t) for t in range(20)], False),
    ("busy and flat 10s", [(0, 3, 5), *[(t, 3, 7) for t in range(1, 12)]], True),
    ("busy and flat 9.4s (under, even with slack)", [(0, 3, 5), (1.0, 3, 7), (10.4, 3, 7)], False),
    (
        "busy and flat 9.5s (slack of half an interval)",
        [(0, 3, 5), (1.0, 3, 7), (10.5, 3, 7)],
        True,
    ),
    ("idle and flat for a minute", [(t, 0, 7) for t in range(60)], False),
    ("idle then busy, flat 5s", [(0, 0, 7), *[(t, 2, 7) for t in range(10, 16)]], False),
    ("idle then busy, flat 10s", [(0, 0, 7), *[(t, 2, 7) for t in range(10, 21)]], True),
    ("busy, went idle mid-way, busy again", [(0, 3, 7), (6, 0, 7), (7, 3, 7), (15, 3, 7)], False),
    (
        "counter went down (restart) then flat 3s",
        [(0, 3, 500), (9, 3, 500), (10, 3, 20), (13, 3, 20)],
        False,
    ),
    ("single scrape", [(0, 3, 7)], False),
]


@pytest.mark.parametrize(
    ("rows", "expected"), [c[1:] for c in STALL_CASES], ids=[c[0] for c in STALL_CASES]
)
def test_stalled_needs_busy_and_flat_for_stall_after(rows, expected) -> None:
    assert stalled(scrapes(rows), stall_after_s=10, interval_s=1) is expected


def test_a_slow_scrape_interval_never_turns_one_busy_scrape_into_a_stall() -> None:
    # interval 30 s, stall_after 10 s: half an interval of slack would be 15 s, more than the
    # whole threshold. A busy replica seen once with its counter where it was is not stalled.
    assert stall_threshold(10, 30) == 5
    assert not stalled(scrapes([(0, 3, 7)]), stall_after_s=10, interval_s=30)
    assert not stalled(scrapes([(0, 3, 5), (30, 3, 7)]), stall_after_s=10, interval_s=30)
    assert stalled(scrapes([(0, 3, 5), (30, 3, 7), (60, 3, 7)]), stall_after_s=10, interval_s=30)


def test_flat_for_counts_from_first_scrape_with_current_value() -> None:
    p = scrapes([(0, 3, 5), (1, 3, 7), (2, 3, 7), (4, 3, 7)])
    assert flat_for(p) == 3
    assert flat_for(scrapes([(0, 0, 7), (4, 0, 7)])) == 0


def test_unchanged_for_ignores_running() -> None:
    assert unchanged_for(scrapes([(0, 3, 5), (2, 0, 5), (6, 2, 5)])) == 6
    assert unchanged_for(scrapes([(0, 3, 5), (2, 0, 9), (6, 2, 9)])) == 4


@pytest.mark.parametrize(
    ("p", "stale", "ever", "expected"),
    [
        (scrapes([(0, 3, 5), (1, 3, 5)]), False, True, True),  # flat over two scrapes while busy
        (scrapes([(0, 3, 5), (1, 3, 9)]), False, True, False),  # moving
        (scrapes([(0, 0, 5), (1, 0, 5)]), False, True, True),  # "idle" yet our request waits
        (scrapes([(0, 3, 5)]), False, True, False),  # one scrape is no evidence
        (Progress(), True, True, True),  # /metrics stopped answering
        (Progress(), True, False, False),  # never scraped: no evidence either way
    ],
)
def test_not_generating_backs_silent_reports(p, stale, ever, expected) -> None:
    assert not_generating(p, stale, ever, interval_s=1) is expected


@pytest.mark.parametrize(
    ("in_row", "agree", "ejects"),
    [
        (1, False, False),
        (SILENT_IN_ROW - 1, False, False),
        (SILENT_IN_ROW, False, True),
        (1, True, True),
    ],
)
def test_silent_failure_ejects_on_evidence_or_repetition(in_row, agree, ejects) -> None:
    assert silent_failure_ejects(in_row, agree) is ejects


def test_backoff_grows_by_base_and_stops_at_cap() -> None:
    assert [backoff_s(n, 30, 300) for n in range(1, 13)] == [
        30,
        60,
        90,
        120,
        150,
        180,
        210,
        240,
        270,
        300,
        300,
        300,
    ]


@pytest.mark.parametrize(
    ("level", "since", "now", "expected"),
    [
        (3, 0.0, 29.9, (3, 0.0)),  # not a full base yet
        (3, 0.0, 30.0, (2, 30.0)),
        (3, 0.0, 75.0, (1, 60.0)),  # two steps, the 15 s toward the third are kept
        (3, 0.0, 1000.0, (0, 90.0)),  # never below zero
        (0, 0.0, 1000.0, (0, 0.0)),
    ],
)
def test_decay_drops_one_level_per_base_healthy(level, since, now, expected) -> None:
    assert decay(level, since, now, base_s=30) == expected


@pytest.mark.parametrize(
    ("size", "percent", "cap"),
    [(3, 50, 1), (4, 50, 2), (10, 10, 1), (10, 35, 3), (1, 50, 1), (2, 0, 0), (5, 100, 5)],
)
def test_ejection_cap_rounds_down_but_allows_one(size, percent, cap) -> None:
    assert ejection_cap(size, percent) == cap


@pytest.mark.parametrize(
    ("for_failure", "until", "now", "early"),
    [
        (True, 130.0, 100.0, True),  # time left: probed now
        (True, 100.0, 100.0, False),  # over anyway: the tick moves it
        (True, 90.0, 100.0, False),
        (False, 130.0, 100.0, False),  # the operator's: until readmitted
        (True, math.inf, 100.0, False),
    ],
)
def test_probe_early(for_failure: bool, until: float, now: float, early: bool) -> None:
    assert probe_early(for_failure, until, now) is early


def test_may_eject_counts_replicas_already_out() -> None:
    assert may_eject(3, 0, 50) and not may_eject(3, 1, 50)
    assert may_eject(4, 1, 50) and not may_eject(4, 2, 50)


@pytest.mark.parametrize(("t", "weight"), [(0, 0.1), (5, 0.1), (30, 0.5), (60, 1.0), (90, 1.0)])
def test_slow_start_weight_ramps_linearly_from_floor(t, weight) -> None:
    assert slow_start_weight(t, 60) == pytest.approx(weight)
    assert slow_start_weight(t, 0) == 1.0


@dataclass(eq=False)
class Watch:
    last_progress: float
    content_sent: bool


def test_silent_streams_spares_only_streams_that_progress() -> None:
    waiting = Watch(last_progress=99.9, content_sent=False)  # nothing sent: free to retry
    quiet = Watch(last_progress=98.0, content_sent=True)  # streaming, silent 2 s
    flowing = Watch(last_progress=99.5, content_sent=True)  # streaming, chunk 0.5 s ago
    assert silent_streams([waiting, quiet, flowing], now=100.0, quiet_s=1.0) == [waiting, quiet]


FROZEN_IDLE = scrapes([(t, 0, 7) for t in range(0, 11)])  # running 0, counters flat 10 s
MOVING = scrapes([(t, 0, 7 * t) for t in range(0, 11)])
TRAFFIC_CASES = [
    ("request waited 10 s, counters flat", FROZEN_IDLE, [Watch(90.0, False)], True),
    ("request waited 5 s only", FROZEN_IDLE, [Watch(95.0, False)], False),
    ("counters still move", MOVING, [Watch(90.0, False)], False),
    ("another stream still flows", FROZEN_IDLE, [Watch(90.0, False), Watch(99.0, True)], False),
    ("only a paused content stream", FROZEN_IDLE, [Watch(80.0, True)], False),
    (
        "paused content stream and a waiter",
        FROZEN_IDLE,
        [Watch(80.0, True), Watch(85.0, False)],
        True,
    ),
    ("no streams", FROZEN_IDLE, [], False),
]


@pytest.mark.parametrize(
    ("p", "streams", "expected"), [c[1:] for c in TRAFFIC_CASES], ids=[c[0] for c in TRAFFIC_CASES]
)
def test_traffic_stalled_needs_a_waiter_no_flow_and_flat_counters(p, streams, expected) -> None:
    assert traffic_stalled(streams, p, now=100.0, stall_after_s=10, interval_s=1) is expected
