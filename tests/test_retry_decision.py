"""The retry rules as tables: every (fault, phase) pair under each state of the 5xx-after-send
opt-in, every way the loop stops, and the label values the dashboards depend on."""

from __future__ import annotations

import itertools

import pytest

from proxy.errors import FailureKind, Fault, RetryReason
from proxy.relay.retry import (
    Action,
    Phase,
    RetryDecision,
    Verdict,
    budget_left,
    decide_retry,
    judge,
)

F = Fault
K = FailureKind
R = RetryReason
RETRY, FAIL, END, RELAY = Action.RETRY, Action.FAIL, Action.END_STREAM, Action.RELAY

# Before the client has anything (SENDING, HELD), opt-in off (or its one retry used):
# (action, what the fleet is told, retry reason, overloaded)
BEFORE = {
    F.UNREACHED: (RETRY, K.CONNECT, R.CONNECT, False),
    F.CLOSED: (FAIL, K.RESET, R.UPSTREAM_5XX, False),
    F.READ_TIMEOUT: (RETRY, K.STREAM_IDLE, R.FIRST_TOKEN_TIMEOUT, False),
    F.FIRST_TOKEN_TIMEOUT: (RETRY, K.FIRST_TOKEN_TIMEOUT, R.FIRST_TOKEN_TIMEOUT, False),
    F.DEADLINE: (FAIL, None, R.FIRST_TOKEN_TIMEOUT, False),
    F.EJECTED: (RETRY, K.STREAM_IDLE, R.REPLICA_EJECTED, False),
    F.BUSY_429: (RETRY, None, R.UPSTREAM_5XX, True),
    F.BUSY_503: (RETRY, K.UPSTREAM_5XX, R.UPSTREAM_5XX, True),
    F.STATUS_5XX: (RELAY, None, R.UPSTREAM_5XX, False),
    F.ERROR_EVENT: (RETRY, K.UPSTREAM_5XX, R.UPSTREAM_5XX, False),
}
# With retry.on_5xx_after_send and its one retry unused, these change (and spend it):
BEFORE_OPTED_IN = {
    F.CLOSED: (RETRY, K.RESET, R.UPSTREAM_5XX, False),
    F.STATUS_5XX: (RETRY, K.UPSTREAM_5XX, R.UPSTREAM_5XX, False),
}
# Once the client has the response start (STARTED, CONTENT): the stream is ended, never retried.
AFTER = {
    F.UNREACHED: K.CONNECT,
    F.CLOSED: K.RESET,
    F.READ_TIMEOUT: K.STREAM_IDLE,
    F.FIRST_TOKEN_TIMEOUT: K.FIRST_TOKEN_TIMEOUT,
    F.DEADLINE: None,
    F.EJECTED: K.STREAM_IDLE,
    F.BUSY_429: None,
    F.BUSY_503: K.UPSTREAM_5XX,
    F.STATUS_5XX: K.UPSTREAM_5XX,
    F.ERROR_EVENT: K.UPSTREAM_5XX,
}
# A suspect replica (detect.suspect) has its 5xx status replayed without the opt-in; a reset
# is not (the replica may have died of the request itself): only STATUS_5XX changes.
BEFORE_SUSPECT = {F.STATUS_5XX: BEFORE_OPTED_IN[F.STATUS_5XX]}
# An eligible stream that continuation would carry elsewhere has a reset before its first token
# replayed once (it would be continued one token later anyway).
BEFORE_RESUMABLE = {F.CLOSED: BEFORE_OPTED_IN[F.CLOSED]}
OPT_IN = {"off": (False, False), "on": (True, False), "on, used": (True, True)}
# (suspect, resumable)
SUSPECT = {"ordinary": (False, False), "suspect": (True, False), "resumable": (False, True),
           "both": (True, True)}  # fmt: skip


def test_the_tables_cover_every_fault_and_phase() -> None:
    assert set(BEFORE) == set(Fault) == set(AFTER)
    assert set(Phase) == {Phase.SENDING, Phase.HELD, Phase.STARTED, Phase.CONTENT}


def expected(
    fault: Fault, phase: Phase, opt_in: bool, used: bool, suspect: bool, resumable: bool
) -> Verdict:
    if phase >= Phase.STARTED:
        return Verdict(END, AFTER[fault], BEFORE[fault][2])
    replays = dict(BEFORE_OPTED_IN) if opt_in else {}
    if suspect:
        replays.update(BEFORE_SUSPECT)
    if resumable:
        replays.update(BEFORE_RESUMABLE)
    if not used and fault in replays:
        action, failure, reason, overloaded = replays[fault]
        return Verdict(action, failure, reason, overloaded, spends_after_send=True)
    action, failure, reason, overloaded = BEFORE[fault]
    return Verdict(action, failure, reason, overloaded)


@pytest.mark.parametrize(
    ("fault", "phase", "opt_in", "suspect"),
    list(itertools.product(Fault, Phase, OPT_IN, SUSPECT)),
    ids=lambda v: str(getattr(v, "name", v)),
)
def test_every_fault_in_every_phase(fault: Fault, phase: Phase, opt_in: str, suspect: str) -> None:
    on, used = OPT_IN[opt_in]
    sus, res = SUSPECT[suspect]
    got = judge(
        fault, phase, on_5xx_after_send=on, after_send_used=used, suspect=sus, resumable=res
    )
    assert got == expected(fault, phase, on, used, sus, res)


def test_after_the_start_nothing_is_retried_whatever_the_opt_in() -> None:
    for fault, phase, (on, used), sus in itertools.product(
        Fault, (Phase.STARTED, Phase.CONTENT), OPT_IN.values(), SUSPECT.values()
    ):
        v = judge(
            fault,
            phase,
            on_5xx_after_send=on,
            after_send_used=used,
            suspect=sus[0],
            resumable=sus[1],
        )
        assert v.action is END and not v.spends_after_send


# (retry, reason, attempts, max_attempts, deadline_left_s, budget_left) -> decision
LOOP = [
    (True, R.CONNECT, 1, 3, 5.0, True, RetryDecision.RETRY),
    (False, R.CONNECT, 1, 3, 5.0, True, RetryDecision.NOT_RETRYABLE),
    (True, R.CONNECT, 3, 3, 5.0, True, RetryDecision.ATTEMPTS_SPENT),
    (True, R.CONNECT, 4, 3, 5.0, True, RetryDecision.ATTEMPTS_SPENT),
    (True, R.CONNECT, 1, 3, 0.0, True, RetryDecision.DEADLINE_PASSED),
    (True, R.CONNECT, 1, 3, -1.0, True, RetryDecision.DEADLINE_PASSED),
    (True, R.CONNECT, 1, 3, 5.0, False, RetryDecision.BUDGET_SPENT),
    (True, R.UPSTREAM_5XX, 1, 3, 5.0, False, RetryDecision.BUDGET_SPENT),
    (True, R.FIRST_TOKEN_TIMEOUT, 1, 3, 5.0, False, RetryDecision.BUDGET_SPENT),
    # A rescue from an ejected replica is outside the budget, not outside the other bounds.
    (True, R.REPLICA_EJECTED, 1, 3, 5.0, False, RetryDecision.RETRY),
    (True, R.REPLICA_EJECTED, 3, 3, 5.0, False, RetryDecision.ATTEMPTS_SPENT),
    (True, R.REPLICA_EJECTED, 1, 3, 0.0, False, RetryDecision.DEADLINE_PASSED),
    (False, R.REPLICA_EJECTED, 1, 3, 5.0, True, RetryDecision.NOT_RETRYABLE),
]


@pytest.mark.parametrize(("retry", "reason", "attempts", "most", "left", "budget", "want"), LOOP)
def test_whether_another_attempt_starts(
    retry: bool,
    reason: RetryReason,
    attempts: int,
    most: int,
    left: float,
    budget: bool,
    want: RetryDecision,
) -> None:
    got = decide_retry(
        retry,
        reason,
        attempts=attempts,
        max_attempts=most,
        deadline_left_s=left,
        budget_left=budget,
    )
    assert got is want


@pytest.mark.parametrize(
    ("retries", "requests", "ratio", "want"),
    [
        (0, 0, 0.2, True),
        (2, 0, 0.2, True),  # at least 3 retries in flight, however few requests
        (3, 0, 0.2, False),
        (3, 100, 0.2, True),
        (19, 100, 0.2, True),
        (20, 100, 0.2, False),
    ],
)
def test_the_retry_budget(retries: int, requests: int, ratio: float, want: bool) -> None:
    assert budget_left(retries, requests, ratio) is want


def test_label_values_are_the_dashboards_strings() -> None:
    # tokenlane_retries_total{reason} and the fleet's failure kinds: renaming one breaks
    # dashboards and alerts, so the strings are pinned here.
    assert [str(r) for r in RetryReason] == [
        "connect",
        "upstream_5xx",
        "first_token_timeout",
        "replica_ejected",
    ]
    assert [str(k) for k in FailureKind] == [
        "connect",
        "reset",
        "upstream_5xx",
        "first_token_timeout",
        "stream_idle",
    ]
    assert f"{RetryReason.CONNECT}" == "connect"
