"""The retry rules, as pure functions over plain data: no I/O, no clock, no policy object.

Two questions, asked at two moments:

- ``judge(fault, phase, ...)``, where an attempt meets a fault: what the fleet is told, whether
  the request may go to another replica (and under which ``tokenlane_retries_total`` reason),
  or, once the client has bytes, that the stream is ended with an in-band error.
- ``decide_retry(verdict, ...)``, after the attempt is over: whether another attempt starts now
  (attempts left, the request's deadline, the retry budget).

The one line everything turns on is the phase: until the client has the response start, a
failed attempt can be abandoned and the request sent elsewhere; after it, never.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Final

from proxy.errors import FailureKind, Fault, RetryReason


class Phase(IntEnum):
    """How far an attempt got, in order (``phase >= STARTED``: the client has bytes)."""

    SENDING = 0  # the request goes out; no status line yet
    HELD = 1  # the status line is in; nothing reached the client (a stream's hold)
    STARTED = 2  # the client has the response start, no content yet
    CONTENT = 3  # content reached the client


class Action(Enum):
    RETRY = "retry"  # abandon the attempt; another replica may take the request
    FAIL = "fail"  # abandon the attempt; the request fails with it (nothing sent yet)
    END_STREAM = "end_stream"  # the client has bytes: end its response with an error
    RELAY = "relay"  # not a failure to act on: relay the replica's answer as it is


@dataclass(frozen=True, slots=True)
class Verdict:
    action: Action
    failure: FailureKind | None  # what the fleet is told (None: not the replica's fault)
    reason: RetryReason  # tokenlane_retries_total reason, if it is retried
    overloaded: bool = False  # the replica said it is busy (429 / 503), not broken
    spends_after_send: bool = False  # uses the request's one retry after a send


# What each fault tells the fleet, and the retry reason it is counted under.
FAILURE: Final[dict[Fault, FailureKind | None]] = {
    Fault.UNREACHED: FailureKind.CONNECT,
    Fault.CLOSED: FailureKind.RESET,
    Fault.READ_TIMEOUT: FailureKind.STREAM_IDLE,
    Fault.FIRST_TOKEN_TIMEOUT: FailureKind.FIRST_TOKEN_TIMEOUT,
    # Cut by the request's own deadline: no verdict on the replica (as when the client leaves).
    Fault.DEADLINE: None,
    # The health verdict is already given; the fleet learns the attempt went silent.
    Fault.EJECTED: FailureKind.STREAM_IDLE,
    # A 429 is a busy replica, not a broken one: never held against it (ejecting replicas
    # for being busy would only push their load onto the rest).
    Fault.BUSY_429: None,
    Fault.BUSY_503: FailureKind.UPSTREAM_5XX,
    Fault.STATUS_5XX: FailureKind.UPSTREAM_5XX,
    Fault.ERROR_EVENT: FailureKind.UPSTREAM_5XX,
}
REASON: Final[dict[Fault, RetryReason]] = {
    Fault.UNREACHED: RetryReason.CONNECT,
    # Resets after a send are retried under the 5xx-after-send rule, so counted under it.
    Fault.CLOSED: RetryReason.UPSTREAM_5XX,
    Fault.READ_TIMEOUT: RetryReason.FIRST_TOKEN_TIMEOUT,
    Fault.FIRST_TOKEN_TIMEOUT: RetryReason.FIRST_TOKEN_TIMEOUT,
    Fault.DEADLINE: RetryReason.FIRST_TOKEN_TIMEOUT,
    Fault.EJECTED: RetryReason.REPLICA_EJECTED,
    Fault.BUSY_429: RetryReason.UPSTREAM_5XX,
    Fault.BUSY_503: RetryReason.UPSTREAM_5XX,
    Fault.STATUS_5XX: RetryReason.UPSTREAM_5XX,
    Fault.ERROR_EVENT: RetryReason.UPSTREAM_5XX,
}
# Faults after which the replica may have spent GPU work on the request: retried only with
# ``retry.on_5xx_after_send``, at most once per request. Otherwise a reset fails the request
# and a 5xx status is relayed as the replica's answer. One exception: a 5xx status from a
# suspect replica (``detect.suspect``: its own /health fails, or many of its answers were 5xx)
# is replayed once by default. A reset is not: the replica may have died of this very request,
# and a replay would take a second one down with it. Except for a stream that continuation
# would carry on another replica (``resumable``): one token later its reset would have been
# continued there anyway, so refusing it at token zero guards nothing.
_AFTER_SEND: Final = frozenset({Fault.CLOSED, Fault.STATUS_5XX})


def judge(
    fault: Fault,
    phase: Phase,
    *,
    on_5xx_after_send: bool,
    after_send_used: bool,
    suspect: bool = False,
    resumable: bool = False,
) -> Verdict:
    """What ``fault``, met in ``phase``, means for the attempt and the request (``suspect``:
    the attempt's replica has evidence of its own against it; ``resumable``: an eligible
    stream that continuation would carry on another replica once it has content)."""
    failure = FAILURE[fault]
    reason = REASON[fault]
    if phase >= Phase.STARTED:
        # The client has the response start: an attempt is never retried after that.
        return Verdict(Action.END_STREAM, failure, reason)
    if fault is Fault.DEADLINE:
        # The request's deadline has passed: no further attempt (uvloop's millisecond timers
        # may fire a hair before loop.time() reaches it, so the loop's own check can miss).
        return Verdict(Action.FAIL, failure, reason)
    if fault in _AFTER_SEND:
        replay = (
            on_5xx_after_send
            or (suspect and fault is Fault.STATUS_5XX)
            or (resumable and fault is Fault.CLOSED)
        )
        if replay and not after_send_used:
            return Verdict(Action.RETRY, failure, reason, spends_after_send=True)
        if fault is Fault.STATUS_5XX:
            # Told to the fleet by the relayed answer's status, once it is relayed.
            return Verdict(Action.RELAY, None, reason)
        return Verdict(Action.FAIL, failure, reason)
    overloaded = fault in (Fault.BUSY_429, Fault.BUSY_503)
    return Verdict(Action.RETRY, failure, reason, overloaded=overloaded)


class RetryDecision(Enum):
    RETRY = "retry"
    NOT_RETRYABLE = "not_retryable"  # the verdict said FAIL
    ATTEMPTS_SPENT = "attempts_spent"  # retry.max_attempts reached
    DEADLINE_PASSED = "deadline_passed"  # retry.deadline_s since the first attempt
    BUDGET_SPENT = "budget_spent"  # retries in flight at retry.budget_ratio of requests


def decide_retry(
    retry: bool,
    reason: RetryReason,
    *,
    attempts: int,
    max_attempts: int,
    deadline_left_s: float,
    budget_left: bool,
) -> RetryDecision:
    """Whether the request gets another attempt after one that failed with ``retry``
    (the verdict was RETRY) under ``reason``, ``attempts`` made so far."""
    if not retry:
        return RetryDecision.NOT_RETRYABLE
    if attempts >= max_attempts:
        return RetryDecision.ATTEMPTS_SPENT
    if deadline_left_s <= 0:
        return RetryDecision.DEADLINE_PASSED
    # Rescues of an ejected replica's requests are outside the budget: they are bounded by
    # what that replica held, and the budget is there to stop retry storms against replicas
    # that fail, not to fail the requests of one that died.
    if not budget_left and reason is not RetryReason.REPLICA_EJECTED:
        return RetryDecision.BUDGET_SPENT
    return RetryDecision.RETRY


def budget_left(retries_in_flight: int, requests_in_flight: int, budget_ratio: float) -> bool:
    """Retries in flight stay under ``budget_ratio`` of requests in flight (at least 3)."""
    return retries_in_flight < max(3.0, budget_ratio * requests_in_flight)


__all__ = [
    "FAILURE",
    "REASON",
    "Action",
    "Phase",
    "RetryDecision",
    "Verdict",
    "budget_left",
    "decide_retry",
    "judge",
]
