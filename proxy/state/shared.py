"""Shared state between gateway instances (DESIGN 5 "Shared state", 4.2 ``redis.*``).

Without ``redis.url`` every instance keeps its own view (``LocalState``). With it
(``RedisState``) instances share three things, none of them on the request path:

- **Replica states** (ejections, readmissions, drains, operator actions). Every transition is
  written to one hash, a record per replica, by a Lua script that also publishes the record on a
  channel. The record, not the message, is the truth: pub/sub drops messages during any
  reconnect gap, so every instance also reads the whole hash every ``reconcile_s`` and applies
  what is newer than what it has. The newest *transition* wins, not the latest write: each
  record carries ``changed_at``, the Unix time its instance made the transition, and the script
  refuses a write whose transition is older than the stored one's (and answers with the stored
  record, which the writer adopts). Otherwise an instance cut off from Redis would, on its
  re-sync, write the transitions it made during the outage over newer ones made elsewhere.
  ``updated_at``, stamped by the script from the Redis server's clock, orders what readers apply.
  The script counts ejections (so the count, and with it the backoff, is shared) and lets an
  ejection that already stands win over a second one of the same replica: two instances that
  see the same stall at once make one ejection, not two.
- **Load**: each instance writes its per-replica in-flight counts to its own hash, rewritten
  every ``heartbeat_s`` with a ``ttl_s`` expiry, so a crashed instance's counts vanish by
  themselves. A background loop sums the other live instances' hashes into a view that the
  balancer reads from memory.
- **Rate limits**: ``LeasedRateLimiter`` (``ratelimit_shared``) decides from local stock; the
  lease loop here refills that stock in batches leased from token buckets kept in Redis.

Redis slow or down (the calls and the breaker: ``redislink``): every call is bounded by
``redis.timeout_ms``. Two failed calls in a row open the breaker (``tokenlane_shared_state_up``
0, one log line): the instance goes on with its local view and local rate limits, and a probe
every ``PROBE_S`` looks for Redis. When it answers, the instance re-syncs (its unwritten
transitions, its known records if Redis lost them, its load) before it trusts the shared view
again, and says so in one log line.

This module holds the protocol (``SharedState``, ``LocalView``, ``ReplicaRecord``), both
backends, and the fleet's side of it (``FleetView``).

Keys (prefix ``tokenlane``): ``{p}:replicas`` (hash: ``"{pool} {url}"`` → record JSON),
``{p}:replicas:changed`` (channel), ``{p}:instances`` (set of instance ids),
``{p}:inflight:{instance}`` (hash: url → count, ``_at``), ``{p}:rl:{limit}:{key id}`` (bucket).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from redis.asyncio import Redis

from proxy.config import RateLimitsConfig, RedisConfig
from proxy.fleet.fleet import EjectReason, Fleet, Replica, ReplicaState
from proxy.routing.ratelimit import LocalRateLimiter, RateLimiter
from proxy.state.ratelimit_shared import (
    BUCKET_IDLE_MS,
    LEASE,
    LEASE_FRACTION,
    LEASE_TICK_S,
    Lease,
    LeaseAsk,
    LeasedRateLimiter,
    batch_size,
    lease_amount,
    limit_state,
    may_spend,
    needs_lease,
    scaled,
    settle,
)
from proxy.state.redislink import (
    PROBE_S,
    REDIS_ERRORS,
    Breaker,
    Unavailable,
    cancelling,
    connect,
    wait_event,
)

if TYPE_CHECKING:
    from proxy.observe.metrics import Metrics

# Names that moved to ratelimit_shared and redislink are re-exported: importable from here
# as before.
__all__ = [
    "BUCKET_IDLE_MS",
    "LEASE",
    "LEASE_FRACTION",
    "LEASE_TICK_S",
    "PROBE_S",
    "REDIS_ERRORS",
    "Breaker",
    "FleetView",
    "Lease",
    "LeaseAsk",
    "LeasedRateLimiter",
    "LocalState",
    "LocalView",
    "RedisState",
    "ReplicaRecord",
    "SharedState",
    "Unavailable",
    "batch_size",
    "lease_amount",
    "limit_state",
    "may_spend",
    "needs_lease",
    "new_instance_id",
    "record_of",
    "scaled",
    "settle",
    "shared_state_for",
    "sum_load",
]

log = logging.getLogger("tokenlane.shared")

T = TypeVar("T")

RECONCILE_S = 1.0  # full read of the replica records and of the others' load
SUBSCRIBE_POLL_S = 1.0  # a pub/sub read waits this long for a message, then loops


# ---------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class ReplicaRecord:
    """One replica's shared state, as stored in Redis and published.

    ``until``: Unix time an ejection ends; None when the state has no end (``healthy``,
    ``probing``, ``draining``, or an operator ejection that lasts until readmitted).
    ``ejections``: the total, counted by the merge script. ``level``: the backoff level behind
    the current ejection's length. ``updated_at``: Redis server time of the write, which orders
    what readers apply; 0 until written. ``instance``: who wrote it. ``changed_at``: Unix time
    (ms precision) the writer made the transition, which decides between competing writes; 0
    when unknown (records written before the field existed), which is the oldest.
    """

    pool: str
    url: str
    state: str
    reason: str | None = None
    until: float | None = None
    ejections: int = 0
    level: int = 0
    updated_at: float = 0.0
    instance: str = ""
    changed_at: float = 0.0

    @property
    def field(self) -> str:
        return f"{self.pool} {self.url}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> ReplicaRecord:
        """Raises ``ValueError`` for anything that is not a record (another writer's junk)."""
        try:
            data = json.loads(raw)
            until = data.get("until")
            return cls(
                pool=str(data["pool"]),
                url=str(data["url"]),
                state=str(data["state"]),
                reason=None if data.get("reason") is None else str(data["reason"]),
                until=None if until is None else float(until),
                ejections=int(data.get("ejections") or 0),
                level=int(data.get("level") or 0),
                updated_at=float(data.get("updated_at") or 0.0),
                instance=str(data.get("instance") or ""),
                changed_at=float(data.get("changed_at") or 0.0),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a replica record: {raw!r:.200}") from exc


class LocalView(Protocol):
    """The gateway's side of shared state: what this instance knows, and where news goes.

    ``apply`` and ``remote_load`` are called on the event loop from background tasks; they must
    not call ``SharedState.publish`` for what they apply (that would echo it back).
    """

    def records(self) -> list[ReplicaRecord]:
        """Every replica's current local state (for re-sync after Redis lost data)."""
        ...

    def in_flight(self) -> dict[str, int]:
        """url → requests this instance has in flight to it."""
        ...

    def apply(self, record: ReplicaRecord) -> bool:
        """A transition made by another instance, newer than anything applied before. False
        when this instance has no such replica (yet: a reload may add it; asked again later)."""
        ...

    def remote_load(self, in_flight: Mapping[str, int]) -> None:
        """url → the other live instances' in-flight sum; empty while Redis is unreachable."""
        ...


class SharedState(Protocol):
    """What the gateway uses, whichever backend is configured."""

    instance: str

    @property
    def up(self) -> bool: ...

    async def start(self, view: LocalView) -> None: ...

    async def stop(self) -> None: ...

    def publish(self, record: ReplicaRecord) -> None:
        """A local transition: shared in the background; never waits, never raises."""
        ...

    def remote_in_flight(self, url: str) -> int:
        """The other instances' in-flight requests to ``url``, from the last background read."""
        ...

    def rate_limiter(self, limits: Callable[[], RateLimitsConfig]) -> RateLimiter: ...


def new_instance_id() -> str:
    """Unique per process start: a restarted gateway never inherits its old keys."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class LocalState:
    """The default: nothing is shared, nothing can be down."""

    def __init__(self, instance: str | None = None) -> None:
        self.instance = instance or new_instance_id()

    @property
    def up(self) -> bool:
        return True

    async def start(self, view: LocalView) -> None:
        return None

    async def stop(self) -> None:
        return None

    def publish(self, record: ReplicaRecord) -> None:
        return None

    def remote_in_flight(self, url: str) -> int:
        return 0

    def rate_limiter(self, limits: Callable[[], RateLimitsConfig]) -> RateLimiter:
        return LocalRateLimiter(limits)


def shared_state_for(
    config: Callable[[], RedisConfig], metrics: Metrics | None = None
) -> SharedState:
    """``RedisState`` when ``redis.url`` is set (a restart key), else ``LocalState``."""
    url = config().url
    if url is None:
        return LocalState()
    return RedisState(url, config, metrics=metrics)


# ---------------------------------------------------------------------------- Lua

# Write one replica record. ARGV: field, proposed record (JSON), mode, channel.
# mode 'write': a transition; 'fill': only if Redis has no record (re-sync after data loss).
# Returns the record that stands afterwards (the proposed one, or the one that won).
# Which one wins: a standing ejection over a second ejection (counted once), unless the second
# is an operator's and the first a detector's; otherwise the newer transition (``changed_at``;
# missing = 0, the oldest; a tie goes to the later write). A refused write changes nothing.
MERGE_RECORD = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local new = cjson.decode(ARGV[2])
-- A writer whose clock runs ahead must not outrank every later transition for the skew's
-- length: its transition counts as made now.
local changed = tonumber(new.changed_at) or 0
if changed * 1000 > now_ms then changed = now_ms / 1000 end
new.changed_at = changed
local raw = redis.call('HGET', KEYS[1], ARGV[1])
local cur = nil
if raw then cur = cjson.decode(raw) end
local last_ms = 0
if cur then
  if ARGV[3] == 'fill' then return raw end
  local cur_changed = tonumber(cur.changed_at) or 0
  local overrides = false
  if new.state == 'ejected' and cur.state == 'ejected' then
    local untl = cur['until']
    if untl == cjson.null or untl * 1000 > now_ms then  -- the stored ejection stands
      if new.reason ~= 'operator' or cur.reason == 'operator' then return raw end
      overrides = true
    end
  end
  if overrides then
    -- taken whatever the times; the stored transition time never goes back, so a stale
    -- write between the two cannot slip in after it
    new.changed_at = math.max(changed, cur_changed)
  elseif changed < cur_changed then
    return raw
  end
  local n = tonumber(cur.ejections) or 0
  if new.state == 'ejected' then n = n + 1 end
  new.ejections = n
  if type(cur.updated_at) == 'number' then last_ms = math.floor(cur.updated_at * 1000 + 0.5) end
end
new.updated_at = math.max(now_ms, last_ms + 1) / 1000
local out = cjson.encode(new)
redis.call('HSET', KEYS[1], ARGV[1], out)
redis.call('PUBLISH', ARGV[4], out)
return out
"""

# Drop a dead instance from the registry, unless it came back meanwhile.
PRUNE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return redis.call('SREM', KEYS[2], ARGV[1]) end
return 0
"""


# ---------------------------------------------------------------------------- Redis


class RedisState:
    """Shared state in Redis; see the module docstring for what is shared and how."""

    def __init__(
        self,
        url: str,
        config: Callable[[], RedisConfig],
        *,
        metrics: Metrics | None = None,
        instance: str | None = None,
        prefix: str = "tokenlane",
        reconcile_s: float = RECONCILE_S,
        probe_s: float = PROBE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.config = config
        self.metrics = metrics
        self.instance = instance or new_instance_id()
        self.reconcile_s = reconcile_s
        self.clock = clock
        self.breaker = Breaker(probe_s)
        self._redis: Redis = connect(url, config().timeout_ms / 1000)
        self._merge = self._redis.register_script(MERGE_RECORD)
        self._lease = self._redis.register_script(LEASE)
        self._prune = self._redis.register_script(PRUNE)
        self._records_key = f"{prefix}:replicas"
        self._channel = f"{prefix}:replicas:changed"
        self._instances_key = f"{prefix}:instances"
        self._inflight_prefix = f"{prefix}:inflight:"
        self._bucket_prefix = f"{prefix}:rl:"
        self._up: bool | None = None  # None until the first attempt to join
        self._view: LocalView | None = None
        self._applied: dict[str, float] = {}  # field → updated_at of the newest record applied
        self._pending: dict[str, ReplicaRecord] = {}  # local transitions not yet written
        self._remote: dict[str, int] = {}
        self._remote_at: float | None = None
        self.instances = 1  # live instances, this one included, as last seen
        self._limiters: list[LeasedRateLimiter] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._dirty = asyncio.Event()  # something to write
        self._reconcile_now = asyncio.Event()
        self._lease_now = asyncio.Event()

    # -- what the gateway calls ----------------------------------------------------------

    @property
    def up(self) -> bool:
        return bool(self._up)

    async def start(self, view: LocalView) -> None:
        """One bounded attempt to join (read the shared records, write our load); then the
        background loops. Never fails: without Redis the instance starts on its local view."""
        self._view = view
        for _ in range(self.breaker.threshold):
            try:
                await self._resync()
            except Unavailable as exc:
                if not self.breaker.closed:
                    self._set_up(False, str(exc))
                    break
            else:
                self._set_up(True, "joined")
                break
        self._tasks = [
            asyncio.create_task(self._sync_loop(), name="shared sync"),
            asyncio.create_task(self._heartbeat_loop(), name="shared heartbeat"),
            asyncio.create_task(self._write_loop(), name="shared writes"),
            asyncio.create_task(self._subscribe_loop(), name="shared subscribe"),
            asyncio.create_task(self._lease_loop(), name="shared leases"),
        ]

    async def stop(self) -> None:
        """Stop the loops; on a clean exit also withdraw our load at once (a crash leaves it to
        the TTL)."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)  # bounded: never hold up a shutdown
        self._tasks = []
        if self._up:
            key = self._inflight_prefix + self.instance

            async def withdraw() -> None:
                async with self._redis.pipeline(transaction=True) as p:
                    p.delete(key)
                    p.srem(self._instances_key, self.instance)
                    await p.execute()

            with contextlib.suppress(Unavailable):
                await self._call(withdraw, "withdraw")
        with contextlib.suppress(*REDIS_ERRORS):
            async with asyncio.timeout(1.0):
                await self._redis.aclose()

    def publish(self, record: ReplicaRecord) -> None:
        # The newest local transition per replica waits here until written; while Redis is
        # down it stays, and the re-sync writes it (or adopts a newer one made elsewhere). A
        # record without its transition time is taken as a transition made now.
        changed_at = round(record.changed_at or time.time(), 3)
        self._pending[record.field] = replace(
            record, instance=self.instance, updated_at=0.0, changed_at=changed_at
        )
        self._dirty.set()

    def remote_in_flight(self, url: str) -> int:
        if not self._up or self._remote_at is None:
            return 0
        if self.clock() - self._remote_at > self.config().ttl_s:
            return 0  # the view stopped refreshing: stale counts are no counts
        return self._remote.get(url, 0)

    def rate_limiter(self, limits: Callable[[], RateLimitsConfig]) -> RateLimiter:
        limiter = LeasedRateLimiter(self, limits)
        self._limiters.append(limiter)
        return limiter

    async def sync(self) -> None:
        """One round of the background sync: apply newer records, refresh the load view.
        ``Unavailable`` when Redis does not answer within ``timeout_ms`` (or the breaker is
        open). The loops call it by themselves; tests and tools may call it too."""
        await self._reconcile()
        await self._refresh_load()

    def wake_leases(self) -> None:
        self._lease_now.set()

    # -- bounded calls and the breaker ---------------------------------------------------

    async def _call(self, fn: Callable[[], Awaitable[T]], what: str, *, probe: bool = False) -> T:
        """``fn()`` within ``timeout_ms``, or ``Unavailable``."""
        if not self.breaker.allows(probe, self.clock()):
            raise Unavailable("breaker open")
        try:
            async with asyncio.timeout(self.config().timeout_ms / 1000):
                result = await fn()
        except REDIS_ERRORS as exc:
            if cancelling():
                raise asyncio.CancelledError from exc
            why = f"{what}: {type(exc).__name__}: {exc}".rstrip(": ")
            if self.breaker.failed(self.clock()):
                self._set_up(False, why)
            elif self.breaker.closed:
                self._reconcile_now.set()  # confirm (or clear) a first failure at once
            raise Unavailable(why) from exc
        # A probe that answers lets the re-sync's calls through; ``up`` waits for the re-sync.
        self.breaker.succeeded()
        return result

    def _set_up(self, up: bool, why: str) -> None:
        if self.metrics is not None:
            self.metrics.shared_state_up.set(1 if up else 0)
        if up == self._up:
            return
        self._up = up
        if up:
            log.info("shared state: Redis at %s in use (%s); instance %s", self._where(), why,
                     self.instance)  # fmt: skip
        else:
            log.warning("shared state: Redis at %s unreachable (%s); going on with the local "
                        "view", self._where(), why)  # fmt: skip
            self._remote = {}
            self._remote_at = None
            if self._view is not None:
                self._safely(self._view.remote_load, {})

    def _where(self) -> str:
        kw = self._redis.connection_pool.connection_kwargs
        if "path" in kw:
            return str(kw["path"])
        return f"{kw.get('host', '?')}:{kw.get('port', '?')}"

    def _safely(self, fn: Callable[[Any], None], arg: Any) -> None:
        try:
            fn(arg)
        except Exception:  # a bug on the gateway side must not end a loop
            log.exception("shared state: applying %r failed", arg)

    # -- re-sync (at start and whenever Redis comes back) --------------------------------

    async def _resync(self) -> None:
        """Write what we hold before trusting what we read: our unwritten transitions, our
        known records where Redis has none (it restarted empty), our load; then read all."""
        await self._call(self._redis.ping, "ping", probe=True)
        await self._flush()
        assert self._view is not None
        known = [r for r in self._view.records() if _informative(r)]
        if known:

            async def fill() -> list[Any]:
                async with self._redis.pipeline(transaction=False) as p:
                    for r in known:
                        rec = replace(r, instance=self.instance, updated_at=0.0)
                        await self._merge(
                            keys=[self._records_key],
                            args=[rec.field, rec.to_json(), "fill", self._channel],
                            client=p,
                        )
                    return await p.execute()

            await self._call(fill, "fill")
        await self._heartbeat()
        await self._reconcile()
        await self._refresh_load()

    # -- replica records -------------------------------------------------------------------

    async def _flush(self) -> None:
        for key, record in list(self._pending.items()):

            async def write(record: ReplicaRecord = record) -> Any:
                return await self._merge(
                    keys=[self._records_key],
                    args=[record.field, record.to_json(), "write", self._channel],
                )

            raw = await self._call(write, "write")
            if self._pending.get(key) is record:
                del self._pending[key]
            try:
                stored = ReplicaRecord.from_json(raw)
            except ValueError as exc:  # someone else's junk under our key: overwrite next time
                log.warning("shared state: ignoring a stored record: %s", exc)
                continue
            self._applied[key] = max(self._applied.get(key, 0.0), stored.updated_at)
            ours = (self.instance, record.state, record.reason, record.ejections)
            if key not in self._pending and ours != (
                stored.instance,
                stored.state,
                stored.reason,
                stored.ejections,
            ):
                # Ours was refused (a newer transition, or a standing ejection, won) or merged
                # (the shared count differs from ours): adopt what Redis holds. After an
                # outage this is how newer transitions made elsewhere beat our pending ones.
                self._apply(stored, force=True)

    def _apply(self, record: ReplicaRecord, *, force: bool = False) -> None:
        """Apply a record read from Redis if it is newer and not contradicted by a local
        transition still waiting to be written."""
        key = record.field
        if not force:
            if record.updated_at <= self._applied.get(key, 0.0):
                return
            if record.instance == self.instance or key in self._pending:
                self._applied[key] = record.updated_at
                return
        if self._view is None:
            return
        try:
            known = self._view.apply(record)
        except Exception:  # a bug on the gateway side must not end a loop
            log.exception("shared state: applying %r failed", record)
            known = True
        if known:  # an unknown replica's record is offered again at the next reconcile
            self._applied[key] = max(self._applied.get(key, 0.0), record.updated_at)

    def _on_message(self, data: str) -> None:
        try:
            record = ReplicaRecord.from_json(data)
        except ValueError as exc:
            log.warning("shared state: ignoring a message: %s", exc)
            return
        self._apply(record)

    async def _reconcile(self) -> None:
        raw = await self._call(lambda: self._redis.hgetall(self._records_key), "reconcile")
        records = []
        for value in raw.values():
            try:
                records.append(ReplicaRecord.from_json(value))
            except ValueError as exc:
                log.warning("shared state: ignoring a record: %s", exc)
        for record in sorted(records, key=lambda r: r.updated_at):
            self._apply(record)

    # -- load ------------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        assert self._view is not None
        counts = {url: n for url, n in self._view.in_flight().items() if n > 0}
        key = self._inflight_prefix + self.instance
        ttl_ms = max(1, int(self.config().ttl_s * 1000))

        async def write() -> None:
            # One transaction: readers never see the hash half-written or without its expiry.
            async with self._redis.pipeline(transaction=True) as p:
                p.delete(key)
                p.hset(key, mapping={"_at": f"{time.time():.3f}", **counts})
                p.pexpire(key, ttl_ms)
                p.sadd(self._instances_key, self.instance)
                await p.execute()

        await self._call(write, "heartbeat")

    async def _refresh_load(self) -> None:
        ids = await self._call(lambda: self._redis.smembers(self._instances_key), "instances")
        others = sorted(i for i in ids if i != self.instance)

        async def read() -> list[Any]:
            async with self._redis.pipeline(transaction=False) as p:
                for i in others:
                    p.hgetall(self._inflight_prefix + i)
                return await p.execute()

        hashes = await self._call(read, "load") if others else []
        totals, live, dead = sum_load(
            dict(zip(others, hashes, strict=True)), time.time(), self.config().ttl_s
        )
        for gone in dead:
            await self._call(
                lambda gone=gone: self._prune(
                    keys=[self._inflight_prefix + gone, self._instances_key], args=[gone]
                ),
                "prune",
            )
        self._remote = totals
        self._remote_at = self.clock()
        self.instances = live + 1
        if self._view is not None:
            self._safely(self._view.remote_load, totals)

    # -- loops -----------------------------------------------------------------------------

    async def _sync_loop(self) -> None:
        """Reconcile and refresh the load view while up; probe and re-sync while down."""
        while True:
            try:
                if self._up:
                    await self.sync()
                elif self.breaker.allows(True, self.clock()):
                    await self._resync()
                    self._set_up(True, "re-synced after an outage")
            except Unavailable:
                pass
            except Exception:  # a bug must not end the loop
                log.exception("shared state: sync failed")
            wait = self.reconcile_s if self._up else self.breaker.probe_s
            await wait_event(self._reconcile_now, wait)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config().heartbeat_s)
            if self._up:
                try:
                    await self._heartbeat()
                except Unavailable:
                    pass
                except Exception:
                    log.exception("shared state: heartbeat failed")

    async def _write_loop(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            if self._up:  # while down the re-sync writes them
                try:
                    await self._flush()
                except Unavailable:
                    pass
                except Exception:
                    log.exception("shared state: writing a record failed")

    async def _subscribe_loop(self) -> None:
        """Apply published records as they come. Only a shortcut: a message lost while
        (re)connecting is picked up by the next reconcile, which each (re)subscription
        triggers at once."""
        while True:
            if not self._up:
                await asyncio.sleep(self.breaker.probe_s)
                continue
            pubsub = self._redis.pubsub()
            try:
                async with asyncio.timeout(self.config().timeout_ms / 1000):
                    await pubsub.subscribe(self._channel)
                self._reconcile_now.set()
                while self._up:
                    message = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=SUBSCRIBE_POLL_S
                    )
                    if message is not None and message.get("type") == "message":
                        self._on_message(message["data"])
            except REDIS_ERRORS as exc:
                if cancelling():
                    raise asyncio.CancelledError from exc
                log.debug("shared state: subscription lost: %r", exc)
            finally:
                with contextlib.suppress(*REDIS_ERRORS):
                    async with asyncio.timeout(self.config().timeout_ms / 1000):
                        await pubsub.aclose()
            if cancelling():
                raise asyncio.CancelledError
            await asyncio.sleep(min(self.breaker.probe_s, self.reconcile_s))

    async def _lease_loop(self) -> None:
        while True:
            await wait_event(self._lease_now, LEASE_TICK_S)
            if not self._up:
                continue
            for limiter in self._limiters:
                asks = limiter.due(self.clock())
                if not asks:
                    continue

                async def lease(asks: list[LeaseAsk] = asks) -> list[Any]:
                    async with self._redis.pipeline(transaction=False) as p:
                        for a in asks:
                            await self._lease(
                                keys=[f"{self._bucket_prefix}{a.kind}:{a.key}"],
                                args=[a.limit, repr(a.amount), BUCKET_IDLE_MS],
                                client=p,
                            )
                        return await p.execute()

                try:
                    results = await self._call(lease, "lease")
                except Unavailable:
                    break
                except Exception:
                    log.exception("shared state: leasing failed")
                    break
                limiter.settle(asks, [(float(g), float(left)) for g, left in results], self.clock())


def _informative(record: ReplicaRecord) -> bool:
    """Worth restoring into an empty Redis: anything but the state every gateway starts in."""
    return record.state != "probing" or record.ejections > 0


def sum_load(
    hashes: Mapping[str, Mapping[str, str]], now: float, ttl_s: float
) -> tuple[dict[str, int], int, list[str]]:
    """Other instances' load hashes → (url → in-flight sum, live instances, dead ids).

    A hash that is gone is a dead instance (its key expired). One whose ``_at`` is older than
    the TTL is treated as missing but not pruned: its writer's clock may be off.
    """
    totals: dict[str, int] = {}
    live = 0
    dead: list[str] = []
    for instance, fields in hashes.items():
        if not fields:
            dead.append(instance)
            continue
        try:
            at = float(fields.get("_at", "0"))
        except ValueError:
            at = 0.0
        if now - at > ttl_s:
            continue
        live += 1
        for url, value in fields.items():
            if url == "_at":
                continue
            with contextlib.suppress(ValueError):
                totals[url] = totals.get(url, 0) + int(value)
    return totals, live, dead


# ---------------------------------------------------------------------------- the fleet


def record_of(replica: Replica, now: float) -> ReplicaRecord:
    """A replica's state as shared; ``now`` is the fleet clock (its ``ejected_until``'s)."""
    until = None
    if replica.state is ReplicaState.EJECTED and not math.isinf(replica.ejected_until):
        until = round(time.time() + (replica.ejected_until - now), 3)
    return ReplicaRecord(
        pool=replica.pool,
        url=replica.url,
        state=replica.state.value,
        reason=replica.reason.value if replica.reason else None,
        until=until,
        ejections=replica.ejections,
        level=replica.backoff_level,
        # when this instance made (or applied) the transition; never made: 0, the oldest
        changed_at=round(replica.changed_at, 3) if replica.changed_at else 0.0,
    )


class FleetView:
    """The fleet as shared state sees it (a ``LocalView``); also hooks the fleet so that every
    transition of its own is published."""

    def __init__(self, fleet: Fleet, shared: SharedState) -> None:
        self.fleet = fleet
        self.shared = shared
        fleet.on_transition = self.transition

    def transition(self, replica: Replica) -> None:
        self.shared.publish(record_of(replica, self.fleet.clock()))

    def records(self) -> list[ReplicaRecord]:
        now = self.fleet.clock()
        return [record_of(r, now) for r in self.fleet.replicas()]

    def in_flight(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.fleet.replicas():  # leaving (draining) replicas included, once
            if r.in_flight:
                counts[r.url] = counts.get(r.url, 0) + r.in_flight
        return counts

    def apply(self, record: ReplicaRecord) -> bool:
        found = self.fleet.find(record.url, record.pool)
        if not found:
            return False
        try:
            state = ReplicaState(record.state)
            reason = EjectReason(record.reason) if record.reason is not None else None
        except ValueError:
            log.warning("shared state: ignoring a record with an unknown state: %r", record)
            return True
        until = 0.0
        if state is ReplicaState.EJECTED:
            now = self.fleet.clock()
            until = math.inf if record.until is None else now + (record.until - time.time())
        self.fleet.apply_remote(
            found[0], state, reason, until, record.ejections, record.level, record.instance
        )
        return True

    def remote_load(self, in_flight: Mapping[str, int]) -> None:
        for r in self.fleet.replicas():
            r.remote_in_flight = in_flight.get(r.url, 0)
