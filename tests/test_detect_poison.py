"""The pure rules that tell a poison request from a failing replica, and an outage."""

from __future__ import annotations

import pytest

from proxy.fleet import detect
from proxy.relay.retry import budget_left


@pytest.mark.parametrize(
    ("in_row", "threshold", "peer_5xx", "peer_total", "ejects"),
    [
        (4, 5, 0, 40, False),  # short of the run
        (5, 5, 0, 40, True),  # peers serve fine: the replica's fault
        (5, 5, 10, 40, True),  # peers mostly fine
        (5, 5, 21, 40, False),  # peers fail alike: the requests' fault (poison)
        (5, 5, 40, 40, False),
        (50, 5, 0, 0, False),  # no peers (or idle ones): left to /health
        (50, 5, 0, 4, False),  # too little peer evidence
        (1, 0, 0, 1, True),  # a threshold of 0 acts as 1
    ],
)
def test_fivexx_outlier(in_row: int, threshold: int, peer_5xx: int, peer_total: int, ejects: bool):
    assert detect.fivexx_outlier(in_row, threshold, peer_5xx, peer_total) is ejects


@pytest.mark.parametrize(
    ("other", "status", "poison"),
    [
        (True, 500, True),
        (True, 502, True),
        (True, 200, False),
        (False, 500, False),
        (True, 0, False),
    ],
)
def test_poisoned(other: bool, status: int, poison: bool) -> None:
    assert detect.poisoned(other, status) is poison


@pytest.mark.parametrize(
    ("flags", "outage"),
    [([], False), ([True], True), ([True, True, True], True), ([True, False, True], False)],
)
def test_in_outage(flags: list[bool], outage: bool) -> None:
    assert detect.in_outage(flags) is outage


@pytest.mark.parametrize(
    ("pending", "requests", "ratio", "left"),
    [
        (0, 1, 0.2, True),
        (2, 1, 0.2, True),
        (3, 1, 0.2, False),
        (19, 100, 0.2, True),
        (20, 100, 0.2, False),
    ],
)
def test_budget_counts_pending_retries(pending: int, requests: int, ratio: float, left: bool):
    assert budget_left(pending, requests, ratio) is left


F, T = False, True


@pytest.mark.parametrize(
    ("health_ok", "recent", "suspect"),
    [
        (True, [], False),  # a fresh replica: no evidence
        (True, [T], False),  # one 5xx proves nothing
        (True, [T, T], True),  # two of two
        (True, [F, T], True),  # half
        (True, [F, F, F, T], True),  # a quarter: the bar
        (True, [F, F, F, F, T], False),  # a fifth
        (True, [F] * 19 + [T], False),  # one in twenty: an ordinary replica's stray 5xx
        (False, [], True),  # its own /health fails: suspect whatever it served
        (False, [F] * 20, True),
    ],
)
def test_suspect(health_ok: bool, recent: list[bool], suspect: bool) -> None:
    assert detect.suspect(health_ok, recent) is suspect


INF = float("inf")


@pytest.mark.parametrize(
    ("for_failure", "until", "health_ok", "probed", "probe"),
    [
        (True, 40.0, True, False, True),  # ejected for failing, /health back: probe now
        (True, 40.0, False, False, False),  # /health still failing: its canary would fail
        (True, 40.0, True, True, False),  # probed early once already: wait the ejection out
        (False, 40.0, True, False, False),  # an operator's ejection: only the operator lifts it
        (True, INF, True, False, False),  # until readmitted
        (True, 10.0, True, False, False),  # its ejection is over anyway (the tick moves it)
    ],
)
def test_probe_when_no_target(
    for_failure: bool, until: float, health_ok: bool, probed: bool, probe: bool
) -> None:
    assert detect.probe_when_no_target(for_failure, until, 20.0, health_ok, probed) is probe
