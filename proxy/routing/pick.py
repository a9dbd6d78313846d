"""Picking a replica for a request: the lane's pool, else its ``spill_to`` pool; healthy,
serving the model, below its limit (``Admission.has_room``), not tried yet; chosen by the
pool's balance; and claimed (with workers, another worker may have taken the slot since).
A pinned request (a stored response's continuation) has its one replica or none.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Final

from proxy.fleet.fleet import Fleet, Pool, Replica, ReplicaState
from proxy.observe.metrics import Metrics
from proxy.relay.call import Call
from proxy.routing import balance, cache_aware
from proxy.routing.admission import Admission
from proxy.routing.profile import affinity_key

if TYPE_CHECKING:
    from proxy.config import Policy


# How often a request with no replica to go to looks again while one it could take is on its
# canary (``Picker.canary_coming``): a retry and a continuation alike.
CANARY_POLL_S: Final = 0.05


class Picker:
    """The relay's choice of a replica (``Relay.try_pick``, the resumer's, realtime's)."""

    def __init__(
        self,
        fleet: Fleet,
        admission: Admission,
        metrics: Metrics,
        policy: Callable[[], Policy],
        rng: random.Random,
        share_placement: Callable[[str, str, Sequence[int]], None] | None = None,
        feeds: cache_aware.PreciseFeeds | None = None,
    ) -> None:
        self.fleet = fleet
        self.admission = admission
        self.metrics = metrics
        self.policy = policy
        self.rng = rng
        self.share_placement = share_placement  # cache_aware picks, to the other processes
        self.feeds = feeds  # replicas' KV events: precise cache_aware routing

    def try_pick(self, call: Call) -> Replica | None:
        """A replica of the lane's pool, else of its ``spill_to`` pool, that can take the
        request now: healthy, serving the model, below its limit, not tried yet. A pinned
        request (``Call.pinned``) has one replica or none."""
        lane = call.lane
        fleet = self.fleet
        admission = self.admission  # its has_room counts slots handed to queued requests
        if call.pinned is not None:
            home = self.pinned_candidate(call)
            if home is None or not admission.has_room(home) or home in call.tried:
                return None
            return home if self.admission.claim(home) else None
        for pool_name in (lane.pool, lane.spill_to):
            # A request keeps the lane it started with; a reload may have removed its pool.
            if pool_name is None:
                continue
            pool = fleet.pools.get(pool_name)
            if pool is None:
                continue
            cands = [
                r
                for r in pool.candidates(call.model)
                if admission.has_room(r) and r not in call.tried
            ]
            choice = None
            while cands:
                choice = self._choose(pool, pool_name, cands, call)
                # With workers, another worker may have taken the slot since has_room.
                if choice is None or self.admission.claim(choice):
                    break
                cands.remove(choice)
                choice = None
            if not cands:
                continue
            if not call.tried:  # round robin advances once per request, not per retry
                pool.rr_counter += 1
            if choice is not None:
                if pool_name != lane.pool:
                    self.metrics.spills.labels(lane.name, lane.pool, pool_name).inc()
                return choice
        return None

    def _choose(
        self, pool: Pool, pool_name: str, cands: list[Replica], call: Call
    ) -> Replica | None:
        cfg = pool.config
        if cfg.balance == "cache_aware":
            chars = self.policy().estimate.chars_per_token
            return cache_aware.pick(
                self.fleet,
                self.metrics,
                chars,
                pool_name,
                cands,
                call,
                self.rng,
                self.share_placement,
                self.feeds,
            )
        key = None
        if cfg.balance == "prefix_affinity" and call.profile is not None:
            key = affinity_key(call.profile, cfg.prefix_chars)
        return balance.pick(
            cfg.balance,
            cands,
            key=key,
            rng=self.rng,
            rr_index=pool.rr_counter,
            bounded_load=cfg.bounded_load,
        )

    def any_serving(self, call: Call) -> bool:
        fleet = self.fleet
        if call.pinned is not None:
            return self.pinned_candidate(call) is not None
        lane = call.lane
        pools = fleet.pools
        return any(
            pools[p].candidates(call.model) for p in (lane.pool, lane.spill_to) if p in pools
        )

    def probing(self, call: Call) -> bool:
        """Whether a replica this call could be given (its lane's pools, not tried, the pinned
        one if pinned) is on its canary: probing with its ``/health`` answering (a dead one
        probes for ever, and is not worth waiting for)."""
        return any(r.state is ReplicaState.PROBING and r.health_ok for r in self._could_take(call))

    def canary_coming(self, call: Call) -> bool:
        """For a call that found no replica: have the fleet probe at once the replicas it could
        be given that are ejected for failures but answer ``/health`` again
        (``Fleet.probe_for_request``), rather than leave it nowhere to go until their ejection
        ends. Then: is one of them on its canary (``probing``), so worth a short wait?"""
        fleet = self.fleet
        why = f"request {call.request_id} found no replica"
        for r in self._could_take(call):
            if r.state is ReplicaState.EJECTED:
                fleet.probe_for_request(r, why)
        return self.probing(call)

    def _could_take(self, call: Call) -> Iterator[Replica]:
        """The replicas of the call's lane's pools that its pick could ever give it: serving
        its model, not tried yet, the pinned one if pinned; in any state."""
        lane = call.lane
        pools = self.fleet.pools
        for p in (lane.pool, lane.spill_to):
            if p not in pools:
                continue
            for r in pools[p].replicas:
                if (
                    r.serves(call.model)
                    and r not in call.tried
                    and (call.pinned is None or r.url == call.pinned)
                ):
                    yield r

    def pinned_candidate(self, call: Call) -> Replica | None:
        """The replica ``call`` is pinned to, while it is one its pool would pick from."""
        for pool in self.fleet.pools.values():
            for replica in pool.candidates(call.model):
                if replica.url == call.pinned:
                    return replica
        return None


__all__ = ["CANARY_POLL_S", "Picker"]
