"""Detectors and ejection arithmetic: pure functions over a replica's recent observations.

No I/O and no clock of their own: every function takes the times it needs, so tests drive them
with made-up numbers. ``fleet.py`` owns the state and calls these to decide.

Decisions documented here (the policy keys in docs/policy.md leave them open):

- **Stall.** A stall is declared from scrapes alone: ``running > 0`` at every scrape of a span of
  at least ``stall_after_s`` during which prompt + generation counters did not change. The span
  starts at the first scrape that showed the current counter values (the conservative end: the
  engine may have moved just before it), and half an interval of slack absorbs scheduling jitter
  between scrapes. A counter that goes down (replica restarted) counts as progress.
- **Stall seen from traffic.** An engine that hangs while idle keeps ``running == 0`` in its
  frozen metrics: the scrape cannot tell it from an idle one. The gateway's own requests can:
  one waiting ``stall_after_s`` for its first content, no content stream moving, and the
  counters flat over the same span is a stall too (``traffic_stalled``).
- **Silent streams.** One first-token timeout (or idle stream) can be a merely slow replica. It
  ejects only when the replica's own metrics agree that it is not generating (counters flat over
  at least two scrapes, or ``/metrics`` not answering), or when ``SILENT_IN_ROW`` attempts in a
  row on it went silent with no success between.
- **Poison requests.** A 5xx may be the request's fault, not the replica's: a body that makes
  every replica answer 500 must not eject them. A connect error or a reset counts toward
  ``consecutive_failures`` as it comes; a 5xx ejects only as an outlier (``fivexx_outlier``):
  ``consecutive_failures`` of them in a row on the replica while its pool peers, over their
  recent attempts (``FIVEXX_WINDOW``), answered at least as many and mostly fine. A poison body
  sprayed over the pool raises every replica's rate alike; one replica that really fails stands
  out. The relay also drops from the count a 5xx that the same request got on another replica
  too (the request is the common factor, ``poisoned``).
- **A suspect replica's 5xx is replayed.** Replaying a 500 elsewhere is opt-in
  (``retry.on_5xx_after_send``): it doubles the cost of every poison body. A replica with
  evidence of its own against it is different (``suspect``): its ``/health`` failed at the last
  check, or a quarter of its recent answers were 5xx. Its 500 is replayed once on another
  replica, and the replay is the verdict: a 5xx there too, the request is poison (nobody's
  count); a good answer there, the 5xx was the replica's own and counts toward
  ``consecutive_failures`` like a reset, with no need for peer evidence. A poison body never
  gets a good answer elsewhere, so it cannot eject a replica this way, even a pool's only one.
- **Outage.** When every replica of a pool is out or failing (a held-back ejection while its
  ``/health`` also fails), the cap is not keeping capacity, only a dead replica in the route:
  the pool has no candidates (``in_outage``) and requests get admission's fast 503.
- **Cap.** At most ``max_ejected_percent`` of a pool may be out for failure-based reasons,
  rounded down but at least one replica when the percentage is above 0 (as Envoy does), so a
  one-replica pool with a ``spill_to`` can still shed a dead replica. Replicas that are out for
  any reason (ejected or probing) count against the cap; a stall ejects regardless. When the
  cap first holds a failing replica back, the pool's replicas ejected for failures are probed
  at once instead of at the end of their ejection (``probe_early``): a replica whose fault
  lifted comes back through its canary, and the failing one can then be ejected in its place.
- **No target, no wait for the end of an ejection.** When a request's retry or a stream's
  continuation finds no replica, the lane's replicas ejected for failures whose ``/health``
  answers again are probed at once (``probe_when_no_target``), once until it is back in
  service: one whose fault lifted is back after one canary. A replica whose ``/health`` fails
  is left alone, and one whose canary fails waits its next ejections out, so the backoff still
  spaces an always-failing replica's canaries.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, TypeVar

SILENT_IN_ROW: Final = 3  # silent attempts in a row that eject even when the counters still move
SLOW_START_FLOOR: Final = 0.1  # a replica in slow start never weighs less than this
FIVEXX_WINDOW = 20  # recent attempts per replica kept for the 5xx outlier comparison
PEER_5XX_RATE_MAX: Final = 0.5  # peers failing more than this: the requests, not the replica, fail
SUSPECT_5XX_RATE: Final = 0.25  # a replica whose recent answers were this much 5xx: replay its 5xx
SUSPECT_MIN_SEEN: Final = 2  # ... over at least this many answers


@dataclass(frozen=True, slots=True)
class Progress:
    """What the scrapes said about token progress, reduced to what the detectors need.

    ``flat_since``: the first scrape that showed the current counter values while busy; None
    when idle (``running == 0``) or never scraped. ``unchanged_since``: the first scrape that
    showed the current values, busy or not. ``last_at``: the latest successful scrape.
    """

    tokens: float | None = None
    running: float = 0.0
    flat_since: float | None = None
    unchanged_since: float | None = None
    last_at: float | None = None


def note_scrape(p: Progress, at: float, running: float, tokens: float) -> Progress:
    """Fold one successful scrape (prompt + generation counter total) into the progress view."""
    moved = p.tokens is None or tokens != p.tokens
    unchanged_since = at if moved or p.unchanged_since is None else p.unchanged_since
    if running <= 0:
        flat_since = None
    else:
        flat_since = at if moved or p.flat_since is None else p.flat_since
    return Progress(tokens, running, flat_since, unchanged_since, at)


def flat_for(p: Progress) -> float:
    """Seconds the counters were seen flat while busy (0 when idle or unknown)."""
    if p.running <= 0 or p.flat_since is None or p.last_at is None:
        return 0.0
    return p.last_at - p.flat_since


def unchanged_for(p: Progress) -> float:
    """Seconds the counters were seen flat, busy or idle (0 when unknown)."""
    if p.unchanged_since is None or p.last_at is None:
        return 0.0
    return p.last_at - p.unchanged_since


def stall_threshold(stall_after_s: float, interval_s: float) -> float:
    """How long counters must be seen flat: ``stall_after_s`` less half a scrape interval of
    slack (scrapes land anywhere in the interval), but never less than half of
    ``stall_after_s``: with a scrape interval much longer than ``stall_after_s`` the slack
    would otherwise go negative and one scrape of a busy replica would read as a stall."""
    return stall_after_s - min(interval_s, stall_after_s) / 2


def stalled(p: Progress, stall_after_s: float, interval_s: float) -> bool:
    """Running > 0 and counters flat for ``stall_after_s`` (see ``stall_threshold``)."""
    return (
        p.running > 0
        and p.flat_since is not None
        and flat_for(p) >= stall_threshold(stall_after_s, interval_s)
    )


def not_generating(p: Progress, stale: bool, ever_scraped: bool, interval_s: float) -> bool:
    """Do the metrics back a silent-stream report? Counters flat over two scrapes or more
    (busy or not: a request waiting for its first token should have moved them), or no
    answer from ``/metrics`` (a replica never scraped gives no evidence either way)."""
    if stale:
        return ever_scraped
    return p.unchanged_since is not None and unchanged_for(p) >= interval_s / 2


class Watched(Protocol):
    last_progress: float

    @property
    def content_sent(self) -> bool: ...


W = TypeVar("W", bound=Watched)


def traffic_stalled(
    streams: Iterable[Watched], p: Progress, now: float, stall_after_s: float, interval_s: float
) -> bool:
    """The stall seen from the gateway's own traffic, for an engine whose metrics froze with
    ``running == 0`` (new requests never reach it, so the scrape looks idle).

    Stalled when a request of ours has waited ``stall_after_s`` for its first content, no
    stream of ours that did get content has moved for that long either, and the counters stood
    still over the same span. Content streams that are merely silent are no evidence on their
    own: a client that stops reading stops its stream, not the replica.
    """
    if unchanged_for(p) < stall_threshold(stall_after_s, interval_s):
        return False
    waited = False
    for w in streams:
        if now - w.last_progress < stall_after_s:
            if w.content_sent:
                return False  # something still flows from it
        elif not w.content_sent:
            waited = True
    return waited


def silent_failure_ejects(silent_in_row: int, metrics_agree: bool) -> bool:
    return metrics_agree or silent_in_row >= SILENT_IN_ROW


# ------------------------------------------------------------------------ 5xx: poison or outlier


def fivexx_outlier(in_row: int, threshold: int, peer_5xx: int, peer_total: int) -> bool:
    """Does a run of ``in_row`` 5xx answers eject the replica?

    Only when the run reaches ``threshold`` and the pool's other replicas, over their recent
    attempts (``peer_total`` of them, ``peer_5xx`` answered 5xx), served at least ``threshold``
    requests with a 5xx rate of at most ``PEER_5XX_RATE_MAX``: they serve the same traffic fine,
    so the fault is this replica's. Peers failing alike point at the requests (a poison body);
    no peer evidence (a one-replica pool, idle peers) leaves the verdict to ``/health``.
    """
    if in_row < max(threshold, 1) or peer_total < max(threshold, 1):
        return False
    return peer_5xx / peer_total <= PEER_5XX_RATE_MAX


def suspect(health_ok: bool, recent_5xx: Sequence[bool]) -> bool:
    """Is a 5xx from this replica more likely its own fault than the request's? Its own
    ``/health`` failed at the last check, or at least ``SUSPECT_5XX_RATE`` of its recent
    answers (``SUSPECT_MIN_SEEN`` of them at least) were 5xx. Its 5xx is then replayed once
    elsewhere. The bar can be low: a poison body that makes a replica suspect costs one more
    answer per request, and its replay clears the replica (``poisoned``)."""
    if not health_ok:
        return True
    seen = len(recent_5xx)
    return seen >= SUSPECT_MIN_SEEN and sum(recent_5xx) >= SUSPECT_5XX_RATE * seen


def poisoned(fivexx_on_other_replica: bool, status: int) -> bool:
    """A 5xx (``status``) on a request that already got a 5xx on another replica: the
    request is the common factor, so neither answer counts against its replica."""
    return fivexx_on_other_replica and status >= 500


def in_outage(out_or_failing: Iterable[bool]) -> bool:
    """Every replica of a pool out of service or failing (a non-empty pool): see ``Outage``
    above. ``out_or_failing`` has one flag per replica."""
    flags = list(out_or_failing)
    return bool(flags) and all(flags)


# ---------------------------------------------------------------------------- ejection arithmetic


def backoff_s(level: int, base_s: float, max_s: float) -> float:
    """How long the ``level``-th ejection in a row lasts: base × level, capped."""
    return min(base_s * max(level, 1), max_s)


def decay(level: int, since: float, now: float, base_s: float) -> tuple[int, float]:
    """The backoff level drops by one per ``base_s`` spent healthy.

    Returns the new level and the new reference time (``since`` advanced by the steps taken, so
    partial progress toward the next step is kept).
    """
    if level <= 0 or now <= since:
        return max(level, 0), since
    steps = min(int((now - since) // base_s), level)
    return level - steps, since + steps * base_s


def ejection_cap(pool_size: int, max_percent: int) -> int:
    """How many replicas of a pool may be out for failure-based reasons."""
    if max_percent <= 0 or pool_size <= 0:
        return 0
    return max(1, math.floor(pool_size * max_percent / 100))


def may_eject(pool_size: int, out_now: int, max_percent: int) -> bool:
    """Would one more failure-based ejection stay within the cap?"""
    return out_now + 1 <= ejection_cap(pool_size, max_percent)


def probe_early(out_for_failure: bool, ejected_until: float, now: float) -> bool:
    """Should an ejected replica be tried again now, before its ejection is over, because the
    cap holds back the ejection of a failing peer? Only a failure-based ejection (an operator's
    lasts until readmitted) with time left: one canary, and if it passes the failing peer can
    go in its place; if it fails the replica is out again, for longer."""
    return out_for_failure and now < ejected_until < math.inf


def probe_when_no_target(
    out_for_failure: bool, ejected_until: float, now: float, health_ok: bool, probed: bool
) -> bool:
    """Should an ejected replica be tried again now because a request found no replica to go
    to? Only a failure-based ejection with time left (``probe_early``), whose ``/health``
    answers again (a dead one would fail its canary), and once until it is back in service
    (``probed``): a replica whose fault goes on is out again after one canary, for longer, and
    then waits its ejections out."""
    return health_ok and not probed and probe_early(out_for_failure, ejected_until, now)


def slow_start_weight(healthy_for_s: float, slow_start_s: float) -> float:
    """Share of a fully warm replica that a just-readmitted one should get: linear from
    ``SLOW_START_FLOOR`` to 1 over ``slow_start_s``."""
    if slow_start_s <= 0 or healthy_for_s >= slow_start_s:
        return 1.0
    return max(SLOW_START_FLOOR, healthy_for_s / slow_start_s)


# ---------------------------------------------------------------------------- rescue


def silent_streams(streams: Iterable[W], now: float, quiet_s: float) -> list[W]:
    """Streams to end when their replica is ejected: those that sent the client nothing yet
    (retrying them elsewhere costs the client nothing) and those with no chunk for
    ``quiet_s``. A stream that still progresses keeps going."""
    return [w for w in streams if not w.content_sent or now - w.last_progress >= quiet_s]
