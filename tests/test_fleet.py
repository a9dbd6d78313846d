"""The health state machine with a fake clock: admission through canaries, ejection reasons,
backoff and decay, the max_ejected_percent cap and panic, operator actions, rescue."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import pytest

from proxy.fleet.fleet import EjectReason, Fleet, Replica, ReplicaState
from proxy.fleet.vllm import EngineSample
from proxy.observe.metrics import Metrics
from proxy.policyfile import build_policy

P, H, E, D = ReplicaState.PROBING, ReplicaState.HEALTHY, ReplicaState.EJECTED, ReplicaState.DRAINING
URLS = ["http://r0:8000", "http://r1:8000", "http://r2:8000"]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(
    health: dict[str, Any] | None = None, urls: list[str] = URLS
) -> tuple[Fleet, Clock, Metrics]:
    policy = build_policy(
        {
            "pools": {"main": {"replicas": [{"url": u} for u in urls]}},
            "lanes": [{"name": "all", "pool": "main"}],
            "health": {"interval_s": 1.0, "stall_after_s": 10.0, **(health or {})},
        }
    )
    clock, metrics = Clock(), Metrics()
    fleet = Fleet(policy, {}, metrics=metrics, clock=clock)
    for r in fleet.replicas():
        r.models = {"m": {"id": "m"}}
    return fleet, clock, metrics


def admit(fleet: Fleet, r: Replica, clock: Clock) -> None:
    """One health round of a probing replica that answers /health and its canary."""
    fleet.observe_health(r, True, clock.t)
    fleet.canary_result(r, True, clock.t)


def all_healthy(health: dict[str, Any] | None = None) -> tuple[Fleet, Clock, Metrics, Replica]:
    """Every replica admitted (so one failure-based ejection stays within the cap); the first."""
    fleet, clock, m = make(health)
    for r in fleet.replicas():
        admit(fleet, r, clock)
    return fleet, clock, m, next(fleet.replicas())


def sample(running: float, tokens: float) -> EngineSample:
    return EngineSample(running=running, prompt_tokens_total=tokens, generation_tokens_total=0)


def stall(fleet: Fleet, r: Replica, clock: Clock) -> None:
    """Scrapes every second with running > 0 and frozen counters until the replica is out."""
    tokens = r.progress.tokens or 0.0
    for _ in range(30):
        fleet.observe_scrape(r, sample(2, tokens + 1), clock.t)
        if r.state is E:
            return
        clock.t += 1.0
    raise AssertionError("no stall ejection within 30 s")


def state_gauge(m: Metrics, r: Replica) -> dict[str, float]:
    return {
        s: m.registry.get_sample_value(
            "tokenlane_replica_state", {"pool": r.pool, "replica": r.name, "state": s}
        )
        for s in ("probing", "healthy", "ejected", "draining")
    }


def ejections(m: Metrics, r: Replica, reason: str) -> float:
    v = m.registry.get_sample_value(
        "tokenlane_ejections_total", {"pool": r.pool, "replica": r.name, "reason": reason}
    )
    return v or 0.0


def panic(m: Metrics) -> float | None:
    return m.registry.get_sample_value("tokenlane_panic", {"pool": "main"})


# ---------------------------------------------------------------------------- probing


def test_replica_starts_probing_and_needs_health_and_canary() -> None:
    fleet, clock, m = make()
    r = next(fleet.replicas())
    assert r.state is P and state_gauge(m, r)["probing"] == 1
    fleet.observe_health(r, True, clock.t)
    assert r.state is P  # /health alone proves nothing about generation
    fleet.canary_result(r, True, clock.t)
    assert (r.state, r.reason) == (H, None)
    assert state_gauge(m, r) == {"probing": 0, "healthy": 1, "ejected": 0, "draining": 0}


def test_canary_token_without_health_200_does_not_readmit() -> None:
    fleet, clock, _ = make()
    r = next(fleet.replicas())
    fleet.observe_health(r, False, clock.t)
    fleet.canary_result(r, True, clock.t)
    assert r.state is P


def test_canary_failure_ejects_with_backoff() -> None:
    fleet, clock, m = make()
    r = next(fleet.replicas())
    fleet.observe_health(r, True, clock.t)
    fleet.canary_result(r, False, clock.t, "no token within 10s")
    assert (r.state, r.reason) == (E, EjectReason.CANARY_FAILED)
    assert r.ejected_until == clock.t + 30
    assert ejections(m, r, "canary_failed") == 1
    clock.t += 29.9
    fleet.tick(r, clock.t)
    assert r.state is E
    clock.t += 0.1
    fleet.tick(r, clock.t)
    assert (r.state, r.reason) == (P, EjectReason.CANARY_FAILED)  # back to the canary gate


# ---------------------------------------------------------------------------- detectors → ejection


def test_stall_ejects_after_stall_after_s_of_flat_counters() -> None:
    fleet, clock, m = make()
    r = next(fleet.replicas())
    admit(fleet, r, clock)
    start = clock.t
    stall(fleet, r, clock)
    assert (r.state, r.reason) == (E, EjectReason.STALL)
    assert 9.5 <= clock.t - start <= 10.0
    assert ejections(m, r, "stall") == 1


def test_frozen_idle_metrics_with_a_waiting_request_is_a_stall() -> None:
    # The engine hung while idle: its scrape says running 0 for ever, our request waits.
    fleet, clock, _ = make()
    r = next(fleet.replicas())
    admit(fleet, r, clock)
    waiter = Watch(last_progress=clock.t, content_sent=False)
    r.streams.add(waiter)
    for _ in range(12):
        fleet.observe_scrape(r, sample(0, 5), clock.t)
        if r.state is E:
            break
        clock.t += 1
    assert (r.state, r.reason) == (E, EjectReason.STALL)
    assert waiter.interrupted == ["replica_ejected"]


def test_idle_replica_with_flat_counters_stays_healthy() -> None:
    fleet, clock, _ = make()
    r = next(fleet.replicas())
    admit(fleet, r, clock)
    for _ in range(60):
        fleet.observe_scrape(r, sample(0, 5), clock.t)
        clock.t += 1
    assert r.state is H


@pytest.mark.parametrize("threshold", [1, 3])
def test_health_check_ejects_after_threshold_failures_in_row(threshold: int) -> None:
    fleet, clock, _, r = all_healthy({"unhealthy_threshold": threshold})
    for _ in range(threshold - 1):
        fleet.observe_health(r, False, clock.t)
    fleet.observe_health(r, True, clock.t)  # a 200 in between starts the count again
    for _ in range(threshold - 1):
        fleet.observe_health(r, False, clock.t)
    assert r.state is H
    fleet.observe_health(r, False, clock.t)
    assert (r.state, r.reason) == (E, EjectReason.HEALTH_CHECK)


@pytest.mark.parametrize("kind", ["connect", "reset", "upstream_5xx"])
def test_consecutive_failures_eject_only_in_a_row(kind: str) -> None:
    fleet, _clock, _, r = all_healthy({"consecutive_failures": 3})
    for peer in list(fleet.replicas())[1:]:  # peers serve fine: a 5xx run is r's own
        for _ in range(3):
            fleet.attempt_started(peer)
            fleet.attempt_finished(peer, None)
    for outcome in [kind, kind, None, kind, kind]:
        fleet.attempt_started(r)
        fleet.attempt_finished(r, outcome)
    assert r.state is H
    fleet.attempt_started(r)
    fleet.attempt_finished(r, kind)
    assert (r.state, r.reason) == (E, EjectReason.CONSECUTIVE_FAILURES)
    assert r.in_flight == 0


def test_one_first_token_timeout_on_a_generating_replica_is_tolerated() -> None:
    fleet, clock, _, r = all_healthy()
    for t in range(3):  # counters move: the replica is slow, not stuck
        fleet.observe_scrape(r, sample(4, 100 * t), clock.t)
        clock.t += 1
    fleet.attempt_started(r)
    fleet.attempt_finished(r, "first_token_timeout")
    assert r.state is H


def test_first_token_timeout_ejects_when_metrics_show_no_progress() -> None:
    fleet, clock, m, r = all_healthy()
    for _ in range(3):  # flat for 2 s: short of a stall, enough to back the relay's report
        fleet.observe_scrape(r, sample(4, 100), clock.t)
        clock.t += 1
    fleet.attempt_started(r)
    fleet.attempt_finished(r, "first_token_timeout")
    assert (r.state, r.reason) == (E, EjectReason.FIRST_TOKEN_TIMEOUT)
    assert ejections(m, r, "first_token_timeout") == 1


def test_idle_streams_in_a_row_eject_as_silent_stream() -> None:
    fleet, clock, _, r = all_healthy()
    for t in range(3):
        fleet.observe_scrape(r, sample(4, 100 * t), clock.t)
    for _ in range(2):
        fleet.attempt_started(r)
        fleet.attempt_finished(r, "stream_idle")
    assert r.state is H
    fleet.attempt_started(r)
    fleet.attempt_finished(r, "stream_idle")
    assert (r.state, r.reason) == (E, EjectReason.SILENT_STREAM)


# ---------------------------------------------------------------------------- backoff and decay


def cycle(fleet: Fleet, r: Replica, clock: Clock) -> float:
    """Stall the replica, return how long the ejection lasts, then let it back in."""
    stall(fleet, r, clock)
    lasts = r.ejected_until - clock.t
    clock.t = r.ejected_until
    fleet.tick(r, clock.t)
    assert r.state is P
    admit(fleet, r, clock)
    return lasts


def test_backoff_sequence_grows_by_base_up_to_cap() -> None:
    fleet, clock, _ = make({"eject_base_s": 30, "eject_max_s": 200})
    r = next(fleet.replicas())
    admit(fleet, r, clock)
    # Each stall takes ~10 s of healthy time: less than a base, so no decay between them.
    assert [cycle(fleet, r, clock) for _ in range(9)] == [30, 60, 90, 120, 150, 180, 200, 200, 200]
    assert r.ejections == 9


def test_backoff_level_decays_one_per_base_spent_healthy() -> None:
    fleet, clock, _ = make({"eject_base_s": 30})
    r = next(fleet.replicas())
    admit(fleet, r, clock)
    assert [cycle(fleet, r, clock) for _ in range(3)] == [30, 60, 90]
    assert r.backoff_level == 3
    clock.t += 65  # healthy for two bases and a bit
    fleet.tick(r, clock.t)
    assert r.backoff_level == 1
    assert cycle(fleet, r, clock) == 60  # level 1 + 1


# ---------------------------------------------------------------------------- cap and panic


def fail(fleet: Fleet, r: Replica, times: int = 5) -> None:
    for _ in range(times):
        fleet.attempt_started(r)
        fleet.attempt_finished(r, "connect")


def test_cap_holds_back_failure_ejection_and_sets_panic(caplog: pytest.LogCaptureFixture) -> None:
    fleet, clock, m = make({"max_ejected_percent": 50})
    r0, r1, r2 = fleet.replicas()
    for r in (r0, r1, r2):
        admit(fleet, r, clock)
    fail(fleet, r0)
    assert r0.state is E
    with caplog.at_level(logging.WARNING, "tokenlane.health"):
        fail(fleet, r1)
    assert (r1.state, r1.capped) == (H, EjectReason.CONSECUTIVE_FAILURES)  # keeps serving
    assert panic(m) == 1
    assert "held back" in caplog.text and r1.name in caplog.text
    fleet.attempt_started(r1)
    fleet.attempt_finished(r1, None)  # it recovered: nothing held back any more
    assert r1.capped is None and panic(m) == 0


def test_panic_gauge_starts_at_zero() -> None:
    _, _, m = make()
    assert panic(m) == 0


def test_capped_ejection_happens_once_there_is_room() -> None:
    fleet, clock, m = make({"max_ejected_percent": 50})
    r0, r1, r2 = fleet.replicas()
    for r in (r0, r1, r2):
        admit(fleet, r, clock)
    fail(fleet, r0)
    fail(fleet, r1)
    assert r1.state is H and panic(m) == 1
    # The hold-back probes r0 at once, not at the end of its ejection: its canary passes.
    assert r0.state is P
    admit(fleet, r0, clock)
    fleet.tick(r1, clock.t)
    assert (r1.state, r1.reason) == (E, EjectReason.CONSECUTIVE_FAILURES)
    assert panic(m) == 0


def test_a_held_back_ejection_probes_the_ejected_once_per_episode() -> None:
    fleet, clock, _m, _ = all_healthy({"max_ejected_percent": 50})
    r0, r1, _r2 = fleet.replicas()
    fail(fleet, r0)
    level = r0.backoff_level
    fail(fleet, r1)
    assert r0.state is P
    fleet.canary_result(r0, False, clock.t)  # still broken: out again, for longer
    assert (r0.state, r0.reason) == (E, EjectReason.CANARY_FAILED)
    assert r0.backoff_level == level + 1
    fail(fleet, r1)  # r1 still held back: no second early probe in the same episode
    assert r0.state is E and r1.capped is EjectReason.CONSECUTIVE_FAILURES
    clock.t = r0.ejected_until
    fleet.tick(r0, clock.t)
    assert r0.state is P  # and its ejection ends on time as ever


def test_an_operator_ejection_is_not_probed_early() -> None:
    fleet, _clock, _m, _ = all_healthy({"max_ejected_percent": 50})
    r0, r1, _r2 = fleet.replicas()
    fleet.operator_eject(r0)
    fail(fleet, r1)
    assert r1.capped is not None and (r0.state, r0.reason) == (E, EjectReason.OPERATOR)


def test_stall_is_never_capped() -> None:
    fleet, clock, m = make({"max_ejected_percent": 50})
    r0, r1, r2 = fleet.replicas()
    for r in (r0, r1, r2):
        admit(fleet, r, clock)
    fail(fleet, r0)
    stall(fleet, r1, clock)
    assert (r1.state, r1.reason) == (E, EjectReason.STALL)
    assert panic(m) == 0


def test_probing_replicas_count_against_the_cap() -> None:
    # At start-up two replicas still probe; the one that serves is not ejected for failures.
    fleet, clock, m = make({"max_ejected_percent": 50})
    r0 = next(fleet.replicas())
    admit(fleet, r0, clock)
    fail(fleet, r0)
    assert r0.state is H and panic(m) == 1


# ---------------------------------------------------------------------------- operator


def test_operator_eject_lasts_until_readmitted() -> None:
    fleet, clock, m = make()
    r = next(fleet.replicas())
    admit(fleet, r, clock)
    fleet.operator_eject(r)
    assert (r.state, r.reason) == (E, EjectReason.OPERATOR) and math.isinf(r.ejected_until)
    assert r.backoff_level == 0 and ejections(m, r, "operator") == 1
    clock.t += 10_000
    fleet.tick(r, clock.t)
    assert r.state is E
    fleet.operator_readmit(r)
    assert r.state is P  # through the canary
    admit(fleet, r, clock)
    assert (r.state, r.reason) == (H, None)


def test_operator_force_readmit_skips_canary() -> None:
    fleet, _, _ = make()
    r = next(fleet.replicas())
    fleet.operator_eject(r)
    fleet.operator_readmit(r, force=True)
    assert (r.state, r.reason) == (H, None)


def test_drained_replica_takes_nothing_and_detectors_leave_it() -> None:
    fleet, clock, _ = make()
    r = next(fleet.replicas())
    admit(fleet, r, clock)
    fleet.operator_drain(r)
    assert r.state is D and r not in fleet.pools["main"].candidates("m")
    fail(fleet, r, 10)
    for _ in range(5):
        fleet.observe_health(r, False, clock.t)
    assert r.state is D
    fleet.operator_readmit(r)
    assert r.state is P


def test_transitions_are_logged_with_replica_from_to_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fleet, clock, _ = make()
    r = next(fleet.replicas())
    with caplog.at_level(logging.INFO, "tokenlane.health"):
        admit(fleet, r, clock)
        stall(fleet, r, clock)
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "tokenlane.health"]
    assert any(f"replica={r.name}" in x and "from=probing to=healthy" in x for x in lines)
    assert any("from=healthy to=ejected reason=stall" in x for x in lines)


# ---------------------------------------------------------------------------- rescue, load


@dataclass(eq=False)
class Watch:
    last_progress: float
    content_sent: bool
    interrupted: list[str] = field(default_factory=list)

    def interrupt(self, reason: str) -> None:
        self.interrupted.append(reason)


def test_ejection_interrupts_silent_streams_and_spares_flowing_ones() -> None:
    fleet, clock, _ = make()
    r = next(fleet.replicas())
    admit(fleet, r, clock)
    fleet.observe_scrape(r, sample(3, 10), clock.t)
    clock.t += 10
    waiting = Watch(last_progress=clock.t - 0.1, content_sent=False)
    silent = Watch(last_progress=clock.t - 10, content_sent=True)
    flowing = Watch(last_progress=clock.t - 0.2, content_sent=True)
    r.streams.update({waiting, silent, flowing})
    fleet.observe_scrape(r, sample(3, 10), clock.t)
    assert r.state is E
    assert waiting.interrupted == ["replica_ejected"] and silent.interrupted == ["replica_ejected"]
    assert flowing.interrupted == []


def test_stale_stats_count_as_busy_never_idle() -> None:
    fleet, clock, _ = make()
    r = next(fleet.replicas())
    assert r.load == 0  # never scraped: nothing known
    fleet.observe_scrape(r, sample(1, 1), clock.t)
    fleet.observe_scrape(r, None, clock.t + 1)
    assert r.stats.stale and r.load >= r.max_in_flight


def test_slow_start_inflates_load_then_fades() -> None:
    fleet, clock, _ = make({"slow_start_s": 60})
    r = next(fleet.replicas())
    admit(fleet, r, clock)
    assert r.weight == pytest.approx(0.1) and r.load == pytest.approx(9.0)  # looks like 9 in flight
    clock.t += 30
    fleet.tick(r, clock.t)
    assert r.weight == pytest.approx(0.5) and r.load == pytest.approx(1.0)
    clock.t += 30
    fleet.tick(r, clock.t)
    assert r.weight == 1.0 and r.load == 0


def test_apply_keeps_state_of_kept_replicas_and_adds_new_ones_probing() -> None:
    fleet, clock, _ = make()
    r0 = next(fleet.replicas())
    admit(fleet, r0, clock)
    changed = fleet.apply(
        build_policy(
            {
                "pools": {"main": {"replicas": [{"url": URLS[0]}, {"url": "http://r9:8000"}]}},
                "lanes": [{"name": "all", "pool": "main"}],
                "health": {"stall_after_s": 5},
            }
        )
    )
    kept, new = fleet.pools["main"].replicas
    assert changed and kept is r0 and kept.state is H and new.state is P
    assert fleet.health.stall_after_s == 5


def test_failures_of_a_replica_reloaded_away_are_ignored() -> None:
    fleet, clock, _ = make()
    gone = next(fleet.replicas())
    admit(fleet, gone, clock)
    fleet.attempt_started(gone)
    fleet.apply(
        build_policy(
            {
                "pools": {"other": {"replicas": [{"url": "http://r9:8000"}]}},
                "lanes": [{"name": "all", "pool": "other"}],
            }
        )
    )
    # It drains: listed, taking nothing new, until its last request ends after the reload.
    assert gone.state is ReplicaState.DRAINING
    assert [r.url for r in fleet.replicas()] == ["http://r9:8000", gone.url]
    fail(fleet, gone, 10)
    assert gone.state is ReplicaState.DRAINING  # failures after leaving eject nothing
    fleet.attempt_finished(gone, None)  # the request it held when the policy changed
    assert [r.url for r in fleet.replicas()] == ["http://r9:8000"]


def reload_to(
    fleet: Fleet, replicas: list[dict[str, Any]], health: dict[str, Any] | None = None
) -> None:
    fleet.apply(
        build_policy(
            {
                "pools": {"main": {"replicas": replicas}},
                "lanes": [{"name": "all", "pool": "main"}],
                "health": {"interval_s": 1.0, "stall_after_s": 10.0, **(health or {})},
            }
        )
    )


def test_state_series_of_a_removed_replica_vanish_once_it_has_drained() -> None:
    fleet, clock, m = make()
    idle, busy, kept = fleet.replicas()
    for r in (idle, busy, kept):
        admit(fleet, r, clock)
    fleet.attempt_started(busy)
    reload_to(fleet, [{"url": kept.url}])
    # A dashboard must not count a replica the policy no longer has as healthy, forever.
    assert set(state_gauge(m, idle).values()) == {None}
    assert state_gauge(m, busy)["draining"] == 1  # still finishing its request
    fleet.attempt_finished(busy, None)
    assert set(state_gauge(m, busy).values()) == {None}
    assert state_gauge(m, kept)["healthy"] == 1


def test_renamed_replica_moves_its_state_series_to_the_new_name() -> None:
    fleet, clock, m = make()
    r0 = next(fleet.replicas())
    admit(fleet, r0, clock)
    old = {"pool": r0.pool, "replica": r0.name, "state": "healthy"}
    reload_to(fleet, [{"url": URLS[0], "name": "fast-0"}, {"url": URLS[1]}, {"url": URLS[2]}])
    assert r0.name == "fast-0" and state_gauge(m, r0)["healthy"] == 1
    assert m.registry.get_sample_value("tokenlane_replica_state", old) is None


def test_removing_the_capped_replica_ends_panic() -> None:
    fleet, _, m, r = all_healthy({"max_ejected_percent": 34})
    others = [x for x in fleet.replicas() if x is not r]
    fail(fleet, others[0], 5)  # out: the cap (1 of 3) is used up
    fail(fleet, others[1], 5)  # held back: panic
    assert fleet.pools["main"].panic and panic(m) == 1
    reload_to(fleet, [{"url": r.url}, {"url": others[0].url}], {"max_ejected_percent": 34})
    assert not fleet.pools["main"].panic and panic(m) == 0


def test_a_held_back_ejection_does_not_survive_a_remote_move_to_probing() -> None:
    fleet, clock, m = make({"max_ejected_percent": 50})
    r0, r1, r2 = fleet.replicas()
    for r in (r0, r1, r2):
        admit(fleet, r, clock)
    fail(fleet, r0)
    fail(fleet, r1)
    assert r1.capped is EjectReason.CONSECUTIVE_FAILURES and panic(m) == 1
    # Another gateway instance had it out and readmitted it to probing (its ejection record
    # missed by pub/sub and superseded before the reconcile).
    fleet.apply_remote(r1, P, EjectReason.OPERATOR, 0.0, 3, 0, "other")
    assert r1.capped is None and panic(m) == 0
    admit(fleet, r1, clock)  # its canary answers
    clock.t += 1
    fleet.tick(r1, clock.t)
    assert r1.state is H  # not ejected for failures from before it proved itself


# ---------------------------------------------------------------------------- poison and outage


def served(fleet: Fleet, r: Replica, outcomes: list[str | None]) -> None:
    for outcome in outcomes:
        fleet.attempt_started(r)
        fleet.attempt_finished(r, outcome)  # type: ignore[arg-type]


def test_poison_requests_spread_over_the_pool_eject_nobody() -> None:
    fleet, _clock, _, _r = all_healthy({"consecutive_failures": 5})
    replicas = list(fleet.replicas())
    for i in range(50):  # fifty poison requests, each answered 500 by whichever replica
        served(fleet, replicas[i % 3], ["upstream_5xx"])
    assert all(r.state is H and r.capped is None for r in replicas)


def test_poison_on_one_replica_with_idle_peers_ejects_nobody() -> None:
    fleet, _clock, _, r = all_healthy({"consecutive_failures": 5})
    served(fleet, r, ["upstream_5xx"] * 50)
    assert r.state is H  # no peer evidence: /health decides


def test_a_replica_failing_what_its_peers_serve_is_ejected() -> None:
    fleet, _clock, _, _r = all_healthy({"consecutive_failures": 5})
    r0, r1, r2 = fleet.replicas()
    served(fleet, r1, [None] * 4)
    served(fleet, r2, [None] * 4)
    served(fleet, r0, ["upstream_5xx"] * 4)
    assert r0.state is H
    served(fleet, r0, ["upstream_5xx"])
    assert (r0.state, r0.reason) == (E, EjectReason.CONSECUTIVE_FAILURES)


def test_a_lone_replica_whose_5xx_were_served_elsewhere_is_ejected() -> None:
    # One replica, no peer evidence: its 5xx alone never eject it (above). Five 5xx in a row
    # that the same requests' replays got served elsewhere are its own fault: out it goes.
    fleet, clock, _ = make({"consecutive_failures": 5}, urls=URLS[:1])
    (r,) = fleet.replicas()
    admit(fleet, r, clock)
    for _ in range(4):
        fleet.note_5xx(r, confirmed=True)
    assert r.state is H and r.failures_in_row == 4
    fleet.attempt_started(r)
    fleet.attempt_finished(r, None)  # a success between breaks the run
    for _ in range(4):
        fleet.note_5xx(r, confirmed=True)
    assert r.state is H
    fleet.note_5xx(r, confirmed=True)
    assert (r.state, r.reason) == (E, EjectReason.CONSECUTIVE_FAILURES)


def test_unconfirmed_5xx_on_a_lone_replica_eject_nothing() -> None:
    fleet, clock, _ = make({"consecutive_failures": 5}, urls=URLS[:1])
    (r,) = fleet.replicas()
    admit(fleet, r, clock)
    for _ in range(50):  # their replays were not served (or never ran): no proof
        fleet.note_5xx(r)
    assert r.state is H and r.failures_in_row == 0


def test_a_request_with_no_target_probes_an_ejected_replica_once_until_it_is_back() -> None:
    fleet, clock, _, r = all_healthy({"eject_base_s": 60, "max_ejected_percent": 100})
    fail(fleet, r)
    assert r.state is E and r.ejected_until > clock.t + 30
    fleet.observe_health(r, False, clock.t)
    assert not fleet.probe_for_request(r, "no target")  # /health fails: left alone
    fleet.observe_health(r, True, clock.t)
    assert fleet.probe_for_request(r, "no target")
    assert r.state is P
    fleet.canary_result(r, False, clock.t, "still broken")  # out again, for longer
    assert r.state is E and r.ejected_until > clock.t + 60
    assert not fleet.probe_for_request(r, "no target")  # it waits this ejection out
    clock.t = r.ejected_until
    fleet.tick(r, clock.t)
    admit(fleet, r, clock)
    assert r.state is H
    fail(fleet, r)  # a new episode: one early probe again
    assert fleet.probe_for_request(r, "no target") and r.state is P


def test_an_operators_ejection_is_not_probed_for_a_request() -> None:
    fleet, clock, _, r = all_healthy()
    fleet.operator_eject(r)
    fleet.observe_health(r, True, clock.t)
    assert not fleet.probe_for_request(r, "no target") and r.state is E


def test_an_uncounted_outcome_only_frees_the_slot() -> None:
    fleet, _clock, _, r = all_healthy({"consecutive_failures": 3})
    for peer in list(fleet.replicas())[1:]:
        served(fleet, peer, [None] * 3)
    for _ in range(10):
        fleet.attempt_started(r)
        fleet.attempt_finished(r, "upstream_5xx", counted=False)  # type: ignore[arg-type]
    assert r.state is H and r.fivexx_in_row == 0 and r.in_flight == 0


def test_total_outage_leaves_no_candidate_until_a_replica_answers_health() -> None:
    fleet, clock, _m = make({"max_ejected_percent": 50})
    r0, r1, r2 = fleet.replicas()
    for r in (r0, r1, r2):
        admit(fleet, r, clock)
    pool = fleet.pools["main"]
    fail(fleet, r0)
    fail(fleet, r1)
    fail(fleet, r2)
    # The cap keeps two "healthy"; r0 is out, probed early (its canary has not answered).
    assert r0.state is P and r1.capped and r2.capped
    assert pool.candidates("m") and not pool.outage  # their /health still answered
    for r in (r1, r2):
        fleet.observe_health(r, False, clock.t)
    assert pool.outage and pool.candidates("m") == [] and not pool.has_healthy()
    fleet.observe_health(r2, True, clock.t)  # one is back: it gets traffic again
    assert not pool.outage and r2 in pool.candidates("m")
